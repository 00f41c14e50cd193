"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for trainer.py's ranks, `--fsdp` (jobs.sh
TRAINER_FSDP=1): each rank holds 1/N of the model, of the LoRA and of AdamW's state, for a model
that does not fit one GPU. support/data_parallel.py's Ranks calls these when --fsdp; not needed
to follow the GRPO step.

    torchrun --standalone --nproc-per-node 2 trainer.py --fsdp --model ... --bucket ... --proxy ...

    shard_model        fully_shard on each decoder layer, then on the root (TRL's and accelerate's
                       FSDP2 wrap); the gradients reduced as a SUM over the ranks
    load_full_state    rank 0's full LoRA and AdamW state into every rank's shards
    gather_full_state  every rank's shards -> the full LoRA and AdamW state on rank 0, on the CPU,
                       in one process's format (what trainer.publish writes)
    idle_pass          a forward and a backward of weight 0: a rank with fewer micro-batches runs
                       as many as the others (each forward and backward is a collective)

Where this departs from PyTorch's FSDP2 and TRL's FSDP2 runs:
1. FSDP2 averages the gradients over the ranks; here they are summed (set_gradient_divide_factor
   1, ReduceOp.SUM): the loss's normalisers are the whole step's on every rank
   (trainer.compute_loss_and_backward), so the sum is the one-process gradient.
2. The resume state is the full LoRA + AdamW state, as one process saves it, not a sharded
   torch.distributed.checkpoint: LoRA's state is small (r 16 on every linear layer of a 32B
   model: ~0.13 B parameters, ~1.6 GB with AdamW's two moments, fp32), and a full state resumes
   under any N, with or without --fsdp.
3. Each rank loads the whole base model into host memory before sharding it (accelerate's
   cpu_ram_efficient_loading loads it on rank 0 alone, the others on the meta device: not built).
4. The forward is trainer.plain_logprobs, the definition: the shared-prompt forward
   (support/shared_prompt.py) fails in fully_shard's backward (docs/hf-jobs.md).

This module imports no role file.
"""

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard

from support.trainer_state import FREE_OPTIMIZER_KEYS, TrainerError


def shard_model(model):
    """fully_shard each decoder layer (transformers' GradientCheckpointingLayer), then the root,
    on the default mesh (every rank, this process's device). Gradients: SUM (departure 1)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise TrainerError(f"--fsdp: no decoder layer (transformers' GradientCheckpointingLayer) "
                           f"in {type(model.get_base_model()).__name__}: run without --fsdp")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # 1.0: the sum, not the mean
            m.set_force_sum_reduction_for_comms(True)  # ReduceOp.SUM (gloo has no PREMUL_SUM)
    return model


def load_full_state(model, optimizer, lora, adamw, resumed):
    """Rank 0's full LoRA ({name: tensor}, model.named_parameters' names) and AdamW state
    (optimizer.state_dict() of one process) into every rank's shards of the sharded model and
    of its optimizer; ranks > 0 pass {} and None. resumed: rank 0 has an AdamW state to load
    (False: a fresh one). Every rank takes part."""
    full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    # a copy: torch puts the shards in the dict it is given. strict=False: the base stays as it is
    set_model_state_dict(model, dict(lora), options=full)
    if resumed:  # torch steps a fresh AdamW once at lr 0 before loading: not for a fresh one
        named = by_name(model, adamw) if dist.get_rank() == 0 else {}
        # this trainer's AdamW settings, kept as built (the load makes betas a list, and
        # state_problem refuses the next save): the ones a resume state may not change
        settings = [{k: v for k, v in g.items() if k not in FREE_OPTIMIZER_KEYS}
                    for g in optimizer.param_groups]
        optimizer.zero_grad(set_to_none=True)  # torch builds the state only with no gradient
        set_optimizer_state_dict(model, optimizer, named, options=full)
        for g, s in zip(optimizer.param_groups, settings):
            g.update(s)


def gather_full_state(model, optimizer=None):
    """(LoRA, AdamW): on rank 0 the full LoRA {name: CPU tensor} and, with an optimizer, its
    full state in optimizer.state_dict()'s format (what one process saves); on the other ranks
    ({}, None). Every rank takes part (all-gathers)."""
    # tensor by tensor, not get_model_state_dict(ignore_frozen_params=True): with tied
    # embeddings that dict keeps lm_head.weight, the whole vocabulary's matrix, to gather
    lora = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            whole = p.detach().full_tensor()  # an all-gather of its shards, on every rank
            if dist.get_rank() == 0:
                lora[n] = whole.cpu()
    if optimizer is None:
        return lora, None
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    named = get_optimizer_state_dict(model, optimizer, options=full)  # rank 0's: whole tensors
    if dist.get_rank() > 0:
        return lora, None
    index = {n: i for i, n in enumerate(lora_names(model))}  # the ids of optimizer.state_dict()
    return lora, {"state": {index[n]: s for n, s in named["state"].items()},
                  "param_groups": optimizer.state_dict()["param_groups"]}  # its own, as built


def lora_names(model):
    """The LoRA parameters' names, in lora_parameters' order: AdamW's ids 0, 1, ..."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def by_name(model, adamw):
    """optimizer.state_dict() (ids) -> torch.distributed.checkpoint's format (names)."""
    names = lora_names(model)
    return {"state": {names[i]: s for i, s in adamw["state"].items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]])
                             for g in adamw["param_groups"]]}


def idle_pass(model, forward, beta):
    """What a micro-batch does, at weight 0, on a stand-in (forward(): its log-probs): the
    forward, the base model's (beta > 0) and the backward, so this rank runs the collectives the
    others run. It adds 0 to every gradient."""
    logps = forward()  # (1, C)
    if beta > 0:
        with torch.no_grad(), model.disable_adapter():
            forward()
    logps.backward(torch.zeros_like(logps))  # a gradient of 0 for each log-prob
