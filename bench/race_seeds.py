"""Final held-out accuracy over many seeds, each side on its own, resumable (docs/race.md).

    # TRL 1.16's GRPOTrainer at the race's settings, one seed after another (10-30 min a seed):
    .venv/bin/python bench/race_seeds.py trl --seeds 5 6 7 --out /root/race-runs/trl
    # the table of every seed kept in docs/race-seeds/ (and any other folder given)
    .venv/bin/python bench/race_seeds.py table docs/race-seeds

`trl` runs bench_vs_trl.py's TRL side (run_trl: the same script, config and venv; 2 threads and
glibc's malloc kept, as the probe chose in docs/race.md's result; only the last checkpoint kept),
scores its final adapter with `rollout.py --eval` on all held-out problems (bench_vs_trl.evaluate,
the command jobs.sh uses), and writes OUT/trl-seedS.json: the accuracy, one "0"/"1" a problem, the
per-step rewards, the training time, the commit and the machine. A seed whose file exists is
skipped, and a seed stopped mid-run resumes from its newest checkpoint (every --save-every steps,
with AdamW's state, the schedule and the RNGs), so a second call continues where a first stopped.

Ours' seeds come from bench/bench_sampler_mismatch.py (its runs.jsonl, one record a run):
at TRL's settings `--staleness 0 --env ZERO_VARIANCE=keep --prefix gap`, at the local defaults
`--staleness 2 --prefix local`, both `--dtype float32 --modes sampler`.

`table` reads every *.json (one record or a list: {"side", "seed", "accuracy", ...}) and *.jsonl
(bench_sampler_mismatch records; the side is the file's name without .jsonl) in the folders given,
and prints each side's seeds, then each of ours' settings against TRL: medians, means, the
difference of each with a 90% percentile-bootstrap interval (each side's runs resampled on their
own: a seed does not pair two implementations), and the exact one-sided rank-sum test of "TRL's
runs end above ours" (race_stats); then ours' settings against each other, paired by seed (the
same prompts, initial LoRA and first batch): the mean difference and an exact sign-flip test.
"""

import argparse
import glob
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_vs_trl  # noqa: E402
import race_stats  # noqa: E402

SIDES = {"trl": "TRL `GRPOTrainer`", "ours-trl-settings": "ours, `MAX_STALENESS=0`, `keep`",
         "ours-defaults": "ours, local defaults (`MAX_STALENESS=2`, `sampler`)",
         "ours-defaults-50-steps": "ours, local defaults, `STEPS=50` (the synchronous 30's time)",
         "ours-trainer-transformers-sampling": "ours' trainer, transformers' sampling (swap)"}


def machine():
    """The CPU's model name and its count of cores, from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"{len(names) or os.cpu_count()} x {names[0] if names else platform.processor()}"


def commit(given):
    if given:
        return given
    done = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True)
    return done.stdout.strip() or None


def run_trl_seeds(a):
    settings = bench_vs_trl.jobs_defaults()
    steps = a.steps or int(settings["STEPS"])
    ns = argparse.Namespace(trl_venv=a.trl_venv, model=os.path.abspath(a.model), steps=steps,
                            eval_every=a.save_every, trl_threads=a.trl_threads,
                            trl_malloc=a.trl_malloc, eval_limit=0, resume=True)
    bench_vs_trl.ensure_model(ns.model)
    os.makedirs(a.out, exist_ok=True)
    for seed in a.seeds:
        path = os.path.join(a.out, f"trl-seed{seed}.json")
        if os.path.exists(path):
            bench_vs_trl.log(f"seed {seed}: {path} is there, skipped")
            continue
        seeded = dict(settings, SEED=str(seed))
        work = os.path.join(a.out, f"seed-{seed}")
        run = bench_vs_trl.run_trl(ns, seeded, work)
        final = run["checkpoints"][-1]
        result = bench_vs_trl.evaluate(ns, seeded, run["bucket"], final["version"],
                                       os.path.join(work, "eval-final.json"))
        record = {"side": "trl", "seed": seed, "accuracy": result["accuracy"], "n": result["n"],
                  "correct": bench_vs_trl.scored(result)["correct"], "steps": steps,
                  "train_s": round(run["train_s"], 1), "attempts": attempts(work),
                  "threads": ns.trl_threads,
                  "malloc": ns.trl_malloc, "contention": run["contention"],
                  "rewards": [round(c["reward"], 4) for c in run["curve"]],
                  "commit": commit(a.commit), "machine": machine()}
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
        bench_vs_trl.log(f"seed {seed}: TRL {100 * record['accuracy']:.1f}% after "
                         f"{record['train_s']:.0f} s of training -> {path}")


def attempts(work):
    """How many processes trained this seed (each resumed from the last one's checkpoint):
    train_s is the last one's."""
    with open(os.path.join(work, "trl", "steps.jsonl")) as f:
        return sum(json.loads(line)["event"] == "train_begin" for line in f)


def load_records(folders):
    """{side: {seed: accuracy}} from the folders' *.json and *.jsonl files (a later file's seed
    replaces an earlier one's; bench_sampler_mismatch's unfinished runs are left out)."""
    out = {}
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
            with open(path) as f:
                recs = json.load(f)
            for r in recs if isinstance(recs, list) else [recs]:
                out.setdefault(r["side"], {})[r["seed"]] = r["accuracy"]
        for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
            side = os.path.basename(path)[:-len(".jsonl")]
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    if r.get("rc") == 0 and r.get("accuracy") is not None:
                        out.setdefault(side, {})[r["seed"]] = r["accuracy"]
    return out


def table(records):
    """Markdown: each side's seeds, then each of ours' settings against TRL."""
    seeds = sorted({s for runs in records.values() for s in runs})
    sides = [k for k in SIDES if k in records] + sorted(set(records) - set(SIDES))
    head = ["side", *map(str, seeds), "seeds", "median", "mean"]
    rows = []
    for side in sides:
        acc = records[side]
        vals = list(acc.values())
        rows.append([SIDES.get(side, side), *(f"{100 * acc[s]:.1f}" if s in acc else "-"
                                               for s in seeds),
                     str(len(vals)), f"{100 * statistics.median(vals):.1f}",
                     f"{100 * statistics.mean(vals):.1f}"])
    lines = [bench_vs_trl.markdown(head, rows), ""]
    if "trl" not in records:
        return "\n".join(lines)
    trl = list(records["trl"].values())
    head = ["TRL - ours", "runs a side", "difference of medians [90% interval]",
            "difference of means [90% interval]", "rank-sum p (TRL's above)"]
    rows = []
    for side in sides:
        if side == "trl":
            continue
        ours = list(records[side].values())
        cells = []
        for stat in (statistics.median, statistics.mean):
            d, lo, hi = race_stats.bootstrap_difference(trl, ours, stat)
            cells.append(f"{100 * d:+.1f} [{100 * lo:+.1f} .. {100 * hi:+.1f}] points")
        rows.append([SIDES.get(side, side), f"{len(trl)} / {len(ours)}", *cells,
                     f"{race_stats.rank_test(trl, ours):.2f}"])
    lines.append(bench_vs_trl.markdown(head, rows))
    ours = [k for k in sides if k != "trl"]
    pairs = [(a, b) for i, a in enumerate(ours) for b in ours[i + 1:]
             if len(set(records[a]) & set(records[b])) > 1]
    if pairs:  # one implementation at two settings: a seed pairs them (prompts, LoRA, 1st batch)
        head = ["the same seeds, ours at two settings", "seeds", "mean difference (SE)",
                "the first higher at", "sign-flip p (two-sided)"]
        rows = []
        for a, b in pairs:
            d = [records[a][k] - records[b][k] for k in sorted(set(records[a]) & set(records[b]))]
            se = statistics.stdev(d) / len(d) ** 0.5
            rows.append([f"{SIDES.get(a, a)} - {SIDES.get(b, b)}", str(len(d)),
                         f"{100 * statistics.mean(d):+.1f} ({100 * se:.1f}) points",
                         f"{sum(x > 0 for x in d)} of {len(d)}",
                         f"{race_stats.sign_flip_test(d):.3f}"])
        lines += ["", bench_vs_trl.markdown(head, rows)]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trl", help="TRL's runs, one a seed, each scored on all held-out problems")
    t.add_argument("--seeds", type=int, nargs="+", required=True)
    t.add_argument("--out", required=True, help="a folder: trl-seedS.json, seed-S/ (logs, adapter)")
    t.add_argument("--steps", type=int, help="training steps (default: jobs.sh's STEPS)")
    t.add_argument("--model", default=bench_vs_trl.SMOLLM2)
    t.add_argument("--trl-venv", default=os.path.join(ROOT, "runs/.venv-trl"))
    t.add_argument("--trl-threads", type=int, default=2)
    t.add_argument("--trl-malloc", choices=("glibc", "kept"), default="kept")
    t.add_argument("--save-every", type=int, default=5,
                   help="TRL's checkpoints (whole: a stopped seed resumes from the newest)")
    t.add_argument("--commit", help="the commit the code is from (default: git's HEAD of ROOT)")
    s = sub.add_parser("table", help="the table of the seeds in the folders given")
    s.add_argument("folders", nargs="+")
    a = p.parse_args(argv)
    if a.cmd == "trl":
        run_trl_seeds(a)
    else:
        print(table(load_records(a.folders)))


if __name__ == "__main__":
    main()
