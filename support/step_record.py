"""The record of one trainer step: its statistics gathered micro-batch by micro-batch, the
log line, metrics/step-S.json in the bucket, --report-to. Not needed to follow the step.

This module imports no role file.
"""

import collections
import sys
import time

import torch

from support.buckets import append_metrics
from support.group_checks import printable
from support.shared_prompt import by_group

ABSURD_RATIO = 1e3  # no sampler's honest mismatch: a group with a ratio above it is named (dep. 8)


STAT_COLUMNS = ("tokens", "approx_kl", "clipped", "ratio_max")  # grpo_loss.offpolicy_stats, per row


class StepStats:
    """The statistics of one step, gathered micro-batch by micro-batch by
    trainer.compute_loss_and_backward (add), over the forwarded completions (result).
    staleness = version - policy_version (0 if no version)."""

    def __init__(self, seqs, version=None, beta=0.0):
        self.seqs, self.version, self.beta = seqs, version, beta
        self.sums, self.rows, self.row_groups, self.forwarded = {"loss": 0.0}, [], [], 0

    def add(self, idx, mask, loss, stats, per_row):
        """One micro-batch: rows idx, its completion mask (n, C), its weighted loss (a float),
        policy_loss's stats and grpo_loss.offpolicy_stats's per-row columns (STAT_COLUMNS)."""
        self.forwarded += len(by_group(self.seqs, idx))
        self.sums["loss"] += loss
        n = float(mask.sum())  # the stats: token-weighted means over the micro-batches
        for k, v in stats.items():
            self.sums[k] = self.sums.get(k, 0.0) + v * n
        stale = torch.tensor([0 if self.version is None
                              else self.version - self.seqs[i]["policy_version"]
                              for i in idx])  # (n,)
        columns = [stale.to(per_row["tokens"])] + [per_row[k] for k in STAT_COLUMNS]
        self.rows.append(torch.stack(columns, 1).cpu())  # (n, 5)
        self.row_groups += [self.seqs[i]["group"] for i in idx]

    def result(self):
        """A dict: loss, ratio_mean, clip_low_frac, clip_high_frac, kl (beta > 0), ratio_max
        (ratio_mean and ratio_max are None when no group was forwarded: every advantage was 0),
        approx_kl, clip_frac, by_staleness {"0": {"approx_kl", "clip_frac", "tokens"}, ...},
        groups_forwarded, absurd_ratio {group index: its largest ratio} for the groups whose ratio
        exceeds ABSURD_RATIO."""
        table = torch.cat(self.rows) if self.rows else torch.zeros(0, 5)  # (rows, 5)
        stale, tokens, approx_kl, clipped, ratio_max = table.unbind(1)  # each (rows,)

        def summary(sel):  # (rows,) bool -> token-weighted means over the selected rows
            n = tokens[sel].sum()
            return {"approx_kl": (approx_kl[sel].sum() / n.clamp(min=1)).item(),
                    "clip_frac": (clipped[sel].sum() / n.clamp(min=1)).item(), "tokens": int(n)}

        out = {"ratio_mean": None, "clip_low_frac": 0.0, "clip_high_frac": 0.0,
               **({"kl": 0.0} if self.beta else {}),
               **{k: v if k == "loss" else v / max(float(tokens.sum()), 1.0)
                  for k, v in self.sums.items()},
               **summary(stale >= 0), "ratio_max": ratio_max.max().item() if len(stale) else None,
               "by_staleness": {str(int(s)): summary(stale == s) for s in stale.unique().tolist()},
               "groups_forwarded": self.forwarded}
        del out["tokens"]
        absurd = {}  # group index -> its largest ratio, for the groups over ABSURD_RATIO
        for k, r in zip(self.row_groups, ratio_max.tolist()):
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
           "groups_dropped": dropped, "groups_absurd_ratio": len(absurd),
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
    print(f"step {step} v{version} | reward {rec['reward_mean']:.3f} ± "
          f"{rec['reward_std']:.3f} | groups {len(groups)} ({flat} all-equal) | stale "
          f"{rec['staleness_mean']:.2f}/{rec['staleness_max']} | loss {rec['loss']:.4f} ratio "
          f"{rec['ratio_mean'] or 1:.4f} (max {rec['ratio_max'] or 1:.2f}) approx_kl "
          f"{rec['approx_kl']:.5f} clip {rec['clip_frac']:.3f}{kl} | gnorm {grad_norm:.3f} | "
          f"wait {rec['wait_s']:.2f}s compute {rec['compute_s']:.2f}s "
          f"{rec['tokens_per_s']:.0f} tok/s")
