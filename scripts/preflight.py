"""The two jobs of `bash jobs.sh preflight` (standard library only: they run in python:3.12-slim).

    python3 scripts/preflight.py serve /bucket/NAME   # job 1: port 8000 exposed, the bucket read-only
    python3 scripts/preflight.py write /bucket/NAME   # job 2: the bucket read-write

serve answers, on 0.0.0.0:8000: /healthz; /headers, what reached the container: each request
header's name, with X-Proxy-Token's value and a SHA-256 prefix of Authorization's (so jobs.sh can
tell that the HF token arrived intact without the token being printed anywhere); /bucket, whether
and how long after it was written it saw the file that job 2 writes. write writes that file
(its own clock inside), then stays up a minute so that the mount can upload it. Both exit by
themselves after --seconds.
"""

import argparse
import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FILE = "from-writer.json"


def watch(folder, seen):
    while "at" not in seen:
        try:
            with open(os.path.join(folder, FILE)) as f:
                written = json.load(f)["written_at"]
            seen.update(at=time.time(), lag_s=round(time.time() - written, 1))
        except (OSError, ValueError, KeyError):
            time.sleep(0.5)


def serve(folder, seconds):
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
                body = {"seen": "at" in seen, "lag_s": seen.get("lag_s")}
            else:
                body = {"ok": True}
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):
            print("[preflight serve]", fmt % args, flush=True)

    server = ThreadingHTTPServer(("0.0.0.0", 8000), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"[preflight serve] listening on 0.0.0.0:8000, watching {folder}/{FILE}", flush=True)
    time.sleep(seconds)


def write(folder, seconds):
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump({"written_at": time.time()}, f)
    os.replace(tmp, os.path.join(folder, FILE))
    print(f"[preflight write] wrote {folder}/{FILE}", flush=True)
    time.sleep(seconds)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["serve", "write"])
    p.add_argument("folder", help="the run's folder in the mounted bucket")
    p.add_argument("--seconds", type=float, default=180, help="exit after this many seconds")
    a = p.parse_args()
    (serve if a.what == "serve" else write)(a.folder, a.seconds)
