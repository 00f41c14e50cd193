"""trainer.py as N processes of one job, one device each (data parallel, PyTorch's own collectives
within the job; the proxy and the replicas still see one trainer). Not needed to follow the GRPO
step: with one process (a plain `python trainer.py`) every call here returns at once, leaving its
argument as it is (spread: grpo_update itself; full_state: (None, optimizer.state_dict()), so
publish saves the model's own LoRA).

    torchrun --standalone --nproc-per-node 2 trainer.py --model ... --bucket ... --proxy ...
    torchrun --standalone --nproc-per-node 2 trainer.py --fsdp ...  # FSDP2: support/fsdp.py

Rank 0 is the trainer of one process: it alone talks to the proxy and writes the bucket. Ranks
1..N-1 build the same model and follow it (follow_rank_zero). What each call guarantees:

    join_ranks             this process's rank in its torchrun job (gloo on CPUs, nccl on GPUs,
                           device cuda:LOCAL_RANK); without torchrun ONE_PROCESS, no process group
    Ranks.start_alike      every rank starts from rank 0's settings (the proxy's contract
                           included), LoRA weights, AdamW state, step and version (--fsdp: each
                           rank its shard of them)
    Ranks.spread           trainer.grpo_update as one rank's part of the step, as DDP wraps a
                           model (the step's code unchanged): every rank on rank 0's groups
                           (same_groups), a micro-batch or more per rank, the loss on this rank's
                           share (share_of_step)
    Ranks.share_of_step    trainer.compute_loss_and_backward on this rank's micro-batches (rank,
                           rank + N, ...), then every rank holds the whole step's LoRA gradient
                           (sum_gradients; --fsdp: its shard, summed by FSDP2's reduce-scatter) and
                           statistics (StepStats merged); --fsdp: the plain forward, as many
                           forwards and backwards on every rank (idle passes of weight 0)
    Ranks.full_state       rank 0 holds the full LoRA and AdamW state, to publish and save
                           (--fsdp: gathered from every rank's shard)
    follow_rank_zero       ranks > 0: the model, then every step rank 0 takes, on its groups

The loss's normalisers are the whole step's on every rank (trainer.compute_loss_and_backward
counts the tokens, rows and micro-batches of the list it is given: each rank gets the step's
list with the other ranks' micro-batches as [], which forward nothing), so the summed gradient
is the one-process gradient, every rank's AdamW step the same, and the resume state rank 0
saves (the full LoRA + AdamW) fits any N, with or without --fsdp (tests/test_data_parallel.py).
A rank that dies: torchrun's agent ends the others and exits non-zero naming it. On gloo, a
collective that fails, or waits longer than the process group's timeout, is a TrainerError naming
the rank; under NCCL a timed-out collective aborts the process (torch's watchdog, no exception)
and torchrun's agent names the rank.

This module imports no role file.
"""

import datetime
import functools
import math
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from support.devices import checkpoint_layers
from support.fsdp import gather_full_state, idle_pass, load_full_state, shard_model
from support.step_record import StepStats
from support.trainer_state import (TrainerError, build_model, lora_parameters, make_optimizer,
                                   saves_state)

# The longest a rank waits in a collective beyond --wait-timeout and --bucket-retry: what rank 0
# may spend between two collectives on top of them (the model's load, a publish, a step's compute)
MARGIN_S = 1800
NEVER_S = 30 * 86400  # --wait-timeout 0 (never give up): a month


class Ranks:
    """Rank `rank` of `world` processes; world == 1: every method returns at once. fsdp: the
    model, LoRA and AdamW sharded over the ranks (FSDP2, support/fsdp.py)."""

    def __init__(self, rank=0, world=1, fsdp=False):
        self.rank, self.world, self.fsdp = rank, world, fsdp

    def start_alike(self, args, run):
        """Every rank starts where rank 0 does: its args (updated from the proxy's contract), LoRA
        weights, AdamW state, step, version and must_publish (run's: a namespace with those and
        model, optimizer; rank 0's from trainer_state.start_run). --fsdp: the model is sharded
        here and run.optimizer becomes an AdamW of the shards."""
        if self.world == 1:
            return run
        adamw = on_cpu(run.optimizer.state_dict()) if self.rank == 0 else None
        start = [{"args": vars(args), "step": run.step, "version": run.version,
                  "must_publish": run.must_publish,  # AdamW's state, on the CPU; --fsdp:
                  "optimizer": bool(adamw["state"]) if self.fsdp else adamw}  # whether any
                 if self.rank == 0 else None]
        with self.collective("the start"):  # load_state_dict puts it on the parameters' device
            dist.broadcast_object_list(start, src=0)
            if not self.fsdp:
                for p in lora_parameters(run.model):
                    dist.broadcast(p.detach(), src=0)
        if self.rank > 0:
            vars(args).update(start[0]["args"])
            run.step, run.version = start[0]["step"], start[0]["version"]
            run.must_publish = start[0]["must_publish"]
        if not self.fsdp:
            if self.rank > 0:
                run.optimizer.load_state_dict(start[0]["optimizer"])
            return run
        # --fsdp: rank 0's full LoRA and AdamW state, into every rank's shard of them
        lora = {n: p.detach() for n, p in run.model.named_parameters() if p.requires_grad}
        shard_model(run.model)
        run.optimizer = make_optimizer(lora_parameters(run.model), args)  # of the shards
        with self.collective("the start (FSDP2)"):
            load_full_state(run.model, run.optimizer, lora if self.rank == 0 else {}, adamw,
                            resumed=start[0]["optimizer"])
        return run

    def spread(self, grpo_update, loss_and_backward, plain_logprobs):
        """grpo_update(model, optimizer, groups, args, step, version) (trainer's) as this rank's
        part of one step: on rank 0's groups (the others pass None), split into a micro-batch or
        more per rank, loss_and_backward (trainer.compute_loss_and_backward) on this rank's share
        (share_of_step; plain_logprobs: --fsdp's forward). One process: grpo_update itself."""
        if self.world == 1:
            return grpo_update

        def update(model, optimizer, groups, args, step, version):
            share = functools.partial(self.share_of_step, loss_and_backward, plain_logprobs)
            return grpo_update(model, optimizer, self.same_groups(groups), args, step, version,
                               loss_and_backward=share, min_microbatches=self.world)
        return update

    def same_groups(self, groups):
        """Rank 0's groups (its argument; other ranks pass None), on every rank."""
        if self.world == 1:
            return groups
        box = [groups]
        with self.collective("the step's groups"):  # ranks > 0 wait here while rank 0 gathers
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def share_of_step(self, loss_and_backward, plain_logprobs, model, seqs, advantages,
                      microbatches, **kw):
        """loss_and_backward(model, seqs, advantages, microbatches, **kw) of the whole step, on
        every rank, from this rank's share of the micro-batches: rank, rank + N, ... (the others
        passed as [], so the normalisers are the step's). Then the LoRA gradient is summed over
        the ranks (sum_gradients) and the statistics merged (StepStats.merge, in rank order), so
        every rank returns what one process returns. --fsdp: the forward is plain_logprobs
        (support/fsdp.py's departure 4), and each rank runs as many forwards and backwards as
        the rank with the most micro-batches (each is a collective): idle passes of weight 0."""
        record = StepStats(seqs, kw["version"], kw["beta"], kw["epsilon"], kw["epsilon_high"])
        mine = [mb if k % self.world == self.rank else [] for k, mb in enumerate(microbatches)]
        passes = [0]  # --fsdp: the forwards with a backward that this rank ran

        def forward(model, seqs, idx, temperature):  # plain_logprobs, counted
            passes[0] += torch.is_grad_enabled()
            return plain_logprobs(model, seqs, idx, temperature)
        out = loss_and_backward(model, seqs, advantages, mine, record=record,
                                forward=forward if self.fsdp else None, **kw)
        for _ in range(len(microbatches[0::self.world]) - passes[0] if self.fsdp else 0):
            idle_pass(model, lambda: plain_logprobs(model, seqs, [0], kw["temperature"]),
                      kw["beta"])
        self.sum_gradients(model)
        shares = [None] * self.world  # each rank's statistics, and whether its share was finite
        with self.collective("the step's statistics"):
            dist.all_gather_object(shares, (record.share(), out["finite"]))
        record.merge([share for share, _ in shares])
        out.update(record.result())  # finite: every rank's (grpo_update checks the gradient norm)
        out["finite"] = all(f for _, f in shares) and math.isfinite(out["loss"])
        return out

    def sum_gradients(self, model):
        """Every rank's .grad of the LoRA parameters becomes the sum over the ranks (one
        all_reduce). A parameter without a gradient on a rank counts as zeros; when no rank has
        one (nothing forwarded anywhere) they stay None, as in one process. --fsdp: FSDP2's
        reduce-scatter in each backward already summed them into this rank's shard."""
        if self.world == 1 or self.fsdp:
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

    def full_state(self, model, optimizer, adamw=True):
        """(LoRA, AdamW state) for rank 0 to publish and, with adamw (a save), to save: None (the
        model holds it) and optimizer.state_dict() (or None); --fsdp: both gathered from every
        rank's shard (every rank calls it: rank 0's publish, follow_rank_zero)."""
        if not self.fsdp:
            return None, optimizer.state_dict() if adamw else None
        with self.collective("the gather of the LoRA (FSDP2)"):
            return gather_full_state(model, optimizer if adamw else None)

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


def join_ranks(wait_timeout, bucket_retry, fsdp=False):
    """ONE_PROCESS without torchrun's variables (nothing to set up: every test of one trainer
    process runs so, e.g. test_run_learns_the_toy_task); else this process's Ranks.
    This process's Ranks: from torchrun's RANK, WORLD_SIZE, LOCAL_RANK (gloo on CPUs, nccl on
    GPUs, each rank on cuda:LOCAL_RANK), or ONE_PROCESS without them. A collective waits at most
    wait_timeout (0: NEVER_S) + bucket_retry + MARGIN_S seconds, then raises. fsdp (--fsdp): the
    ranks shard the model (FSDP2); with one process, a TrainerError."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and fsdp:
        raise TrainerError("--fsdp shards the model over torchrun's ranks, and this is one "
                           "process: start it with torchrun --nproc-per-node N (jobs.sh: "
                           "TRAINER_GPUS=N, N >= 2), or drop --fsdp")
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
    return Ranks(dist.get_rank(), dist.get_world_size(), fsdp)


def follow_rank_zero(args, ranks, update):
    """Ranks > 0: no proxy, no bucket. The model and AdamW as rank 0 builds them (start_run),
    started where rank 0 starts (start_alike), then each of rank 0's steps: update(model,
    optimizer, None, args, step, version), trainer.grpo_update spread over the ranks. --fsdp:
    also its part in each of rank 0's publishes (full_state), at the same points as rank 0."""
    model = build_model(args.model, args.lora_r, args.lora_alpha, args.lora_target, args.seed,
                        device="cpu" if args.fsdp else None)
    model.eval()  # no dropout, as rank 0's (start_run)
    run = ranks.start_alike(args, SimpleNamespace(
        model=model, optimizer=make_optimizer(lora_parameters(model), args), step=0, version=0,
        must_publish=False))
    step, version, optimizer = run.step, run.version, run.optimizer
    if args.gradient_checkpointing:
        checkpoint_layers(model)
    if run.must_publish:  # rank 0's first publish, with the resume state (trainer.train)
        ranks.full_state(model, optimizer)
    while step < args.max_steps:
        update(model, optimizer, None, args, step, version)  # on rank 0's groups
        step, version = step + 1, version + 1
        ranks.full_state(model, optimizer, saves_state(step, args))


def on_cpu(obj):
    """obj (dicts, lists, tensors) with every tensor copied to the CPU: pickled across ranks."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_cpu(v) for v in obj)
    return obj
