"""The two jobs of `bash jobs.sh preflight` (standard library only: they run in python:3.12-slim).

    python3 scripts/preflight.py serve /bucket/NAME   # job 1: port 8000 exposed, the bucket read-only
    python3 scripts/preflight.py write /bucket/NAME   # job 2: the bucket read-write
    GATEWAY_TOKEN=hf_... python3 scripts/preflight.py probe URL   # jobs.sh, from this machine

serve answers, on 0.0.0.0:8000: /healthz; /headers, what reached the container: each request
header's name, with X-Proxy-Token's value and a SHA-256 prefix of Authorization's (so jobs.sh can
tell that the HF token arrived intact without the token being printed anywhere); /bucket, whether
and how long after it was written it saw the file that job 2 writes, and job 2's verdicts on the
trainer's write path. write first runs that path on the mount: support/buckets.py's DirBucket,
the code trainer.py writes the bucket with (a folder made and opened with dir_fd and O_NOFOLLOW,
a temp file with O_EXCL, fsync, os.replace, an existing LATEST replaced, os.fwalk, unlink +
rmdir), one verdict line each; then it writes that file (its own clock and the verdicts inside)
with a plain open + os.replace, so job 1 learns the verdicts even when DirBucket's writes fail,
and stays up a minute so that the mount can upload it. Both exit by themselves after --seconds.

probe sends job 1, through the gateway, what a run sends: a POST of --post-mb MB (a replica's
POST /rollouts carries up to ~1 MB of groups) with `Authorization: Bearer $GATEWAY_TOKEN` and an
X-Proxy-Token, which serve answers with the size and a SHA-256 prefix of what arrived; then a GET
that serve holds --hold s before answering (the proxy holds /quota and /batch up to 30 s). One
verdict line each: the status, the time, and whether the body arrived whole or the hold was cut.
"""

import argparse
import hashlib
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support.buckets import BucketError, DirBucket  # noqa: E402  the standard library only

FILE = "from-writer.json"
CHECK = "dirbucket-check"  # the folder, beside FILE, that write_path writes and deletes


def watch(folder, seen):
    while "at" not in seen:
        try:
            with open(os.path.join(folder, FILE)) as f:
                got = json.load(f)
            seen.update(at=time.time(), lag_s=round(time.time() - got["written_at"], 1),
                        write_path=got.get("write_path"))
        except (OSError, ValueError, KeyError):
            time.sleep(0.5)


def serve(folder, seconds, port=8000):
    seen = {}
    threading.Thread(target=watch, args=(folder, seen), daemon=True).start()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/headers":
                auth = self.headers.get("Authorization")
                body = {"names": sorted(self.headers.keys()),
                        "authorization_sha256": auth and hashlib.sha256(auth.encode()).hexdigest()[:16],
                        "x_proxy_token": self.headers.get("X-Proxy-Token")}
            elif self.path == "/bucket":
                body = {"seen": "at" in seen, "lag_s": seen.get("lag_s"),
                        "write_path": seen.get("write_path")}
            elif self.path.startswith("/hold?seconds="):  # what the proxy's /batch does
                t0 = time.monotonic()
                time.sleep(min(float(self.path.split("=", 1)[1]), 120))
                body = {"held_s": round(time.monotonic() - t0, 1)}
            else:
                body = {"ok": True}
            self.answer(body)

        def do_POST(self):  # what a replica's POST /rollouts does: its size and a hash of it
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.answer({"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16]})

        def answer(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):
            print("[preflight serve]", fmt % args, flush=True)

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"[preflight serve] listening on 0.0.0.0:{port}, watching {folder}/{FILE}", flush=True)
    time.sleep(seconds)


def write_path(folder, retry_after=5.0):
    """The trainer's bucket writes, done by DirBucket itself in folder/CHECK: {step: "ok" or what
    failed}, one printed verdict each. hf-mount has refused a create without O_TRUNC (DirBucket's
    temp file has O_EXCL | O_TRUNC) and the unlink of a file just written (still uploading): the
    delete is tried at once, then again after retry_after s."""
    b, verdicts = DirBucket(os.path.join(folder, CHECK)), {}
    adapter, latest = "adapters/v000000/adapter_model.safetensors", "adapters/LATEST"

    def write_new():  # makes adapters/v000000/ on the way
        b.write(adapter, b"weights")
        return None if b.read(adapter) == b"weights" else f"read back {b.read(adapter)!r}"

    def replace():  # what every publish does to LATEST
        b.write(latest, b"1")
        b.write(latest, b"2")
        return None if b.read(latest) == b"2" else f"read back {b.read(latest)!r}, not b'2'"

    def listed():
        return None if b.list() == sorted([adapter, latest]) else f"listed {b.list()}"

    def delete():  # DirBucket.delete ignores a failed unlink or rmdir: the listing tells
        for key in b.list():
            b.delete(key)
        return f"still there: {b.list()}" if b.list() else None

    def step(name, attempt):
        try:
            problem = attempt()
        except (BucketError, OSError) as e:
            problem = f"{type(e).__name__}: {e}"
        verdicts[name] = problem or "ok"
        print(f"[preflight write] DirBucket {name}: {verdicts[name]}", flush=True)
        return problem is None

    step("write (a new folder, temp file O_EXCL | O_TRUNC + fsync, os.replace)", write_new)
    step("replace (LATEST written twice)", replace)
    step("list (os.fwalk)", listed)
    if not step("delete (unlink + rmdir) right after the write", delete):
        time.sleep(retry_after)
        step(f"delete {retry_after:g} s later", delete)
    try:
        os.rmdir(b.url)
    except OSError:
        pass
    return verdicts


def write(folder, seconds):
    os.makedirs(folder, exist_ok=True)
    verdicts = write_path(folder)
    tmp = os.path.join(folder, f".{FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump({"written_at": time.time(), "write_path": verdicts}, f)
    os.replace(tmp, os.path.join(folder, FILE))
    print(f"[preflight write] wrote {folder}/{FILE}", flush=True)
    time.sleep(seconds)


def request(url, data=None, timeout=60):
    """(status, seconds, parsed JSON body or None) of one request through the gateway, with the
    headers a replica sends; status 0 when nothing answered."""
    headers = {"Authorization": f"Bearer {os.environ['GATEWAY_TOKEN']}",
               "X-Proxy-Token": os.environ.get("PROBE", "preflight"),
               "Content-Type": "application/json"}
    t0 = time.monotonic()
    try:
        req = urllib.request.Request(url, data, headers)
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, b""
    except OSError:
        status, body = 0, b""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    return status, round(time.monotonic() - t0, 1), parsed


def probe(url, post_mb=2.0, hold=35.0):
    """Print one verdict line for a POST of post_mb MB and one for a request held `hold` s."""
    body = json.dumps({"groups": os.urandom(int(post_mb * 2**20) // 2).hex()}).encode()
    status, took, got = request(f"{url}/upload", body)
    whole = got == {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()[:16]}
    print(f"[preflight] POST of {len(body) / 2**20:.1f} MB through the gateway (a replica posts up "
          f"to ~1 MB of groups): " + (f"{status} in {took} s, arrived whole" if whole else
                                      f"FAILED: status {status or 'none'} after {took} s"
                                      + (", arrived altered" if got else "")), flush=True)
    status, took, got = request(f"{url}/hold?seconds={hold:g}", timeout=hold + 60)
    held = bool(got) and got.get("held_s", 0) >= hold - 0.5
    print(f"[preflight] a request the job holds {hold:g} s (the proxy holds /quota and /batch up "
          f"to 30 s): " + (f"{status}, answered after {took} s" if held else
                           f"CUT: status {status or 'none'} after {took} s: the gateway does not "
                           f"keep a request open that long"), flush=True)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["serve", "write", "probe"])
    p.add_argument("folder", help="the run's folder in the mounted bucket; probe: job 1's URL")
    p.add_argument("--seconds", type=float, default=180, help="exit after this many seconds")
    p.add_argument("--port", type=int, default=8000, help="serve: the port")
    p.add_argument("--post-mb", type=float, default=2.0, help="probe: the POST's size in MB")
    p.add_argument("--hold", type=float, default=35.0, help="probe: seconds the request is held")
    a = p.parse_args()
    if a.what == "probe":
        sys.exit(probe(a.folder.rstrip("/"), a.post_mb, a.hold))
    elif a.what == "serve":
        serve(a.folder, a.seconds, a.port)
    else:
        write(a.folder, a.seconds)
