"""The learner: pull scored groups from the proxy, take GRPO steps on the LoRA weights, publish.

    python trainer.py --model Qwen/Qwen2.5-0.5B-Instruct --bucket /bucket \
        --proxy https://JOB--8000.hf.jobs
    torchrun --standalone --nproc-per-node 2 trainer.py ...  # the same flags on 2 GPUs: data
    # parallel, the update of one process; rank 0 alone talks to the proxy and the bucket
    torchrun --standalone --nproc-per-node 2 trainer.py --fsdp ...  # FSDP2: the model sharded

The whole system on one CPU with the tiny test model (tests/test_trainer.py; the toy reward goes
from ~0.05 to ~0.9 in 24 steps, ~20 s). The settings are given once, to the proxy:

    python tests/tiny_model.py /tmp/tiny
    export PROXY_TOKEN=secret OMP_NUM_THREADS=1
    python proxy.py --port 8000 --num-generations 8 --groups-per-step 4 --max-staleness 2 \
        --max-completion-length 6 &
    python rollout.py --engine hf --task toy --model /tmp/tiny --bucket runs/toy \
        --proxy http://127.0.0.1:8000 &
    python trainer.py --model /tmp/tiny --bucket runs/toy --proxy http://127.0.0.1:8000 \
        --learning-rate 1e-3 --lora-r 8 --lora-alpha 16 --max-steps 24

The trainer never generates: rollout.py replicas do, with the adapter versions this file
publishes to the bucket (adapters/v{N:06d}, LATEST). Killed at any moment, the same command
resumes from the last saved state (bucket trainer/), loses at most the steps since that save and
never publishes a version twice. Logs: "resumed from step S, version V" or "starting fresh",
then "step N vV | reward ...", "published vV at step N", "saved state at step N", "done".

Where this departs from the GRPO paper (DeepSeekMath) and TRL's GRPOTrainer:
1. By default the old policy is the replica's sampler (--old-logprobs sampler, as TRL's
   AsyncGRPOTrainer): ratio = exp(logpi_theta - logp_sampler) with the log-probs vLLM returned,
   so the ratio also absorbs staleness and the engines' numerical mismatch. --old-logprobs
   learner is TRL's GRPOTrainer with vLLM: the ratio against this forward's log-probs, detached
   (no second forward), the loss weighted by exp(logp_old - logp_sampler) as
   --vllm-importance-sampling-* say (grpo_loss.py's departure 2; jobs.sh's choice on GPUs).
   Each step records the sampler/learner gap by staleness (sampling/*). A step whose loss or
   gradient is not finite is skipped (the same weights are published again).
2. Groups may be up to max_staleness versions old (the proxy drops older ones); one version is
   one optimizer step (after a resume the numbers jump past any version the bucket has seen).
3. One optimizer step per batch (TRL's num_iterations = 1, mu = 1 in the paper).
4. Groups whose rewards are all equal count toward groups_per_step, as in TRL (they have zero
   advantage, so with beta = 0 they are not even forwarded, but their tokens stay in the
   normaliser; a step of only such groups still applies AdamW's momentum, as TRL's does). The
   proxy's --zero-variance drop gives DAPO's dynamic sampling instead.
5. --lr-scheduler-type linear (TRL's default) or constant, no warmup; AdamW, --weight-decay 0.
6. The reference policy for --beta > 0 is the base model, i.e. the same weights with the adapter
   disabled (what TRL does with PEFT), not a frozen copy of a starting checkpoint.
7. `truncated` counts the completions that ended without EOS (finish_reason "length", or cut at
   max_completion_length), as TRL's completions/clipped_ratio; `clipped_ratio` is their fraction.
   --mask-truncated-completions (TRL's, off by default) leaves them out of the loss and its
   normalisers, as TRL zeroes their completion mask.
8. TRL's two-sided clip `delta` is on by default (2.0; TRL's default, None, is `--delta none`).
   A replica holds the current adapter and can send log-probs far below it: without delta one
   such group can make the ratio ~4e8 and steer the whole step. With delta a token whose ratio
   is above it has no gradient. A group with a ratio above ABSURD_RATIO is named on stderr and
   counted in the step's `groups_absurd_ratio`; it stays in the step (delta: those tokens inert).
9. Groups the trainer cannot use (group_problem: no prompt or completion tokens, a token id
   outside the vocabulary, a log-prob per id missing, a reward outside the proxy's reward_range,
   longer than the model's context; a prompt or reward other than the run's reward functions
   give, recomputed: support/reward_check.py) are dropped and reported (stderr, the step's
   `groups_dropped`, the proxy's POST /reject, which gives them back to the step's quota and
   bans their worker); more groups are asked for: a step still has groups_per_step.
"""

import math
import sys
import tempfile
import time

import torch

import grpo_loss
import sync
from support.buckets import BucketError, open_bucket, save_trainer_state
from support.cli import trainer_args
from support.contract import CONTRACT_FLAGS  # the settings read from the proxy in train()
from support.data_parallel import ONE_PROCESS, follow_rank_zero, join_ranks  # torchrun
from support.defaults import DEFAULTS  # the keywords' defaults: the flags' (TRL's)
from support.devices import checkpoint_layers  # --gradient-checkpointing
from support.group_checks import UsableGroups, Waiting  # what a hostile replica cannot do
from support.proxy_client import ProxyClient, ProxyError
from support.reward_check import TaskRewards  # rewards recomputed with the run's reward functions
from support.shared_prompt import by_group, make_microbatches, plain_logprobs_fast
from support.step_record import StepStats, record_step  # metrics, the log line
from support.trainer_state import TrainerError, lora_parameters, saves_state, start_run, write_state


# ---- ALGO, README's steps 5-9: 5. take a batch  6. advantages  7. log-probs  8. loss  9. publish
# The functions of each phase in that order; train() at the end runs them, a step per loop.

# ---- ALGO, 5. take a batch: groups from the proxy, one record per completion

def gather_groups(client, n, wait_timeout, bucket_url, usable_groups=list):
    """Long-poll the proxy until n groups are in hand (at most max_staleness versions old; with
    --zero-variance drop, unequal rewards). usable_groups: what the trainer keeps of each answer
    (group_checks.UsableGroups: the groups it can use, the others dropped and reported)."""
    groups, waiting = [], Waiting(client, wait_timeout, bucket_url)
    while len(groups) < n:
        waiting.check(len(groups), n)  # a line a minute; TrainerError after wait_timeout
        # a long poll: the proxy answers as soon as it has them, or after the timeout
        answer = client.get_batch(n - len(groups), timeout=min(30.0, wait_timeout or 30.0))
        groups += usable_groups(answer["groups"])
    return groups


def flatten_groups(groups, max_completion_length):
    """Groups -> one record per completion, in group order. A group is the record GROUP of
    support/contract.py (make_group builds it on the replica, the proxy checked it field by field).
    "group" is the group's index in `groups`: the completions of a group share its prompt in the
    forward (make_microbatches)."""
    return [{"prompt_ids": list(g["prompt_ids"]), "ids": list(c["ids"][:max_completion_length]),
             "logprobs": list(c["logprobs"][:max_completion_length]), "reward": float(c["reward"]),
             "policy_version": int(g["policy_version"]), "group": k,  # truncated: no EOS (TRL's)
             "truncated": (c.get("finish_reason") != "stop"
                           or len(c["ids"]) > max_completion_length)}
            for k, g in enumerate(groups) for c in g["completions"]]


# ---- ALGO, 6. advantages: grpo_loss.group_advantages (called in grpo_update)
# ---- ALGO, 7. log-probs under the current policy. plain_logprobs is the definition; the step
# runs plain_logprobs_fast (support/shared_prompt.py): the same values and gradients, each
# group's prompt forwarded once (test_shared_prompt.py); --fsdp: plain_logprobs (support/fsdp.py)

def plain_logprobs(model, seqs, idx, temperature=DEFAULTS["temperature"]):
    """Log-probs (n, C) of the completion tokens of rows idx: each row [pad.. prompt | completion
    ..pad] in one forward, its prompt computed once per completion. Garbage on padding."""
    P = max(len(seqs[i]["prompt_ids"]) for i in idx)
    C = max(len(seqs[i]["ids"]) for i in idx)
    input_ids = torch.zeros((len(idx), P + C), dtype=torch.long)  # (n, P + C)
    attn = torch.zeros_like(input_ids)  # (n, P + C) 1 on the row's tokens
    for r, i in enumerate(idx):
        pr, ids = seqs[i]["prompt_ids"], seqs[i]["ids"]
        input_ids[r, P - len(pr):P + len(ids)] = torch.tensor(pr + ids)
        attn[r, P - len(pr):P + len(ids)] = 1
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # (n, P + C) as if unpadded
    device = next(model.parameters()).device
    logits = model(input_ids=input_ids.to(device), attention_mask=attn.to(device),
                   position_ids=position_ids.to(device), logits_to_keep=C + 1,
                   use_cache=False).logits[:, :-1]  # (n, C, V): position j predicts token j
    return grpo_loss.token_logprobs(logits, input_ids[:, P:].to(device), temperature)  # (n, C)


def completion_tensors(seqs, idx, device):
    """The sampler's log-probs (n, C) of rows idx and their completion mask (n, C), right-padded:
    1 on the generated tokens (EOS included), from the lengths, never from a pad id."""
    C = max(len(seqs[i]["ids"]) for i in idx)
    old, mask = torch.zeros((len(idx), C)), torch.zeros((len(idx), C))  # (n, C) (n, C)
    for r, i in enumerate(idx):
        old[r, :len(seqs[i]["ids"])] = torch.tensor(seqs[i]["logprobs"])
        mask[r, :len(seqs[i]["ids"])] = 1.0
    return old.to(device), mask.to(device)


# ---- ALGO, 8. loss: grpo_loss.policy_loss per micro-batch, its gradient accumulated

def compute_loss_and_backward(model, seqs, advantages, microbatches,
                              loss_type=DEFAULTS["loss_type"], epsilon=DEFAULTS["epsilon"],
                              epsilon_high=None, beta=DEFAULTS["beta"], max_completion_length=None,
                              temperature=DEFAULTS["temperature"], delta=None, version=None,
                              use_bias_correction_kl=DEFAULTS["use_bias_correction_kl"],
                              mask_truncated_completions=DEFAULTS["mask_truncated_completions"],
                              correction=None, forward=None, record=None):
    """Accumulate the step's GRPO gradient over the micro-batches; return the step's loss and stats.

    Each micro-batch's loss is weighted (grpo_loss.microbatch_weight) so that the sum is the loss
    of the whole step as TRL defines it. With beta == 0, a group whose advantages are all 0 (its
    rewards all equal) adds nothing to the loss or the gradient, so it is not forwarded; its
    sequences and tokens stay in every normaliser, so the gradient is TRL's (which keeps them).
    mask_truncated_completions: TRL zeroes the completion mask of those without EOS: their tokens
    leave the loss and the token counts, their rows stay in grpo's and dr_grpo's row counts.
    correction: grpo_loss.sampler_correction's keywords (TRL's names, --old-logprobs and the
    --vllm-importance-sampling-* flags): where the sampler's log-probs enter the loss.
    forward: the log-probs' forward, plain_logprobs's arguments (default plain_logprobs_fast, see
    7. above); record: a step_record.StepStats to gather the statistics in (default a new one).
    A micro-batch [] forwards nothing (the normalisers count it). Returns StepStats.result's
    dict (loss, ratios, approx_kl, clip fractions, ...), and finite: False when the loss or a
    LoRA gradient is inf or NaN (then the optimizer must not step).
    """
    device = next(model.parameters()).device
    masked = {i for i, s in enumerate(seqs) if mask_truncated_completions and s["truncated"]}
    total_tokens = sum(len(s["ids"]) for i, s in enumerate(seqs) if i not in masked)
    record = record or StepStats(seqs, version, beta, epsilon, epsilon_high)

    def logprobs(idx):  # (n, C) = plain_logprobs(model, seqs, idx, temperature), see 7. above
        return (forward(model, seqs, idx, temperature) if forward else
                plain_logprobs_fast(model, seqs, idx, grpo_loss.token_logprobs, temperature))
    for idx in microbatches:
        idx = [i for i in idx if i not in masked]  # no loss; grpo, dr_grpo still count them
        mb_tokens = sum(len(seqs[i]["ids"]) for i in idx)  # bnpo's normaliser: all its rows
        if beta == 0.0:  # advantage 0 everywhere in a group: no loss, no gradient, no forward
            idx = [i for g in by_group(seqs, idx) if bool((advantages[g] != 0).any())
                   for i in g]
        if not idx:
            continue
        sampled, mask = completion_tensors(seqs, idx, device)  # (n, C) the sampler's, (n, C)
        logps = logprobs(idx)  # = plain_logprobs(model, seqs, idx, temperature)
        ref = None
        if beta > 0:
            with torch.no_grad(), model.disable_adapter():  # (n, C) the base model's
                ref = logprobs(idx)
        # the sampler's log-probs: the old policy, or a weight on the loss (--old-logprobs
        # learner: old = logps.detach(), the learner's at this step's weights, no 2nd forward)
        adv = advantages[idx].to(device)  # (n,)
        weights = grpo_loss.sampler_correction(logps, sampled, adv, mask, **(correction or {}))
        # the loss of this micro-batch, normalised as loss_type says (dapo: by the whole step's
        # tokens, bnpo: by this micro-batch's); weights: old_logprobs and the two weights
        loss, stats = grpo_loss.policy_loss(
            logps, advantages=adv, mask=mask, epsilon=epsilon, epsilon_high=epsilon_high,
            loss_type=loss_type, max_completion_length=max_completion_length, ref_logprobs=ref,
            beta=beta, num_tokens={"dapo": total_tokens, "bnpo": mb_tokens}.get(loss_type),
            delta=delta, use_bias_correction_kl=use_bias_correction_kl, **weights)
        weight = grpo_loss.microbatch_weight(loss_type, mask, len(seqs), len(microbatches))
        (loss * weight).backward()
        record.add(idx, mask, loss.item() * weight, stats,  # the step's statistics, per row:
                   grpo_loss.offpolicy_stats(logps, sampled, mask, correction),
                   weights["off_policy_mask"])
    out = record.result()  # the statistics, and "loss": the sum of the loss * weight added above
    out["finite"] = math.isfinite(out["loss"]) and grpo_loss.all_finite(  # each on its own device
        [p.grad for p in model.parameters() if p.requires_grad])
    return out


# ---- ALGO, 9. publish: the adapter to the bucket (and the resume state), then the proxy

def publish(model, bucket, version, keep, base_model, step, state=None, optimizer=None, key=None,
            adapter_key=None, saved_step=None, full=None):
    """Publish the adapter as `version` (sync.publish_adapter: its files, its manifest, then
    LATEST); with `state`, also save the resume state (weights, optimizer, RNGs), tagged with an
    HMAC under `key` (env TRAINER_STATE_KEY) when there is one. The manifest is tagged for the
    replicas under adapter_key (env ADAPTER_KEY) and as the trainer's own under key, with
    saved_step: the step of the newest resume state saved before it. full: (LoRA, AdamW state)
    from Ranks.full_state (--fsdp: gathered from the shards); None: the model's, optimizer's."""
    lora, adamw = full or (None, optimizer.state_dict() if optimizer else None)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, state_dict=lora)  # the PEFT folder (lora None: the model's)
        sync.publish_adapter(bucket, d, version, keep=keep, key=adapter_key, trainer_key=key,
                             base_model=base_model, step=step, state_step=saved_step)
        if state is not None:
            write_state(d, state, adamw, key)
            save_trainer_state(bucket, d)


# ---- ALGO: the loop. grpo_update: steps 6-8; train(): the rest

def grpo_update(model, optimizer, groups, args, step, version,
                loss_and_backward=compute_loss_and_backward, min_microbatches=1):
    """README's steps 6-8: advantages, log-probs, loss, AdamW (skipped if not finite). Returns
    (seqs, micro-batches, stats, grad norm, finite). Under torchrun, Ranks.spread wraps it, as
    DDP wraps a model: loss_and_backward the same over the ranks, a micro-batch or more each."""
    seqs = flatten_groups(groups, args.max_completion_length)
    # whole groups, at most --micro-batch-tokens per forward/backward
    mbs = make_microbatches(seqs, args.micro_batch_tokens, at_least=min_microbatches)
    # 6. advantages: each reward against its group's mean (and std: --scale-rewards)
    rewards = torch.tensor([s["reward"] for s in seqs])  # (B,) B = groups * G
    advantages = grpo_loss.group_advantages(rewards, args.num_generations, args.scale_rewards)
    # 7. + 8. log-probs and the loss, the gradient accumulated over the micro-batches.
    # Zeros, not None (make_optimizer's): all-equal groups still step AdamW, as TRL's do.
    optimizer.zero_grad(set_to_none=False)
    stats = loss_and_backward(
        model, seqs, advantages, mbs, loss_type=args.loss_type, epsilon=args.epsilon,
        epsilon_high=args.epsilon_high, beta=args.beta, delta=args.delta,
        max_completion_length=args.max_completion_length, temperature=args.temperature,
        version=version, use_bias_correction_kl=args.use_bias_correction_kl,
        mask_truncated_completions=args.mask_truncated_completions,
        correction={k: getattr(args, k) for k in grpo_loss.CORRECTION})
    grad_norm = torch.nn.utils.clip_grad_norm_(lora_parameters(model), args.max_grad_norm).item()
    finite = stats.pop("finite") and math.isfinite(grad_norm)
    # the schedule: a function of the step, so a resume continues it
    decay = 1 - step / args.max_steps if args.lr_scheduler_type == "linear" else 1
    for g in optimizer.param_groups:
        g["lr"] = args.learning_rate * decay
    if finite:  # else a poisoned group would reach the weights: the same ones again (stderr)
        optimizer.step()
    return seqs, mbs, stats, grad_norm, finite


def train(args, ranks=ONE_PROCESS):
    # one process: grpo_update itself; torchrun: over the ranks, each its share of the
    # micro-batches, the gradient summed (support/data_parallel.py)
    many = ranks.world > 1
    update = ranks.spread(grpo_update, compute_loss_and_backward, plain_logprobs) if many \
        else grpo_update
    if ranks.rank > 0:  # torchrun: the other ranks never talk to the proxy or the bucket
        return follow_rank_zero(args, ranks, update)
    bucket = open_bucket(args.bucket, retry_s=args.bucket_retry)  # rides out outages once it worked
    client = ProxyClient(args.proxy)  # token: env PROXY_TOKEN; a wrong URL or token ends below
    contract = client.contract(**{k: getattr(args, k) for k in CONTRACT_FLAGS})
    vars(args).update({k: contract[k] for k in CONTRACT_FLAGS})  # the run's settings: the proxy's
    # the model with a fresh LoRA, or as the resume state in the bucket left it; its versions
    # follow its own (with TRAINER_STATE_KEY, a LATEST it did not write is passed over)
    run = start_run(args, bucket, contract)
    run = ranks.start_alike(args, run) if many else run  # torchrun: every rank starts alike
    model, optimizer, step, version = run.model, run.optimizer, run.step, run.version  # --fsdp:
    groups_consumed = run.groups_consumed  # each rank holds a shard of the model and AdamW
    if args.gradient_checkpointing:  # each layer's activations recomputed in the backward pass
        checkpoint_layers(model)
    keep = args.max_staleness + 2  # versions kept in the bucket: any a replica may still use
    # what the model takes, announced with every version: the proxy refuses other groups (400)
    vocab_size = model.get_input_embeddings().num_embeddings
    client.set_limits(vocab_size=vocab_size, context_length=run.limits["context"])
    task_rewards = TaskRewards(args.task, args.data, args.model)  # on with --task (jobs.sh's)
    # where groups arrive: valid groups pass unchanged, in order; the others are dropped and
    # reported (test_honest_groups_pass_the_trainers_checks_unchanged_at_the_defaults)
    usable_groups = UsableGroups(client, vocab_size, task_rewards, **run.limits)

    def publish_and_save(version, save):
        state = {"step": step, "version": version, "published_step": step,
                 "groups_consumed": groups_consumed, "args": vars(args)} if save else None
        publish(model, bucket, version, keep, args.model, step, state, optimizer, run.key,
                run.adapter_key, run.saved_step,
                ranks.full_state(model, optimizer, save) if many else None)  # --fsdp: gathered
        run.saved_step = step if save else run.saved_step  # what the next manifests record
        # The handshake: after the files, so a replica told of v by /quota finds it in the bucket
        # (proxy.RolloutBuffer.set_version; the replica's side is rollout.Replica.step).
        client.set_version(version)
        saved = f"\nsaved state at step {step} (version {version})" if save else ""
        print(f"published v{version} at step {step}" + saved)

    if run.must_publish:  # v0 (the untrained LoRA), or the restored weights under a new number
        publish_and_save(version, save=True)
    else:  # the trainer announces itself: the proxy now hands out groups
        client.set_version(version)

    # The GRPO loop: one optimizer step, and one adapter version, per batch.
    while step < args.max_steps:
        t0 = time.time()
        # 5. take a batch: groups_per_step groups (a long poll), one record per completion
        groups = gather_groups(client, args.groups_per_step, args.wait_timeout, bucket.url,
                               usable_groups)
        groups_consumed += len(groups)
        t1 = time.time()
        # 6.-8. advantages, log-probs and loss, one AdamW step (torchrun: on every rank)
        result = update(model, optimizer, groups, args, step, version)  # grpo_update
        step += 1
        # the step's record: absurd ratios named (departure 8), metrics/, --report-to, stdout
        record_step(run, args, groups, result, step=step, version=version,
                    dropped=usable_groups.lap(),  # why -> groups dropped while gathering these
                    times=(t0, t1, time.time()), reward_check_s=task_rewards.lap())
        # 9. publish: one version per optimizer step (and the resume state every --save-every)
        version += 1
        publish_and_save(version, save=saves_state(step, args))
    client.done()  # replicas learn it from /quota and exit; the proxy exits after them
    if run.reporter:
        run.reporter.finish()
    print(f"done: {step} steps, last version v{version}, {groups_consumed} groups consumed")


# ---- SUPPORT: main(), the wiring (the flags: support/cli.py's trainer_args)

def main(argv=None):
    args = trainer_args(argv, description=__doc__.split("\n")[0])
    sys.stdout.reconfigure(line_buffering=True)  # each log line reaches a piped log at once
    try:  # torchrun: this rank of N (support/data_parallel.py); else one process, no group
        ranks = join_ranks(args.wait_timeout, args.bucket_retry, args.fsdp)
        train(args, ranks)
        ranks.leave()
    except (ProxyError, BucketError, TrainerError) as e:
        sys.exit(f"trainer.py: error: {e}")


if __name__ == "__main__":
    main()
