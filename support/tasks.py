"""The built-in tasks, written as anyone's own task is: rows with a "prompt" (here a chat
message) and an "answer" column, and reward functions in TRL's convention (support/rewards.py):
f(completions, answer, **kwargs) -> one float per completion. Read them as examples; a new task
needs no edit here: `--dataset data.jsonl --reward-funcs my_rewards.py:reward` (README, "Your own
task").

    --task  rows (load_task)                                       reward function (BUILTIN)
    arith   "What is A + B?" (A, B in 0..50); held-out pairs by a hash    number_reward
    gsm8k   grade-school math (local JSONL or the hub's openai/gsm8k)    number_reward
    math    MATH (local JSONL or the hub's MATH-lighteval), \\boxed{}    boxed_math_reward
    toy     "Say a digit." for the tiny test model                       seven_reward

MATH's check costs bounded time (docs/math.md): answers too long or with exponent towers are
scored 0 before math-verify; math-verify runs in a child process with a short timeout, and a
group whose answers take longer is unverifiable (MathTimeout: the group is dropped).

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
import time

from support.task_data import load_splits


class TaskError(Exception):
    """A task that cannot run here (a missing dependency); the message says what to install."""

NUMBER = re.compile(r"(?<!\d)-?\d[\d,]*(?:\.\d+)?")  # "1,234.5", "-7"; "$18" -> "18"; "3-4" -> 3, 4


def last_number(text):
    """The last number written in `text` as a float (commas dropped), or None."""
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def same_number(text, reference):
    """True when the last number of `text` equals the reference number (commas dropped)."""
    got = last_number(text)
    return got is not None and abs(got - float(str(reference).replace(",", ""))) < 1e-6


def content(completion):
    """A completion's text: TRL passes a string for a plain prompt, a list of messages for a
    conversational one (then the last message's content)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def number_reward(completions, answer, **kwargs):
    """arith, gsm8k: 1.0 when the completion's last number is the answer, else 0.0."""
    return [float(same_number(content(c), a)) for c, a in zip(completions, answer)]


def seven_reward(completions, **kwargs):
    """toy (the tiny test model): 1.0 for a "7" anywhere."""
    return [float("7" in content(c)) for c in completions]


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


MAX_ANSWER_CHARS = 200  # a boxed answer longer than this is not checked: 0.0
MATH_TIMEOUT_S = 3.0  # the most one answer may take in math-verify's process
MATH_GROUP_BUDGET_S = 4.0  # the most one call (one group's answers) may take in all
TOWER = re.compile(r"\^\s*\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\^|\^\s*\w\s*\^")  # 9^{9^{9}}, 9^9^9
BIG_EXPONENT = re.compile(r"\^\s*\{?\s*-?\d{4,}")  # 9^{999999999}: ^ and 4 digits or more
BIG_FACTORIAL = re.compile(r"\d{3,}\s*!")  # 1000000!


class MathTimeout(Exception):
    """math-verify took longer than the bound: the answer can be neither right nor wrong."""


def costly_answer(answer):
    """Why a boxed answer would cost math-verify seconds (None when it would not): too long, a
    power in an exponent, an exponent of 4 digits or more, a factorial of 3 digits or more.
    Measured: 9^{9^{9}}, 9^{999999999} and 1000000! each time out at 5 s; 10^{10000} costs
    0.7 s (docs/math.md)."""
    if len(answer) > MAX_ANSWER_CHARS:
        return f"{len(answer)} characters (> {MAX_ANSWER_CHARS})"
    for pattern, what in ((TOWER, "a power in an exponent"), (BIG_EXPONENT, "an exponent of 4+ "
                          "digits"), (BIG_FACTORIAL, "a factorial of 3+ digits")):
        if pattern.search(answer):
            return what
    return None


def boxed_math_reward(completions, answer, **kwargs):
    r"""math: 1.0 when the completion's last \boxed{} is the answer as mathematics (\frac12 = 0.5
    = \dfrac{1}{2}, 5\text{ cm} = 5, intervals, sets, expressions) by Hugging Face's math-verify
    (the checker of TRL's accuracy_reward); 0.0 for no box or a costly one (costly_answer).
    Raises MathTimeout when math-verify takes longer than MATH_TIMEOUT_S on one answer or the
    group's answers MATH_GROUP_BUDGET_S in all: the group is unverifiable."""
    deadline, scores = time.monotonic() + MATH_GROUP_BUDGET_S, []
    for c, reference in zip(completions, answer):
        boxed = last_boxed(content(c))
        if not boxed or not boxed.strip() or costly_answer(boxed):
            scores.append(0.0)
            continue
        left = min(MATH_TIMEOUT_S, deadline - time.monotonic())
        scores.append(MATH_SCORER(boxed, reference, left) if left > 0 else None)
        if scores[-1] is None:
            raise MathTimeout(f"math-verify took over {MATH_TIMEOUT_S:g} s on one answer, or "
                              f"{MATH_GROUP_BUDGET_S:g} s on the group's: {boxed[:60]!r}")
    return scores


class MathScorer:
    """math-verify in a child process. Its timeouts use signal.alarm, which works only in a main
    thread (TRL turns them off in other threads) and cannot stop C code. Here they run in the
    child's main thread (1 s per parse and per comparison: a timeout there answers None), and a
    child that takes longer than the caller's `timeout_s` or dies is killed and replaced (that
    answer: None). Any thread may call it. Returns 1.0, 0.0, or None (unverifiable)."""

    def __init__(self):
        self.proc, self.lock = None, threading.Lock()

    def __call__(self, answer, reference, timeout_s=MATH_TIMEOUT_S):
        with self.lock:
            if self.proc is not None and self.proc.poll() is not None:  # died since (memory?)
                self.close()
            if self.proc is None:
                self.start()
            try:
                self.proc.stdin.write(json.dumps([answer, reference]) + "\n")  # ASCII: one line
                self.proc.stdin.flush()
                if line := self.read(timeout_s):  # "": the child died
                    return None if line == "timeout" else float(line)
            except (OSError, ValueError):  # a broken pipe (it died) or a garbled line
                pass
            self.close()
            return None

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
    """The MathScorer child: a JSON [answer, reference] per line in, "1.0", "0.0" or "timeout"
    out (math-verify logs each of its timeouts as a warning, then answers False)."""
    import logging

    from math_verify import LatexExtractionConfig, parse, verify

    timeouts = []  # math-verify's warnings since the last answer: "Timeout during ..."
    log = logging.getLogger("math_verify")
    log.setLevel(logging.WARNING)
    log.propagate = False  # said here, not on stderr
    log.addHandler(type("Timeouts", (logging.Handler,), {
        "emit": lambda self, r: timeouts.append(r) if "Timeout" in r.getMessage() else None})())

    @functools.lru_cache(maxsize=4096)  # each reference is parsed once
    def boxed(latex):
        return parse(f"\\boxed{{{latex}}}", [LatexExtractionConfig()], parsing_timeout=1)

    # the first parse loads math-verify's grammar (~2 s on a loaded 2-core machine): before
    # "ready", with no time limit, so that no answer's 1 s limit pays for it
    parse("\\boxed{\\left( 1, \\frac{\\pi}{2} \\right)}", [LatexExtractionConfig()],
          parsing_timeout=None)
    print("ready", flush=True)
    for line in sys.stdin:
        answer, reference = json.loads(line)
        timeouts.clear()
        try:  # the reference first: verify is not symmetric
            ok = float(verify(boxed(reference), boxed(answer), timeout_seconds=1))
        except Exception:  # math-verify catches its own errors; anything else: a wrong answer
            ok = 0.0
        print("timeout" if timeouts else ok, flush=True)


MATH_SCORER = MathScorer()

# --task NAME: its rows (load_task) and its reward function
BUILTIN = {"arith": number_reward, "gsm8k": number_reward, "math": boxed_math_reward,
           "toy": seven_reward}


ARITH_MAX = 50        # "What is A + B?" for 0 <= A, B <= ARITH_MAX: 2601 pairs
ARITH_TEST_SHARE = 6  # 1 pair in 6 is held out: 411 problems, a standard error <= 2.5 points


def arith_is_test(a, b):
    """The held-out (A, B) pairs, 1 in ARITH_TEST_SHARE by a hash of the pair: never trained on,
    only --eval. (A hash, not a rule on A and B: with (21 A + B) % 5, which is (A + B) % 5,
    every held-out answer would end in 0 or 5 and no training one.)"""
    return int(hashlib.sha256(f"{a} + {b}".encode()).hexdigest(), 16) % ARITH_TEST_SHARE == 0


def load_task(task, split, data=None):
    """The rows of a built-in task's split: [{"prompt": [one user message], "answer": reference}].
    gsm8k and math come from --data (a folder holding train.jsonl and test.jsonl, or one JSONL
    file, split as any dataset without a test split is: support/task_data.py), else the hub."""
    if task == "toy":
        return [user("Say a digit.", "7")]
    if task == "arith":
        pairs = [(a, b) for a in range(ARITH_MAX + 1) for b in range(ARITH_MAX + 1)
                 if arith_is_test(a, b) == (split == "test")]
        # a fixed order (not --seed), so --limit picks the same problems
        random.Random(0).shuffle(pairs)
        return [user(f"What is {a} + {b}?", str(a + b)) for a, b in pairs]
    if task not in BUILTIN:
        raise TaskError(f"unknown task {task!r}: use {', '.join(BUILTIN)}, or --dataset with "
                        "--reward-funcs for your own")
    if task == "math" and importlib.util.find_spec("math_verify") is None:
        raise TaskError("--task math needs math-verify: pip install -r requirements.txt")
    if data and os.path.isdir(data):
        with open(os.path.join(data, f"{split}.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    elif data:  # one file: never both splits (its test rows held out by the stated rule)
        rows = split_file(data)[split]
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
    return [user(r["question"] + instruction, gsm8k_reference(r["answer"])) for r in rows]


@functools.lru_cache(maxsize=4)
def split_file(path):
    """A one-file --data's train and test rows (loaded and split once per process)."""
    return load_splits(path, check=False)


def user(question, answer):
    """A row in TRL's conversational form: the question as the user's message."""
    return {"prompt": [{"role": "user", "content": question}], "answer": answer}


def math_item(row, where):
    r"""A MATH row as an item: its short "answer" (MATH-500, PRM800K) else the last \boxed{} of its
    worked "solution" (the MATH release). The prompt ends in Qwen2.5-Math's instruction."""
    if not isinstance(row, dict):
        raise TaskError(f"{where}: a MATH row is a JSON object, not {type(row).__name__}")
    answer = row.get("answer")
    answer = str(answer) if answer not in (None, "") else last_boxed(str(row.get("solution") or ""))
    if not answer or "problem" not in row:
        raise TaskError(f"{where}: a MATH row needs a \"problem\" and an \"answer\", or a "
                         f"\"solution\" with a \\boxed{{}} answer; this one has {sorted(row)[:8]}")
    return user(row["problem"] + "\nPlease reason step by step, and put your final answer "
                "within \\boxed{}.", answer)


def shard_order(n_items, seed, replica_id, num_replicas):
    """Endless row indices for one replica: its own slice, reshuffled each epoch (seed + id)."""
    # toy has 1 item: then every replica takes all
    mine = list(range(replica_id, n_items, num_replicas)) or list(range(n_items))
    rng = random.Random(seed + replica_id)
    while True:
        rng.shuffle(mine)
        yield from mine


def completion_text(tokenizer, ids):
    """What a completion's reward is computed from, on the replica and again in the trainer's
    check (support/reward_check.py): its sampled ids decoded, special tokens (the EOS) left out."""
    return tokenizer.decode(ids, skip_special_tokens=True)
