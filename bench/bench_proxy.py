"""Load benchmark of proxy.py against the same API on FastAPI + uvicorn, in one run.

POST /rollouts with groups of 8 completions x 256 tokens at 1, 8 and 32 concurrent clients
(keep-alive connections), while a consumer drains the buffer with GET /batch?groups=64 as the
trainer does (after announcing its version). Both servers run as their own processes, share
proxy.py's validation and buffer code (so the ratio measures the HTTP layer alone), and are
measured in turns, level by level. The groups fit proxy.py's default contract (G 8, 256 tokens).
Not collected by pytest (no test_ prefix); FastAPI and uvicorn are benchmark-only dependencies.

    .venv/bin/python bench/bench_proxy.py                    # ~1 minute
    .venv/bin/python bench/bench_proxy.py --seconds 10 --clients 1 8 32 64
    .venv/bin/python bench/bench_proxy.py --post-size       # a real POST against --max-body-mb
"""

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from conftest import free_port, wait_port  # noqa: E402


def fastapi_app(max_groups=4096):
    """The proxy's POST /rollouts, GET /batch and POST /version on FastAPI, with proxy.py's own validation
    and buffer (default contract)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    import proxy
    from support import contract, http_hardening
    from support.worker_bounds import GuardedBuffer

    buffer, app = GuardedBuffer(proxy.RolloutBuffer(), max_groups=max_groups), FastAPI()

    @app.post("/rollouts")
    async def rollouts(request: Request):
        try:  # 400 naming the field, 409, 413, 429 when full
            return JSONResponse(buffer.add(contract.validate_rollouts(http_hardening.parse_json(await request.body()), max_groups,
                                                                   buffer.contract)))
        except http_hardening.ApiError as e:
            return JSONResponse({"error": str(e)}, status_code=e.code, headers=e.headers)

    @app.post("/version")
    async def version(request: Request):
        return JSONResponse(buffer.set_version(json.loads(await request.body())["version"]))

    @app.get("/batch")
    def batch(groups: int, timeout: float = 0.0):  # a plain def: FastAPI runs it in its thread pool, so it may block
        out, version, _ = buffer.take(groups, min(timeout, http_hardening.MAX_POLL_S))  # no ack: delivered once written
        return JSONResponse({"groups": out, "trainer_version": version})  # json.dumps, like proxy.py

    @app.get("/stats")
    def stats():
        return JSONResponse(buffer.stats())

    return app


def group_template(n=8, tokens=256, seed=0):  # proxy.py's default contract
    """A POST body of one group, with b"__GID__" where the group_id goes."""
    rnd = random.Random(seed)
    group = {"group_id": "__GID__", "policy_version": 0, "worker": "bench", "prompt": "x" * 200,
             "temperature": 1.0, "max_completion_length": tokens,
             "prompt_ids": [rnd.randrange(32000) for _ in range(64)],
             "completions": [{"ids": [rnd.randrange(32000) for _ in range(tokens)],
                              "logprobs": [-rnd.expovariate(2.0) for _ in range(tokens)],  # full float repr
                              "reward": float(rnd.random() < 0.5), "text": "y" * tokens * 3, "finish_reason": "length"}
                             for _ in range(n)]}
    return json.dumps({"groups": [group]}).encode()


def drain(port, stop):
    """The trainer: announce version 0, long-poll GET /batch and throw the groups away (read, not parsed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/version", b'{"version": 0}', {"Content-Type": "application/json"})
    conn.getresponse().read()
    while not stop.is_set():
        conn.request("GET", "/batch?groups=64&timeout=0.5")
        conn.getresponse().read()


def load(port, clients, seconds, template, tag):
    """`clients` keep-alive connections POSTing groups for `seconds`; returns (groups/s, latencies in s, statuses)."""
    deadline, lat, statuses, lock = time.perf_counter() + seconds, [], {}, threading.Lock()

    def client(c):
        conn, mine, seen, k = http.client.HTTPConnection("127.0.0.1", port, timeout=60), [], {}, 0
        while time.perf_counter() < deadline:
            body = template.replace(b"__GID__", f"{tag}-{c}-{k}".encode())
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/rollouts", body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                status = r.status
            except OSError as e:  # counted, and the connection is made again
                status = type(e).__name__
                conn.close()
            mine.append(time.perf_counter() - t0)
            seen[status] = seen.get(status, 0) + 1
            k += 1
        with lock:
            lat.extend(mine)
            for s, v in seen.items():
                statuses[s] = statuses.get(s, 0) + v

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses.get(200, 0) / (time.perf_counter() - t0), sorted(lat), statuses


def stats(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/stats")
    return json.loads(conn.getresponse().read())


def pct(xs, q):
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def post_size():
    """What a real POST weighs against the default --max-body-mb, and the longest the proxy can spend
    parsing a body within it (a JSON parse holds the GIL: the other endpoints wait that long)."""
    from support import contract, http_hardening, proxy_service

    c, limit = contract.CONTRACT, proxy_service.body_limit(contract.CONTRACT)
    B, G, T = c["groups_per_step"], c["num_generations"], c["max_completion_length"]
    one = group_template(G, T)
    groups = json.loads(one)["groups"] * B
    body = json.dumps({"groups": groups}).encode()  # as ProxyClient sends it
    print(f"# a POST of {B} groups x {G} x {T} tokens: {len(body) / 2**20:.2f} MiB, "
          f"{len(body) / (B * G * T):.1f} bytes a sampled token; default --max-body-mb "
          f"{limit / 2**20:.2f} MiB ({limit} bytes)")
    worst = b'{"groups": [' + b"[]," * ((limit - 16) // 3) + b"[]]}"
    for name, data in [("the real POST", body), ("a body of [] lists at the limit", worst)]:
        t0 = time.perf_counter()
        try:  # what the proxy does with it: parse, validate (the real one passes), free
            contract.validate_rollouts(http_hardening.parse_json(data), 4096, c)
        except http_hardening.ApiError as e:
            name += f" ({str(e)[:40]}...)"
        print(f"# parse, validate, free {name}, {len(data) / 2**20:.2f} MiB: {time.perf_counter() - t0:.3f} s")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--post-size", action="store_true", help="only print a real POST's size and parse times")
    p.add_argument("--seconds", type=float, default=6.0, help="load duration per server and concurrency level")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32], help="concurrency levels")
    p.add_argument("--serve-fastapi", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the FastAPI server process
    args = p.parse_args()
    if args.post_size:
        return post_size()
    if args.serve_fastapi:
        import uvicorn

        uvicorn.run(fastapi_app(), host="127.0.0.1", port=args.serve_fastapi, log_level="warning", access_log=False)
        return

    ports = {"proxy.py": free_port(), "FastAPI": free_port()}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "proxy.py"), "--port", str(ports["proxy.py"])],
                              env=env, stderr=subprocess.DEVNULL),
             subprocess.Popen([sys.executable, __file__, "--serve-fastapi", str(ports["FastAPI"])], env=env)]
    stop, template = threading.Event(), group_template()
    drains = [threading.Thread(target=drain, args=(port, stop), daemon=True) for port in ports.values()]
    try:
        for port, t in zip(ports.values(), drains):
            wait_port(port)
            t.start()
        print(f"# {len(template) / 1024:.0f} KiB per POST (1 group of 8 x 256 tokens); {args.seconds:g} s per cell; "
              f"{os.cpu_count()} CPUs; Python {sys.version.split()[0]}; consumer GET /batch?groups=64 running",
              flush=True)
        results = {}
        for clients in args.clients:
            for name, port in ports.items():
                load(port, clients, 0.5, template, f"warm{clients}")
                t0, delivered = time.perf_counter(), stats(port)["delivered"]
                rate, lat, statuses = load(port, clients, args.seconds, template, f"c{clients}")
                out = (stats(port)["delivered"] - delivered) / (time.perf_counter() - t0)  # what the consumer got
                results[name, clients] = (rate, pct(lat, 0.5), pct(lat, 0.99), out)
                print(f"  {name:8s} {clients:3d} clients: in {rate:6.1f} groups/s, out {out:6.1f} groups/s, "
                      f"p50 {pct(lat, 0.5):6.1f} ms, p99 {pct(lat, 0.99):6.1f} ms, statuses {statuses}", flush=True)
        print("\nPOST /rollouts groups/s in (and groups/s the consumer got out), latency of the POSTs:\n")
        print("| clients | proxy.py in (out) | p50 ms | p99 ms | FastAPI+uvicorn in (out) | p50 ms | p99 ms "
              "| ratio in | ratio in+out |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for clients in args.clients:
            a, b = results["proxy.py", clients], results["FastAPI", clients]
            print(f"| {clients} | {a[0]:.0f} ({a[3]:.0f}) | {a[1]:.1f} | {a[2]:.1f} | {b[0]:.0f} ({b[3]:.0f}) "
                  f"| {b[1]:.1f} | {b[2]:.1f} | {a[0] / b[0]:.2f} | {(a[0] + a[3]) / (b[0] + b[3]):.2f} |")
        for name, port in ports.items():  # the books balance on both after the load
            s = stats(port)
            ok = s["accepted"] == s["delivered"] + s["dropped_stale"] + s["dropped_zero_variance"] + s["buffered"]
            print(f"# {name}: accepted {s['accepted']}, delivered {s['delivered']}, buffered {s['buffered']}, "
                  f"refused_full {s['refused_full']}, identity {'holds' if ok else 'BROKEN'}")
    finally:
        stop.set()
        for t in drains:
            t.join(5)
        for proc in procs:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
