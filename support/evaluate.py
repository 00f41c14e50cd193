"""rollout.py --eval: the base model or an adapter, greedy, on the task's test split, scored by
the run's reward functions (support/rewards.py): the mean reward, and the accuracy when every
function returns 0 or 1 (a row is correct when every function that applies gives it 1). jobs.sh
--local runs it before and after training. Not part of the GRPO step.

    python rollout.py --eval --model /tmp/smollm2 --task arith --engine hf --limit 100  # base
    python rollout.py --eval --model M --dataset rows.jsonl --reward-funcs rewards.py:reward
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m pytest -q tests/test_rollout.py

A row whose reward function fails is reported with its name and left out of both numbers
(`errors` in the result). This module imports no role file.
"""

import hashlib
import json
import os
import time

from support.buckets import open_bucket
from support.engines import adapter_rank, make_engine, pick_engine
from support.rewards import RewardFuncError, templated


def eval_cache_key(args, task, engine_name, rows):
    """The name of the base model's greedy result in --eval-cache: one per (model, rows, reward
    functions and weights, --max-completion-length, engine). A local model folder's files (name,
    size, mtime) are in the key, so a changed model is a miss; so are the rows themselves and
    each reward function's file (its bytes), so an edited reward is a miss too."""
    m = args.model
    stats = [(f, os.stat(os.path.join(m, f))) for f in sorted(os.listdir(m))] \
        if os.path.isdir(m) else []
    stamps = [[f, st.st_size, st.st_mtime_ns] for f, st in stats]
    model = os.path.abspath(m) if stamps else m
    key = json.dumps([model, stamps, rows, task.fingerprint(), args.max_completion_length,
                      engine_name], default=str).encode()
    return f"base-{task.name}-{hashlib.sha256(key).hexdigest()[:16]}.json"


def score_rows(task, rows, texts, tokenizer):
    """Each row's reward (None when a function failed: said on stdout), whether each is correct,
    and whether the accuracy is defined (every value of every function 0, 1 or None). The
    completion_ids a function gets here are the text tokenized again (the engines' greedy
    returns texts)."""
    rewards, binary, correct = [], True, []
    for i, (row, text) in enumerate(zip(rows, texts)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        try:
            (r,), per_function = task.score(row, [text], [ids], f"test row {i}")
        except RewardFuncError as e:
            print(f"eval: row left out: {e}", flush=True)
            rewards.append(None), correct.append(None)
            continue
        values = [v[0] for v in per_function if v[0] is not None]
        binary = binary and all(v in (0.0, 1.0) for v in values)
        rewards.append(r), correct.append(all(v == 1.0 for v in values))
    return rewards, correct, binary


def run_eval(args, task, version=None, path=None):
    """Greedy rewards of adapter `version`, pulled into `path` (rollout.eval_adapter), or of the
    base model (cached: eval_cache_key) on the task's test split: written to --eval-out, and its
    one line printed (jobs.sh shows it)."""
    # the cache is a folder bucket: each write is atomic
    t0, cache = time.time(), open_bucket(args.eval_cache)
    rows = task.rows("test")[: args.limit or None]
    key = None if args.adapter != "base" or args.no_eval_cache else \
        eval_cache_key(args, task, pick_engine(args.engine)[0], rows)
    if key and (hit := cache.read(key)) is not None:
        result = dict(json.loads(hit), seconds=round(time.time() - t0, 1), cached=True)
    else:
        engine = make_engine(args, lora_rank=adapter_rank(path) if path else 8)
        if path:
            engine.load_adapter(version, path)
        prompts = [templated(engine.tokenizer, row["prompt"])[1] for row in rows]
        texts = engine.greedy(prompts, args.max_completion_length)
        rewards, correct, binary = score_rows(task, rows, texts, engine.tokenizer)
        scored = [r for r in rewards if r is not None]
        result = {"task": task.name, "reward_funcs": [n for n, _ in task.funcs],
                  "model": args.model, "adapter": args.adapter, "version": version,
                  "engine": engine.name, "n": len(scored), "errors": len(rows) - len(scored),
                  "mean_reward": sum(scored) / max(1, len(scored)),
                  "seconds": round(time.time() - t0, 1),
                  "max_completion_length": args.max_completion_length,
                  "results": [{"prompt": row["prompt"], "answer": row.get("answer"),
                               "completion": t, "reward": r, "correct": c}
                              for row, t, r, c in zip(rows, texts, rewards, correct)]}
        if binary:  # report.py reads these two
            result["correct"] = sum(1 for c in correct if c)
            result["accuracy"] = result["correct"] / max(1, len(scored))
        if key:
            cache.write(key, json.dumps(result, default=str).encode())
    out = args.eval_out or os.path.join("runs", f"eval-{task.name}-{args.adapter}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    v = result["version"]
    which = args.adapter if v is None else f"{args.adapter} (v{v})"
    score = (f"accuracy {result['accuracy']:.3f} ({result['correct']}/{result['n']}), "
             if "accuracy" in result else "")
    errors = f", {result['errors']} rows left out (reward errors)" if result["errors"] else ""
    print(f"eval {task.name} adapter={which} {result['engine']}: {score}mean reward "
          f"{result['mean_reward']:.3f} in {result['seconds']:.1f}s{errors} -> {out}"
          + (" (cached)" if result.get("cached") else ""), flush=True)
    return result
