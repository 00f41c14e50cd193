"""Benchmark: a pool of unequal and dying replicas, side by side. One fast replica alone; the fast
one + a replica k x slower (k = --slowdowns); the fast one + an equal one; the fast one + an equal
one SIGKILLed mid-lease every --kill-every steps (and started again at once: a preempted machine
coming back). bench_async.py's roles and measurements, one run per column.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_pool.py                  # tiny model: ~6 min
    .venv/bin/python bench/bench_pool.py --slowdowns 4 --steps 20 --kill-every 4

The second replica is emulated as a machine of its own (emulated_replica), since two cores cannot
host the trainer and two engines of different speed. Its work is real: rollout.py with the current
adapter, asking /quota, its groups used by the trainer. Two things are emulated: it runs at the
lowest CPU priority (SCHED_IDLE: only cycles the trainer and the fast replica leave idle, as
another machine takes none of theirs), and after each generate call it sleeps until k x the fast
replica's seconds per generated token (measured in the fast-alone column) have passed for the
tokens it made. Starved of idle cycles it is slower than k x: the table prints the k it had. What
it still takes from the others: memory bandwidth and caches, the proxy's CPU for its requests, and
its first start-up (run at normal priority, during the warm-up steps; a restart after a kill runs
at SCHED_IDLE like its generation). Other load on the machine starves it: measure on an otherwise
idle one (the last two rows show the load). Rows:

  seconds per step     wall / measured steps; the trainer idle is its wait_s / wall
  replica-i share      replica i's groups among those the proxy accepted in the measured steps
  replica-i idle       1 - (generation seconds of its batches that ended in the window) / wall
  replica-1 k          the fast replica's rate alone / replica 1's rate in the run
  dropped              groups stale on arrival + over quota (a killed replica's lease is neither)
  bound                the fastest step the pool allows: max(T_train, B / (r0 + r1)), r0 the fast
                       replica's rate alone (groups per generation second), r1 the second one's
                       in that run, T_train from the fast-alone run; "of bound" is bound / seconds
                       per step
  stall per kill       per kill, from the last step before it to the first step after the killed
                       replica (restarted) delivered again: the seconds beyond as many steps at
                       the fast-alone pace (what holding a dead lease cost the trainer), against
                       the fast replica's generation time for one step
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
import sys
import time
import urllib.request

import bench_async as ba  # the roles as subprocesses, the step records, the load measurement


def emulated_replica(k, seconds_per_token, restart, argv):
    """rollout.py as if on a machine of its own, k x slower than the fast replica. Its work is
    real (the current adapter, the proxy's quota, groups the trainer uses); two things emulate
    the other machine. It generates at the lowest CPU priority (SCHED_IDLE), so it takes only
    cycles the trainer and the fast replica leave idle, as a separate machine takes none of
    theirs. And after each generate call it sleeps until k x `seconds_per_token` (the fast
    replica's, measured in the fast-alone column) have passed for the tokens it generated: a
    measured delay per token, taking no core. Its first start-up (torch, the model) runs at
    normal priority, during the warm-up steps; a restart, in the measured steps, at SCHED_IDLE."""
    def lowest_priority():  # every thread of this process
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))

    if restart:
        lowest_priority()
    import rollout

    def paced(generate):
        def generate_paced(self, *args, **kwargs):
            if os.sched_getscheduler(0) != os.SCHED_IDLE:  # the first call: start-up is over
                lowest_priority()
            t0 = time.monotonic()
            out = generate(self, *args, **kwargs)  # n lists of G samples
            tokens = sum(len(s.ids) for group in out for s in group)
            time.sleep(max(0.0, t0 + k * seconds_per_token * tokens - time.monotonic()))
            return out
        return generate_paced

    rollout.HFEngine.generate = paced(rollout.HFEngine.generate)
    rollout.VLLMEngine.generate = paced(rollout.VLLMEngine.generate)
    rollout.main(argv)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--slowdowns", type=float, nargs="*", default=[2, 4, 8],
      help="k of each fast + k x slower column")
    a("--kill-every", type=int, default=5,
      help="SIGKILL the second replica mid-lease every N steps (0: no kill columns)")
    a("--staleness", type=int, default=2, help="the proxy's --max-staleness")
    a("--steps", type=int, default=12, help="trainer steps measured per run")
    a("--warmup", type=int, default=3, help="trainer steps before the measured ones (model loads)")
    a("--groups", type=int, default=8, help="groups per trainer step, B")
    a("--num-generations", type=int, default=8, help="G")
    a("--max-new-tokens", type=int, default=64, help="completion length: T_gen against T_train")
    a("--model", help="base model folder (default: the tiny test model, built into --out)")
    a("--task", default="toy")
    a("--out", default="/tmp/bench_pool", help="work folder (emptied first)")
    a("--code", default=ba.ROOT, help="folder holding the role files to run")
    opts = p.parse_args(argv)
    opts.learning_rate, opts.lora_r, opts.poll_interval = 1e-5, 8, None  # bench_async's defaults
    return opts


def killer(every, warmup, kills):
    """during(): after every `every`-th step, SIGKILL replica 1 once the proxy shows it holding a
    lease, then start it again at once (same worker name). Appends each kill's time to `kills`."""
    def during(url, start_replica, replicas, trainer):
        done = set()
        while trainer.proc.poll() is None:
            steps = sum(1 for _, line in list(trainer.lines) if ba.STEP.match(line))
            if steps > warmup and steps % every == 0 and steps not in done:
                done.add(steps)
                time.sleep(random.uniform(0.0, 0.3))
                deadline = time.time() + 10
                while time.time() < deadline:  # mid-lease: groups leased to it, not yet delivered
                    try:
                        answer = urllib.request.urlopen(url + "/stats", timeout=5)
                        leased = json.load(answer)["leased"]
                    except (OSError, ValueError):  # the proxy busy or ending: look again
                        leased = {}
                    if leased.get("replica-1", 0) > 0:
                        break
                    time.sleep(0.02)
                victim = [r for r in replicas if r.name.split(".")[0] == "replica-1"][-1]
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


def column(opts, label, slow=None, kill=False):
    """One run: the summary, with per-replica numbers. slow: k of the emulated second replica
    (None: the fast one alone)."""
    replicas = 1 if slow is None else 2
    o = argparse.Namespace(**{**vars(opts), "replicas": replicas})
    py, here = sys.executable, os.path.abspath(__file__)

    starts = []

    def replica(i):
        if i == 1:
            starts.append(i)  # the first start, then restarts
            return [py, here, "--as-replica", str(slow), str(opts.seconds_per_token),
                    "restart" if len(starts) > 1 else "start"], {}
        return [py, os.path.join(os.path.abspath(opts.code), "rollout.py")], {}

    kills = []
    run_dir = os.path.join(opts.out, label.replace(" ", "_").replace("+", "plus"))
    during = killer(opts.kill_every, opts.warmup, kills) if kill else None
    run = ba.run_system(o, opts.staleness, os.path.join(run_dir, "bucket"), run_dir,
                        replica=replica, during=during)
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
                     "rate": sum(b["accepted"] for b in mine) / gen if gen else 0.0}
    if slow is None:  # the pace the emulated replicas are set against, and the step
        opts.seconds_per_token = seconds_per_token(os.path.join(run_dir, "replica-0.log"), t0, t1)
        opts.step_alone = s["step_s"]
    kills = [k for k in kills if t0 < k <= t1]
    s.update(label=label, per=per, kills=len(kills), stalls=stalls(run, kills, opts.step_alone),
             over_quota=run["stats"]["over_quota"])
    print(f"{label}: {s['step_s']:.3f} s/step (logs in {run_dir})", flush=True)
    return s


def print_table(rows, opts):
    alone = rows[0]
    t_train, t_gen = alone["T_train"], alone["T_gen"]
    equal = next((r for r in rows if r["label"] == "+ equal"), None)
    lines = [f"{'':<30}" + "".join(f"{r['label']:>14}" if len(r["label"]) < 14 else " " + r["label"]
                                   for r in rows)]

    def row(label, fmt):
        lines.append(f"{label:<30}" + "".join(f"{fmt(r):>14}" for r in rows))

    fast = alone["per"]["replica-0"]["rate"]  # groups per generation second, on its own core
    for r in rows:
        # the fast replica at its own best rate, the second one at the rate it had in the run
        rate = fast + r["per"].get("replica-1", {}).get("rate", 0.0)
        r["bound"] = max(t_train, opts.groups / max(1e-9, rate))
    row("seconds per step", lambda r: f"{r['step_s']:.3f}")
    row("vs fast alone", lambda r: f"{alone['step_s'] / r['step_s']:.2f}x")
    row("trainer idle", lambda r: f"{r['trainer_idle']:.1%}")
    for i in range(2):
        name = f"replica-{i}"
        row(f"{name} share", lambda r: f"{r['per'][name]['share']:.1%}" if name in r["per"]
            else "-")
        row(f"{name} idle", lambda r: f"{r['per'][name]['idle']:.1%}" if name in r["per"] else "-")
    row("replica-1 k x slower (as run)", lambda r: f"{fast / r['per']['replica-1']['rate']:.1f}"
        if r["per"].get("replica-1", {}).get("rate") else "-")
    row("groups dropped (stale+over)", lambda r: f"{r['dropped']}+{r['over_quota']}")
    row("bound s/step", lambda r: f"{r['bound']:.3f}")
    row("of bound", lambda r: f"{r['bound'] / r['step_s']:.0%}")
    row("kills in measured steps", lambda r: f"{r['kills']}")
    row("stall per kill (s)", lambda r: f"{sum(r['stalls']) / len(r['stalls']):.2f}"
        if r["stalls"] else "-")
    row("cost per kill (s)", lambda r: f"{(r['wall'] - equal['wall']) / r['kills']:.2f}"
        if r["kills"] and equal else "-")
    row("load average before/after", lambda r: f"{r['load'][0]}/{r['load'][1]}")
    row("CPU of other processes", lambda r: f"{r['other_cpu']:.2f}")
    print("\n".join(lines))
    print(f"\nfast alone: T_train {t_train:.3f} s, T_gen {t_gen:.3f} s per step (the generation "
          "time a kill is measured against)")


def main():
    if len(sys.argv) > 4 and sys.argv[1] == "--as-replica":  # column(): the emulated replica
        k, seconds, start = sys.argv[2:5]
        return emulated_replica(float(k), float(seconds), start == "restart", sys.argv[5:])
    opts = parse_args()
    ba.fresh_out(opts)
    print(f"workload: {opts.model}, task {opts.task}, G={opts.num_generations}, B={opts.groups}, "
          f"--max-new-tokens {opts.max_new_tokens}, --max-staleness {opts.staleness}; "
          f"{opts.warmup} warm-up + {opts.steps} measured steps; {os.cpu_count()} CPUs", flush=True)
    plan = [("fast alone", None, False)] + [(f"+ {k:g}x slower", k, False) for k in opts.slowdowns]
    if opts.kill_every:
        plan += [("+ equal", 1, False), ("+ equal killed", 1, True)]
    rows = [column(opts, label, slow, kill) for label, slow, kill in plan]
    print()
    print_table(rows, opts)
    with open(os.path.join(opts.out, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
