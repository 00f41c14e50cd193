"""Benchmark: adapter propagation, from the end of a trainer step to the first groups a replica
makes with the adapter that step published, on a directory bucket and on an S3 server.

    OMP_NUM_THREADS=1 .venv/bin/python tests/bench_propagation.py              # dir + S3, S=0 and S=2: ~4 min
    .venv/bin/python tests/bench_propagation.py --buckets s3 --staleness 2 --steps 30   # + bench_async.py's options

Each run is the local system of tests/bench_async.py (proxy + one rollout.py replica + trainer.py,
subprocesses, one thread each); the S3 bucket is a moto_server subprocess on 127.0.0.1 (real boto3
requests, no real network: a floor, not a WAN figure). A probe thread in this process reads
adapters/LATEST every --probe-ms to time when each version became visible. For every version a
replica loaded, with times taken from the processes' log lines as they arrive:

  publish     end of the trainer step (its "step N" line) -> LATEST visible to the probe:
              save_pretrained, files + manifest.json + LATEST written (S3: PUTs)
  pick-up     LATEST visible -> the replica reads it: the replica is busy with a batch (async) or
              between two checks, --poll-interval apart (synchronous, S=0)
  pull        download + sha256 verification against the manifest (the replica's "pull" seconds)
  load        hot-load into the engine (the replica's "load" seconds)
  in use      end of the trainer step -> the adapter is loaded (sum of the four above)
  1st groups  end of the trainer step -> the replica posted its first batch made with it
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import sync  # noqa: E402
from bench_async import BATCH, LOADED, PUBLISHED, STEP, run_system  # noqa: E402
from bench_async import parse_args as bench_args  # noqa: E402
from conftest import free_port, make_s3_bucket, wait_port  # noqa: E402

PARTS = ["publish", "pick-up", "pull", "load", "in use", "1st groups"]


def probe(bucket_url, every, seen, stop):
    """Record the first time each LATEST version is read: {version: unix time}."""
    b = sync.open_bucket(bucket_url)
    while not stop.is_set():
        v = sync.latest_version(b)
        if v is not None and v not in seen:
            seen[v] = time.time()
        time.sleep(every)


def chains(run, visible):
    """One dict of part -> seconds per version the replica loaded (v0, published before step 1, left out)."""
    step_t = {int(m.group(1)): t for t, line in run["trainer"] if (m := STEP.search(line))}
    pub_step = {int(m.group(1)): int(m.group(2)) for _, line in run["trainer"] if (m := PUBLISHED.search(line))}
    loaded, first = {}, {}
    for t, line in run["replica"]:
        if m := LOADED.search(line):
            loaded[int(m.group(1))] = (t, float(m.group(2)), float(m.group(3)))
        elif (m := BATCH.search(line)) and int(m.group(1)) not in first:
            first[int(m.group(1))] = t
    out = []
    for v, (t_loaded, pull, load) in sorted(loaded.items()):
        if v == 0 or v not in visible or pub_step.get(v) not in step_t:
            continue
        t_step, t_seen = step_t[pub_step[v]], t_loaded - pull - load
        c = {"publish": visible[v] - t_step, "pick-up": max(0.0, t_seen - visible[v]), "pull": pull, "load": load,
             "in use": t_loaded - t_step}
        if v in first:
            c["1st groups"] = first[v] - t_step
        out.append(c)
    return out, len(pub_step) - 1


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def start_s3():
    """A moto S3 server subprocess; sets the AWS_* variables for this process and its children."""
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_port(port)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(env)
    return proc, env


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--buckets", nargs="+", default=["dir", "s3"], choices=["dir", "s3"], help="bucket kinds")
    p.add_argument("--probe-ms", type=float, default=20, help="how often the probe reads adapters/LATEST")
    args, rest = p.parse_known_args()  # the rest: tests/bench_async.py's options (--steps, --staleness, ...)
    opts = bench_args(["--out", "/tmp/bench_propagation", "--steps", "15", *rest])
    shutil.rmtree(opts.out, ignore_errors=True)
    os.makedirs(opts.out)
    if not opts.model:
        import tiny_model

        opts.model = tiny_model.build(os.path.join(opts.out, "tiny"))
    print(f"workload: {opts.model}, task {opts.task}, G={opts.num_generations}, {opts.groups} groups per batch "
          f"and step, --max-new-tokens {opts.max_new_tokens}, {opts.warmup}+{opts.steps} steps per run, replica "
          f"--poll-interval {opts.poll_interval if opts.poll_interval is not None else 'default'}; probe every "
          f"{args.probe_ms:g} ms", flush=True)
    s3, env, results = None, {}, []
    try:
        for kind in args.buckets:
            if kind == "s3" and s3 is None:
                s3, env = start_s3()
            for s in opts.staleness:
                run_dir = os.path.join(opts.out, f"{kind}-S{s}")
                url = make_s3_bucket(f"S{s}") if kind == "s3" else os.path.join(run_dir, "bucket")
                seen, stop = {}, threading.Event()
                th = threading.Thread(target=probe, args=(url, args.probe_ms / 1000, seen, stop), daemon=True)
                th.start()
                run = run_system(opts, s, url, run_dir, env, own_pids=[s3.pid] if s3 else [])
                stop.set()
                th.join()
                rows, published = chains(run, seen)
                results.append((kind, s, rows, published, run["load"]))
                print(f"{kind} S={s}: {len(rows)} of {published} published versions loaded by the replica; load "
                      f"average {run['load'][0]} -> {run['load'][1]}, other processes took {run['other_cpu']:.2f} "
                      "cores", flush=True)
    finally:
        if s3:
            s3.kill()
            s3.wait()
    print("\nseconds from the end of a trainer step, p50 / p95 over the versions a replica loaded")
    print(f"{'bucket':<7}{'S':>3}{'n':>4}" + "".join(f"{c:>16}" for c in PARTS))
    for kind, s, rows, published, _ in results:
        cells = []
        for c in PARTS:
            xs = [r[c] for r in rows if c in r]
            cells.append(f"{pct(xs, 0.5):.3f} / {pct(xs, 0.95):.3f}" if xs else "-")
        print(f"{kind:<7}{s:>3}{len(rows):>4}" + "".join(f"{x:>16}" for x in cells))


if __name__ == "__main__":
    main()
