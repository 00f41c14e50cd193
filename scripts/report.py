"""The before/after table that `jobs.sh --local` prints at the end of a run.

    python scripts/report.py runs/NAME [--bucket B] [--train-seconds S] [--wall-seconds S]

Reads what the run left behind: runs/NAME/eval-base.json and eval-final.json (from
`rollout.py --eval`), runs/NAME/stats.json (the proxy's /stats at the end of training) and the
bucket's metrics (buckets.read_metrics: one object per trainer step). Prints a Markdown table and the reward
curve as a one-line sparkline.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sync  # noqa: E402
from support import buckets

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

    def pct(e):
        return f"{100 * e['accuracy']:.1f}% ({e.get('correct', '?')}/{e.get('n', '?')})" if "accuracy" in e else "n/a"

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
    width = max(len(r[0]) for r in rows)
    print(f"| {'':{width}} | {'value':<24} |")
    print(f"|{'-' * (width + 2)}|{'-' * 26}|")
    for k, v in rows:
        print(f"| {k:{width}} | {v:<24} |")
    print(f"\nreward per step {sparkline(rewards)}  ({min(rewards, default=0):.2f} .. {max(rewards, default=0):.2f})")


if __name__ == "__main__":
    main()
