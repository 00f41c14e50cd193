"""The learner: pull scored groups from the proxy, take GRPO steps on the LoRA weights, publish.

    python trainer.py --model Qwen/Qwen2.5-0.5B-Instruct --bucket /bucket \
        --proxy https://JOB--8000.hf.jobs

The whole system on one CPU machine with the tiny test model (what tests/test_trainer.py runs;
the toy reward goes from ~0.05 to ~0.9 in these 24 steps, ~20 s). The run's settings are given
once, to the proxy; the replica and the trainer read them from it:

    python tests/tiny_model.py /tmp/tiny
    export PROXY_TOKEN=secret OMP_NUM_THREADS=1
    python proxy.py --port 8000 --num-generations 8 --groups-per-step 4 --max-staleness 2 \
        --max-new-tokens 6 &
    python rollout.py --engine hf --task toy --model /tmp/tiny --bucket runs/toy \
        --proxy http://127.0.0.1:8000 &
    python trainer.py --model /tmp/tiny --bucket runs/toy --proxy http://127.0.0.1:8000 \
        --learning-rate 1e-3 --lora-r 8 --lora-alpha 16 --max-steps 24
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_trainer.py -q  # tests

The token for the proxy comes from PROXY_TOKEN. The trainer never generates: rollout.py replicas
do, with the adapter versions this file publishes to the bucket (adapters/v{N:06d}, LATEST).
Killed at any moment (SIGKILL, preemption), the same command resumes from the last saved state
(bucket trainer/), loses at most the steps since that save, and never publishes a version twice.
Logs on stdout: the first line says "resumed from step S, version V" or "starting fresh"; then
"step N vV | reward ...", "published vV at step N", "saved state at step N (version V)",
"done: ...".

Where this departs from the GRPO paper (DeepSeekMath) and TRL's GRPOTrainer:
1. The old policy is the replica's sampler: ratio = exp(logpi_theta - logp_sampler), with the
   log-probs vLLM returned, not recomputed here (as TRL's AsyncGRPOTrainer). The ratio so also
   absorbs the small mismatch between the inference engine's numerics and the trainer's. A step
   whose loss or gradient is not finite is skipped (the same weights are published again).
2. Groups may be up to max_staleness versions old (the proxy drops older ones); one version is
   one optimizer step (after a resume the numbers jump past any version the bucket has seen).
3. One optimizer step per batch (TRL's num_iterations = 1, mu = 1 in the paper).
4. Groups whose rewards are all equal count toward groups_per_step, as in TRL (they have zero
   advantage, so with beta = 0 they are not even forwarded, but their tokens stay in the
   normaliser; a step of only such groups still applies AdamW's momentum, as TRL's does). The
   proxy's --zero-variance drop gives DAPO's dynamic sampling instead.
5. --lr-scheduler-type linear (TRL's default) or constant, no warmup; AdamW, no weight decay.
6. The reference policy for --beta > 0 is the base model, i.e. the same weights with the adapter
   disabled (what TRL does with PEFT), not a frozen copy of a starting checkpoint.
7. `truncated` counts the completions that ended without EOS (finish_reason "length", or cut at
   max_completion_length), as TRL's completions/clipped_ratio; `clipped_ratio` is their fraction.
   --mask-truncated-completions (TRL's, off by default) leaves them out of the loss and its
   normalisers, as TRL zeroes their completion mask.
8. TRL's two-sided clip `delta` is on by default (2.0; TRL's default is None). A replica holds the
   current adapter and can send log-probs far below it: without delta one such group can make
   the ratio ~4e8 and steer the whole step. With delta a token whose ratio is above it has no
   gradient. A group with a ratio above ABSURD_RATIO is named on stderr and counted in the
   step's `groups_absurd_ratio`; it stays in the step (delta makes those tokens inert).
   `--delta none` turns the cap off, as TRL's default.
9. Groups the trainer cannot use (group_problem: no prompt or completion tokens, a token id
   outside the vocabulary, a log-prob per id missing, a reward outside the proxy's
   reward_range, longer than the model's context) are dropped and reported (stderr, and the
   step's `groups_dropped`), and more groups are asked for: a step still has groups_per_step.
"""

import argparse
import hashlib
import hmac
import math
import os
import pickle
import random
import re
import sys
import tempfile
import time

import torch

import grpo_loss
import sync
from proxy import CONTRACT_FLAGS, ProxyClient, ProxyError  # CONTRACT_FLAGS: read in train()

DELTA = 2.0  # --delta's default: TRL's two-sided clip, on (departure 8); >= 1 + epsilon_high
ABSURD_RATIO = 1e3  # no sampler's honest mismatch: a group with a ratio above it is named (dep. 8)


class TrainerError(Exception):
    """A misconfiguration or a run that cannot go on; the message says what to do."""


# ---- ALGO: 1. take a batch  2. advantages  3. log-probs  4. loss  5. publish
# The functions of each phase in that order; train() at the end runs them, a step per loop.



# ---- ALGO, 1. take a batch: groups from the proxy, one record per completion

def gather_groups(client, n, wait_timeout, bucket_url, vocab_size, dropped=None, **limits):
    """Long-poll the proxy until n usable groups are in hand (at most max_staleness versions old;
    with --zero-variance drop, unequal rewards). A group the trainer cannot use (group_problem;
    limits: its num_generations, context, reward_range) is dropped, named on stderr, counted in
    `dropped`."""
    groups, start, last_log = [], time.time(), time.time()
    while len(groups) < n:
        waited = time.time() - start
        if (wait_timeout and waited > wait_timeout) or time.time() - last_log > 60:
            s = client.stats()  # the proxy sees the whole run: say what it sees
            why = (f"the proxy has {s['buffered']} groups buffered, leases {s['leased']}, dropped "
                   f"{s['dropped_stale']} as stale and {s['dropped_zero_variance']} with equal "
                   "rewards; replicas that load no new adapter ('adapter vN loaded' in their logs) "
                   f"are not reading --bucket {bucket_url}")
            if wait_timeout and waited > wait_timeout:
                raise TrainerError(f"no groups for {waited:.0f}s (have {len(groups)}/{n}): {why}; "
                                   "raise --wait-timeout for slow starts")
            print(f"waiting for groups: {len(groups)}/{n} after {waited:.0f}s; {why}")
            last_log = time.time()
        # a long poll: the proxy answers as soon as it has them, or after the timeout
        answer = client.get_batch(n - len(groups), timeout=min(30.0, wait_timeout or 30.0))
        for g in answer["groups"]:
            if not (problem := group_problem(g, vocab_size, **limits)):
                groups.append(g)
                continue
            if dropped is not None:
                dropped[problem[0]] = dropped.get(problem[0], 0) + 1
            gid, worker = (printable(g.get(k) if isinstance(g, dict) else "?")
                           for k in ("group_id", "worker"))
            print(f"dropped group {gid} from {worker}: {problem[1]}", file=sys.stderr)
    return groups


def flatten_groups(groups, max_completion_length):
    """Groups -> one record per completion, in group order. A group is the record proxy.GROUP
    defines (proxy.make_group builds it on the replica, the proxy checked it field by field).
    "group" is the group's index in `groups`: the completions of a group share its prompt in the
    forward (make_microbatches)."""
    # proxy-checked: G completions, a log-prob per id
    return [{"prompt_ids": list(g["prompt_ids"]), "ids": list(c["ids"][:max_completion_length]),
             "logprobs": list(c["logprobs"][:max_completion_length]), "reward": float(c["reward"]),
             "policy_version": int(g["policy_version"]), "group": k,  # truncated: no EOS (TRL's)
             "truncated": (c.get("finish_reason") != "stop"
                           or len(c["ids"]) > max_completion_length)}
            for k, g in enumerate(groups) for c in g["completions"]]


# ---- ALGO, 2. advantages: grpo_loss.group_advantages (called in train)
# ---- ALGO, 3. log-probs: each group's prompt forwarded once, its completions on top

def by_group(seqs, idx):
    """Sequence indices -> lists of them, one per group, in first-seen order."""
    groups = {}
    for i in idx:
        groups.setdefault(seqs[i]["group"], []).append(i)
    return list(groups.values())


def make_microbatches(seqs, max_tokens):
    """Split the step into micro-batches of whole groups, at most max_tokens each (padding counted,
    and each group's prompt once: k groups of n completions cost k * longest prompt + n * longest
    completion). Longest first, so that an out-of-memory shows on the first pass; a group over
    budget goes alone. Returns index lists."""
    def cost(gs):
        return (len(gs) * max(len(seqs[g[0]]["prompt_ids"]) for g in gs)
                + sum(map(len, gs)) * max(len(seqs[i]["ids"]) for g in gs for i in g))

    batches = []
    for g in sorted(by_group(seqs, range(len(seqs))), key=lambda g: -cost([g])):
        if batches and cost(batches[-1] + [g]) <= max_tokens:
            batches[-1].append(g)
        else:
            batches.append([g])
    return [[i for g in gs for i in g] for gs in batches]


def collate(seqs, idx, advantages, device):
    """The tensors of the shared-prompt forward of rows idx: the prompts' common prefix once
    (prefix_ids, one row: a chat template's system prompt), the rest of each group's prompt once,
    left-padded after it ([prefix | pad.. rest], k rows), and the n completions right-padded
    ([completion ..pad]), row r continuing prompt row_prompt[r]. Rows keep idx's order. Padding is
    id 0; the masks hide it."""
    groups = by_group(seqs, idx)
    prompts = [seqs[g[0]]["prompt_ids"] for g in groups]
    # the common prefix's length; every prompt's rest keeps >= 1 token
    L = min(len(os.path.commonprefix(prompts)), min(map(len, prompts)) - 1)
    P = max(map(len, prompts)) - L
    C = max(len(seqs[i]["ids"]) for i in idx)
    prompt_ids = torch.zeros((len(groups), P), dtype=torch.long)  # (k, P) the rests of the prompts
    rest_mask = torch.zeros_like(prompt_ids)  # (k, P) 1 on their tokens
    for j, pr in enumerate(prompts):
        prompt_ids[j, P - len(pr) + L:] = torch.tensor(pr[L:])
        rest_mask[j, P - len(pr) + L:] = 1
    prefix_mask = torch.ones((len(groups), L), dtype=torch.long)  # (k, L)
    prompt_mask = torch.cat([prefix_mask, rest_mask], 1)  # (k, L + P)
    group_of = {i: j for j, g in enumerate(groups) for i in g}
    row_prompt = torch.tensor([group_of[i] for i in idx])  # (n,) the prompt row of each completion
    completion_ids = torch.zeros((len(idx), C), dtype=torch.long)  # (n, C)
    old = torch.zeros((len(idx), C))  # (n, C) sampler log-probs, 0 on padding
    mask = torch.zeros((len(idx), C))  # (n, C) 1 on generated tokens (EOS included), from lengths
    for r, i in enumerate(idx):
        ids = seqs[i]["ids"]
        completion_ids[r, :len(ids)] = torch.tensor(ids)
        old[r, :len(ids)] = torch.tensor(seqs[i]["logprobs"])
        mask[r, :len(ids)] = 1.0
    prompt_len = prompt_mask.sum(-1)[row_prompt]  # (n,)
    mb = {"prefix_ids": torch.tensor(prompts[0][:L]).view(1, L),  # (1, L)
          "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
          # (k, P) the rests' positions as if unpadded
          "prompt_positions": L + (rest_mask.cumsum(-1) - 1).clamp(min=0),
          "row_prompt": row_prompt, "completion_ids": completion_ids,
          # (n, C) the completions' positions: they follow their prompt
          "completion_positions": prompt_len.unsqueeze(1) + torch.arange(C),
          "attention_mask": torch.cat([prompt_mask[row_prompt], mask.long()], 1),  # (n, L + P + C)
          "old_logprobs": old, "mask": mask,  # (n, C) (n, C)
          "advantages": advantages[list(idx)]}  # (n,)
    return {k: t.to(device) for k, t in mb.items()}


def completion_logprobs(model, mb, temperature=1.0):
    """Current log-probs (n, C) of the completion tokens, each prompt token through the model once.

    1. The common prefix of the prompts (one row), its KV cache repeated for the k prompts.
    2. The rests of the k prompts on top of it: their KV cache, and the logits of their last
       position, which predict the first token of each of their completions.
    3. The cache repeated for each prompt's completions (k -> n rows), and the completions forwarded
       on top of it. The gradient reaches the prompts' activations through the caches, so values and
       gradients are those of one [prompt | completion] pass per row, with the prompts' compute
       done once instead of G times. The last completion token predicts nothing we need: left out.
    """
    cache = None  # use_cache=True below: the base config says False (build_model)
    if mb["prefix_ids"].shape[1]:
        cache = model(input_ids=mb["prefix_ids"], use_cache=True,
                      logits_to_keep=1).past_key_values  # (1, h, L, d) per layer
        # each layer's keys/values -> (k, h, L, d)
        cache.batch_repeat_interleave(mb["prompt_ids"].shape[0])
    out = model(input_ids=mb["prompt_ids"], attention_mask=mb["prompt_mask"],
                position_ids=mb["prompt_positions"], past_key_values=cache, use_cache=True,
                logits_to_keep=1)  # logits (k, 1, V); cache (k, h, L + P, d) per layer
    first = out.logits[mb["row_prompt"]]  # (n, 1, V) the last prompt logits, once per completion
    logps = [grpo_loss.token_logprobs(first, mb["completion_ids"][:, :1], temperature)]  # (n, 1)
    if mb["completion_ids"].shape[1] > 1:
        cache = out.past_key_values
        cache.batch_select_indices(mb["row_prompt"])  # (k, h, L + P, d) -> (n, h, L + P, d)
        logits = model(input_ids=mb["completion_ids"][:, :-1],
                       attention_mask=mb["attention_mask"][:, :-1],
                       position_ids=mb["completion_positions"][:, :-1], past_key_values=cache,
                       use_cache=True).logits  # (n, C-1, V): position j predicts token j+1
        rest = grpo_loss.token_logprobs(logits, mb["completion_ids"][:, 1:], temperature)
        logps.append(rest)  # (n, C-1)
    return torch.cat(logps, 1)  # (n, C) from logits / temperature


# ---- ALGO, 4. loss: grpo_loss.policy_loss per micro-batch, its gradient accumulated

STAT_COLUMNS = ("tokens", "approx_kl", "clipped", "ratio_max")  # grpo_loss.offpolicy_stats, per row


def compute_loss_and_backward(model, seqs, advantages, microbatches, loss_type="dapo",
                              epsilon=0.2, epsilon_high=None, beta=0.0,
                              max_completion_length=None, temperature=1.0, delta=None,
                              version=None, use_bias_correction_kl=True,
                              mask_truncated_completions=False):
    """Accumulate the step's GRPO gradient over the micro-batches; return the step's loss and stats.

    Each micro-batch's loss is weighted (grpo_loss.microbatch_weight) so that the sum is the loss
    of the whole step as TRL defines it. With beta == 0, a group whose advantages are all 0 (its
    rewards all equal) adds nothing to the loss or the gradient, so it is not forwarded; its
    sequences and tokens stay in every normaliser, so the gradient is TRL's (which keeps them).
    mask_truncated_completions: TRL zeroes the completion mask of those without EOS: their tokens
    leave the loss and the token counts, their rows stay in grpo's and dr_grpo's row counts.
    The stats cover the forwarded completions. staleness = version - policy_version (0 if no
    version).
    Returns a dict: loss, ratio_mean, clip_low_frac, clip_high_frac, kl (beta > 0), ratio_max
    (ratio_mean and ratio_max are None when no group was forwarded: every advantage was 0),
    approx_kl, clip_frac, by_staleness {"0": {"approx_kl", "clip_frac", "tokens"}, ...},
    groups_forwarded, absurd_ratio {group index: its largest ratio} for the groups whose ratio
    exceeds ABSURD_RATIO, and finite: False when the loss or a LoRA gradient is inf or NaN (then
    do not step the optimizer: the weights would become NaN).
    """
    device = next(model.parameters()).device
    masked = {i for i, s in enumerate(seqs) if mask_truncated_completions and s["truncated"]}
    total_tokens = sum(len(s["ids"]) for i, s in enumerate(seqs) if i not in masked)
    sums, rows, row_groups, forwarded = {"loss": 0.0}, [], [], 0
    for idx in microbatches:
        # masked: no loss; grpo and dr_grpo still divide by all B rows
        idx = [i for i in idx if i not in masked]
        # bnpo's normaliser: the whole micro-batch
        mb_tokens = sum(len(seqs[i]["ids"]) for i in idx)
        if beta == 0.0:  # advantage 0 everywhere in a group: no loss, no gradient, no forward
            idx = [i for g in by_group(seqs, idx) if bool((advantages[g] != 0).any())
                   for i in g]
        if not idx:
            continue
        forwarded += len(by_group(seqs, idx))
        mb = collate(seqs, idx, advantages, device)
        logps = completion_logprobs(model, mb, temperature)  # (n, C)
        ref = None
        if beta > 0:
            with torch.no_grad(), model.disable_adapter():
                ref = completion_logprobs(model, mb, temperature)  # (n, C) base model
        # the loss of this micro-batch, normalised as loss_type says (dapo: by the whole step's
        # tokens, bnpo: by this micro-batch's)
        loss, stats = grpo_loss.policy_loss(
            logps, mb["old_logprobs"], mb["advantages"], mb["mask"], epsilon=epsilon,
            epsilon_high=epsilon_high, loss_type=loss_type,
            max_completion_length=max_completion_length, ref_logprobs=ref, beta=beta,
            num_tokens={"dapo": total_tokens, "bnpo": mb_tokens}.get(loss_type), delta=delta,
            use_bias_correction_kl=use_bias_correction_kl)
        weight = grpo_loss.microbatch_weight(loss_type, mb["mask"], len(seqs), len(microbatches))
        (loss * weight).backward()
        sums["loss"] += loss.item() * weight
        n = float(mb["mask"].sum())  # the stats: token-weighted means over the micro-batches
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v * n
        per_row = grpo_loss.offpolicy_stats(logps, mb["old_logprobs"], mb["mask"], epsilon,
                                            epsilon_high)  # STAT_COLUMNS, each (n,)
        stale = torch.tensor([0 if version is None else version - seqs[i]["policy_version"]
                              for i in idx])  # (n,)
        columns = [stale.to(per_row["tokens"])] + [per_row[k] for k in STAT_COLUMNS]
        rows.append(torch.stack(columns, 1).cpu())  # (n, 5)
        row_groups += [seqs[i]["group"] for i in idx]

    table = torch.cat(rows) if rows else torch.zeros(0, 5)  # (rows, 5) every forwarded row
    stale, tokens, approx_kl, clipped, ratio_max = table.unbind(1)  # each (rows,)

    def summary(sel):  # (rows,) bool -> token-weighted means over the selected rows
        n = tokens[sel].sum()
        return {"approx_kl": (approx_kl[sel].sum() / n.clamp(min=1)).item(),
                "clip_frac": (clipped[sel].sum() / n.clamp(min=1)).item(), "tokens": int(n)}

    out = {"ratio_mean": None, "clip_low_frac": 0.0, "clip_high_frac": 0.0,
           **({"kl": 0.0} if beta else {}),
           **{k: v if k == "loss" else v / max(float(tokens.sum()), 1.0) for k, v in sums.items()},
           **summary(stale >= 0), "ratio_max": ratio_max.max().item() if len(stale) else None,
           "by_staleness": {str(int(s)): summary(stale == s) for s in stale.unique().tolist()},
           "groups_forwarded": forwarded}
    del out["tokens"]
    absurd = {}  # group index -> its largest ratio, for the groups over ABSURD_RATIO
    for k, r in zip(row_groups, ratio_max.tolist()):
        if r > ABSURD_RATIO:
            absurd[k] = max(r, absurd.get(k, 0.0))
    out["absurd_ratio"] = absurd
    out["finite"] = math.isfinite(out["loss"]) and grpo_loss.all_finite(  # each on its own device
        [p.grad for p in model.parameters() if p.requires_grad])
    return out


# ---- ALGO, 5. publish: the adapter to the bucket (and the resume state), then the proxy

def publish(model, bucket, version, keep, base_model, step, state=None, optimizer=None, key=None):
    """Publish the adapter as `version`; with `state`, also save the resume state (weights,
    optimizer, RNGs), tagged with an HMAC under `key` (env TRAINER_STATE_KEY) when there is one."""
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        sync.publish_adapter(bucket, d, version, keep=keep, base_model=base_model, step=step)
        if state is not None:
            rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
            full = dict(state, optimizer=optimizer.state_dict(), rng_python=random.getstate(),
                        rng_torch=torch.get_rng_state(), rng_cuda=rng_cuda)
            torch.save(full, os.path.join(d, "state.pt"))
            if key:
                with open(os.path.join(d, STATE_TAG), "w") as f:
                    f.write(state_tag(key, d))
            sync.save_trainer_state(bucket, d)


# ---- ALGO: the loop

def train(args):
    # rides out outages once it worked
    bucket = sync.open_bucket(args.bucket, retry_s=args.bucket_retry)
    client = ProxyClient(args.proxy)  # token: env PROXY_TOKEN
    # a wrong URL or token ends here
    contract = client.contract(**{k: getattr(args, k) for k in CONTRACT_FLAGS})
    # the run's settings: the proxy's
    vars(args).update({k: contract[k] for k in CONTRACT_FLAGS})
    tmp, key = tempfile.TemporaryDirectory(), os.environ.get("TRAINER_STATE_KEY") or None
    state_dir = sync.load_trainer_state(bucket, tmp.name)
    state = load_state(state_dir, key, bucket.url)  # authenticated with a key; checked in any case
    probe = make_optimizer([torch.zeros(1)], args)  # this trainer's AdamW settings
    if state is not None and (why := state_problem(state, probe)):
        raise TrainerError(f"{bucket.url}/trainer: the resume state does not fit this trainer "
                           f"({why}): not written by trainer.py? remove {bucket.url}/trainer to "
                           "start fresh (and set TRAINER_STATE_KEY: an HMAC then shows who wrote "
                           "it)")
    where = f"{bucket.url}/trainer"
    print(f"resumed from step {state['step']}, version {state['version']} (state in {where})"
          if state else f"starting fresh: no trainer state in {bucket.url}")
    print(f"run settings from the proxy: {contract}")
    latest = sync.latest_version(bucket)
    version, must_publish = starting_version(state, latest, sync.versions(bucket))
    if latest is not None and not state:
        print(f"note: {bucket.url} already holds adapters up to v{latest}; this run starts at "
              f"v{version}")
    # --report-to: the trackio or wandb module (both have init/log/finish)
    reporter, kind = None, args.report_to
    if kind != "none":
        try:
            reporter = __import__(kind)
        except ImportError:
            raise TrainerError(f"--report-to {kind} needs the {kind} package: pip install {kind} "
                               "(or --report-to none)")
        reporter.init(project="async-grpo-lora", config=vars(args))
    random.seed(args.seed)
    model = build_model(args.model, args.lora_r, args.lora_alpha, args.lora_target, args.seed)
    model.eval()  # no dropout: the recomputed log-probs must be the policy the sampler ran
    # what group_problem checks a group against
    limits = {"num_generations": args.num_generations,
              "reward_range": contract.get("reward_range"),
              "context": getattr(model.config, "max_position_embeddings", None)}
    optimizer = make_optimizer(lora_parameters(model), args)
    # versions kept in the bucket: every one a replica may still be using
    keep = args.max_staleness + 2
    step, groups_consumed = (state["step"], state["groups_consumed"]) if state else (0, 0)
    if state:
        try:
            restore_state(model, optimizer, state_dir, state)
        # e.g. a size mismatch: the state belongs to another model
        except (RuntimeError, ValueError) as e:
            saved, why = state.get("args", {}), str(e).strip().splitlines()[0][:160]
            raise TrainerError(f"the state in {bucket.url}/trainer (--model {saved.get('model')}, "
                               f"--lora-r {saved.get('lora_r')}) does not fit --model {args.model} "
                               f"--lora-r {args.lora_r} ({why}): run with that run's settings, or "
                               "another --bucket") from None
    tmp.cleanup()

    def publish_and_save(version, save):
        state = {"step": step, "version": version, "published_step": step,
                 "groups_consumed": groups_consumed, "args": vars(args)} if save else None
        publish(model, bucket, version, keep, args.model, step, state, optimizer, key)
        # The handshake: after the files, so a replica told of v by /quota finds it in the bucket
        # (proxy.RolloutBuffer.set_version; the replica's side is rollout.Replica.step).
        client.set_version(version)
        saved = f"\nsaved state at step {step} (version {version})" if save else ""
        print(f"published v{version} at step {step}" + saved)

    if must_publish:  # v0 (the untrained LoRA), or the restored weights under a new number
        publish_and_save(version, save=True)
    else:  # the trainer announces itself: the proxy now hands out groups
        client.set_version(version)

    # The GRPO loop: one optimizer step, and one adapter version, per batch.
    while step < args.max_steps:
        t0 = time.time()
        # 1. take a batch: groups_per_step groups (a long poll), one record per completion
        dropped = {}  # why -> groups dropped while gathering this step's (group_problem)
        groups = gather_groups(client, args.groups_per_step, args.wait_timeout, bucket.url,
                               model.get_input_embeddings().num_embeddings, dropped, **limits)
        groups_consumed += len(groups)
        t1 = time.time()
        seqs = flatten_groups(groups, args.max_completion_length)
        mbs = make_microbatches(seqs, args.micro_batch_tokens)
        # 2. advantages: each reward against its group's mean (and std: --scale-rewards)
        rewards = torch.tensor([s["reward"] for s in seqs])  # (B,) B = groups * G
        advantages = grpo_loss.group_advantages(rewards, args.num_generations,
                                                args.scale_rewards)  # (B,)
        # 3. + 4. log-probs and the loss, the gradient accumulated over the micro-batches.
        # Zeros, not None: all-equal groups still step AdamW's momentum, as TRL's do.
        optimizer.zero_grad(set_to_none=False)
        stats = compute_loss_and_backward(model, seqs, advantages, mbs, args.loss_type,
                                          args.epsilon, args.epsilon_high, args.beta,
                                          args.max_completion_length, args.temperature,
                                          args.delta, version, args.use_bias_correction_kl,
                                          args.mask_truncated_completions)
        # stats: loss, ratios, approx_kl, clip fractions, ... (compute_loss_and_backward)
        grad_norm = torch.nn.utils.clip_grad_norm_(lora_parameters(model), args.max_grad_norm)
        grad_norm = grad_norm.item()
        finite = stats.pop("finite") and math.isfinite(grad_norm)
        # a group whose ratio no honest sampler gives: named (inert under delta, departure 8)
        for k, r in (absurd := stats.pop("absurd_ratio")).items():
            who = f"group {printable(groups[k]['group_id'])} from {printable(groups[k]['worker'])}"
            then = (f"delta {args.delta:g} leaves such tokens no gradient" if args.delta
                    else "--delta none: it steers this step")
            print(f"step {step + 1}: {who}: importance ratio {r:.3g} > {ABSURD_RATIO:g}, its "
                  f"log-probs are not its sampler's; {then}", file=sys.stderr)
        # the schedule: a function of the step, so a resume continues it
        decay = 1 - step / args.max_steps if args.lr_scheduler_type == "linear" else 1
        for g in optimizer.param_groups:
            g["lr"] = args.learning_rate * decay
        if finite:
            optimizer.step()
        else:  # one poisoned group must not reach the weights: skip the update, publish the same
            print(f"step {step + 1}: loss {stats['loss']} / gradient norm {grad_norm}: not "
                  "finite, update skipped", file=sys.stderr)
        step += 1
        t2 = time.time()

        # the step's record: metrics/ in the bucket, --report-to, one line on stdout
        stale = [version - g["policy_version"] for g in groups]
        flat = sum(len({c["reward"] for c in g["completions"]}) == 1 for g in groups)
        tokens = sum(len(s["ids"]) for s in seqs)
        rec = {"step": step, "version": version, "reward_mean": rewards.mean().item(),
               "reward_std": rewards.std().item(), "groups": len(groups),
               "groups_zero_variance": flat,
               "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
               "policy_versions": sorted({g["policy_version"] for g in groups}), "tokens": tokens,
               "truncated": (cut := sum(s["truncated"] for s in seqs)),  # ended without EOS, as TRL
               "clipped_ratio": cut / len(seqs),
               "grad_norm": grad_norm, "skipped_non_finite": not finite,
               "groups_dropped": dropped, "groups_absurd_ratio": len(absurd),
               **stats, "learning_rate": optimizer.param_groups[0]["lr"], "micro_batches": len(mbs),
               "wait_s": round(t1 - t0, 3), "compute_s": round(t2 - t1, 3),
               "tokens_per_s": round(tokens / max(t2 - t1, 1e-9), 1), "time": time.time()}
        sync.append_metrics(bucket, rec)
        if reporter:  # the same numbers (lists and dicts left out)
            reporter.log({k: v for k, v in rec.items() if isinstance(v, (int, float))})
        kl = f" kl {rec['kl']:.4f}" if args.beta > 0 else ""
        print(f"step {step} v{version} | reward {rec['reward_mean']:.3f} ± "
              f"{rec['reward_std']:.3f} | groups {len(groups)} ({flat} all-equal) | stale "
              f"{rec['staleness_mean']:.2f}/{rec['staleness_max']} | loss {rec['loss']:.4f} ratio "
              f"{rec['ratio_mean'] or 1:.4f} (max {rec['ratio_max'] or 1:.2f}) approx_kl "
              f"{rec['approx_kl']:.5f} clip {rec['clip_frac']:.3f}{kl} | gnorm {grad_norm:.3f} | "
              f"wait {rec['wait_s']:.2f}s compute {rec['compute_s']:.2f}s "
              f"{rec['tokens_per_s']:.0f} tok/s")
        # 5. publish: one version per optimizer step (and the resume state every --save-every)
        version += 1
        publish_and_save(version, save=step % args.save_every == 0 or step == args.max_steps)
    client.done()  # replicas learn it from /quota and exit; the proxy exits after them
    if reporter:
        reporter.finish()
    print(f"done: {step} steps, last version v{version}, {groups_consumed} groups consumed")


# ---- SUPPORT (the model, resume, CLI, hardening): not needed to follow a step

def build_model(model_name, lora_r=16, lora_alpha=32, lora_target="all-linear", seed=0):
    """Base model + fresh LoRA (B = 0, so version 0 is the base policy). bf16 on GPU, fp32 on
    CPU."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    gpu = torch.cuda.is_available()
    dtype, device = (torch.bfloat16, "cuda") if gpu else (torch.float32, "cpu")
    base = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype).to(device)
    base.config.use_cache = False
    targets = lora_target if lora_target == "all-linear" \
        else [t.strip() for t in lora_target.split(",")]
    lora = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=targets,
                      task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    return get_peft_model(base, lora)  # adapter weights are kept in fp32 (autocast_adapter_dtype)


def lora_parameters(model):
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(params, args):
    """AdamW, no weight decay (departure 5); a resume state must match it (state_problem)."""
    return torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=0.0)


def restore_state(model, optimizer, state_dir, state):
    """Load the LoRA weights, optimizer and RNGs that publish saved (state_dir:
    load_trainer_state's)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(os.path.join(state_dir, "adapter_model.safetensors"))
    set_peft_model_state_dict(model, weights)
    optimizer.load_state_dict(state["optimizer"])
    random.setstate(state["rng_python"])
    torch.set_rng_state(state["rng_torch"])
    if state.get("rng_cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])


def starting_version(state, latest, seen=()):
    """(version, publish?) for a trainer starting with resume state `state` (or None) on a bucket
    whose LATEST is `latest` (or None), holding files of versions `seen` (complete or torn by a kill
    mid-publish). A number the bucket has seen is never published again; LATEST is reused only if
    it holds exactly the saved weights."""
    if state and state["published_step"] == state["step"] \
            and latest == state["version"] >= max(seen, default=-1):
        return state["version"], False
    known = [v for v in (latest, state["version"] if state else None, *seen) if v is not None]
    return (1 + max(known) if known else 0), True


def delta_or_none(v):
    return None if v.lower() == "none" else float(v)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model", required=True, help="base model: a Hub id or a local folder")
    a("--bucket", required=True, help="a directory (or mounted bucket) or s3://bucket/prefix")
    a("--proxy", required=True,
      help="the proxy's URL, e.g. http://127.0.0.1:8000 (token: env PROXY_TOKEN)")
    # The run's contract comes from the proxy (GET /config); these flags only double-check it.
    a("--num-generations", type=int, help="completions per prompt, G (default: the proxy's)")
    a("--groups-per-step", type=int,
      help="groups (prompts) per optimizer step (default: the proxy's)")
    a("--max-staleness", type=int,
      help="the proxy's staleness bound; sets the versions kept (default: the proxy's)")
    a("--temperature", type=float,
      help="the replicas' sampling temperature; divides logits (default: the proxy's)")
    a("--max-completion-length", type=int,
      help="max_new_tokens; dr_grpo's normaliser (default: the proxy's)")
    # the loss, as TRL names it
    a("--epsilon", type=float, default=0.2, help="lower clip: ratio >= 1 - epsilon")
    a("--epsilon-high", type=float, default=None,
      help="upper clip: ratio <= 1 + epsilon_high (default: epsilon)")
    a("--delta", type=delta_or_none, default=DELTA,
      help=f"TRL's two-sided clip: ratio <= delta (>= 1 + epsilon_high) if advantage < 0; "
           f"'none': off (default {DELTA}: one group cannot steer a step)")
    a("--beta", type=float, default=0.0,
      help="KL coefficient against the base model (adapter disabled); 0 = no KL")
    a("--use-bias-correction-kl", action=argparse.BooleanOptionalAction, default=True,
      help="with --beta > 0: multiply the per-token KL by the importance ratio (TRL's default: on)")
    a("--mask-truncated-completions", action="store_true",
      help="leave completions that ended without EOS out of the loss (TRL's; default: off)")
    a("--loss-type", default="dapo", choices=["grpo", "bnpo", "dr_grpo", "dapo"],
      help="loss normalisation, as in TRL")
    a("--scale-rewards", default="group", choices=["group", "batch", "none"],
      help="divide advantages by this std")
    a("--learning-rate", type=float, default=3e-4, help="AdamW's initial learning rate")
    a("--lr-scheduler-type", default="linear", choices=["linear", "constant"],
      help="linear: decays to 0 at --max-steps (TRL's default); constant")
    a("--max-grad-norm", type=float, default=1.0,
      help="clip the LoRA gradient's global norm to this")
    a("--max-steps", type=int, default=500,
      help="stop after this many optimizer steps (counted across restarts)")
    a("--micro-batch-tokens", type=int, default=8192,
      help="tokens (padding counted) per forward/backward pass")
    a("--save-every", type=int, default=10, help="save resume state every this many steps")
    a("--seed", type=int, default=0, help="seed for the LoRA init and torch's/python's RNGs")
    a("--lora-r", type=int, default=16, help="LoRA rank (vLLM wants 1, 8, 16, 32, 64, ...)")
    a("--lora-alpha", type=int, default=32, help="LoRA alpha (scale = alpha / r)")
    a("--lora-target", default="all-linear",
      help="'all-linear' or comma-separated module names, e.g. q_proj,v_proj")
    a("--wait-timeout", type=float, default=1800.0,
      help="seconds with no usable group before giving up (0: never)")
    a("--bucket-retry", type=float, default=300.0,
      help="seconds to retry a bucket that worked before (an outage)")
    a("--report-to", default="none", choices=["none", "trackio", "wandb"],
      help="also send each step's metrics there")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if too_small := [f for f in ("save_every", "micro_batch_tokens") if getattr(args, f) < 1]:
        sys.exit(f"trainer.py: error: --{too_small[0].replace('_', '-')} must be >= 1")
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if args.delta is not None and not args.delta >= 1 + high:
        sys.exit(f"trainer.py: error: --delta {args.delta:g} must be >= 1 + epsilon_high = "
                 f"{1 + high:g} (raise it, or --delta none to turn TRL's two-sided clip off)")
    # each log line reaches a piped log (or a watcher) at once
    sys.stdout.reconfigure(line_buffering=True)
    try:
        train(args)
    except (ProxyError, sync.BucketError, TrainerError) as e:
        sys.exit(f"trainer.py: error: {e}")


# ---- SUPPORT, hardening: what a hostile replica (groups) or bucket writer (resume state)
# can send, checked before it can crash, steer or poison the learner.

def group_problem(g, vocab_size, num_generations=None, context=None, reward_range=None):
    """(kind, why) when the trainer cannot use group g (the proxy's JSON), else None. The proxy
    checks groups too; this holds on its own: one bad group must not crash or poison a step."""
    def ids_ok(ids):
        return type(ids) is list and all(type(t) is int and 0 <= t < vocab_size for t in ids)

    def number(x, lo=-math.inf, hi=math.inf):  # NaN fails
        return type(x) in (int, float) and lo <= x <= hi and math.isfinite(x)

    lo, hi = reward_range or (-math.inf, math.inf)
    try:
        comps, prompt = g["completions"], g["prompt_ids"]
        if num_generations is not None and len(comps) != num_generations:
            return "num_completions", f"{len(comps)} completions, not {num_generations}"
        if not prompt:
            return "empty_prompt", "no prompt tokens (prompt_ids: [])"
        for j, c in enumerate(comps):
            ids, lps = c["ids"], c["logprobs"]
            if not ids:
                return "empty_completion", f"completion {j} has no tokens (ids: [])"
            if not (ids_ok(prompt) and ids_ok(ids)):
                return "token_id", f"a token id >= the vocabulary size {vocab_size} (or < 0)"
            if len(lps) != len(ids) or not all(map(number, lps)):
                return "logprobs", (f"completion {j}: {len(lps)} log-probs for {len(ids)} ids, "
                                    "or NaN")
            if not number(c["reward"], lo, hi):
                r = str(c["reward"])[:30]
                return "reward", f"completion {j}: reward {r} not in [{lo:g}, {hi:g}]"
        longest = len(prompt) + max(len(c["ids"]) for c in comps)
        if context is not None and longest > context:
            return "too_long", f"{longest} tokens of prompt + completion > the context {context}"
        int(g["policy_version"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return "malformed", "not a group in the proxy's JSON form"
    return None


def printable(v, n=64):
    """A peer's string for a log line: at most n characters, no control character (no fake line)."""
    return "".join(ch if ch.isprintable() else "?" for ch in str(v)[:n])


STATE_TAG = "state.hmac"  # next to state.pt: the state's HMAC under env TRAINER_STATE_KEY
FREE_OPTIMIZER_KEYS = {"params", "lr", "initial_lr", "foreach", "fused", "capturable",
                       "differentiable"}  # AdamW settings a resume state may set as it likes


def state_tag(key, folder):
    """HMAC-SHA256 (hex) under key of every file in folder but the tag: names and sha256s,
    sorted."""
    mac = hmac.new(key.encode(), digestmod=hashlib.sha256)
    for name in sorted(os.listdir(folder)):
        if name != STATE_TAG and os.path.isfile(path := os.path.join(folder, name)):
            with open(path, "rb") as f:
                mac.update(f"{name}\0{hashlib.sha256(f.read()).hexdigest()}\n".encode())
    return mac.hexdigest()


def load_state(state_dir, key, where):
    """The resume state load_trainer_state put in state_dir (None: there is none). With a key, it is
    refused unless its HMAC tag matches; it never unpickles code (weights_only). TrainerError."""
    if state_dir is None:
        return None
    fresh = f"remove {where}/trainer to start fresh"
    if key:
        tag_path = os.path.join(state_dir, STATE_TAG)
        tag = open(tag_path, "rb").read().strip() if os.path.exists(tag_path) else None
        if tag is None or not hmac.compare_digest(tag, state_tag(key, state_dir).encode()):
            which = "no" if tag is None else "a wrong"
            raise TrainerError(f"{where}/trainer: the resume state has {which} HMAC tag under "
                               "TRAINER_STATE_KEY: this run's trainer did not write it (or used "
                               f"another key); set the key that run used, or {fresh}")
    try:  # weights_only: a state.pt planted in the bucket cannot run code here
        return torch.load(os.path.join(state_dir, "state.pt"), weights_only=True)
    except pickle.UnpicklingError as e:  # torch's text advises weights_only=False: not repeated
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        why = f"it calls {found.group(1)}" if found else "not a plain pickle"
        raise TrainerError(f"{where}/trainer/state.pt holds more than tensors and plain values "
                           "(written by something else than trainer.py?): weights only load failed "
                           f"({why}); {fresh}") from None


def state_problem(state, optimizer):
    """Why a resume state does not fit this trainer (counters, its own AdamW settings, finite
    moments with |exp_avg| <= 10 sqrt(exp_avg_sq), as Adam's own updates keep them), or None."""
    try:
        if not all(type(state[k]) is int and state[k] >= 0
                   for k in ("step", "version", "published_step", "groups_consumed")):
            return "step, version, published_step or groups_consumed is not an int >= 0"
        saved = state["optimizer"]["param_groups"]
        if len(saved) != len(optimizer.param_groups):
            return f"{len(saved)} optimizer parameter groups, not {len(optimizer.param_groups)}"
        for theirs, ours in zip(saved, optimizer.param_groups):
            for k in set(ours) - FREE_OPTIMIZER_KEYS:
                if theirs.get(k, ours[k]) != ours[k]:
                    return f"AdamW {k}={str(theirs[k])[:40]}, not this trainer's {ours[k]}"
        for moments in state["optimizer"]["state"].values():
            m, v = moments["exp_avg"].float(), moments["exp_avg_sq"].float()
            if not (torch.isfinite(m).all() and torch.isfinite(v).all() and (v >= 0).all()
                    and (m.abs() <= 10 * v.sqrt() + 1e-12).all()):
                return "AdamW moments that are not finite, or exp_avg beyond 10 sqrt(exp_avg_sq)"
    except (KeyError, TypeError, AttributeError, RuntimeError):
        return "not the dict trainer.py saves"
    return None


if __name__ == "__main__":
    main()
