"""The GRPO math: group advantages, per-token log-probs, the clipped policy loss. Pure torch, no
I/O.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_grpo_loss.py tests/test_learn_toy.py -q

The first test file checks every function against numbers worked out by hand; the second runs a
few dozen GRPO steps on the tiny test model and checks that a toy reward goes from ~0 to ~1.

The names are TRL's (`GRPOTrainer._compute_loss` in huggingface/trl, trl/trainer/grpo_trainer.py):
`epsilon`, `epsilon_high`, `delta`, `beta`, `use_bias_correction_kl`, `loss_type`, `scale_rewards`,
`max_completion_length`, `vllm_importance_sampling_*`, `off_policy_mask_threshold`, so a reader
who knows TRL can check this file against it line by line.

Where this departs from GRPO as the DeepSeekMath paper writes it (arXiv 2402.03300, eq. 3), and
from TRL:
1. No KL term by default (`beta=0.0`, TRL's default too). The paper uses beta = 0.04. With
   `beta > 0` the term is the paper's k3 estimator (eq. 4), multiplied by the importance ratio
   as TRL 1.16 does by default (`use_bias_correction_kl=True`, DeepSeek-V3.2 arXiv 2512.02556):
   the ratio is not detached, so it changes the KL gradient even where it equals 1. With LoRA
   the reference policy is the base model with the adapter disabled (no second model in memory).
2. Where the sampler's log-probs enter (sampler_correction). "sampler" (trainer.py's default,
   TRL's AsyncGRPOTrainer): they are the old policy, ratio = exp(logp - logp_sampler), so the
   clip absorbs staleness and the sampler/trainer numerical mismatch. "learner" (TRL's
   GRPOTrainer with vLLM, and the paper's pi_old): the old log-probs are the learner's at this
   step's weights, i.e. this forward's, detached (one optimizer step per batch: no second
   forward; ratio 1, clip and delta inert); the sampler's enter as a weight on each token's
   loss, exp(logp_old - logp_sampler) per token or per sequence, truncated or masked (TRL's
   vllm_importance_sampling_*), and in DeepSeek-V3.2's off-policy mask. A group k versions old
   is weighted against the sampler that made it: staleness and numerics together. jobs.sh runs
   "learner" + sequence_mask on GPUs, "sampler" locally (docs/sampler-mismatch.md: why).
3. Token-level normalisation by default (`loss_type="dapo"`: sum over all completion tokens of
   the optimizer batch / their count, DAPO arXiv 2503.14476 sec. 3.3). The paper averages over each
   sequence's tokens first (`"grpo"` here), which weights a token of a short answer more than a
   token of a long one.
4. Asymmetric clipping: `epsilon_high` may exceed `epsilon` ("clip-higher", DAPO sec. 3.1), and
   `delta` caps the ratio of negative-advantage tokens too (two-sided clipping, TRL's `delta`).
   policy_loss's default is TRL's (None: off); trainer.py turns it on by default (--delta 2.0),
   since a replica can send log-probs that make one group's ratio ~4e8: above delta a token of
   either sign has no gradient, so such a group cannot steer the step.
5. Advantages add 1e-4 to the std (a group with equal rewards gets advantage 0, not NaN) and can
   be scaled by the batch std or not at all (`scale_rewards="none"`, Dr. GRPO arXiv 2503.20783).
6. The log-ratio is 0 on padding and at most LOG_RATIO_MAX = 20 (a ratio of 4.9e8) before exp().
   TRL has neither: a garbage or extreme sampler log-prob there makes exp() inf and the gradient
   NaN even where the loss is clipped and its true gradient is 0. A ratio held at the bound has
   no gradient (it is as far off-policy as a token can be; `delta` bounds it properly).
   So has the importance weight's log (TRL's weight whenever clip_max < e^20). TRL gives a NaN
   sampler log-prob weight 1; the contract refuses NaN here (the step would not be finite).
7. Micro-batches: TRL divides each micro-batch's loss by the number of micro-batches. That is the
   definition of "bnpo" (each micro-batch's token mean, averaged: see microbatch_weight), so we
   do the same there; for "grpo" and "dr_grpo" we weight by the micro-batch's share of the
   sequences instead, which equals the whole batch's loss whatever the split (TRL's equals it
   only when every micro-batch holds as many sequences).
"""

import math

import torch
from torch.utils.checkpoint import checkpoint

from support.defaults import DEFAULTS  # the keywords' defaults: trainer.py's flags' (TRL's)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
OLD_LOGPROBS = ("sampler", "learner")  # whose log-probs are the ratio's old policy (departure 2)
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's
# sampler_correction's keywords, as trainer.py's flags name them (TRL's names but the first)
CORRECTION = ("old_logprobs", "vllm_importance_sampling_correction",
              "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
              "vllm_importance_sampling_clip_min", "off_policy_mask_threshold")
LOG_RATIO_MAX = 20.0  # exp(20) = 4.9e8, far from float32's overflow at exp(88.7) (departure 6)


# ---- ALGO: the step's math, README's steps 6. advantages (group_advantages)
# 7. log-probs (token_logprobs, log_ratio)  8. the loss (sampler_correction: which log-probs are
# the old policy; policy_loss, microbatch_weight). At the defaults that is the whole step: the
# OPTIONS below (TRL's vLLM importance weights, the off-policy mask) and the SUPPORT after them
# (settings check, the logs' statistics) can be read later.

def group_advantages(rewards, group_size, scale_rewards=DEFAULTS["scale_rewards"]):
    """Advantage of each completion against the other completions of its prompt.

    rewards: (B,) float, laid out group by group (B = groups * group_size). Returns (B,).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, not {scale_rewards!r}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"need groups of >= 2 completions and B divisible by group_size: "
                         f"got B={rewards.numel()}, group_size={group_size}")
    grouped = rewards.view(-1, group_size)  # (B/G, G)
    mean = grouped.mean(dim=1).repeat_interleave(group_size)  # (B,)
    advantages = rewards - mean  # (B,)  TRL: advantages = rewards - mean_grouped_rewards
    if scale_rewards == "none":  # Dr. GRPO: no std scaling (arXiv 2503.20783, sec. 3.1)
        return advantages
    if scale_rewards == "group":
        std = grouped.std(dim=1).repeat_interleave(group_size)  # (B,) Bessel-corrected, as TRL
    else:
        std = rewards.std().expand_as(rewards)  # (B,) one std for the whole batch, as TRL "batch"
    return advantages / (std + 1e-4)  # (B,)  TRL: advantages / (std_rewards + 1e-4)


def _chunk_logprobs(logits, ids, temperature):
    """(b, T, V) logits, (b, T) ids -> (b, T) log-softmax of the ids, computed in float32."""
    logits = logits.float() / temperature if temperature != 1.0 else logits.float()  # (b, T, V)
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (b, T)
    return picked - torch.logsumexp(logits, dim=-1)  # (b, T)  log_softmax(x)_i = x_i - logsumexp(x)


def token_logprobs(logits, ids, temperature=DEFAULTS["temperature"], chunk_rows=4):
    """Log-probs of `ids` under `logits`, without a second (B, T, V) float tensor.

    logits: (B, T, V), where logits[b, t] is the distribution that produced ids[b, t] (the caller
    shifts: logits[:, :-1] for ids[:, 1:]). ids: (B, T) int. Returns (B, T) float32.
    `temperature` divides the logits first, as the sampler did (its log-probs are the ones the
    ratio compares against).

    Memory: log_softmax followed by gather would allocate a full (B, T, V) float tensor (the peak
    of a step with a 49k vocabulary). Here, `chunk_rows` rows at a time, we gather the picked
    logit and subtract logsumexp (the same trick as TRL's `selective_log_softmax`,
    trl/trainer/utils.py). Each chunk runs under activation checkpointing, so its float32 / scaled
    copy is freed after the forward and rebuilt in the backward, one chunk at a time.
    """
    rows = []
    for lg, ix in zip(logits.split(chunk_rows), ids.split(chunk_rows)):  # (b, T, V), (b, T)
        if lg.requires_grad and torch.is_grad_enabled():
            rows.append(checkpoint(_chunk_logprobs, lg, ix, temperature, use_reentrant=False))
        else:
            rows.append(_chunk_logprobs(lg, ix, temperature))  # (b, T)
    return torch.cat(rows)  # (B, T)


def log_ratio(logprobs, old_logprobs, mask):
    """log(pi_theta / pi_behaviour) per token: (B, T), 0 on padding, at most LOG_RATIO_MAX.

    Padding may hold anything (-inf, garbage): it is zeroed before exp(), so that neither the loss
    nor the gradient can become NaN (TRL only multiplies by the mask afterwards). The clamp keeps
    exp() finite (departure 6): beyond it the ratio is held at e^20 with no gradient.
    """
    return torch.where(mask.bool(), logprobs - old_logprobs, 0.0).clamp(max=LOG_RATIO_MAX)  # (B, T)


def sampler_correction(
        logprobs, sampling_logprobs, advantages, mask, old_logprobs=DEFAULTS["old_logprobs"],
        vllm_importance_sampling_correction=DEFAULTS["vllm_importance_sampling_correction"],
        vllm_importance_sampling_mode=DEFAULTS["vllm_importance_sampling_mode"],
        vllm_importance_sampling_clip_max=DEFAULTS["vllm_importance_sampling_clip_max"],
        vllm_importance_sampling_clip_min=DEFAULTS["vllm_importance_sampling_clip_min"],
        off_policy_mask_threshold=DEFAULTS["off_policy_mask_threshold"]):
    """Where the sampler's log-probs enter the loss (departure 2): policy_loss's old_logprobs,
    importance_sampling_ratio and off_policy_mask, as a dict. logprobs: (B, T) this forward's;
    sampling_logprobs: (B, T) the sampler's; advantages: (B,); mask: (B, T). The keywords and
    defaults are TRL's GRPOConfig's but old_logprobs: "sampler": the old policy is the sampler
    (TRL's AsyncGRPOTrainer). "learner": it is this forward, detached (with one optimizer step
    per batch, what TRL's no-grad forward computes), and with vllm_importance_sampling_correction
    the loss is weighted by importance_sampling_ratio (TRL's GRPOTrainer with vLLM)."""
    if old_logprobs not in OLD_LOGPROBS:
        raise ValueError(f"old_logprobs must be one of {OLD_LOGPROBS}, not {old_logprobs!r}")
    out = dict(old_logprobs=sampling_logprobs, importance_sampling_ratio=None, off_policy_mask=None)
    if old_logprobs == "learner":
        # TRL: old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None
        out["old_logprobs"] = logprobs.detach()  # (B, T)
        if vllm_importance_sampling_correction:
            out["importance_sampling_ratio"], _ = importance_sampling_ratio(
                out["old_logprobs"], sampling_logprobs, mask, vllm_importance_sampling_mode,
                vllm_importance_sampling_clip_max, vllm_importance_sampling_clip_min)
    if off_policy_mask_threshold is not None:
        out["off_policy_mask"] = off_policy_mask(advantages, logprobs, sampling_logprobs, mask,
                                                 off_policy_mask_threshold)  # (B, 1)
    return out


def policy_loss(logprobs, old_logprobs, advantages, mask, epsilon=DEFAULTS["epsilon"],
                epsilon_high=DEFAULTS["epsilon_high"], loss_type=DEFAULTS["loss_type"],
                max_completion_length=None, num_tokens=None, ref_logprobs=None,
                beta=DEFAULTS["beta"], delta=None, importance_sampling_ratio=None,
                off_policy_mask=None, use_bias_correction_kl=DEFAULTS["use_bias_correction_kl"]):
    """Clipped surrogate loss of GRPO, aggregated the way TRL's `loss_type` names it.

    logprobs: (B, T) of the policy being trained (carries the gradient).
    old_logprobs: (B, T) the sampler's, or the learner's detached (sampler_correction).
    advantages: (B,) from group_advantages.
    mask: (B, T), 1 on completion tokens (up to and including the first EOS), 0 on padding.
    num_tokens: the token count "dapo" and "bnpo" divide by (default: this mask's sum). dapo: the
      completion tokens of the whole optimizer step (TRL's num_items_in_batch); bnpo: those of
      the micro-batch (TRL's local batch), rows left out of the forward included.
    delta: two-sided clipping (TRL's `delta`): the unclipped ratio is also capped at delta, which
      bounds the loss of a negative-advantage token (-r * A grows without limit otherwise).
    ref_logprobs: (B, T) of the reference policy, needed when beta > 0.
    use_bias_correction_kl: multiply the per-token KL by the ratio before delta caps it (TRL's
      name and default: True). False: the paper's k3 term alone.
    importance_sampling_ratio: (B, T) or (B, 1); off_policy_mask: (B, 1) of 0/1. Each multiplies
      the clipped surrogate (not the KL term), as TRL does. None: 1.
    Returns (loss, stats) with stats a dict of python floats: ratio_mean, clip_low_frac,
    clip_high_frac, and kl when beta > 0 (masked means over completion tokens).
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    check_settings(loss_type, max_completion_length, beta, ref_logprobs, delta, epsilon_high)
    keep = mask.bool()  # (B, T)
    mask = mask.to(logprobs.dtype)  # (B, T)
    adv = advantages.to(logprobs.dtype).unsqueeze(1)  # (B, 1)

    # pi_theta / pi_behaviour, TRL's coef_1
    coef_1 = torch.exp(log_ratio(logprobs, old_logprobs, keep))  # (B, T)
    ratio = coef_1  # (B, T)  before delta caps it: the stats and the KL correction use it
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon_high)  # (B, T)  TRL's coef_2
    if delta is not None:  # TRL: coef_1 = torch.clamp(coef_1, max=self.args.delta)
        coef_1 = torch.clamp(coef_1, max=delta)  # (B, T)
    per_token_loss1 = coef_1 * adv  # (B, T)
    per_token_loss2 = coef_2 * adv  # (B, T)
    # the PPO clip, DeepSeekMath eq. 3
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)  # (B, T)
    if off_policy_mask is not None:  # TRL: per_token_loss = per_token_loss * off_policy_mask
        per_token_loss = per_token_loss * off_policy_mask  # (B, T)
    if importance_sampling_ratio is not None:
        # TRL: per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
        per_token_loss = per_token_loss * importance_sampling_ratio  # (B, T)
    if beta != 0.0:
        ref_diff = torch.where(keep, ref_logprobs - logprobs, 0.0)  # (B, T)
        # k3 estimator of KL(pi_theta || pi_ref): DeepSeekMath eq. 4;
        # http://joschu.net/blog/kl-approx.html
        per_token_kl = torch.exp(ref_diff) - ref_diff - 1  # (B, T)
        # TRL: per_token_kl = per_token_kl * coef_1 (coef_1 before delta's clamp)
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio  # (B, T)
        # TRL: per_token_loss = per_token_loss + self.beta * per_token_kl
        per_token_loss = per_token_loss + beta * per_token_kl  # (B, T)

    masked = per_token_loss * mask  # (B, T)  zero on padding
    tokens = mask.sum().clamp(min=1.0) if num_tokens is None else max(float(num_tokens), 1.0)  # ()
    if loss_type == "grpo":  # TRL: ((l * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()  # ()
    elif loss_type == "bnpo":  # TRL: (l * m).sum() / m.sum().clamp(min=1.0), m of the local batch
        loss = masked.sum() / tokens  # ()
    elif loss_type == "dr_grpo":  # TRL: (l * m).sum() / (l.size(0) * self.max_completion_length)
        loss = masked.sum() / (per_token_loss.size(0) * max_completion_length)  # ()
    else:  # "dapo"; TRL: (l * m).sum() / normalizer, normalizer = num_items_in_batch (whole batch)
        loss = masked.sum() / tokens  # ()

    with torch.no_grad():  # TRL's metrics: clip_ratio/low_mean, clip_ratio/high_mean, kl
        n = mask.sum().clamp(min=1.0)  # ()
        # the tokens whose gradient the clip stopped: ratio too low, ratio too high
        is_low_clipped = (ratio < 1 - epsilon) & (adv < 0)  # (B, T)
        is_high_clipped = (ratio > 1 + epsilon_high) & (adv > 0)  # (B, T)
        stats = {
            "ratio_mean": ((ratio * mask).sum() / n).item(),
            "clip_low_frac": ((is_low_clipped * mask).sum() / n).item(),
            "clip_high_frac": ((is_high_clipped * mask).sum() / n).item(),
        }
        if beta != 0.0:
            stats["kl"] = ((per_token_kl * mask).sum() / n).item()
    return loss, stats


def microbatch_weight(loss_type, mb_mask, total_sequences, num_microbatches):
    """Factor for one micro-batch's policy_loss in the sum over the micro-batches of a step.

    mb_mask: (b, T) completion mask of the micro-batch's forwarded rows; total_sequences: B of the
    whole step; num_microbatches: how many micro-batches the step was split into.
    "grpo", "dr_grpo": the share of the sequences, so that the sum equals (in value and gradient)
      the loss of the whole batch at once, whatever the split.
    "dapo": 1; call policy_loss with num_tokens = the whole step's token count: the sum is then
      the whole batch's token mean, whatever the split.
    "bnpo": 1 / num_microbatches, with num_tokens = the micro-batch's token count: exactly TRL
      (loss / gradient_accumulation_steps). With one micro-batch it equals "dapo"; with several
      it is the mean of the micro-batches' token means, so a token in a micro-batch with few
      tokens weighs more, and the result depends on how --micro-batch-tokens splits the step.
    """
    if loss_type in ("grpo", "dr_grpo"):  # a mean over sequences: weight by the share of sequences
        return mb_mask.size(0) / total_sequences
    if loss_type == "bnpo":  # TRL: loss = loss / self.current_gradient_accumulation_steps
        return 1.0 / num_microbatches
    if loss_type == "dapo":  # already divided by the whole batch's token count
        return 1.0
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, not {loss_type!r}")


# ---- OPTIONS (sampler_correction calls them): TRL's vLLM importance-sampling correction
# (--old-logprobs learner: jobs.sh's on GPUs, off locally) and DeepSeek-V3.2's off-policy mask

def importance_sampling_ratio(old_logprobs, sampling_logprobs, mask, mode,
                              clip_max=DEFAULTS["vllm_importance_sampling_clip_max"],
                              clip_min=DEFAULTS["vllm_importance_sampling_clip_min"]):
    """TRL's vllm_importance_sampling_ratio (grpo_trainer.py 2660-2705): pi_old / pi_sampler per
    token (token_*) or per sequence (sequence_*: the product), held in [clip_min, clip_max]
    (*_truncate) or 0 outside it (*_mask). No gradient. old_logprobs, sampling_logprobs, mask:
    (B, T). Returns (ratio, outside), (B, T) or (B, 1): `outside` (bool) marks the ratios
    outside the bounds before truncation or masking."""
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {IS_MODES}, not {mode!r}")
    with torch.no_grad():
        # TRL: per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
        diff = torch.where(mask.bool(), old_logprobs.detach().float() - sampling_logprobs,
                           0.0)  # (B, T)
        if mode.startswith("sequence"):
            # TRL: per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
            diff = diff.sum(-1, keepdim=True)  # (B, 1)
        # TRL: vllm_importance_sampling_ratio = torch.exp(logps_diff); bounded first (departure 6)
        ratio = torch.exp(diff.clamp(max=LOG_RATIO_MAX))  # (B, T) or (B, 1)
        lo = -math.inf if clip_min is None else clip_min
        hi = math.inf if clip_max is None else clip_max
        outside = (ratio < lo) | (ratio > hi)  # TRL: invalid_mis_mask
        if mode.endswith("truncate"):
            # TRL: torch.clamp(ratio, min=vllm_importance_sampling_clip_min, max=..._clip_max)
            return ratio.clamp(min=lo, max=hi), outside
        # TRL: ratio.masked_fill(invalid_mis_mask, value=0.0)
        return ratio.masked_fill(outside, 0.0), outside


def off_policy_mask(advantages, logprobs, sampling_logprobs, mask, threshold):
    """TRL's get_off_policy_mask (grpo_trainer.py ~2945-2968; DeepSeek-V3.2 arXiv 2512.02556 eq.
    9): (B, 1), 0 for a sequence whose advantage is negative and whose mean over its tokens of
    log(pi_sampler / pi_theta) exceeds threshold, else 1. No gradient."""
    with torch.no_grad():
        # TRL: kl_div = sampling_per_token_logps - per_token_logps.detach()
        kl_div = torch.where(mask.bool(), sampling_logprobs - logprobs.detach(), 0.0)  # (B, T)
        # TRL: avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        avg_seq_kl = kl_div.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(
            min=1.0)  # (B, 1)
        # TRL: keep if (advantages >= 0) | (avg_seq_kl <= off_policy_threshold)
        keep = (advantages.unsqueeze(1) >= 0) | (avg_seq_kl <= threshold)  # (B, 1)
        return keep.to(logprobs.dtype)  # (B, 1)


# ---- SUPPORT: the settings check, the logs' off-policy statistics and the finite check

def check_settings(loss_type, max_completion_length, beta, ref_logprobs, delta, epsilon_high):
    """policy_loss's settings that cannot work: a ValueError that says what to change."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, not {loss_type!r}")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length (the limit in tokens)")
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs (log-probs with the adapter disabled)")
    if delta is not None and delta < 1 + epsilon_high:
        raise ValueError(f"delta must be >= 1 + epsilon_high = {1 + epsilon_high} (TRL recommends "
                         f"> 1 + epsilon), not {delta}: it caps the ratio above the clip range")


def offpolicy_stats(logprobs, sampling_logprobs, mask, correction=None):
    """Statistics only, for the logs (step_record.row_columns): "log_ratio", log(pi_theta /
    pi_sampler) (B, T), and importance_sampling_ratio's "weight" and "outside" with correction's
    mode and bounds (sampler_correction's keywords), whether or not the loss applies them."""
    c = {**DEFAULTS, **(correction or {})}
    with torch.no_grad():
        logprobs = logprobs.detach().float()  # (B, T)
        weight, outside = importance_sampling_ratio(  # (B, T) or (B, 1) each
            logprobs, sampling_logprobs, mask, c["vllm_importance_sampling_mode"],
            c["vllm_importance_sampling_clip_max"], c["vllm_importance_sampling_clip_min"])
        return {"log_ratio": log_ratio(logprobs, sampling_logprobs, mask),  # (B, T)
                "weight": weight, "outside": outside}


def all_finite(tensors):
    """True when every tensor (e.g. each LoRA parameter's .grad; None is skipped) is finite.
    The tensors may live on different devices: each device's flags are reduced there, to one
    bool."""
    flags = {}  # device -> 0-dim bool tensors on it
    for t in tensors:
        if t is not None:
            flags.setdefault(t.device, []).append(torch.isfinite(t).all())  # () on t's device
    return all(bool(torch.stack(f).all()) for f in flags.values())
