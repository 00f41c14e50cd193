"""What the trainer's reward check (support/reward_check.py) costs: the seconds TaskRewards.problem
takes for one step's groups, made as a replica makes them (the row's prompt, each reward
scored from the decoded ids), on the tiny test model's tokenizer or --model's.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_reward_check.py --task arith
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_reward_check.py --task gsm8k \
        --data ../shared/data/gsm8k
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_reward_check.py --task math \
        --data tests/data/math_sample.jsonl

A completion's text is an answer, "The answer is N." or "So we get \\boxed{N}.", N the row's
answer or a random number (cut to --tokens tokens), so the reward function parses a number or a
box as it would. Prints the
median over --repeats steps of --groups x --generations completions: the whole check, and per
completion. The first step also tokenizes each row's prompt once (TaskRewards caches it): it
is reported apart. For math, each step's check gets a fresh math-verify process (started before
the clock), so that nothing parsed while the groups were made is cached.
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from support.reward_check import TaskRewards  # noqa: E402
from support.rewards import templated  # noqa: E402
from support.tasks import MATH_SCORER, completion_text  # noqa: E402


def step_groups(check, rng, groups, generations, tokens):
    """One step's groups for check's task, as rollout.Replica.batch makes them."""
    rows, out = check.task.rows("train"), []
    for _ in range(groups):
        i = rng.randrange(len(rows))
        ids = []
        for _ in range(generations):  # right, or a wrong number each time (math-verify parses it)
            n = rows[i]["answer"] if rng.random() < 0.5 else str(rng.randrange(10**6))
            text = rng.choice([f"The answer is {n}.", f"So we get \\boxed{{{n}}}."])
            x = check.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids.append(x[:tokens - 1] + [check.tokenizer.eos_token_id])
        texts = [completion_text(check.tokenizer, x) for x in ids]
        scores, _ = check.task.score(rows[i], texts, ids, f"train row {i}")
        out.append({"item": i, "prompt_ids": templated(check.tokenizer, rows[i]["prompt"])[1],
                    "completions": [{"ids": x, "logprobs": [-1.0] * len(x), "reward": r}
                                    for x, r in zip(ids, scores)]})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="arith", choices=["arith", "gsm8k", "math"])
    p.add_argument("--data", help="gsm8k, math: a JSONL file or a folder (as rollout.py's)")
    p.add_argument("--model", help="a model folder for its tokenizer (default: the tiny model)")
    p.add_argument("--groups", type=int, default=16, help="groups per step, B")
    p.add_argument("--generations", type=int, default=8, help="completions per group, G")
    p.add_argument("--tokens", type=int, default=256, help="longest completion, in tokens")
    p.add_argument("--repeats", type=int, default=20, help="steps measured")
    opts = p.parse_args(argv)
    model = opts.model
    if model is None:
        import tiny_model

        model = tiny_model.build(tempfile.mkdtemp(prefix="bench-reward-check-"))
    check, rng = TaskRewards({"task": opts.task}, opts.data, model), random.Random(0)
    first, times = None, []
    for r in range(opts.repeats + 1):
        groups = step_groups(check, rng, opts.groups, opts.generations, opts.tokens)
        if opts.task == "math":  # math-verify's child caches what it parsed: a fresh one, warm
            MATH_SCORER.close()
            MATH_SCORER("1", "1")
        t0 = time.perf_counter()
        problems = [check.problem(g) for g in groups]
        spent = time.perf_counter() - t0
        assert problems == [None] * len(groups), problems  # every honest group checks out
        first, times = (spent, times) if r == 0 else (first, times + [spent])
    n = opts.groups * opts.generations
    med = statistics.median(times)
    print(f"{opts.task}: a step of {opts.groups} groups x {opts.generations} completions "
          f"(<= {opts.tokens} tokens): check {med * 1e3:.1f} ms (median of {opts.repeats}; "
          f"{med / n * 1e6:.0f} us a completion); the first step, prompts tokenized: "
          f"{first * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
