"""The before/after table that `jobs.sh --local` prints at the end of a run.

    python scripts/report.py runs/NAME [--bucket B] [--train-seconds S] [--wall-seconds S]

Reads what the run left behind: runs/NAME/eval-base.json and eval-final.json (from
`rollout.py --eval`), runs/NAME/stats.json (the proxy's /stats at the end of training) and the
bucket's metrics (buckets.read_metrics: one object per trainer step). Prints a Markdown table (the
greedy accuracy before and after, or the mean reward where a task's rewards are not all 0 or 1), the
reward curve as a one-line sparkline, and the sampler/learner mismatch by staleness over the run
(mismatch_by_staleness; what the numbers mean: docs/sampler-mismatch.md).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sync  # noqa: E402
from support import buckets  # noqa: E402
from support.step_record import IS_RATIO, LOGP_DIFF  # noqa: E402  TRL's sampling/* names

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values, width=60):
    """Values squeezed into `width` buckets (means), drawn with eight bar heights."""
    if not values:
        return ""
    step = max(1, -(-len(values) // width))  # ceil
    means = [sum(values[i:i + step]) / len(values[i:i + step]) for i in range(0, len(values), step)]
    lo, hi = min(means), max(means)
    span = (hi - lo) or 1.0
    return "".join(BARS[min(len(BARS) - 1, int((v - lo) / span * len(BARS)))] for v in means)


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def mismatch_by_staleness(metrics):
    """The steps' `by_staleness` records summed over a run -> {k: {"steps", "tokens", "dlogp_mean",
    "dlogp_max", "w_min", "w_max", "outside_frac"}} for each staleness k seen, k ascending.
    dlogp_mean and outside_frac are the steps' values weighted by their tokens (outside_frac is
    over tokens or completions as the mode counts its weights: weighted by tokens, it is an
    approximation for a sequence_* mode); dlogp_max, w_min and w_max are the extremes over the
    steps."""
    out = {}
    for m in metrics:
        for k, s in (m.get("by_staleness") or {}).items():
            a = out.setdefault(int(k), {"steps": 0, "tokens": 0, "dlogp_mean": 0.0,
                                        "dlogp_max": 0.0, "w_min": None, "w_max": None,
                                        "outside_frac": 0.0})
            n = s.get("tokens", 0)
            a["steps"] += 1
            a["tokens"] += n
            a["dlogp_mean"] += n * s[LOGP_DIFF + "mean"]  # a sum until divided below
            a["outside_frac"] += n * s[IS_RATIO + "outside_frac"]
            a["dlogp_max"] = max(a["dlogp_max"], s[LOGP_DIFF + "max"])
            if n:  # a step whose rows had no weight reports 0 for both extremes
                lo, hi = s[IS_RATIO + "min"], s[IS_RATIO + "max"]
                a["w_min"] = lo if a["w_min"] is None else min(a["w_min"], lo)
                a["w_max"] = hi if a["w_max"] is None else max(a["w_max"], hi)
    for a in out.values():
        a["dlogp_mean"] /= max(a["tokens"], 1)
        a["outside_frac"] /= max(a["tokens"], 1)
    return dict(sorted(out.items()))


def weight(w):
    """A weight as 1.000, or 2.3e-05 when it would print as 0.000 (a completion far off)."""
    return f"{w:.1e}" if 0 < w < 5e-4 else f"{w:.3f}"


def mismatch_lines(by_k):
    """mismatch_by_staleness's result as a few readable lines (none when no step recorded it)."""
    if not by_k:
        return []
    lines = ["sampler/learner mismatch by staleness k, summed over the run's steps: |logp -",
             "logp_sampler| per token, weights w (0 where a *_mask mode masked one), outside",
             "[clip_min, clip_max] (docs/sampler-mismatch.md)",
             f"  {'k':>2} {'steps':>6} {'tokens':>8} {'|dlogp| mean':>13} {'max':>9}"
             f"  {'w min..max':<15} {'outside':>7}"]
    for k, a in by_k.items():
        w = "n/a" if a["w_min"] is None else f"{weight(a['w_min'])}..{weight(a['w_max'])}"
        lines.append(f"  {k:>2} {a['steps']:>6} {a['tokens']:>8} {a['dlogp_mean']:>13.2e}"
                     f" {a['dlogp_max']:>9.2e}  {w:<15} {a['outside_frac']:>7.3f}")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="runs/NAME, as written by jobs.sh --local")
    p.add_argument("--bucket", help="the run's bucket (default RUN_DIR/bucket)")
    p.add_argument("--train-seconds", type=float, help="seconds from trainer start to its exit")
    p.add_argument("--wall-seconds", type=float, help="seconds for the whole jobs.sh run")
    a = p.parse_args()

    base = load_json(os.path.join(a.run_dir, "eval-base.json"))
    final = load_json(os.path.join(a.run_dir, "eval-final.json"))
    stats = load_json(os.path.join(a.run_dir, "stats.json"))
    metrics = buckets.read_metrics(a.bucket or os.path.join(a.run_dir, "bucket"))
    rewards = [m["reward_mean"] for m in metrics if "reward_mean" in m]
    stale = [m["staleness_mean"] for m in metrics if m.get("staleness_mean") is not None]
    versions = sync.latest_version(a.bucket or os.path.join(a.run_dir, "bucket"))

    def pct(e):  # an accuracy where every reward is 0 or 1 (support/evaluate.py), else the mean
        if "accuracy" in e:
            return f"{100 * e['accuracy']:.1f}% ({e.get('correct', '?')}/{e.get('n', '?')})"
        return f"mean reward {e['mean_reward']:.3f} ({e.get('n', '?')})" if "mean_reward" in e \
            else "n/a"

    def third(xs, which):
        k = max(1, len(xs) // 3)
        part = xs[:k] if which == "first" else xs[-k:]
        return sum(part) / len(part) if part else float("nan")

    rows = [
        ("greedy accuracy, base model", pct(base)),
        ("greedy accuracy, final adapter", pct(final)),
        ("trainer steps", str(metrics[-1]["step"] if metrics else 0)),
        ("adapter versions published", str(versions + 1 if versions is not None else 0)),
        ("mean reward, first third -> last third", f"{third(rewards, 'first'):.3f} -> {third(rewards, 'last'):.3f}"),
        ("mean staleness of groups used", f"{sum(stale) / len(stale):.2f}" if stale else "n/a"),
        ("groups accepted / delivered / dropped stale",
         f"{stats.get('accepted', '?')} / {stats.get('delivered', '?')} / {stats.get('dropped_stale', '?')}"),
    ]
    if a.train_seconds is not None:
        rows.append(("training wall time", f"{a.train_seconds:.0f} s"))
    if a.wall_seconds is not None:
        rows.append(("whole run wall time (setup, evals, training)", f"{a.wall_seconds:.0f} s"))
    width, vw = max(len(r[0]) for r in rows), max(24, *(len(r[1]) for r in rows))
    print(f"| {'':{width}} | {'value':<{vw}} |")
    print(f"|{'-' * (width + 2)}|{'-' * (vw + 2)}|")
    for k, v in rows:
        print(f"| {k:{width}} | {v:<{vw}} |")
    print(f"\nreward per step {sparkline(rewards)}  ({min(rewards, default=0):.2f} .. {max(rewards, default=0):.2f})")
    lines = mismatch_lines(mismatch_by_staleness(metrics))
    if lines:
        print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
