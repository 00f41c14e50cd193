"""The race's arithmetic (bench/bench_vs_trl.py): what a checkpoint list says, the statistics over
seeds and problems, and the load other processes put on the machine while a side trains.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_race.py

A checkpoint is {"step", "t", "accuracy", "correct"}: `t` is training seconds since the side's start
(model loads included), `correct` one "0"/"1" per held-out problem, in the task's fixed order.
"""

import itertools
import math
import os
import random
import statistics
import threading
import time


def time_to_target(checkpoints, target):
    """(seconds, step) of the first checkpoint whose accuracy is at least `target`, or None."""
    hit = next((c for c in checkpoints if c["accuracy"] >= target - 1e-9), None)
    return (hit["t"], hit["step"]) if hit else None


def accuracy_at(checkpoints, t, base_accuracy):
    """The accuracy a side had at `t` seconds: its last checkpoint at or before t (the base model's
    before its first)."""
    before = [c for c in checkpoints if c["t"] <= t + 1e-9]
    return before[-1]["accuracy"] if before else base_accuracy


def time_ratio(t_ours, t_trl, trl_end):
    """(ours / TRL's time to the target, qualifier). TRL never reaching it: the ratio is below
    t_ours / trl_end (TRL would need more than its whole run), given as that bound with "<";
    ours never reaching it: inf with ">" (not reached)."""
    if t_ours is None:
        return math.inf, ">"
    if t_trl is None:
        return t_ours / trl_end, "<"
    return t_ours / t_trl, ""


def median(values):
    """The median; inf counts as larger than everything (a side that never reached the target)."""
    return statistics.median(sorted(values))


def bootstrap_median(values, resamples=10000, level=0.95, seed=0):
    """(median, low, high): the percentile bootstrap interval of the median over `values` (one per
    seed), resampled with replacement. With 3 seeds the interval is coarse: it can only be
    bounded by the values themselves."""
    rng, n = random.Random(seed), len(values)
    meds = sorted(median([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    lo = meds[int(math.floor((1 - level) / 2 * (resamples - 1)))]
    hi = meds[int(math.ceil((1 + level) / 2 * (resamples - 1)))]
    return median(values), lo, hi


def bootstrap_difference(a, b, stat=statistics.mean, resamples=10000, level=0.90, seed=0):
    """(stat(a) - stat(b), low, high): the percentile bootstrap interval of the difference, each
    side's runs resampled with replacement on their own (two independent samples: a seed does not
    pair two implementations' runs)."""
    rng = random.Random(seed)
    diffs = sorted(stat([rng.choice(a) for _ in a]) - stat([rng.choice(b) for _ in b])
                   for _ in range(resamples))
    lo = diffs[int(math.floor((1 - level) / 2 * (resamples - 1)))]
    hi = diffs[int(math.ceil((1 + level) / 2 * (resamples - 1)))]
    return stat(a) - stat(b), lo, hi


def mcnemar(correct_a, correct_b):
    """McNemar's exact test on paired outcomes (the same problems, two adapters; "0"/"1" each):
    the problems only A solved and only B solved (mcnemar_counts)."""
    if len(correct_a) != len(correct_b):
        raise ValueError(f"paired test on {len(correct_a)} and {len(correct_b)} problems: "
                         "score both adapters on the same held-out problems")
    return mcnemar_counts(sum(x == "1" and y == "0" for x, y in zip(correct_a, correct_b)),
                          sum(x == "0" and y == "1" for x, y in zip(correct_a, correct_b)))


def mcnemar_counts(only_a, only_b):
    """{"only_a", "only_b", "p"}: p is the two-sided binomial probability of a split of the
    discordant problems at least as uneven as this one if each were a fair coin."""
    n = only_a + only_b
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2 ** n if n else 1.0
    return {"only_a": only_a, "only_b": only_b, "p": min(1.0, 2 * tail)}


def compare(trl, ours, target):
    """One seed's row: each side's time to `target` and final accuracy, their ratio (time_ratio),
    TRL's accuracy when ours ended, and McNemar's test of the two final adapters. trl, ours: runs
    with "checkpoints" (scored), "base_accuracy" and "train_s"."""
    hit_trl, hit_ours = time_to_target(trl["checkpoints"], target), time_to_target(ours["checkpoints"], target)
    t_trl, t_ours = (hit_trl or (None,))[0], (hit_ours or (None,))[0]
    ratio, qualifier = time_ratio(t_ours, t_trl, trl["train_s"])
    last_trl, last_ours = trl["checkpoints"][-1], ours["checkpoints"][-1]
    return {"trl_time_to_target": t_trl, "ours_time_to_target": t_ours,
            "trl_step_to_target": (hit_trl or (None, None))[1], "ours_step_to_target": (hit_ours or (None, None))[1],
            "ratio": ratio, "ratio_qualifier": qualifier,
            "trl_final": last_trl["accuracy"], "ours_final": last_ours["accuracy"],
            "ours_end_t": last_ours["t"],
            "trl_at_ours_end": accuracy_at(trl["checkpoints"], last_ours["t"], trl["base_accuracy"]),
            "paired_final": mcnemar(last_trl["correct"], last_ours["correct"])}


def rank_test(a, b):
    """Exact one-sided rank-sum test (Mann-Whitney) of "a's values are larger than b's", over
    every way to split the pooled values into groups of len(a) and len(b): the share of splits
    whose rank sum for the first group is at least a's (ties: mean ranks). Runs, not problems,
    are the units: it asks whether one side's runs end higher than the other's."""
    pooled = sorted(a + b)
    rank = {x: sum(i + 1 for i, y in enumerate(pooled) if y == x) / pooled.count(x) for x in pooled}
    ranks, mine = [rank[x] for x in a + b], sum(rank[x] for x in a)
    splits = list(itertools.combinations(ranks, len(a)))
    return sum(sum(c) >= mine - 1e-9 for c in splits) / len(splits)


def sign_flip_test(diffs):
    """Exact two-sided paired test of "the mean difference is 0": the share of the 2^n ways to
    flip the differences' signs whose mean is at least as far from 0 as the one measured. For runs
    of one implementation paired by seed (the same prompts, initial LoRA and first batch)."""
    far = abs(sum(diffs)) - 1e-9
    flips = itertools.product((1, -1), repeat=len(diffs))
    return sum(abs(sum(f * d for f, d in zip(fs, diffs))) >= far for fs in flips) / 2 ** len(diffs)


def over_seeds(rows):
    """The race's verdict over seeds: the median ratio of times to the target with its bootstrap
    interval, the median final accuracies, McNemar's test pooled over seeds and problems (these
    adapters), and the rank test over runs (the two sides)."""
    med, lo, hi = bootstrap_median([r["ratio"] for r in rows])
    return {"seeds": len(rows), "median_ratio": med, "ratio_interval": [lo, hi],
            "runs_trl_higher_p": rank_test([r["trl_final"] for r in rows],
                                           [r["ours_final"] for r in rows]),
            "median_trl_final": median([r["trl_final"] for r in rows]),
            "median_ours_final": median([r["ours_final"] for r in rows]),
            "pooled_paired_final": mcnemar_counts(sum(r["paired_final"]["only_a"] for r in rows),
                                                  sum(r["paired_final"]["only_b"] for r in rows))}


# ----------------------------------------------------------------------------- contention

def tree_cpu_ticks(root):
    """CPU clock ticks used by process `root` and its descendants: utime + stime of each, plus
    cutime + cstime (its children that exited and were reaped), read from /proc."""
    stats = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)": state ppid ...
        except OSError:  # gone since listdir
            continue
        stats[int(pid)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
    children = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    todo, ticks = [root], 0
    while todo:
        pid = todo.pop()
        ticks += stats.get(pid, (0, 0))[1]
        todo += children.get(pid, [])
    return ticks


def busy_ticks():
    """Clock ticks all CPUs spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v) - v[3] - v[4]


class ContentionSampler(threading.Thread):
    """Every `interval` s: the cores that processes outside this process's tree kept busy (all busy
    CPU time minus ours, over the interval). samples: [(unix time, cores)]. Without /proc
    (macOS) it records nothing and summary() says so."""

    def __init__(self, interval=1.0):
        super().__init__(daemon=True)
        self.interval, self.samples, self.stop_event = interval, [], threading.Event()
        self.hz, self.root = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100, os.getpid()

    def run(self):
        try:
            last = (time.time(), busy_ticks(), tree_cpu_ticks(self.root))
        except OSError:
            return
        while not self.stop_event.wait(self.interval):
            now = (time.time(), busy_ticks(), tree_cpu_ticks(self.root))
            other = (now[1] - last[1]) - max(0, now[2] - last[2])
            self.samples.append((now[0], max(0.0, other / self.hz / (now[0] - last[0]))))
            last = now

    def stop(self):
        self.stop_event.set()
        self.join()

    def summary(self, start=None, end=None):
        """{"mean", "max", "samples"} of the cores others kept busy within [start, end]."""
        cores = [c for t, c in self.samples if (start is None or t >= start) and (end is None or t <= end)]
        if not cores:
            return {"mean": None, "max": None, "samples": 0}
        return {"mean": round(sum(cores) / len(cores), 2), "max": round(max(cores), 2), "samples": len(cores)}
