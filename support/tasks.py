"""The tasks a replica trains on and their rewards: prompts from a split, a score per completion.

    task    prompts                                                      reward
    arith   "What is A + B?" (A, B in 0..50); held-out pairs by a hash    the last number
    gsm8k   grade-school math (local JSONL or the hub's openai/gsm8k)    the last number
    math    MATH (local JSONL or the hub's MATH-lighteval), \\boxed{}    math-verify
    toy     "Say a digit." for the tiny test model                       a "7" anywhere

rollout.py imports load_task, reward and shard_order from here; the tests import the rest.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_rewards.py -q
"""

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import random
import re
import select
import subprocess
import sys
import threading


class TaskError(Exception):
    """A task that cannot run here (a missing dependency); the message says what to install."""

NUMBER = re.compile(r"(?<!\d)-?\d[\d,]*(?:\.\d+)?")  # "1,234.5", "-7"; "$18" -> "18"; "3-4" -> 3, 4


def last_number(text):
    """The last number written in `text` as a float (commas dropped), or None."""
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def number_reward(completion, reference):
    """1.0 when the last number of the completion equals the reference number, else 0.0."""
    got = last_number(completion)
    return float(got is not None and abs(got - float(str(reference).replace(",", ""))) < 1e-6)


def gsm8k_reference(answer):
    """GSM8K answers end in "#### N": return N ("1,080" stays as written; number_reward drops
    commas)."""
    return answer.split("####")[-1].strip()


def last_boxed(text):
    r"""What the last \boxed{...} of `text` holds (nested braces matched), or None: no box, or the
    last one never closed (a completion cut at the length limit). The last box is the final answer
    (oat's rule, and the HF recipe's); an answer without a box is no answer."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{"):i]
    return None


def math_reward(completion, reference):
    r"""1.0 when the last \boxed{} of the completion is the reference as mathematics (\frac12 = 0.5
    = \dfrac{1}{2}, 5\text{ cm} = 5, intervals, sets, expressions), by Hugging Face's math-verify
    (the checker of TRL's accuracy_reward); 0.0 for anything else, never an exception."""
    answer = last_boxed(completion)
    return MATH_SCORER(answer, reference) if answer and answer.strip() else 0.0


class MathScorer:
    """math-verify in a child process. Its timeouts use signal.alarm, which works only in a main
    thread (TRL turns them off in other threads) and cannot stop C code. Here they run in the
    child's main thread (5 s per parse and per comparison), and a child that takes longer than
    `timeout_s` or dies is killed and replaced (that answer: 0.0). Any thread may call it."""

    def __init__(self, timeout_s=30.0):
        self.timeout_s, self.proc, self.lock = timeout_s, None, threading.Lock()

    def __call__(self, answer, reference):
        with self.lock:
            if self.proc is not None and self.proc.poll() is not None:  # died since (memory?)
                self.close()
            if self.proc is None:
                self.start()
            try:
                self.proc.stdin.write(json.dumps([answer, reference]) + "\n")  # ASCII: one line
                self.proc.stdin.flush()
                if line := self.read(self.timeout_s):  # "": the child died
                    return float(line)
            except (OSError, ValueError):  # a broken pipe (it died) or a garbled line
                pass
            self.close()
            return 0.0

    def close(self):
        """Stop the child (a later call starts a new one)."""
        self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(OSError):  # bytes it never read
            self.proc.stdin.close()
        self.proc.stdout.close()
        self.proc = None

    def start(self):
        """A plain `python -c` child (multiprocessing's spawn would re-run the caller's script)."""
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
        code = (f"import sys; sys.path.insert(0, {root!r}); "
                "from support.tasks import math_verify_loop; math_verify_loop()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if self.read(120.0) != "ready":
            self.close()
            raise TaskError("the math-verify process did not start (its error is above): "
                               "--task math needs math-verify (pip install -r requirements.txt)")

    def read(self, timeout):
        """The child's next line, "" when it is gone, None when it says nothing for `timeout` s."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline().strip() if ready else None


def math_verify_loop():
    """The MathScorer child: a JSON [answer, reference] per line in, "1.0" or "0.0" out."""
    import logging

    from math_verify import LatexExtractionConfig, parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # a timeout is a 0.0, not a warning

    @functools.lru_cache(maxsize=4096)  # each reference is parsed once
    def boxed(latex):
        return parse(f"\\boxed{{{latex}}}", [LatexExtractionConfig()])

    print("ready", flush=True)
    for line in sys.stdin:
        answer, reference = json.loads(line)
        try:  # the reference first: verify is not symmetric
            ok = float(verify(boxed(reference), boxed(answer)))
        except Exception:  # math-verify catches its own errors; anything else: a wrong answer
            ok = 0.0
        print(ok, flush=True)


MATH_SCORER = MathScorer()


def reward(task, completion, item):
    """arith, gsm8k: the last number is the answer; math: the last \\boxed{} (math_reward); toy (the
    tiny test model): a "7" anywhere."""
    if task == "math":
        return math_reward(completion, item["answer"])
    return float("7" in completion) if task == "toy" else number_reward(completion, item["answer"])


ARITH_MAX = 50        # "What is A + B?" for 0 <= A, B <= ARITH_MAX: 2601 pairs
ARITH_TEST_SHARE = 6  # 1 pair in 6 is held out: 411 problems, a standard error <= 2.5 points


def arith_is_test(a, b):
    """The held-out (A, B) pairs, 1 in ARITH_TEST_SHARE by a hash of the pair: never trained on,
    only --eval. (A hash, not a rule on A and B: with (21 A + B) % 5, which is (A + B) % 5,
    every held-out answer would end in 0 or 5 and no training one.)"""
    return int(hashlib.sha256(f"{a} + {b}".encode()).hexdigest(), 16) % ARITH_TEST_SHARE == 0


def load_task(task, split, data=None):
    """The items of a task split: [{"question": user message, "answer": reference}]. gsm8k and math
    come from a local JSONL file (or a folder holding train.jsonl / test.jsonl), else the hub."""
    if task == "toy":
        return [{"question": "Say a digit.", "answer": "7"}]
    if task == "arith":
        pairs = [(a, b) for a in range(ARITH_MAX + 1) for b in range(ARITH_MAX + 1)
                 if arith_is_test(a, b) == (split == "test")]
        # a fixed order (not --seed), so --limit picks the same problems
        random.Random(0).shuffle(pairs)
        return [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]
    if task not in ("gsm8k", "math"):
        raise ValueError(f"unknown task {task!r}: use gsm8k, math, arith or toy")
    if task == "math" and importlib.util.find_spec("math_verify") is None:
        raise TaskError("--task math needs math-verify: pip install -r requirements.txt")
    if data:
        with open(os.path.join(data, f"{split}.jsonl") if os.path.isdir(data) else data) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    elif task == "gsm8k":
        import datasets

        rows = datasets.load_dataset("openai/gsm8k", "main", split=split)
    else:  # MATH (Hendrycks et al., MIT) as open-r1 loads it: problem, level, type, solution
        import datasets

        rows = datasets.load_dataset("DigitalLearningGmbH/MATH-lighteval", "default", split=split)
    if task == "math":
        return [math_item(r, f"{data or 'MATH'} ({split}) row {i + 1}") for i, r in enumerate(rows)]
    instruction = ("\nThink step by step, then end your reply with the final answer as a plain "
                   "number.")
    return [{"question": r["question"] + instruction, "answer": gsm8k_reference(r["answer"])}
            for r in rows]


def math_item(row, where):
    r"""A MATH row as an item: its short "answer" (MATH-500, PRM800K) else the last \boxed{} of its
    worked "solution" (the MATH release). The prompt ends in Qwen2.5-Math's instruction."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a MATH row is a JSON object, not {type(row).__name__}")
    answer = row.get("answer")
    answer = str(answer) if answer not in (None, "") else last_boxed(str(row.get("solution") or ""))
    if not answer or "problem" not in row:
        raise ValueError(f"{where}: a MATH row needs a \"problem\" and an \"answer\", or a "
                         f"\"solution\" with a \\boxed{{}} answer; this one has {sorted(row)[:8]}")
    return {"question": row["problem"] + "\nPlease reason step by step, and put your final answer "
            "within \\boxed{}.", "answer": answer}


def shard_order(n_items, seed, replica_id, num_replicas):
    """Endless item indices for one replica: its own slice, reshuffled each epoch with
    seed + replica_id."""
    # toy has 1 item: then every replica takes all
    mine = list(range(replica_id, n_items, num_replicas)) or list(range(n_items))
    rng = random.Random(seed + replica_id)
    while True:
        rng.shuffle(mine)
        yield from mine


def chat_prompt(tokenizer, question):
    """The chat-templated prompt text and its token ids (what the engine is fed)."""
    if not tokenizer.chat_template:  # a base model: the question as is
        text = question
    else:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def completion_text(tokenizer, ids):
    """What a completion's reward is computed from, on the replica and again in the trainer's
    check (support/reward_check.py): its sampled ids decoded, special tokens (the EOS) left out."""
    return tokenizer.decode(ids, skip_special_tokens=True)
