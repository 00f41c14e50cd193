"""The record of one trainer step: its statistics gathered micro-batch by micro-batch, the
log line, metrics/step-S.json in the bucket, --report-to. In the step: StepStats.result's "loss"
is the sum of the micro-batches' weighted losses (add's); the rest is statistics and the record.

This module imports no role file.
"""

import collections
import sys
import time

import torch

from support.buckets import append_metrics
from support.defaults import DEFAULTS
from support.group_checks import printable
from support.shared_prompt import by_group

ABSURD_RATIO = 1e3  # no sampler's honest mismatch: a group with a ratio above it is named (dep. 8)


STAT_COLUMNS = ("tokens", "approx_kl", "clipped", "ratio_max", "logp_diff", "logp_diff_max",
                "is_count", "is_sum", "is_min", "is_max", "is_outside",
                "off_policy_masked")  # row_columns, per row
# The sampler/learner mismatch, TRL's names (grpo_trainer.py ~2862-2895) and two of ours
LOGP_DIFF = "sampling/sampling_logp_difference/"  # + mean, max: |logp_theta - logp_sampler|
IS_RATIO = "sampling/importance_sampling_ratio/"  # + min, mean, max, outside_frac (ours)
OPM_MASKED = "sampling/off_policy_mask/masked_frac"  # ours: completions off_policy_mask drops


def row_columns(offpolicy, mask, epsilon=DEFAULTS["epsilon"],
                epsilon_high=DEFAULTS["epsilon_high"], off_policy_mask=None):
    """grpo_loss.offpolicy_stats's tensors, mask (B, T) and off_policy_mask ((B, 1) or None) ->
    STAT_COLUMNS, each (B,): "tokens" (completion tokens); sums over them of "approx_kl",
    CleanRL's k3 estimate of KL(pi_sampler || pi_theta), (r - 1) - log r with r = pi_theta /
    pi_sampler, of "clipped", tokens whose r lies outside [1 - epsilon, 1 + epsilon_high] whatever
    the advantage's sign (CleanRL's clipfrac), and of "logp_diff", |log r| (TRL's
    sampling_logp_difference; log r held at 20 as grpo_loss.log_ratio holds it); the row's
    largest "ratio_max" and "logp_diff_max" (0 if empty);
    the weights, per token or per completion (sequence_*) as TRL counts them: "is_count", "is_sum",
    "is_min", "is_max" (inf / 0 with none), "is_outside" (outside [clip_min, clip_max]: masked or
    truncated); "off_policy_masked" (1: off_policy_mask leaves the row out)."""
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.float()  # (B, T)
    lr, weight = offpolicy["log_ratio"], offpolicy["weight"]  # (B, T), (B, T) or (B, 1)
    ratio = lr.exp()  # (B, T)
    approx_kl = (ratio - 1) - lr  # (B, T)  approx KL: http://joschu.net/blog/kl-approx.html
    clipped = ((ratio < 1 - epsilon) | (ratio > 1 + epsilon_high)).float()  # (B, T)
    diff = lr.abs() * mask  # (B, T)  TRL: torch.abs(old_per_token_logps - sampling_...)
    # TRL's statistics of the weights: over the tokens (token_*), over the sequences (sequence_*)
    at = mask.bool() if weight.shape[1] > 1 else torch.ones_like(weight, dtype=torch.bool)
    dropped = (torch.zeros_like(mask[:, 0]) if off_policy_mask is None
               else 1.0 - off_policy_mask.float()[:, 0])  # (B,)
    return {"tokens": mask.sum(-1), "approx_kl": (approx_kl * mask).sum(-1),  # (B,) each
            "clipped": (clipped * mask).sum(-1), "ratio_max": (ratio * mask).amax(-1),
            "logp_diff": diff.sum(-1), "logp_diff_max": diff.amax(-1),
            "is_count": at.float().sum(-1), "is_sum": torch.where(at, weight, 0.0).sum(-1),
            "is_min": torch.where(at, weight, float("inf")).amin(-1),
            "is_max": torch.where(at, weight, 0.0).amax(-1),
            "is_outside": (offpolicy["outside"] & at).float().sum(-1), "off_policy_masked": dropped}


class StepStats:
    """The statistics of one step, gathered micro-batch by micro-batch by
    trainer.compute_loss_and_backward (add), over the forwarded completions (result).
    staleness = version - policy_version (0 if no version)."""

    def __init__(self, seqs, version, beta, epsilon, epsilon_high):
        self.seqs, self.version, self.beta = seqs, version, beta
        self.epsilon, self.epsilon_high = epsilon, epsilon_high
        self.sums, self.rows, self.row_groups, self.forwarded = {"loss": 0.0}, [], [], 0

    def add(self, idx, mask, loss, stats, offpolicy, off_policy_mask=None):
        """One micro-batch: rows idx, its completion mask (n, C), its weighted loss (a float),
        policy_loss's stats, grpo_loss.offpolicy_stats's tensors and off_policy_mask (n, 1) or
        None; kept per row (row_columns)."""
        self.forwarded += len(by_group(self.seqs, idx))
        self.sums["loss"] += loss
        n = float(mask.sum())  # the stats: token-weighted means over the micro-batches
        for k, v in stats.items():
            self.sums[k] = self.sums.get(k, 0.0) + v * n
        stale = torch.tensor([0 if self.version is None
                              else self.version - self.seqs[i]["policy_version"]
                              for i in idx])  # (n,)
        per_row = row_columns(offpolicy, mask, self.epsilon, self.epsilon_high, off_policy_mask)
        columns = [stale.to(per_row["tokens"])] + [per_row[k] for k in STAT_COLUMNS]
        self.rows.append(torch.stack(columns, 1).cpu())  # (n, 1 + len(STAT_COLUMNS))
        self.row_groups += [self.seqs[i]["group"] for i in idx]

    def share(self):
        """What this record gathered, without seqs: what merge takes from each rank."""
        return {"sums": self.sums, "rows": self.rows, "row_groups": self.row_groups,
                "forwarded": self.forwarded}

    def merge(self, shares):
        """Gather what every rank's record did (their share(), this one's among them) instead of
        this record's own: data parallel's whole step (support/data_parallel.py)."""
        self.sums = {}
        for s in shares:
            for k, v in s["sums"].items():
                self.sums[k] = self.sums.get(k, 0.0) + v
        self.rows = [r for s in shares for r in s["rows"]]
        self.row_groups = [k for s in shares for k in s["row_groups"]]
        self.forwarded = sum(s["forwarded"] for s in shares)

    def result(self):
        """The step's loss (the sum of add's losses) and statistics, a dict: loss, ratio_mean,
        clip_low_frac, clip_high_frac, kl (beta > 0), ratio_max (ratio_mean and ratio_max are
        None when no group was forwarded: every advantage was 0), the summary below over all
        forwarded rows, by_staleness {"0": {the summary, "tokens"}, "1": ...}, groups_forwarded,
        absurd_ratio {group index: its largest ratio} for the groups whose ratio exceeds
        ABSURD_RATIO. The summary: approx_kl, clip_frac (token means),
        LOGP_DIFF mean (a token mean) and max, IS_RATIO min, mean, max and outside_frac (over
        tokens, or over completions for a sequence_* mode, as TRL; 0 with none), OPM_MASKED."""
        table = torch.cat(self.rows) if self.rows else torch.zeros(0, 1 + len(STAT_COLUMNS))
        stale, *cols = table.unbind(1)  # each (rows,)
        col = dict(zip(STAT_COLUMNS, cols))

        def extreme(v, f):  # f = torch.min or torch.max of v; TRL's 0 when v is empty
            return f(v).item() if len(v) else 0.0

        def summary(sel):  # (rows,) bool -> the summary over the selected rows
            c = {k: v[sel] for k, v in col.items()}
            n, m = c["tokens"].sum().clamp(min=1), c["is_count"].sum().clamp(min=1)
            has = c["is_count"] > 0  # (rows,) rows with a weight
            return {"approx_kl": (c["approx_kl"].sum() / n).item(),
                    "clip_frac": (c["clipped"].sum() / n).item(), "tokens": int(c["tokens"].sum()),
                    LOGP_DIFF + "mean": (c["logp_diff"].sum() / n).item(),
                    LOGP_DIFF + "max": extreme(c["logp_diff_max"], torch.max),
                    IS_RATIO + "min": extreme(c["is_min"][has], torch.min),
                    IS_RATIO + "mean": (c["is_sum"].sum() / m).item(),
                    IS_RATIO + "max": extreme(c["is_max"][has], torch.max),
                    IS_RATIO + "outside_frac": (c["is_outside"].sum() / m).item(),
                    OPM_MASKED: c["off_policy_masked"].mean().item() if int(sel.sum()) else 0.0}

        out = {"ratio_mean": None, "clip_low_frac": 0.0, "clip_high_frac": 0.0,
               **({"kl": 0.0} if self.beta else {}),
               **{k: v if k == "loss" else v / max(float(col["tokens"].sum()), 1.0)
                  for k, v in self.sums.items()},
               **summary(stale >= 0),
               "ratio_max": col["ratio_max"].max().item() if len(stale) else None,
               "by_staleness": {str(int(s)): summary(stale == s) for s in stale.unique().tolist()},
               "groups_forwarded": self.forwarded}
        del out["tokens"]
        absurd = {}  # group index -> its largest ratio, for the groups over ABSURD_RATIO
        for k, r in zip(self.row_groups, col["ratio_max"].tolist()):
            if r > ABSURD_RATIO:
                absurd[k] = max(r, absurd.get(k, 0.0))
        out["absurd_ratio"] = absurd
        return out


def name_absurd(step, groups, absurd, delta):
    """Name on stderr each group whose ratio no honest sampler gives (departure 8)."""
    for k, r in absurd.items():
        who = f"group {printable(groups[k]['group_id'])} from {printable(groups[k]['worker'])}"
        then = (f"delta {delta:g} leaves such tokens no gradient" if delta
                else "--delta none: it steers this step")
        print(f"step {step + 1}: {who}: importance ratio {r:.3g} > {ABSURD_RATIO:g}, its "
              f"log-probs are not its sampler's; {then}", file=sys.stderr)


def record_step(run, args, groups, update, *, step, version, dropped, times, reward_check_s):
    """The record of step `step` (counted from 1) after trainer.grpo_update, `update` its
    (seqs, micro-batches, stats, gradient norm, finite): a skipped update said on stderr, the
    groups of an absurd ratio named (name_absurd), then metrics/step-S.json, --report-to and the
    log line (log_step)."""
    seqs, mbs, stats, grad_norm, finite = update
    if not finite:  # grpo_update did not step: a poisoned group must not reach the weights
        print(f"step {step}: loss {stats['loss']} / gradient norm {grad_norm}: not finite, "
              "update skipped", file=sys.stderr)
    absurd = stats.pop("absurd_ratio")
    name_absurd(step - 1, groups, absurd, args.delta)
    log_step(run, args, groups, seqs, stats, step=step, version=version, grad_norm=grad_norm,
             finite=finite, dropped=dropped, absurd=absurd, micro_batches=len(mbs), times=times,
             reward_check_s=reward_check_s)


def log_step(run, args, groups, seqs, stats, *, step, version, grad_norm, finite, dropped, absurd,
             micro_batches, times, reward_check_s=0.0):
    """The step's record: metrics/step-S.json in the bucket, --report-to, one line on stdout.
    times: (start, batch in hand, step done) from time.time(); reward_check_s: the seconds the
    reward check (support/reward_check.py) took while gathering."""
    t0, t1, t2 = times
    rewards = torch.tensor([s["reward"] for s in seqs])  # (B,)
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
           # kind -> groups dropped while gathering (the trainer's checks; reward_func_error:
           # the replicas'), and their sum for --report-to (which takes numbers only)
           "groups_dropped": dropped, "groups_dropped_total": sum(dropped.values()),
           "groups_absurd_ratio": len(absurd),
           # how many of the groups trained on came from each worker (--max-worker-share)
           "groups_by_worker": dict(collections.Counter(printable(g["worker"]) for g in groups)),
           "reward_check_s": reward_check_s,
           **stats, "learning_rate": run.optimizer.param_groups[0]["lr"],
           "micro_batches": micro_batches,
           "wait_s": round(t1 - t0, 3), "compute_s": round(t2 - t1, 3),
           "tokens_per_s": round(tokens / max(t2 - t1, 1e-9), 1), "time": time.time()}
    append_metrics(run.bucket, rec)
    if run.reporter:  # the same numbers (lists and dicts left out)
        run.reporter.log({k: v for k, v in rec.items() if isinstance(v, (int, float))})
    kl = f" kl {rec['kl']:.4f}" if args.beta > 0 else ""
    lost = f", {rec['groups_dropped_total']} dropped" if dropped else ""
    print(f"step {step} v{version} | reward {rec['reward_mean']:.3f} ± "
          f"{rec['reward_std']:.3f} | groups {len(groups)} ({flat} all-equal{lost}) | stale "
          f"{rec['staleness_mean']:.2f}/{rec['staleness_max']} | loss {rec['loss']:.4f} ratio "
          f"{rec['ratio_mean'] or 1:.4f} (max {rec['ratio_max'] or 1:.2f}) approx_kl "
          f"{rec['approx_kl']:.5f} clip {rec['clip_frac']:.3f}{kl} | sampler |dlogp| "
          f"{rec[LOGP_DIFF + 'mean']:.4f} is_out {rec[IS_RATIO + 'outside_frac']:.3f} | "
          f"gnorm {grad_norm:.3f} | "
          f"wait {rec['wait_s']:.2f}s compute {rec['compute_s']:.2f}s "
          f"{rec['tokens_per_s']:.0f} tok/s")
