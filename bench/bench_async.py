"""Benchmark: the async speed-up, side by side: one workload with --max-staleness 0 (synchronous
GRPO, the replica waits for every new adapter) and with --max-staleness 2.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_async.py                    # tiny model: ~3 min
    .venv/bin/python bench/bench_async.py --steps 30 --staleness 0 1 2 4
    .venv/bin/python bench/bench_async.py --replicas 2 --staleness 2 --max-new-tokens 16   # the proxy feeds 2
    .venv/bin/python bench/bench_async.py --code /tmp/before                   # another checkout's role files

Each run starts `python proxy.py` (the run's settings), --replicas `rollout.py --engine hf` replicas
and `trainer.py` as subprocesses (one thread each: on a 2-core machine, 1 replica + 1 trainer is the
fair setup) on a directory bucket, lets the trainer take --warmup + --steps steps, and measures the
last --steps:

  wall          seconds for those steps (the step records' "time" of the last one minus the warm-up's last)
  trainer idle  the trainer's wait_s (blocked on GET /batch) summed over the steps / wall
  replica idle  1 - seconds generating / wall / replicas (generation seconds from the replicas' batch
                lines; "wasted" is generation whose groups arrived stale)
  T_gen         generation seconds per trainer step's worth of groups, per replica
  T_train       trainer seconds per step without its wait (forward/backward, optimizer, publish, metrics)
  groups        generated = accepted by the proxy, used = delivered to the trainer, dropped = stale
  staleness     mean trainer_version - policy_version of the groups the measured steps got

The bound an overlap of the two roles allows is (T_gen + T_train) / max(T_gen, T_train), with the
per-step times of the synchronous run (where each role has its core to itself). Every process
line is kept with the time it arrived, in --out/<run>/<role>.log.
"""

import argparse
import ast
import contextlib
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from support import buckets
from conftest import free_port, wait_port  # noqa: E402

BATCH = re.compile(r"\] batch \d+ v(\d+) \(trainer v\d+\) \d+ groups [\d.]+ groups/s .*accepted (\d+) stale (\d+)"
                   r" gen ([\d.]+)s")
LOADED = re.compile(r"adapter v(\d+) loaded \(pull ([\d.]+)s, load ([\d.]+)s")
STEP = re.compile(r"^step (\d+) v\d+ \|")
PUBLISHED = re.compile(r"^published v(\d+) at step (\d+)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="base model folder (default: the tiny test model, built into --out)")
    p.add_argument("--task", default="toy", help="rollout.py --task (toy for the tiny model, arith for SmolLM2)")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 2], help="--max-staleness of each run; the first "
                   "is the baseline of the speed-up")
    p.add_argument("--steps", type=int, default=20, help="trainer steps measured per run")
    p.add_argument("--warmup", type=int, default=3, help="trainer steps before the measured ones (model loads)")
    p.add_argument("--num-generations", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--groups", type=int, default=8, help="groups per trainer step (the proxy's --groups-per-step)")
    p.add_argument("--replicas", type=int, default=1, help="rollout.py replicas (the proxy shares each step among them)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="replica --max-new-tokens = trainer "
                   "--max-completion-length; sets T_gen against T_train")
    p.add_argument("--learning-rate", type=float, default=1e-5, help="small, so that the workload (completion "
                   "lengths, skipped groups) stays the same through the runs")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (alpha = 2 r)")
    p.add_argument("--poll-interval", type=float, help="the replica's --poll-interval (default: rollout.py's)")
    p.add_argument("--code", default=ROOT, help="folder holding the proxy.py, rollout.py and trainer.py to run")
    p.add_argument("--out", default="/tmp/bench_async", help="work folder: model, buckets, logs (emptied first)")
    return p.parse_args(argv)


class Role:
    """One role as a subprocess; each line of its stdout + stderr kept with the time it arrived."""

    def __init__(self, name, cmd, env, log_dir, cwd, cpus=None):
        self.name, self.lines = name, []  # [(unix time, line)]
        self.log = open(os.path.join(log_dir, f"{name}.log"), "w")
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None  # cpus: the cores it may use
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=cwd, bufsize=1, preexec_fn=pin)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            t = time.time()
            self.lines.append((t, line.rstrip("\n")))
            self.log.write(f"{t:.3f} {line}")
            self.log.flush()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(5)
        self.log.close()

    def tail(self, n=15):
        return "\n".join(line for _, line in self.lines[-n:])


def cpu_seconds(extra_pids=()):
    """(CPU seconds all CPUs spent busy, CPU seconds of this process + its reaped children + extra_pids).
    Their difference over a run is what other processes took: the load that disturbs a measurement."""
    ticks = os.sysconf("SC_CLK_TCK")
    v = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    busy = (sum(v) - v[3] - v[4]) / ticks  # all but idle and iowait
    own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    for pid in extra_pids:  # e.g. a moto_server still running
        with contextlib.suppress(OSError):
            own += sum(int(x) for x in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[11:13]) / ticks
    return busy, own


def role_env(extra=None):
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(extra or {})}


def run_system(opts, staleness, bucket, log_dir, env=None, own_pids=(), replica=None, during=None,
               trainer_cpus=None):
    """One run of proxy + replica + trainer; returns what the summaries need. own_pids: helper
    processes (an S3 server) whose CPU is not counted as other load. replica(i): (argv prefix, env)
    of replica i (default: rollout.py as it is); during(url, start_replica, replicas, trainer): in
    a thread while the trainer runs (bench_pool.py kills and restarts replicas with it), with url.
    trainer_cpus: the cores the trainer is pinned to (default: any)."""
    os.makedirs(log_dir, exist_ok=True)
    py, code, port = sys.executable, os.path.abspath(opts.code), free_port()
    url, env, total = f"http://127.0.0.1:{port}", role_env(env), opts.warmup + opts.steps
    G, P, L = str(opts.num_generations), str(opts.groups), str(opts.max_new_tokens)
    load_before, cpu_before, start = open("/proc/loadavg").read().split()[0], cpu_seconds(own_pids), time.time()
    roles = [Role("proxy", [py, f"{code}/proxy.py", "--port", str(port), "--max-staleness", str(staleness),
                            "--num-generations", G, "--groups-per-step", P, "--max-new-tokens", L], env, log_dir, code)]
    try:
        wait_port(port)
        poll = ["--poll-interval", str(opts.poll_interval)] if opts.poll_interval is not None else []
        replicas = []

        def start_replica(i):  # a restarted replica gets its own log, the same worker name
            prefix, extra = replica(i) if replica else ([py, f"{code}/rollout.py"], {})
            n = sum(r.name.split(".")[0] == f"replica-{i}" for r in replicas)
            name = f"replica-{i}" + (f".{n}" if n else "")
            replicas.append(Role(name, [*prefix, "--engine", "hf", "--task", opts.task, "--model", opts.model,
                                        "--bucket", bucket, "--proxy", url, "--replica-id", str(i),
                                        "--num-replicas", str(opts.replicas), "--seed", "0", "--cache-dir",
                                        os.path.join(log_dir, f"cache-{i}"), *poll], {**env, **extra},
                                 log_dir, code))
            roles.append(replicas[-1])
            return replicas[-1]

        for i in range(opts.replicas):
            start_replica(i)
        trainer = Role("trainer", [py, f"{code}/trainer.py", "--model", opts.model, "--bucket", bucket, "--proxy", url,
                                   "--learning-rate", str(opts.learning_rate), "--lora-r", str(opts.lora_r),
                                   "--lora-alpha", str(2 * opts.lora_r), "--max-steps", str(total), "--save-every",
                                   str(total), "--wait-timeout", "600"], env, log_dir, code, trainer_cpus)
        roles.append(trainer)
        if during:
            threading.Thread(target=during, args=(url, start_replica, replicas, trainer), daemon=True).start()
        if trainer.proc.wait(timeout=1800) != 0:
            sys.exit(f"bench: trainer failed (S={staleness}):\n{trainer.tail()}\nreplica-0:\n{replicas[0].tail()}")
        roles[0].proc.wait(timeout=120)  # the run ends by itself: the proxy exits once the replicas were told
        stats = ast.literal_eval(next(line for _, line in roles[0].lines if "proxy: stopped: " in line)
                                 .split("proxy: stopped: ", 1)[1])  # its final counters
    finally:
        for r in reversed(roles):
            r.stop()
    busy, own = (b - a for a, b in zip(cpu_before, cpu_seconds(own_pids)))
    metrics = buckets.read_metrics(bucket)
    batches = [{"t": t, "version": int(m.group(1)), "accepted": int(m.group(2)), "stale": int(m.group(3)),
                "gen_s": float(m.group(4)), "replica": r.name.split(".")[0]}
               for r in replicas for t, line in r.lines if (m := BATCH.search(line))]
    return {"staleness": staleness, "metrics": metrics, "stats": stats, "batches": batches,
            "replicas": opts.replicas, "trainer": trainer.lines,
            "other_cpu": max(0.0, busy - own) / (time.time() - start),
            "load": (load_before, open("/proc/loadavg").read().split()[0])}


def summarize(run, warmup, steps, num_generations=8):
    """The measured window: steps warmup+1 .. warmup+steps."""
    m = {r["step"]: r for r in run["metrics"]}
    lo, hi = warmup, warmup + steps
    train = [m[k]["time"] - m[k - 1]["time"] - m[k]["wait_s"] for k in range(lo + 1, hi + 1)]  # no wait
    t0, t1 = m[lo]["time"], m[hi]["time"]
    win = [m[k] for k in range(lo + 1, hi + 1)]
    wall = t1 - t0
    batches = [b for b in run["batches"] if t0 < b["t"] <= t1]
    gen = sum(b["gen_s"] for b in batches)
    wasted = sum(b["gen_s"] * b["stale"] / max(1, b["accepted"]) for b in batches)
    consumed = [r["groups"] for r in win]
    gen_per_group = gen / max(1, sum(b["accepted"] for b in batches))  # a batch can be a top-up of a few groups
    s = run["stats"]
    return {"S": run["staleness"], "wall": wall, "step_s": wall / steps,
            "trainer_idle": sum(r["wait_s"] for r in win) / wall,
            "replica_idle": 1 - gen / (wall * run["replicas"]), "replica_wasted": wasted / (wall * run["replicas"]),
            "T_gen": gen_per_group * statistics.mean(consumed) / run["replicas"],
            "T_train": statistics.mean(train),
            "staleness": sum(r["staleness_mean"] * c for r, c in zip(win, consumed)) / sum(consumed),
            "zero_variance": sum(r["groups_zero_variance"] for r in win), "consumed": sum(consumed),
            "generated": s["accepted"], "used": s["delivered"], "dropped": s["dropped_stale"],
            "tokens": sum(r["tokens"] for r in win) / max(1, num_generations * sum(consumed)),
            "load": run["load"], "other_cpu": run["other_cpu"]}


def print_table(rows, opts):
    base = rows[0]
    cols = [f"S={r['S']}{' (sync)' if r['S'] == 0 else ''}" for r in rows]
    lines = [f"{'':<38}" + "".join(f"{c:>16}" for c in cols)]

    def row(label, fmt, key):
        lines.append(f"{label:<38}" + "".join(f"{fmt(r[key] if key else r):>16}" for r in rows))

    row(f"wall for {opts.steps} steps (s)", lambda v: f"{v:.1f}", "wall")
    row("seconds per step", lambda v: f"{v:.3f}", "step_s")
    row("trainer idle (wait_s / wall)", lambda v: f"{v:.1%}", "trainer_idle")
    row("replica idle (1 - gen / wall / N)", lambda v: f"{v:.1%}", "replica_idle")
    row("replica making groups stale on arrival", lambda v: f"{v:.1%}", "replica_wasted")
    row("T_gen per step (s)", lambda v: f"{v:.3f}", "T_gen")
    row("T_train per step (s)", lambda v: f"{v:.3f}", "T_train")
    row("groups generated/used/dropped", lambda r: f"{r['generated']}/{r['used']}/{r['dropped']}", None)
    row("groups with equal rewards / used", lambda r: f"{r['zero_variance']}/{r['consumed']}", None)
    row("mean staleness", lambda v: f"{v:.2f}", "staleness")
    row("mean completion tokens", lambda v: f"{v:.1f}", "tokens")
    row("load average before/after", lambda v: f"{v[0]}/{v[1]}", "load")
    row("CPU taken by other processes", lambda v: f"{v:.2f} cores", "other_cpu")
    row("speed-up vs the first column", lambda r: f"{base['wall'] / r['wall']:.2f}x", None)
    print("\n".join(lines))
    tg, tt = base["T_gen"], base["T_train"]
    bound = (tg + tt) / max(tg, tt)
    print(f"\nbound of a two-role overlap, from the S={base['S']} run's T_gen {tg:.3f}s and T_train {tt:.3f}s: "
          f"(T_gen + T_train) / max = {bound:.2f}x")
    for r in rows[1:]:
        speedup = base["wall"] / r["wall"]
        print(f"S={r['S']}: speed-up {speedup:.2f}x = {speedup / bound:.0%} of the bound; its {r['step_s']:.3f} s/step "
              f"against max(T_gen, T_train) = {max(tg, tt):.3f} s ({max(tg, tt) / r['step_s']:.0%})")


def fresh_out(opts):
    """Empty the work folder --out; build the tiny test model there unless --model names one."""
    shutil.rmtree(opts.out, ignore_errors=True)
    os.makedirs(opts.out)
    if not opts.model:
        import tiny_model

        opts.model = tiny_model.build(os.path.join(opts.out, "tiny"))


def main():
    opts = parse_args()
    fresh_out(opts)
    print(f"workload: {opts.model}, task {opts.task}, G={opts.num_generations}, {opts.groups} groups per trainer "
          f"step, --max-new-tokens {opts.max_new_tokens}, lr {opts.learning_rate}, LoRA r {opts.lora_r}; "
          f"{opts.replicas} replica(s) (--engine hf) + 1 trainer, 1 thread each; {opts.warmup} warm-up + {opts.steps} "
          f"measured steps; {os.cpu_count()} CPUs; code from {opts.code}", flush=True)
    rows = []
    for s in opts.staleness:
        run_dir = os.path.join(opts.out, f"S{s}")
        run = run_system(opts, s, os.path.join(run_dir, "bucket"), run_dir)
        rows.append(summarize(run, opts.warmup, opts.steps, opts.num_generations))
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(rows[-1], f, indent=1)
        print(f"S={s}: {rows[-1]['wall']:.1f}s for {opts.steps} steps (logs in {run_dir})", flush=True)
    print()
    print_table(rows, opts)


if __name__ == "__main__":
    main()
