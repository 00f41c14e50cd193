"""Benchmark: how fast a published adapter reaches the replicas on each bucket path (a directory, a
mounted bucket that lags like hf-mount, S3), and how many requests the replicas make meanwhile.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_propagation.py          # 5 runs, ~8 min on 2 idle cores
    .venv/bin/python bench/bench_propagation.py --runs mount:4:20 mount:0:4 --lag 10 30 --replicas 1

Each run is a whole local system: `python proxy.py` (the run's contract, as jobs.sh gives it), --replicas
`rollout.py --engine hf --task toy` replicas and `trainer.py` on the tiny model (tests/tiny_model.py),
subprocesses with one thread each. A run is KIND:S[:STEPS] (STEPS: the trainer's --max-steps):

  dir     one directory for everyone: a file is visible the moment it is written
  mount   the trainer writes directory A; a mirror thread here copies each new or changed file of
          A/adapters to B (and each deletion) after a delay drawn uniformly from --lag per file, in any
          order, like an eventually consistent hf-mount view (metadata cached ~10 s, polled ~30 s).
          Replicas read B; sync.py's manifest check makes the torn views safe. v0 (published before
          step 1) shows at once: the start of a run is not what is measured
  s3      s3://... through boto3 on a moto_server on 127.0.0.1: strongly consistent like the Storage
          Buckets S3 gateway (https://s3.hf.co); loopback latency, so a lower bound

The trainer's step takes seconds like a GPU step of the HF default: the tiny model is fast, so the
step is made big through the contract only (proxy flags: --groups-per-step 16, G 8, --max-new-tokens
256: 128 completions of ~95 tokens, the random tiny model often stops early; ~8 s per step on an
idle 2-core machine, 2-3x that when other processes take the CPUs). No role's code or flags change.
Between each role and the proxy (and, for s3, each role and the S3 server) sits a relay that counts
HTTP requests by method and path.

Per run, over the trainer's steps 2..N (step 1 waits for the replicas to load the model):
  s/step, wait       seconds per trainer step; the trainer's wait_s (blocked on GET /batch) / wall
  staleness          mean trainer version - policy version of the groups the steps used
  visible            mount only: publish of vN ("published vN" line) -> B holds vN's files and a LATEST >= N
  loaded             publish of vN -> a replica logged "adapter vM loaded" with M >= N (a replica may skip
                     versions), per replica and version; p50 / p95
  1st group          publish of vN -> the first batch of groups made with vM >= N was accepted by the proxy
  req/min            per replica, by endpoint, through the relay (the Hub: ~1,000 requests / 5 min per account)
  LATEST/min         per replica: reads of adapters/LATEST (dir, mount: counted with inotify as opens of
                     the file; dir minus the trainer's one read per publish; s3: GETs at the relay)
"""

import argparse
import collections
import ctypes
import os
import random
import re
import select
import struct
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from support import buckets
from bench_async import BATCH, LOADED, PUBLISHED, STEP, Role, fresh_out, role_env  # noqa: E402
from chaos import TcpRelay, aws_env, start_moto  # noqa: E402
from conftest import free_port, make_s3_bucket, wait_port  # noqa: E402

DONE = re.compile(r"^done: (\d+) steps")


class CountingRelay(TcpRelay):
    """A TcpRelay that parses the client -> server byte stream as HTTP/1.1 requests (keep-alive,
    Content-Length and chunked bodies) and records (time, method, path) for each request line."""

    def __init__(self, target):
        super().__init__(target)
        self.requests, self.lock = [], threading.Lock()

    def _pipe(self, a, b):
        if a.getsockname()[1] != self.port:  # server -> client: relay only
            return TcpRelay._pipe(a, b)
        buf, state = bytearray(), ["head", 0]  # what comes next, bytes of body to skip first
        try:
            while data := a.recv(65536):
                b.sendall(data)
                if state:
                    buf += data
                    try:
                        self._parse(buf, state)
                    except ValueError:  # not HTTP/1.1 as expected: relay the rest uncounted
                        state = None
        except OSError:
            pass
        TcpRelay._pipe(a, b)  # the stream ended: close both sides the same way

    def _parse(self, buf, state):
        while True:
            if state[1]:
                n = min(state[1], len(buf))
                del buf[:n]
                state[1] -= n
                if state[1]:
                    return
            end = buf.find(b"\r\n\r\n" if state[0] == "head" else b"\r\n")
            if end < 0:
                return
            text = bytes(buf[:end]).decode("latin-1")
            del buf[:end + (4 if state[0] == "head" else 2)]
            if state[0] == "head":
                line, *fields = text.split("\r\n")
                method, target, _ = line.split(" ")
                with self.lock:
                    self.requests.append((time.time(), method, target))
                head = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
                if "chunked" in head.get("transfer-encoding", "").lower():
                    state[0] = "chunk"
                else:
                    state[1] = int(head.get("content-length") or 0)
            elif state[0] == "chunk":  # a chunk's size line, then its bytes and CRLF
                size = int(text.split(";")[0], 16)
                state[:] = ["trailer", 0] if size == 0 else ["chunk", size + 2]
            elif not text:  # the empty line after the trailers ends the request
                state[0] = "head"

    def between(self, t0, t1):
        with self.lock:
            return [r for r in self.requests if t0 <= r[0] <= t1]


class LatestWatch:
    """Counts opens of adapters/LATEST in a folder with inotify (Linux, through ctypes): every read of
    LATEST by a DirBucket opens the file. times: when each open happened."""

    IN_OPEN = 0x20

    def __init__(self, folder):
        self.times, self.stop = [], threading.Event()
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, folder.encode(), self.IN_OPEN) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {folder}")
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        while not self.stop.is_set():
            if not select.select([self.fd], [], [], 0.2)[0]:
                continue
            data, i = os.read(self.fd, 65536), 0
            while i < len(data):
                _, mask, _, n = struct.unpack_from("iIII", data, i)
                name = data[i + 16:i + 16 + n].rstrip(b"\0")
                i += 16 + n
                if name == b"LATEST":
                    self.times.append(time.time())

    def close(self):
        self.stop.set()
        self.thread.join()
        os.close(self.fd)


class Mirror:
    """Eventually consistent copy of A/adapters into B/adapters: each new, changed or deleted file
    shows in B after its own delay, uniform in lag = (lo, hi) seconds, written atomically (a view
    shows a file whole). A path never goes back to an older content (newest seen wins).
    shown[key]: times each key's content was applied in B, with the content's first bytes."""

    def __init__(self, src, dst, lag, seed=0, sub="adapters"):  # sub="": every file (hf_jobs_emulator)
        self.src, self.dst, self.lag, self.rng, self.sub = src, dst, lag, random.Random(seed), sub
        self.stop, self.pending, self.applied = threading.Event(), [], {}  # applied: key -> seq
        self.shown = collections.defaultdict(list)  # key -> [(time, bytes or None)]
        self.seen, self.seq = {}, 0  # key -> stat signature in A
        os.makedirs(os.path.join(dst, sub), exist_ok=True)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _scan(self):
        now, found = {}, os.path.join(self.src, self.sub)
        for folder, _, names in os.walk(found):
            for n in names:
                if n.startswith("."):  # a writer's temporary file
                    continue
                path = os.path.join(folder, n)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                now[os.path.relpath(path, self.src)] = (st.st_ino, st.st_size, st.st_mtime_ns)
        return now

    def _schedule(self, key, data):
        self.seq += 1
        first = key.startswith("adapters/v000000/") or (key == buckets.LATEST and data and sync_version(data) == 0)
        lag = 0.0 if first else self.rng.uniform(*self.lag)  # v0, before step 1: the start is not measured
        self.pending.append((time.time() + lag, self.seq, key, data))

    def _apply(self, seq, key, data):
        if self.applied.get(key, 0) > seq:
            return
        self.applied[key] = seq
        path = os.path.join(self.dst, key)
        if data is None:
            if os.path.exists(path):
                os.remove(path)
                try:
                    os.rmdir(os.path.dirname(path))
                except OSError:  # not empty yet
                    pass
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.mirror.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        self.shown[key].append((time.time(), data))

    def _run(self):
        while not self.stop.is_set():
            now = self._scan()
            for key, sig in now.items():
                if self.seen.get(key) != sig:
                    try:
                        with open(os.path.join(self.src, key), "rb") as f:
                            data = f.read()
                    except OSError:  # replaced or deleted meanwhile: the next scan sees it
                        continue
                    self.seen[key] = sig
                    self._schedule(key, data)
            for key in set(self.seen) - set(now):
                del self.seen[key]
                self._schedule(key, None)
            # one clock reading for both: with two, a change due between them was in neither list
            # and never shown (an emulated job then waited for a LATEST it never saw)
            t = time.time()
            due = sorted(p for p in self.pending if p[0] <= t)
            self.pending = [p for p in self.pending if p[0] > t]
            for _, seq, key, data in due:
                self._apply(seq, key, data)
            time.sleep(0.05)

    def visible(self, version):
        """When B first held every file of vN and a LATEST naming N or later (None: never)."""
        prefix = f"adapters/v{version:06d}/"
        files = [k for k in self.shown if k.startswith(prefix)]
        latest = [t for t, d in self.shown.get("adapters/LATEST", []) if d and sync_version(d) >= version]
        if not files or not latest:
            return None
        return max([min(t for t, d in self.shown[k] if d is not None) for k in files] + [min(latest)])

    def close(self):
        self.stop.set()
        self.thread.join()


def sync_version(data):
    try:
        return int(re.search(rb"\d+", data).group(0))
    except AttributeError:
        return -1


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else None


def run_one(opts, kind, staleness, steps, out, s3_port):
    """One run of proxy + replicas + trainer on one bucket kind; returns the numbers of the table."""
    run_dir = os.path.join(out, f"{kind}-S{staleness}")
    os.makedirs(run_dir)
    py, port = sys.executable, free_port()
    G, B, L = str(opts.num_generations), str(opts.groups_per_step), str(opts.max_new_tokens)
    relays = {"trainer": CountingRelay(port).start()}
    relays.update({f"replica-{i}": CountingRelay(port).start() for i in range(opts.replicas)})
    s3_relays, envs, watch, mirror = {}, {}, None, None
    if kind == "s3":
        write_url = read_url = make_s3_bucket(f"{kind}-S{staleness}")
        for name in relays:  # each role talks to S3 through its own counting relay
            s3_relays[name] = CountingRelay(s3_port).start()
            envs[name] = aws_env(f"http://127.0.0.1:{s3_relays[name].port}")
    else:
        write_url = os.path.join(run_dir, "bucket")
        read_url = write_url if kind == "dir" else os.path.join(run_dir, "mount")
        os.makedirs(os.path.join(write_url, "adapters"))
        if kind == "mount":
            mirror = Mirror(write_url, read_url, opts.lag, seed=staleness)
        try:
            watch = LatestWatch(os.path.join(read_url, "adapters"))
        except OSError as e:
            print(f"  (no inotify: LATEST reads not counted: {e})", flush=True)
    poll = ["--poll-interval", str(opts.poll_interval)] if opts.poll_interval is not None else []
    roles = [Role("proxy", [py, "proxy.py", "--port", str(port), "--max-staleness", str(staleness),
                            "--num-generations", G, "--groups-per-step", B, "--max-new-tokens", L],
                  role_env(), run_dir, ROOT)]
    try:
        wait_port(port)
        replicas = [Role(f"replica-{i}", [py, "rollout.py", "--engine", "hf", "--task", "toy", "--model", opts.model,
                                          "--bucket", read_url, "--proxy",
                                          f"http://127.0.0.1:{relays[f'replica-{i}'].port}",
                                          "--replica-id", str(i), "--num-replicas", str(opts.replicas), "--seed", "0",
                                          "--cache-dir", os.path.join(run_dir, f"cache-{i}"), *poll],
                         role_env(envs.get(f"replica-{i}")), run_dir, ROOT) for i in range(opts.replicas)]
        trainer = Role("trainer", [py, "trainer.py", "--model", opts.model, "--bucket", write_url, "--proxy",
                                   f"http://127.0.0.1:{relays['trainer'].port}", "--learning-rate", "1e-5",
                                   "--lora-r", "8", "--lora-alpha", "16", "--max-steps", str(steps),
                                   "--save-every", str(steps), "--wait-timeout", "600"],
                       role_env(envs.get("trainer")), run_dir, ROOT)
        roles += [*replicas, trainer]
        if trainer.proc.wait(timeout=1800) != 0:
            sys.exit(f"bench: trainer failed ({kind} S={staleness}):\n{trainer.tail()}\n"
                     f"replica-0:\n{replicas[0].tail()}")
    finally:  # the replicas would exit after their current batch (tests/test_jobs_local.py checks that)
        for r in reversed(roles):
            r.stop()
        for x in (watch, mirror, *relays.values(), *s3_relays.values()):
            if x is not None:
                x.close() if hasattr(x, "close") else x.stop()
    metrics = {m["step"]: m for m in buckets.read_metrics(write_url)}
    return analyse(opts, kind, staleness, metrics, trainer, replicas, relays, s3_relays, watch, mirror)


def analyse(opts, kind, staleness, metrics, trainer, replicas, relays, s3_relays, watch, mirror):
    step_t = {int(m.group(1)): t for t, line in trainer.lines if (m := STEP.search(line))}
    pub = {int(m.group(1)): t for t, line in trainer.lines if (m := PUBLISHED.search(line))}
    n = max(metrics)
    t0, t1 = step_t[1], max(t for t, line in trainer.lines if DONE.search(line))  # the measured window
    wall = metrics[n]["time"] - metrics[1]["time"]
    win = [metrics[k] for k in range(2, n + 1)]
    versions = [v for v in pub if 1 <= v < max(pub) and pub[v] >= t0]  # the last one: nobody needs it
    loads = {r.name: [(t, int(m.group(1))) for t, line in r.lines if (m := LOADED.search(line))] for r in replicas}
    batches = [(t, int(m.group(1))) for r in replicas for t, line in r.lines if (m := BATCH.search(line))]
    loaded = [min(t for t, u in loads[r] if u >= v) - pub[v] for v in versions for r in loads
              if any(u >= v for _, u in loads[r])]
    first = [min(t for t, u in batches if u >= v) - pub[v] for v in versions if any(u >= v for _, u in batches)]
    visible = [mirror.visible(v) - pub[v] for v in versions if mirror and mirror.visible(v)]
    minutes = (t1 - t0) / 60
    per_min = collections.Counter()
    for name in loads:
        for _, method, target in relays[name].between(t0, t1):
            per_min[f"{method} {target.split('?')[0]}"] += 1 / minutes / len(loads)
    latest = None
    if kind == "s3":
        latest = sum(1 for name in loads for _, m, tg in s3_relays[name].between(t0, t1)
                     if m == "GET" and tg.split("?")[0].endswith("/adapters/LATEST")) / minutes / len(loads)
        s3_all = sum(len(s3_relays[name].between(t0, t1)) for name in loads) / minutes / len(loads)
        s3_trainer = len(s3_relays["trainer"].between(t0, t1)) / len(win)
    elif watch:
        own = sum(1 for v, t in pub.items() if t0 <= t <= t1) if kind == "dir" else 0  # the trainer's reads
        latest = max(0, sum(1 for t in watch.times if t0 <= t <= t1) - own) / minutes / len(loads)
    skipped = sum(len(versions) - len({u for _, u in loads[r] if u in versions}) for r in loads)
    return {"run": f"{kind} S={staleness}", "steps": len(win), "step_s": wall / len(win),
            "compute_s": sum(m["compute_s"] for m in win) / len(win),
            "wait": sum(m["wait_s"] for m in win) / wall,
            "staleness": sum(m["staleness_mean"] * m["groups"] for m in win) / sum(m["groups"] for m in win),
            "visible": visible, "loaded": loaded, "first": first, "versions": len(versions),
            "skipped": skipped / len(loads), "per_min": per_min, "latest": latest,
            "s3_per_min": s3_all if kind == "s3" else None, "s3_trainer": s3_trainer if kind == "s3" else None,
            "trainer_per_min": len(relays["trainer"].between(t0, t1)) / minutes}


def print_table(rows, opts):
    cols = [r["run"] for r in rows]
    lines = [f"{'':<40}" + "".join(f"{c:>14}" for c in cols)]

    def row(label, fmt):
        lines.append(f"{label:<40}" + "".join(f"{fmt(r):>14}" for r in rows))

    def p(key):
        return lambda r: "-" if not r[key] else f"{pct(r[key], 0.5):.1f} / {pct(r[key], 0.95):.1f}"

    row("trainer steps measured", lambda r: f"{r['steps']}")
    row("seconds per step (compute)", lambda r: f"{r['step_s']:.1f} ({r['compute_s']:.1f})")
    row("trainer wait (wait_s / wall)", lambda r: f"{r['wait']:.0%}")
    row("mean staleness of the groups used", lambda r: f"{r['staleness']:.2f}")
    row("publish -> visible s, p50 / p95", p("visible"))
    row("publish -> loaded s, p50 / p95", p("loaded"))
    row("publish -> 1st group s, p50 / p95", p("first"))
    row("versions skipped / published, per rep.", lambda r: f"{r['skipped']:.1f} / {r['versions']}")
    endpoints = sorted({k for r in rows for k in r["per_min"]}, key=lambda k: -sum(r["per_min"][k] for r in rows))
    for k in endpoints:
        row(f"replica {k} /min", lambda r: f"{r['per_min'][k]:.1f}")
    row("replica requests /min to the proxy", lambda r: f"{sum(r['per_min'].values()):.1f}")
    row("replica requests /5 min (Hub: ~1,000)", lambda r: f"{5 * sum(r['per_min'].values()):.0f}")
    row("trainer requests /min to the proxy", lambda r: f"{r['trainer_per_min']:.1f}")
    row("replica LATEST reads /min", lambda r: "-" if r["latest"] is None else f"{r['latest']:.1f}")
    row("replica S3 requests /min (all)", lambda r: "-" if r["s3_per_min"] is None else f"{r['s3_per_min']:.1f}")
    row("trainer S3 requests per step", lambda r: "-" if r["s3_trainer"] is None else f"{r['s3_trainer']:.1f}")
    print("\n".join(lines))


def parse_run(spec):
    kind, _, rest = spec.partition(":")
    s, _, steps = rest.partition(":")
    if kind not in ("dir", "mount", "s3") or not s.isdigit() or (steps and not steps.isdigit()):
        raise argparse.ArgumentTypeError(f"{spec!r}: write KIND:S[:STEPS], KIND dir, mount or s3, e.g. mount:4:12")
    return kind, int(s), int(steps) if steps else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", type=parse_run, help="KIND:S[:STEPS] each (default: dir:4:5 mount:4:9 "
                   "mount:1:4 mount:0:3 s3:4:5)",
                   default=[("dir", 4, 5), ("mount", 4, 9), ("mount", 1, 4), ("mount", 0, 3), ("s3", 4, 5)])
    p.add_argument("--steps", type=int, default=10, help="trainer steps of a run that names none")
    p.add_argument("--lag", type=float, nargs=2, default=[10.0, 30.0], metavar=("LO", "HI"),
                   help="mount: seconds before a file written in A shows in B, uniform in [LO, HI]")
    p.add_argument("--replicas", type=int, default=2, help="rollout.py replicas per run")
    p.add_argument("--groups-per-step", type=int, default=16, help="the proxy's --groups-per-step")
    p.add_argument("--num-generations", type=int, default=8, help="the proxy's --num-generations")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the proxy's --max-new-tokens (sets the step time)")
    p.add_argument("--poll-interval", type=float, help="the replicas' --poll-interval (default: rollout.py's)")
    p.add_argument("--model", help="base model folder (default: the tiny test model, built into --out)")
    p.add_argument("--out", default="/tmp/bench_propagation", help="work folder: model, buckets, logs (emptied first)")
    opts = p.parse_args()
    fresh_out(opts)
    print(f"workload: tiny model, task toy, G={opts.num_generations}, {opts.groups_per_step} groups per step, "
          f"--max-new-tokens {opts.max_new_tokens}; {opts.replicas} replica(s) --engine hf (--poll-interval "
          f"{opts.poll_interval if opts.poll_interval is not None else 'default'}) + trainer, 1 thread each, "
          f"{os.cpu_count()} CPUs; mount lag {opts.lag[0]:g}-{opts.lag[1]:g} s per file; load average "
          f"{open('/proc/loadavg').read().split()[0]}", flush=True)
    moto, rows, start = None, [], time.time()
    try:
        for kind, s, steps in opts.runs:
            if kind == "s3" and moto is None:
                moto, s3_port = start_moto()
                os.environ.update(aws_env(f"http://127.0.0.1:{s3_port}"))  # make_s3_bucket's client
            t = time.time()
            rows.append(run_one(opts, kind, s, steps or opts.steps, opts.out, s3_port if kind == "s3" else None))
            print(f"{rows[-1]['run']}: {time.time() - t:.0f} s (logs in {opts.out}/{kind}-S{s}); load average "
                  f"{open('/proc/loadavg').read().split()[0]}", flush=True)
    finally:
        if moto:
            moto.kill()
            moto.wait()
    print(f"\n{time.time() - start:.0f} s in all; seconds from the trainer's 'published vN' line; per replica, "
          "over the trainer's steps 2..N\n")
    print_table(rows, opts)


if __name__ == "__main__":
    main()
