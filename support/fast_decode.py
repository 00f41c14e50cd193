"""The hf engine's decode loop (engines.HFEngine._decode): a llama-like decoder run layer by layer
over the model's own weights, for P prompts x n samples at once.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_generate.py  # against generate
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q tests/test_engines.py

What it computes is what transformers' forward computes (LlamaDecoderLayer: x + attn(norm(x)),
then x + mlp(norm(x))), in fewer torch calls:
- join_projections: q/k/v and gate/up laid back to back at load, each group one matmul, the
  model's own Linear layers holding views (no copy);
- linear_group: each LoRA group as one x @ A and one addmm, its B block-diagonal, scaled;
- FastDecoder.prefill: every distinct prompt token once, in one pass; FastDecoder.step: one new
  token per row, each prompt's cache read once for its n rows, the new tokens' cache preallocated;
- Packs: on a CPU in fp32 with MKL, the base weights packed once for the steps' row count.
fast_decode_support says when a model or adapter is outside what it covers (engines.HFEngine then
samples with transformers' generate). docs/generation.md has the measurements. torch is imported
inside functions, as in support/engines.py.
"""

FAST_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")  # decoders HFEngine._decode runs
FAST_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "lm_head")  # the linear maps FastDecoder applies a LoRA on


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
        if A is None:
            return y
        if A.dtype == y.dtype:
            return y.addmm_(F.linear(x, A), B_t)  # (rows, out) += (rows, k*r) @ (k*r, out)
        # a bf16 model, its LoRA in fp32 (peft's autocast_adapter_dtype): the LoRA term in fp32
        # and the sum rounded to the model's dtype, as peft's Linear computes it
        return (y + F.linear(x.to(A.dtype), A) @ B_t).to(y.dtype)  # (rows, out)

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
    weight MKL does at every call; the same sgemm, the same tokens (tests/test_engines.py). Made
    for one row count (the decode steps' P*n rows), at the first call with it, kept while calls
    come with it: a second copy of the base weights in memory. Products with another row count
    (the prefill) take the weights as they are. Private torch ops, so only where they exist (usable)."""

    def __init__(self):
        self.rows, self.packed = None, {}

    @staticmethod
    def usable(device, dtype):
        """Whether MKL's packed weights can run here: fp32 on a CPU whose torch has MKL's packing
        ops (then the same products, faster: test_packed_weights_sample_as_unpacked)."""
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
