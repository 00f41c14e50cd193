"""rollout.py --eval: the greedy accuracy of the base model or an adapter on the task's test
split (jobs.sh --local runs it before and after training). Not part of the GRPO step.

    python rollout.py --eval --model /tmp/smollm2 --task arith --engine hf --limit 100  # base
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m pytest -q tests/test_rollout.py

This module imports no role file.
"""

import hashlib
import json
import os
import time

from support.buckets import open_bucket
from support.engines import adapter_rank, make_engine, pick_engine
from support.tasks import chat_prompt, load_task, reward


def eval_cache_key(args, engine_name, items):
    """The name of the base model's greedy result in --eval-cache: one per (model, problems,
    --max-completion-length, engine). A local model folder's files (name, size, mtime) are in the
    key, so a changed model is a miss, and so are the problems themselves; after changing a
    reward function, pass --no-eval-cache once."""
    m = args.model
    stats = [(f, os.stat(os.path.join(m, f))) for f in sorted(os.listdir(m))] \
        if os.path.isdir(m) else []
    stamps = [[f, st.st_size, st.st_mtime_ns] for f, st in stats]
    model = os.path.abspath(m) if stamps else m
    key = json.dumps([model, stamps, items, args.max_completion_length, engine_name]).encode()
    return f"base-{args.task}-{hashlib.sha256(key).hexdigest()[:16]}.json"


def run_eval(args, version=None, path=None):
    """Greedy accuracy of adapter `version`, pulled into `path` (rollout.eval_adapter), or of the
    base model (cached: eval_cache_key) on the task's test split: written to --eval-out, and its
    one line printed (jobs.sh shows it)."""
    # the cache is a folder bucket: each write is atomic
    t0, cache = time.time(), open_bucket(args.eval_cache)
    items = load_task(args.task, "test", args.data)[: args.limit or None]
    key = None if args.adapter != "base" or args.no_eval_cache else \
        eval_cache_key(args, pick_engine(args.engine)[0], items)
    if key and (hit := cache.read(key)) is not None:
        result = dict(json.loads(hit), seconds=round(time.time() - t0, 1), cached=True)
    else:
        engine = make_engine(args, lora_rank=adapter_rank(path) if path else 8)
        if path:
            engine.load_adapter(version, path)
        prompts = [chat_prompt(engine.tokenizer, it["question"])[1] for it in items]
        texts = engine.greedy(prompts, args.max_completion_length)
        correct = [reward(args.task, text, item) for text, item in zip(texts, items)]
        acc, seconds = sum(correct) / len(items), time.time() - t0
        result = {"task": args.task, "model": args.model, "adapter": args.adapter,
                  "version": version, "engine": engine.name, "n": len(items),
                  "correct": int(sum(correct)), "accuracy": acc, "seconds": round(seconds, 1),
                  "max_completion_length": args.max_completion_length,
                  "max_new_tokens": args.max_completion_length,  # the old name
                  "results": [{"question": it["question"], "answer": it["answer"],
                               "completion": t, "correct": c}
                              for it, t, c in zip(items, texts, correct)]}
        if key:
            cache.write(key, json.dumps(result).encode())
    out = args.eval_out or os.path.join("runs", f"eval-{args.task}-{args.adapter}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    v = result["version"]
    which = args.adapter if v is None else f"{args.adapter} (v{v})"
    print(f"eval {args.task} adapter={which} {result['engine']}: accuracy "
          f"{result['accuracy']:.3f} ({result['correct']}/{result['n']}) in "
          f"{result['seconds']:.1f}s -> {out}"
          + (" (cached)" if result.get("cached") else ""), flush=True)
    return result
