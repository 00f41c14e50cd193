"""The card under a role: which dtype it computes in, and the trainer's activation checkpointing.

    card_dtype(capability, role)  one rule for the trainer and both engines: bf16 from compute
                                  capability 8.0; below it fp16 for a replica (vLLM 0.32's wheels
                                  start at 7.5, the T4's), a refusal for the trainer; fp32
                                  without CUDA
    checkpoint_layers(model)      trainer.py --gradient-checkpointing: each decoder layer's
                                  activations recomputed in the backward pass, the shared-prompt
                                  forward's KV cache kept correct

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_gpu_round.py -q

This module imports no role file.
"""

import functools

# vLLM 0.32 serves bf16 from compute capability 8.0 (Ampere) only: platforms/cuda.py:255-264
# (supported_dtypes), and an explicit bfloat16 below it is refused (platforms/cuda.py:636-653).
BF16_FROM = (8, 0)
TRAINER_FLAVORS = "l4x1, a10g-*, l40sx*, a100-*, h200*"  # the Jobs flavours of capability >= 8.0


def card_dtype(capability, role, name="this GPU"):
    """"float32" without CUDA (capability None); else the dtype for `role` on this card.
    The dtype, as a torch attribute name, that `role` ("trainer" or "replica") computes in on
    a CUDA card of compute capability (major, minor).

    From 8.0 (A10G, L4, L40S, A100, H200) "bfloat16", for the trainer and both engines alike, so
    that sampler and learner run the same dtype. Below 8.0 (T4: 7.5) there is no bf16: a replica
    serves "float16" (what vLLM's dtype "auto" falls back to there, config/model.py:2405-2443).
    vLLM 0.32's CUDA wheels are built for capability 7.5 and up, so below 7.5 (no Jobs flavour)
    only the hf engine (ENGINE=hf) can serve. The trainer refuses (ValueError, its message says
    what to do): training in fp16 needs the loss scaling this trainer does not do."""
    if capability is None:
        return "float32"
    if tuple(capability) >= BF16_FROM:
        return "bfloat16"
    if role == "replica":
        return "float16"
    major, minor = capability
    raise ValueError(f"{name} has compute capability {major}.{minor}: no bfloat16 below 8.0, and "
                     "the trainer does not train in float16 (no loss scaling). Run the trainer "
                     f"on a card of capability >= 8.0 (Jobs flavours {TRAINER_FLAVORS}); a "
                     "t4-* card can still run replicas (they sample in float16)")


def checkpoint_layers(model):
    """Activation checkpointing (TRL's gradient_checkpointing) on each decoder layer of `model`:
    the backward pass recomputes a layer's activations instead of keeping them, so a micro-batch
    keeps one hidden state per layer, not every intermediate tensor (the memory table:
    docs/gpu-round.md). The same values and gradients (tests/test_gpu_round.py).

    Not transformers' gradient_checkpointing_enable: that one runs only in train mode and drops
    the KV cache (modeling_layers.py:81-109, "Caching is incompatible with gradient
    checkpointing"), and trainer.py's shared-prompt forward (support/shared_prompt.py) needs both
    eval mode and the cache. Here a layer's recomputation first puts its cache layer back as it
    was when the layer first ran, so the replay appends the same keys and values once more to the
    same prefix (torch.utils.checkpoint, non-reentrant: the graph is the first pass's, only the
    saved tensors are recomputed). Returns the number of layers wrapped."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for i, layer in enumerate(layers):
        layer.forward = functools.partial(_checkpointed, layer.forward, i)
    return len(layers)


def _checkpointed(forward, index, hidden_states, *args, **kwargs):
    """forward(hidden_states, *args, **kwargs) under torch.utils.checkpoint; `index`: the layer's
    place in the KV cache (past_key_values.layers, a DynamicCache's list of layers)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    if not torch.is_grad_enabled():  # nothing is kept for a backward pass anyway
        return forward(hidden_states, *args, **kwargs)
    layers = getattr(kwargs.get("past_key_values"), "layers", None)
    if layers is not None and index >= len(layers):  # a cache that makes its layers as it goes
        raise RuntimeError("checkpoint_layers needs a KV cache whose layers exist before the "
                           "forward (transformers' DynamicCache(config=...), what its models make)")
    before = None if layers is None else dict(vars(layers[index]))

    def run(h):
        if before is not None:  # the replay: the cache layer as the first pass found it
            vars(layers[index]).clear()
            vars(layers[index]).update(before)
        return forward(h, *args, **kwargs)

    return checkpoint(run, hidden_states, use_reentrant=False)
