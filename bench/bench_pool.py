"""Benchmark: a pool of unequal and dying replicas, side by side. One fast replica alone; the fast
one + a replica k x slower (k = --slowdowns); the fast one + an equal one; the fast one + an equal
one SIGKILLed mid-lease every --kill-every steps (and started again at once: a preempted machine
coming back). bench_async.py's roles and measurements; the columns run --repeats times in turn.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_pool.py                  # tiny model: ~12 min
    .venv/bin/python bench/bench_pool.py --slowdowns 4 --steps 20 --kill-every 4 --repeats 1

Two cores cannot host the trainer and two engines of different speed, so every replica emulates a
machine of its own (emulated_replica). Its work is real: rollout.py with the current adapter,
asking /quota, its groups used by the trainer. Its speed is emulated: after each generate call it
sleeps until k x c seconds per generated token have passed for the tokens it made (k = 1 for the
fast replica, the column's k for the second). c is --headroom x the engine's own seconds per token,
measured first in a calibration run with one replica not paced. The trainer is pinned to one
core, the replicas to the other; with the headroom above 1 + 1/k both replicas' real work fits in
their core's time, so each keeps its pace (the "pace kept" row counts the generate calls that
did), and the second replica runs at the lowest CPU priority (SCHED_IDLE), so it never slows the
fast one, as another machine would not. Its first start-up runs at normal priority during the
warm-up; a restart after a kill at SCHED_IDLE. Other load on the machine breaks the pacing:
measure on an otherwise idle one (the last rows show the load). Rows (median over the repeats,
then the worst repeat where it says so):

  seconds per step     wall / measured steps; the trainer idle is its wait_s / wall
  vs fast alone        the fast-alone column's seconds per step / this column's, in the same repeat
  replica-i share      replica i's groups among those the proxy accepted in the measured steps
  replica-i idle       1 - (generation seconds of its batches that ended in the window) / wall
  replica-1 k          the fast replica's rate alone / replica 1's rate in the run
  pace kept            the share of each replica's generate calls whose real work ended within
                       its emulated time
  dropped              groups stale on arrival + over quota (a killed replica's lease is neither)
  bound                the fastest step the pool allows: max(T_train, B / (r0 + r1)), r0 the fast
                       replica's rate alone (groups per generation second), r1 the second one's
                       in that run, T_train from the fast-alone run; "of bound" is bound / seconds
                       per step
  stall per kill       per kill, from the last step before it to the first step after the killed
                       replica (restarted) delivered again: the seconds beyond as many steps at
                       the fast-alone pace (what holding a dead lease cost the trainer), against
                       the fast replica's generation time for one step (T_gen)
  cost per kill        (this column's wall - the equal pair's wall) / kills: the stall plus the
                       groups the replica did not make while dead and restarting
"""


import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import sys
import time
import urllib.request

import bench_async as ba  # the roles as subprocesses, the step records, the load measurement


def emulated_replica(k, seconds_per_token, mode, cpus, argv):
    """rollout.py as if on a machine of its own, k x slower than the fast replica (k = 1: the fast
    one; k = 0: not paced, the calibration). Its work is real (the current adapter, the proxy's
    quota, groups the trainer uses). Its speed is emulated: after each generate call it sleeps
    until k x `seconds_per_token` have passed for the tokens it generated (a delay per token,
    taking no core), and prints "[pace] real s, emulated s". Pinned to `cpus`. mode "fast": the
    fast replica; "start" or "restart": the second one, which generates at the lowest CPU priority
    (SCHED_IDLE), so it takes only cycles the fast one leaves idle. Its first start-up runs at
    normal priority, during the warm-up; a restart at SCHED_IDLE."""
    def lowest_priority():  # every thread of this process
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))

    os.sched_setaffinity(0, cpus)
    if mode == "restart":
        lowest_priority()
    import rollout
    from support import engines

    def paced(generate):
        def generate_paced(self, *args, **kwargs):
            if mode != "fast" and os.sched_getscheduler(0) != os.SCHED_IDLE:  # the start-up is over
                lowest_priority()
            t0 = time.monotonic()
            out = generate(self, *args, **kwargs)  # n lists of G samples
            tokens = sum(len(s.ids) for group in out for s in group)
            real, emulated = time.monotonic() - t0, k * seconds_per_token * tokens
            time.sleep(max(0.0, emulated - real))
            if k:
                print(f"[pace] real {real:.3f}s emulated {emulated:.3f}s", flush=True)
            return out
        return generate_paced

    engines.HFEngine.generate = paced(engines.HFEngine.generate)
    engines.VLLMEngine.generate = paced(engines.VLLMEngine.generate)
    rollout.main(argv)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--slowdowns", type=float, nargs="*", default=[2, 4, 8],
      help="k of each fast + k x slower column")
    a("--kill-every", type=int, default=8,
      help="SIGKILL the second replica mid-lease every N steps (0: no kill columns)")
    a("--staleness", type=int, default=2, help="the proxy's --max-staleness")
    a("--steps", type=int, default=24, help="trainer steps measured per run")
    a("--warmup", type=int, default=3, help="trainer steps before the measured ones (model loads)")
    a("--groups", type=int, default=8, help="groups per trainer step, B")
    a("--num-generations", type=int, default=8, help="G")
    a("--max-new-tokens", type=int, default=64, help="completion length: T_gen against T_train")
    a("--model", help="base model folder (default: the tiny test model, built into --out)")
    a("--task", default="toy")
    a("--repeats", type=int, default=3, help="runs of every column, in turn")
    a("--headroom", type=float, default=2.5,
      help="the fast replica's emulated seconds per token / the engine's own on its core (> 2: "
           "two replicas' real work fits in one core)")
    a("--out", default="/tmp/bench_pool", help="work folder (emptied first)")
    a("--code", default=ba.ROOT, help="folder holding the role files to run")
    opts = p.parse_args(argv)
    opts.learning_rate, opts.lora_r, opts.poll_interval = 1e-5, 8, None  # bench_async's defaults
    return opts


def killer(every, warmup, kills):
    """during(): after every `every`-th step, SIGKILL replica 1 as soon as it has delivered since
    it (re)started and the proxy shows it holding a lease, then start it again at once (same worker
    name). Appends each kill's time to `kills`."""
    def leased(url):
        try:
            return json.load(urllib.request.urlopen(url + "/stats", timeout=5))["leased"]
        except (OSError, ValueError):  # the proxy busy or ending: look again
            return {}

    def during(url, start_replica, replicas, trainer):
        done = set()
        while trainer.proc.poll() is None:
            steps = sum(1 for _, line in list(trainer.lines) if ba.STEP.match(line))
            if steps > warmup and steps % every == 0 and steps not in done:
                done.add(steps)
                time.sleep(random.uniform(0.0, 0.3))
                victim = [r for r in replicas if r.name.split(".")[0] == "replica-1"][-1]
                while trainer.proc.poll() is None and not (  # working, and mid-lease
                        any(ba.BATCH.search(line) for _, line in list(victim.lines))
                        and leased(url).get("replica-1", 0) > 0):
                    time.sleep(0.02)
                if trainer.proc.poll() is not None:
                    return
                victim.proc.send_signal(signal.SIGKILL)
                kills.append(time.time())
                start_replica(1)
            time.sleep(0.05)
    return during


TOKENS = re.compile(r"groups/s (\d+) tokens/s .* gen ([\d.]+)s$")


def seconds_per_token(log, t0, t1):
    """A replica's generation seconds per generated token over its batches that ended in t0..t1,
    from its log (the unix time each line arrived, then the line)."""
    gen = tokens = 0.0
    for line in open(log):
        t, _, text = line.rstrip("\n").partition(" ")
        if (m := TOKENS.search(text)) and t0 < float(t) <= t1:
            gen, tokens = gen + float(m.group(2)), tokens + int(m.group(1)) * float(m.group(2))
    return gen / max(1.0, tokens)


def stalls(run, kills, step_alone):
    """Seconds each kill cost the trainer beyond the fast replica alone: from the last step that
    ended before the kill to the first that ended after replica 1 delivered again, less as many
    steps at `step_alone`."""
    ends = sorted(r["time"] for r in run["metrics"])
    back = sorted(b["t"] for b in run["batches"] if b["replica"] == "replica-1")
    out = []
    for k in kills:
        b = next((t for t in back if t > k), None)
        before = max((t for t in ends if t <= k), default=None)
        after = next((t for t in ends if b is not None and t >= b), None)
        if before is not None and after is not None:
            out.append(after - before - sum(before < t <= after for t in ends) * step_alone)
    return out


def cores():
    """(the trainer's cores, the replicas' cores): one each where this process may use two."""
    avail = sorted(os.sched_getaffinity(0))
    return ({avail[0]}, {avail[1]}) if len(avail) > 1 else (None, set(avail))


PACE = re.compile(r"\[pace\] real ([\d.]+)s emulated ([\d.]+)s")


def paces(run_dir, name, t0, t1):
    """(generate calls of replica `name` that ended in t0..t1 within their emulated time, calls),
    from its logs (a restarted replica writes name.1.log, ...)."""
    kept = calls = 0
    for log in os.listdir(run_dir):
        if log.split(".")[0] == name and log.endswith(".log"):
            for line in open(os.path.join(run_dir, log)):
                t, _, text = line.partition(" ")
                if (m := PACE.search(text)) and t0 < float(t) <= t1:
                    calls += 1
                    kept += float(m.group(1)) <= float(m.group(2))
    return kept, calls


def column(opts, label, slow=None, kill=False, calibrate=False):
    """One run: the summary, with per-replica numbers. slow: k of the emulated second replica
    (None: the fast one alone). calibrate: the fast one alone, not paced."""
    replicas = 1 if slow is None else 2
    o = argparse.Namespace(**{**vars(opts), "replicas": replicas})
    py, here = sys.executable, os.path.abspath(__file__)
    trainer_cpus, replica_cpus = cores()
    starts = []

    def replica(i):
        starts.append(i)  # the first starts, then restarts
        k = (0 if calibrate else 1) if i == 0 else slow
        mode = "fast" if i == 0 else "restart" if starts.count(i) > 1 else "start"
        return [py, here, "--as-replica", str(k), str(opts.seconds_per_token), mode,
                ",".join(map(str, replica_cpus))], {}

    kills = []
    run_dir = os.path.join(opts.out, label.replace(" ", "_").replace("+", "plus"))
    during = killer(opts.kill_every, opts.warmup, kills) if kill else None
    run = ba.run_system(o, opts.staleness, os.path.join(run_dir, "bucket"), run_dir,
                        replica=replica, during=during, trainer_cpus=trainer_cpus)
    s = ba.summarize(run, opts.warmup, opts.steps, opts.num_generations)
    m = {r["step"]: r for r in run["metrics"]}
    t0, t1 = m[opts.warmup]["time"], m[opts.warmup + opts.steps]["time"]
    window = [b for b in run["batches"] if t0 < b["t"] <= t1]
    total, per = max(1, sum(b["accepted"] for b in window)), {}
    for i in range(replicas):
        name = f"replica-{i}"
        mine = [b for b in window if b["replica"] == name]
        gen = sum(b["gen_s"] for b in mine)
        per[name] = {"share": sum(b["accepted"] for b in mine) / total,
                     "idle": max(0.0, 1 - gen / (t1 - t0)),
                     "rate": sum(b["accepted"] for b in mine) / gen if gen else 0.0,
                     "pace": paces(run_dir, name, t0, t1)}
    if calibrate:  # the engine's own seconds per token on the replicas' core
        return seconds_per_token(os.path.join(run_dir, "replica-0.log"), t0, t1)
    if slow is None:  # the step the stalls are measured against
        opts.step_alone = s["step_s"]
    kills = [k for k in kills if t0 < k <= t1]
    s.update(label=label, per=per, kills=len(kills), stalls=stalls(run, kills, opts.step_alone),
             over_quota=run["stats"]["over_quota"])
    print(f"{label}: {s['step_s']:.3f} s/step (logs in {run_dir})", flush=True)
    return s


def derive(runs, groups):
    """Per run of one repeat (runs[0]: the fast one alone): its pace against the fast-alone run's
    and the bound (groups: B, per trainer step)."""
    alone = runs[0]
    fast = alone["per"]["replica-0"]["rate"]  # groups per generation second, alone
    for r in runs:
        # the fast replica at its rate alone, the second one at the rate it had in the run
        rate = fast + r["per"].get("replica-1", {}).get("rate", 0.0)
        r["bound"] = max(alone["T_train"], groups / max(1e-9, rate))
        r["vs_alone"], r["of_bound"] = alone["step_s"] / r["step_s"], r["bound"] / r["step_s"]
        r["k_as_run"] = fast / r["per"]["replica-1"]["rate"] \
            if r["per"].get("replica-1", {}).get("rate") else None


def print_table(columns):
    """columns: {label: [its run in each repeat]}."""
    med = statistics.median
    labels, alone = list(columns), columns[next(iter(columns))]
    lines = [f"{'':<30}" + "".join(f"{c:>14}" if len(c) < 14 else " " + c for c in labels)]

    def row(label, fmt):
        lines.append(f"{label:<30}" + "".join(f"{fmt(columns[c]):>14}" for c in labels))

    def per(name, key):  # the replica's value in each run, or None where it did not run
        return lambda runs: [r["per"][name][key] for r in runs] if name in runs[0]["per"] else None

    def kept(paces):  # [(calls within their time, calls)] of each run
        if paces is None:
            return "-"
        return f"{sum(k for k, _ in paces) / max(1, sum(n for _, n in paces)):.0%}"

    def pct(values, f=med):
        return "-" if values is None else f"{f(values):.1%}"

    row("seconds per step", lambda rs: f"{med(r['step_s'] for r in rs):.3f}")
    row("  min-max", lambda rs: f"{min(r['step_s'] for r in rs):.2f}-"
                                f"{max(r['step_s'] for r in rs):.2f}")
    row("vs fast alone", lambda rs: f"{med(r['vs_alone'] for r in rs):.2f}x")
    row("  worst repeat", lambda rs: f"{min(r['vs_alone'] for r in rs):.2f}x")
    row("trainer idle", lambda rs: pct([r["trainer_idle"] for r in rs]))
    for i in range(2):
        name = f"replica-{i}"
        row(f"{name} share", lambda rs: pct(per(name, "share")(rs)))
        row(f"{name} idle", lambda rs: pct(per(name, "idle")(rs)))
        row(f"{name} pace kept", lambda rs: kept(per(name, "pace")(rs)))
    row("replica-1 k x slower (as run)", lambda rs: "-" if rs[0]["k_as_run"] is None
        else f"{med(r['k_as_run'] for r in rs):.1f}")
    row("groups dropped (stale+over)", lambda rs: f"{sum(r['dropped'] for r in rs)}+"
                                                  f"{sum(r['over_quota'] for r in rs)}")
    row("bound s/step", lambda rs: f"{med(r['bound'] for r in rs):.3f}")
    row("of bound", lambda rs: f"{med(r['of_bound'] for r in rs):.0%}")
    row("  worst repeat", lambda rs: f"{min(r['of_bound'] for r in rs):.0%}")
    row("kills in measured steps", lambda rs: f"{sum(r['kills'] for r in rs)}")
    row("stall per kill (s, mean)", lambda rs: "-" if not any(r["stalls"] for r in rs) else
        f"{statistics.mean(x for r in rs for x in r['stalls']):.2f}")
    row("  max", lambda rs: "-" if not any(r["stalls"] for r in rs) else
        f"{max(x for r in rs for x in r['stalls']):.2f}")
    equal = columns.get("+ equal")
    def cost(rs):  # the walls beyond the equal pair's, per kill
        kills = sum(r["kills"] for r in rs)
        return "-" if not kills or not equal else \
            f"{sum(r['wall'] - e['wall'] for r, e in zip(rs, equal)) / kills:.2f}"

    row("cost per kill (s)", cost)
    row("load average before/after", lambda rs: f"{rs[0]['load'][0]}/{rs[-1]['load'][1]}")
    row("CPU of other processes", lambda rs: f"{max(r['other_cpu'] for r in rs):.2f}")
    print("\n".join(lines))
    print(f"\nfast alone: T_train {med(r['T_train'] for r in alone):.3f} s, T_gen "
          f"{med(r['T_gen'] for r in alone):.3f} s per step (the generation time a kill is "
          "measured against)")


def main():
    if len(sys.argv) > 5 and sys.argv[1] == "--as-replica":  # column(): an emulated replica
        k, seconds, start, cpus = sys.argv[2:6]
        return emulated_replica(float(k), float(seconds), start,
                                {int(c) for c in cpus.split(",")}, sys.argv[6:])
    opts = parse_args()
    ba.fresh_out(opts)
    trainer_cpus, replica_cpus = cores()
    print(f"workload: {opts.model}, task {opts.task}, G={opts.num_generations}, B={opts.groups}, "
          f"--max-new-tokens {opts.max_new_tokens}, --max-staleness {opts.staleness}; "
          f"{opts.warmup} warm-up + {opts.steps} measured steps, {opts.repeats} repeats; trainer "
          f"on CPU {trainer_cpus or 'any'}, replicas on CPU {replica_cpus}", flush=True)
    opts.seconds_per_token = 0.0
    own = column(opts, "calibration", calibrate=True)
    opts.seconds_per_token = opts.headroom * own
    print(f"calibration: the engine makes a token in {own * 1e3:.3f} ms on its core; the fast "
          f"replica is paced at {opts.headroom:g}x that, {opts.seconds_per_token * 1e3:.3f} ms",
          flush=True)
    plan = [("fast alone", None, False)] + [(f"+ {k:g}x slower", k, False) for k in opts.slowdowns]
    if opts.kill_every:
        plan += [("+ equal", 1, False), ("+ equal killed", 1, True)]
    columns = {label: [] for label, _, _ in plan}
    for rep in range(opts.repeats):
        runs = [column(opts, f"{label} {rep}", slow, kill) for label, slow, kill in plan]
        derive(runs, opts.groups)
        for (label, _, _), r in zip(plan, runs):
            columns[label].append(r)
    print()
    print_table(columns)
    with open(os.path.join(opts.out, "summary.json"), "w") as f:
        json.dump({"seconds_per_token": opts.seconds_per_token, "columns": columns}, f, indent=1,
                  default=str)


if __name__ == "__main__":
    main()
