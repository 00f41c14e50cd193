"""Where the sampler's log-probs enter the loss, measured (docs/sampler-mismatch.md): a replica
that samples in bf16 (`rollout.py --engine hf --dtype bfloat16`) against the fp32 trainer, at
max_staleness 0 and 2, under the three losses, over several seeds. A run is one
`bash jobs.sh --local`, or on the toy task the three processes started directly (run_toy:
jobs.sh's two evaluations would score toy's one prompt, 0 or 1, and cost two model loads a
run); this prints Markdown tables of the outcome and the mismatch.

    # the tiny test model on the toy task: 6 settings x 5 seeds + the fp32 reference rows,
    # 25-51 s a run on a shared 2-core machine
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_sampler_mismatch.py \
        --task toy --out runs/mismatch-toy
    # SmolLM2 on arith, jobs.sh's local defaults (30 steps), max_staleness 2 only: 12-15 min a run
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_sampler_mismatch.py \
        --model runs/models/smollm2-135m-instruct --task arith --staleness 2 --no-reference \
        --env EVAL_LIMIT=200 --seeds 0,1,2 --out runs/mismatch-arith
    # the table again, from what --out holds
    .venv/bin/python bench/bench_sampler_mismatch.py --task toy --out runs/mismatch-toy --table-only

The three losses (`--old-logprobs` and TRL's knobs, trainer.py):
  sampler         the sampler is the old policy (today's default; TRL's AsyncGRPOTrainer)
  sequence_mask   the learner is, the completion weighted by w, 0 outside [0, 3] (TRL's default)
  token_truncate  the learner is, each token weighted by min(w, 3)
The reference: a float32 replica with `sampler` (no numerical mismatch: ~1e-6 at k = 0).

Per run: the outcome (jobs.sh's final greedy accuracy, runs/NAME/eval-final.json; on the toy
task the mean reward over the last third of the steps) and the mismatch by staleness over the
run (scripts/report.py's mismatch_by_staleness). Per setting: the median and range over seeds
and the mismatch pooled over them; then each learner mode against `sampler`, and the bf16
replica against the fp32 one, at the same staleness: the runs' rank-sum test
(race_stats.rank_test) and the seeds paired (paired_p). Each run is appended to OUT/runs.jsonl
as it ends: a second call with more seeds runs only the new ones.
"""

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from race_stats import rank_test  # noqa: E402
from scripts.report import mismatch_by_staleness, weight  # noqa: E402
from support.buckets import read_metrics  # noqa: E402
from support.step_record import IS_RATIO, LOGP_DIFF  # noqa: E402  TRL's sampling/* names

MODES = {  # the loss -> TRAINER_ARGS
    "sampler": "--old-logprobs sampler",
    "sequence_mask": "--old-logprobs learner --vllm-importance-sampling-mode sequence_mask",
    "token_truncate": "--old-logprobs learner --vllm-importance-sampling-mode token_truncate",
}
TOY_STEPS = 16  # the toy task on the tiny model (docs/sampler-mismatch.md: 16 steps)


def settings(staleness, modes, reference, dtype="bfloat16"):
    """(replica dtype, max_staleness, mode) to run: dtype (bf16) under every mode, then the fp32
    reference (`sampler`) per staleness."""
    out = [(dtype, s, m) for s in staleness for m in modes]
    return out + ([("float32", s, "sampler") for s in staleness] if reference else [])


def run_name(prefix, setting, seed):
    dtype, staleness, mode = setting
    return f"{prefix}-{dtype[:4]}-s{staleness}-{mode}-seed{seed}"


def last_third(xs):
    k = max(1, len(xs) // 3)
    return sum(xs[-k:]) / len(xs[-k:]) if xs else float("nan")


def run_jobs_sh(a, setting, seed, run, env_extra):
    """One `bash jobs.sh --local` (NAME = run's folder name) -> its exit status."""
    dtype, staleness, mode = setting
    env = dict(os.environ, NAME=os.path.basename(run), MODEL=a.model, TASK=a.task,
               SEED=str(seed), MAX_STALENESS=str(staleness), ENGINE="hf",
               PROXY_PORT=str(a.port), ROLLOUT_ARGS=f"--dtype {dtype}", TRAINER_ARGS=MODES[mode],
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.update(env_extra)  # --env, --steps: over these
    with open(os.path.join(a.out, os.path.basename(run) + ".log"), "w") as log:
        job = subprocess.Popen(["bash", "jobs.sh", "--local"], cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    try:
        return job.wait()
    finally:  # stopped early: TERM, on which jobs.sh stops every process it started
        if job.poll() is None:
            job.terminate()
            job.wait(timeout=60)


def run_toy(a, setting, seed, run, steps):
    """The three roles started directly, as docs/sampler-mismatch.md runs the toy task -> the
    trainer's exit status. The replica and the proxy exit by themselves once the trainer is done;
    after 60 s they are stopped."""
    dtype, staleness, mode = setting
    py, url, bucket = sys.executable, f"http://127.0.0.1:{a.port}", os.path.join(run, "bucket")
    env = dict(os.environ, PROXY_TOKEN=os.urandom(16).hex(), OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.pop("ROLLOUT_TOKEN", None)
    roles = {
        "proxy": ["proxy.py", "--port", str(a.port), "--num-generations", "8",
                  "--groups-per-step", "4", "--max-staleness", str(staleness),
                  "--max-new-tokens", "6"],
        "rollout": ["rollout.py", "--engine", "hf", "--task", "toy", "--model", a.model,
                    "--bucket", bucket, "--proxy", url, "--dtype", dtype, "--seed", str(seed)],
        "trainer": ["trainer.py", "--model", a.model, "--bucket", bucket, "--proxy", url,
                    "--learning-rate", "1e-3", "--lora-r", "8", "--lora-alpha", "16",
                    "--max-steps", str(steps), "--seed", str(seed), *MODES[mode].split()]}
    os.makedirs(run, exist_ok=True)
    procs = {}
    try:
        for role, args in roles.items():
            with open(os.path.join(run, role + ".log"), "w") as log:
                procs[role] = subprocess.Popen([py, *args], cwd=ROOT, env=env, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True)
            if role == "proxy":
                time.sleep(2)  # listening before the others ask
        rc = procs["trainer"].wait(timeout=1800)
        for role in ("rollout", "proxy"):
            procs[role].wait(timeout=60)
        return rc
    finally:  # whatever is still running: its process group, by its id
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 15)
                p.wait()


def run_one(a, setting, seed, env_extra):
    """One run -> its record for runs.jsonl."""
    dtype, staleness, mode = setting
    name = run_name(a.prefix, setting, seed)
    run = os.path.join(ROOT, "runs", name)
    shutil.rmtree(run, ignore_errors=True)  # a left-over bucket would be resumed from
    t0 = time.time()
    if a.task == "toy":
        rc = run_toy(a, setting, seed, run, a.steps or TOY_STEPS)
    else:
        rc = run_jobs_sh(a, setting, seed, run, env_extra)
    metrics = read_metrics(os.path.join(run, "bucket"))
    try:
        with open(os.path.join(run, "eval-final.json")) as f:
            accuracy = json.load(f)["accuracy"]
    except (OSError, ValueError, KeyError):
        accuracy = None
    rewards = [m["reward_mean"] for m in metrics]
    return {"dtype": dtype, "staleness": staleness, "mode": mode, "seed": seed, "rc": rc,
            "name": name, "steps": len(metrics), "wall_s": round(time.time() - t0, 1),
            "accuracy": accuracy, "reward_last_third": last_third(rewards),
            "mismatch": {str(k): v for k, v in mismatch_by_staleness(metrics).items()}}


def train_seconds(record):
    """The run's training wall time (its summary.md, jobs.sh --local's), or None (toy task)."""
    try:
        with open(os.path.join(ROOT, "runs", record["name"], "summary.md")) as f:
            return float(re.search(r"training wall time\s*\|\s*([\d.]+) s", f.read()).group(1))
    except (OSError, AttributeError):
        return None


def outcome(record, task):
    """What a run is judged by: the final accuracy, or on the toy task the late reward."""
    return record["reward_last_third"] if task == "toy" else record["accuracy"]


def finished(record, task):
    """A run counts when it has its outcome. Not its exit status alone: jobs.sh is read by bash as
    it runs, and an edit of the file during a run can fail the lines after the summary."""
    x = outcome(record, task)
    return record["steps"] > 0 and x is not None and x == x  # not NaN


def pooled(by_ks):
    """Several runs' mismatch_by_staleness -> one, as if their steps were one run's: each run's
    sums enter mismatch_by_staleness as one step of its tokens, then the steps are counted."""
    def as_step(a):  # a run's sums at one k, as a step's by_staleness entry
        return {"tokens": a["tokens"], LOGP_DIFF + "mean": a["dlogp_mean"],
                LOGP_DIFF + "max": a["dlogp_max"], IS_RATIO + "min": a["w_min"],
                IS_RATIO + "max": a["w_max"], IS_RATIO + "outside_frac": a["outside_frac"]}
    out = mismatch_by_staleness([{"by_staleness": {k: as_step(a) for k, a in by_k.items()}}
                                 for by_k in by_ks])
    for k, a in out.items():
        a["steps"] = sum(by_k[kk]["steps"] for by_k in by_ks for kk in by_k if int(kk) == k)
    return out


def two_sided(a, b):
    """The exact rank-sum test's two-sided p of "a and b differ" (rank_test is one-sided)."""
    return min(1.0, 2 * min(rank_test(a, b), rank_test(b, a)))


def paired_p(diffs):
    """The exact two-sided sign-flip test of paired differences (one per seed: the same seed
    starts both runs from the same LoRA and the same first samples): the share of the 2^n ways
    to flip their signs whose sum is at least as far from 0. All n of one sign: 2 / 2^n."""
    total = abs(sum(diffs))
    flips = itertools.product((1, -1), repeat=len(diffs))
    sums = [abs(sum(f * d for f, d in zip(fl, diffs))) for fl in flips]
    return sum(x >= total - 1e-12 for x in sums) / len(sums)


def mismatch_cells(by_k):
    """The table's mismatch columns, each "value for k=0 / value for k=1 / ..."."""
    def w(a):
        return "n/a" if a["w_min"] is None else f"{weight(a['w_min'])}..{weight(a['w_max'])}"
    by_k = [dict(a, k=k) for k, a in by_k.items()]
    return [" / ".join(f(a) for a in by_k) for f in (
        lambda a: f"{a['k']}", lambda a: f"{a['steps']}", lambda a: f"{a['dlogp_mean']:.1e}",
        lambda a: f"{a['dlogp_max']:.2g}", w, lambda a: f"{a['outside_frac']:.3f}")]


def train_cell(runs):
    """A setting's training seconds: the median (min..max) over its runs, or "-"."""
    xs = [x for x in map(train_seconds, runs) if x is not None]
    return f"{statistics.median(xs):.0f} ({min(xs):.0f}..{max(xs):.0f})" if xs else "-"


def table(records, task):
    """The Markdown tables: one row per setting (the runs that finished); then each learner mode
    against `sampler`, and the bf16 replica against the fp32 one, at the same staleness."""
    groups = {}
    for r in records:
        if finished(r, task):
            groups.setdefault((r["dtype"], r["staleness"], r["mode"]), []).append(r)
    what = "mean reward, last third of steps" if task == "toy" else "final greedy accuracy"
    lines = [f"| replica | max staleness | loss | seeds | {what}: median (min..max) | run s "
             "| training s | k | steps | `sampling_logp_difference` mean | max | weights `w` | `outside_frac` |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = lambda g: (g[0][1], g[0][0] == "float32", list(MODES).index(g[0][2]))  # noqa: E731
    for (dtype, staleness, mode), rs in sorted(groups.items(), key=order):
        xs = [outcome(r, task) for r in rs]
        seeds = ",".join(str(r["seed"]) for r in rs)
        lines.append(f"| {dtype} | {staleness} | `{mode}` | {seeds} | {statistics.median(xs):.3f} "
                     f"({min(xs):.3f}..{max(xs):.3f}) | "
                     f"{statistics.median(r['wall_s'] for r in rs):.0f} | {train_cell(rs)} | "
                     + " | ".join(mismatch_cells(pooled([r["mismatch"] for r in rs]))) + " |")
    lines += ["", f"Against a baseline at the same staleness ({what}): each learner mode against"
              " `sampler`, the bf16 replica against the fp32 one; the runs' rank-sum test"
              " (race_stats.rank_test, two-sided, exact) and the seeds paired (paired_p):", "",
              "| max staleness | setting | baseline | medians | rank-sum p "
              "| seeds higher / lower | paired p |", "|---|---|---|---|---|---|---|"]
    pairs = [((d, s, m), (d, s, "sampler")) for d, s, m in groups if m != "sampler"]
    pairs += [(("bfloat16", s, "sampler"), ("float32", s, "sampler")) for d, s, m in groups
              if d == "float32" and ("bfloat16", s, "sampler") in groups]
    for one, base in sorted(pairs, key=lambda p: (p[0][1], p[1][0], p[0][2])):
        if base not in groups:
            continue
        a, b = [outcome(r, task) for r in groups[one]], [outcome(r, task) for r in groups[base]]
        by_seed = {r["seed"]: outcome(r, task) for r in groups[base]}
        diffs = [outcome(r, task) - by_seed[r["seed"]] for r in groups[one] if r["seed"] in by_seed]
        lines.append(f"| {one[1]} | {one[0]} `{one[2]}` | {base[0]} `{base[2]}` | "
                     f"{statistics.median(a):.3f} vs {statistics.median(b):.3f} | "
                     f"{two_sided(a, b):.2f} | {sum(d > 0 for d in diffs)} / "
                     f"{sum(d < 0 for d in diffs)} | {paired_p(diffs):.3f} |")
    return "\n".join(lines)


def load(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model folder (default: the tiny test model, built in OUT)")
    p.add_argument("--task", default="toy", help="toy, arith, gsm8k or math (jobs.sh's TASK)")
    p.add_argument("--steps", type=int, help="STEPS (default: 16 on toy, jobs.sh's 30 otherwise)")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated SEED values")
    p.add_argument("--staleness", default="0,2", help="comma-separated MAX_STALENESS values")
    p.add_argument("--modes", default=",".join(MODES), help=f"some of {', '.join(MODES)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the replica's dtype under every mode (float32: jobs.sh --local's own)")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="leave out the float32-replica `sampler` rows")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="another jobs.sh setting for every run, e.g. EVAL_LIMIT=200 (repeatable)")
    p.add_argument("--out", required=True, help="a folder: runs.jsonl")
    p.add_argument("--prefix", default="mismatch", help="run NAMEs: PREFIX-dtype-sS-mode-seedN")
    p.add_argument("--port", type=int, default=8200, help="PROXY_PORT (never 8000: taken)")
    p.add_argument("--table-only", action="store_true",
                   help="print OUT/runs.jsonl's table, run nothing")
    a = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the runners' finally: stop the run
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "runs.jsonl")
    if not a.table_only:
        if a.model is None:
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            import tiny_model
            a.model = tiny_model.build(os.path.abspath(os.path.join(a.out, "tiny-model")))
        env_extra = dict(kv.split("=", 1) for kv in a.env)  # jobs.sh's settings (not on toy)
        if a.steps:
            env_extra["STEPS"] = str(a.steps)
        done = {(r["dtype"], r["staleness"], r["mode"], r["seed"])
                for r in load(path) if finished(r, a.task)}
        todo = settings([int(s) for s in a.staleness.split(",")], a.modes.split(","),
                        a.reference and a.dtype != "float32", a.dtype)
        for seed in [int(s) for s in a.seeds.split(",")]:  # seed-major: a cut run has matched seeds
            for setting in todo:
                if (*setting, seed) in done:
                    continue
                r = run_one(a, setting, seed, env_extra)
                print(f"{r['name']}: rc {r['rc']}, {r['steps']} steps, accuracy {r['accuracy']}, "
                      f"late reward {r['reward_last_third']:.3f}, {r['wall_s']:.0f} s", flush=True)
                with open(path, "a") as f:
                    f.write(json.dumps(r) + "\n")
    print(table(load(path), a.task))


if __name__ == "__main__":
    main()
