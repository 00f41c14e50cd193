"""trainer.py as N processes of one job, one device each (data parallel, PyTorch's own collectives
within the job; the proxy and the replicas still see one trainer). Not needed to follow the GRPO
step: with one process (a plain `python trainer.py`) every call here returns at once.

    torchrun --standalone --nproc-per-node 2 trainer.py --model ... --bucket ... --proxy ...

Rank 0 is the trainer of one process: it alone talks to the proxy and writes the bucket. Ranks
1..N-1 build the same model and follow it (follow_rank_zero). What each call guarantees:

    join_ranks             this process's rank in its torchrun job (gloo on CPUs, nccl on GPUs,
                           device cuda:LOCAL_RANK); without torchrun ONE_PROCESS, no process group
    Ranks.start_alike      every rank starts from rank 0's settings (the proxy's contract
                           included), LoRA weights, AdamW state, step and version
    Ranks.same_groups      every rank holds rank 0's groups of the step
    Ranks.my_share         this rank's micro-batches: rank, rank + N, ... of the step's list
    Ranks.sum_gradients    every rank holds the whole step's LoRA gradient, the sum of the shares
    Ranks.whole_step       every rank holds the whole step's statistics (StepStats merged)
    follow_rank_zero       ranks > 0: the model, then every step rank 0 takes, on its groups

The loss's normalisers are the whole step's on every rank (trainer.compute_loss_and_backward
counts the tokens, rows and micro-batches of the whole step, not of its share), so the summed
gradient is the one-process gradient, every rank's AdamW step the same, and the resume state
rank 0 saves (the full LoRA + AdamW) fits any N (tests/test_data_parallel.py).
A rank that dies: torchrun's agent ends the others and exits non-zero naming it; a collective
that fails, or waits longer than the process group's timeout, is a TrainerError naming the rank.

This module imports no role file.
"""

import datetime
import os

import torch
import torch.distributed as dist

from support.devices import checkpoint_layers
from support.trainer_state import TrainerError, build_model, lora_parameters, make_optimizer

# The longest a rank waits in a collective beyond --wait-timeout and --bucket-retry: what rank 0
# may spend between two collectives on top of them (the model's load, a publish, a step's compute)
MARGIN_S = 1800
NEVER_S = 30 * 86400  # --wait-timeout 0 (never give up): a month


class Ranks:
    """Rank `rank` of `world` processes; world == 1: every method returns at once."""

    def __init__(self, rank=0, world=1):
        self.rank, self.world = rank, world

    def start_alike(self, args, model, optimizer, step=0, version=0):
        """Every rank starts where rank 0 does: its args (updated from the proxy's contract), LoRA
        weights, AdamW state, step and version. Returns (step, version)."""
        if self.world == 1:
            return step, version
        start = [{"args": vars(args), "step": step, "version": version,  # AdamW's, on the CPU:
                  "optimizer": on_cpu(optimizer.state_dict())} if self.rank == 0 else None]
        with self.collective("the start"):  # load_state_dict puts it on the parameters' device
            dist.broadcast_object_list(start, src=0)
            for p in lora_parameters(model):
                dist.broadcast(p.detach(), src=0)
        if self.rank > 0:
            vars(args).update(start[0]["args"])
            optimizer.load_state_dict(start[0]["optimizer"])
        return start[0]["step"], start[0]["version"]

    def same_groups(self, groups):
        """Rank 0's groups (its argument; other ranks pass None), on every rank."""
        if self.world == 1:
            return groups
        box = [groups]
        with self.collective("the step's groups"):  # ranks > 0 wait here while rank 0 gathers
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def my_share(self, microbatches):
        """This rank's micro-batches of the whole step's list: rank, rank + N, ..."""
        return microbatches[self.rank::self.world]

    def sum_gradients(self, model):
        """Every rank's .grad of the LoRA parameters becomes the sum over the ranks (one
        all_reduce). A parameter without a gradient on a rank counts as zeros; when no rank has
        one (nothing forwarded anywhere) they stay None, as in one process."""
        if self.world == 1:
            return
        params = lora_parameters(model)
        had = any(p.grad is not None for p in params)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads]  # (n,) + 1 flag: "had one"
                         + [torch.full((1,), float(had), device=params[0].device)])
        with self.collective("the gradients"):
            dist.all_reduce(flat)  # SUM
        if flat[-1] == 0:
            return
        for p, g in zip(params, flat[:-1].split([p.numel() for p in params])):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(g.view_as(p))

    def whole_step(self, record):
        """record (a step_record.StepStats of this rank's micro-batches) merged with every other
        rank's, in rank order: the statistics one process gathers, on every rank."""
        if self.world == 1:
            return record
        shares = [None] * self.world
        with self.collective("the step's statistics"):
            dist.all_gather_object(shares, record.share())
        record.merge(shares)
        return record

    def collective(self, what):
        return Collective(self, what)

    def leave(self):
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


class Collective:
    """A failed or timed-out collective -> a TrainerError that says which rank and what to do."""

    def __init__(self, ranks, what):
        self.ranks, self.what = ranks, what

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if isinstance(error, RuntimeError):  # gloo's "Connection closed by peer", a timeout
            raise TrainerError(
                f"rank {self.ranks.rank} of {self.ranks.world}: {self.what} did not come through "
                f"({str(error).strip().splitlines()[0][:200]}): another rank of this trainer died "
                "or hangs (its log says why); the run ends here, and the same command resumes "
                "from the last state saved in the bucket") from None
        return False


ONE_PROCESS = Ranks(0, 1)


def join_ranks(wait_timeout, bucket_retry):
    """This process's Ranks: from torchrun's RANK, WORLD_SIZE, LOCAL_RANK (gloo on CPUs, nccl on
    GPUs, each rank on cuda:LOCAL_RANK), or ONE_PROCESS without them. A collective waits at most
    wait_timeout (0: NEVER_S) + bucket_retry + MARGIN_S seconds, then raises."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return ONE_PROCESS
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    gpu = torch.cuda.is_available()
    if gpu and local >= torch.cuda.device_count():
        raise TrainerError(f"rank {rank}: LOCAL_RANK {local} but {torch.cuda.device_count()} "
                           "GPUs: start at most one process per GPU (--nproc-per-node)")
    if gpu:
        torch.cuda.set_device(local)  # build_model's "cuda" is this rank's card
    timeout = datetime.timedelta(seconds=(wait_timeout or NEVER_S) + bucket_retry + MARGIN_S)
    dist.init_process_group("nccl" if gpu else "gloo", timeout=timeout)
    return Ranks(dist.get_rank(), dist.get_world_size())


def follow_rank_zero(args, ranks, update):
    """Ranks > 0: no proxy, no bucket. The model and AdamW as rank 0 builds them (start_run),
    started where rank 0 starts (start_alike), then each of rank 0's steps: update(model,
    optimizer, groups, args, step, version, ranks), trainer.grpo_update, on its groups."""
    model = build_model(args.model, args.lora_r, args.lora_alpha, args.lora_target, args.seed)
    model.eval()  # no dropout, as rank 0's (start_run)
    optimizer = make_optimizer(lora_parameters(model), args)
    step, version = ranks.start_alike(args, model, optimizer)
    if args.gradient_checkpointing:
        checkpoint_layers(model)
    while step < args.max_steps:
        update(model, optimizer, ranks.same_groups(None), args, step, version, ranks)
        step, version = step + 1, version + 1


def on_cpu(obj):
    """obj (dicts, lists, tensors) with every tensor copied to the CPU: pickled across ranks."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_cpu(v) for v in obj)
    return obj
