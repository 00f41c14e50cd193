"""Benchmark: publish -> visible -> pulled latency of an adapter through sync.py.

    .venv/bin/python bench/bench_sync.py                 # 1 MB and 20 MB, dir and S3, 5 runs each
    .venv/bin/python bench/bench_sync.py --repeats 9 --sizes 1 20 100

For each backend and size, the trainer side publishes a fresh version (random weights) while a
replica thread polls latest_version every 5 ms; as soon as it sees the version it pulls and
verifies it. Times are seconds since publish_adapter was called, medians over the runs. The S3
backend is a moto_server this script starts on 127.0.0.1: the real wire protocol, but no real
network, so the S3 numbers are a floor (request handling, hashing, copies), not a WAN figure.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import sync  # noqa: E402
from support import buckets
from conftest import free_port, wait_port  # noqa: E402


def one_run(bucket, version, size_mb, work):
    """Publish one adapter of size_mb; return (published, visible, pulled) seconds from the start."""
    src = os.path.join(work, f"src{version}")
    os.makedirs(src)
    with open(os.path.join(src, "adapter_model.safetensors"), "wb") as f:
        f.write(os.urandom(int(size_mb * 1e6)))
    with open(os.path.join(src, "adapter_config.json"), "w") as f:
        f.write('{"r": 8, "lora_alpha": 16}')
    seen = {}

    def replica():
        while sync.latest_version(bucket) != version:
            time.sleep(0.005)
        seen["visible"] = time.perf_counter()
        sync.pull_adapter(bucket, version, os.path.join(work, "pulled"), timeout=60)
        seen["pulled"] = time.perf_counter()

    reader = threading.Thread(target=replica)
    reader.start()
    start = time.perf_counter()
    sync.publish_adapter(bucket, src, version, keep=3)
    published = time.perf_counter()
    reader.join()
    return published - start, seen["visible"] - start, seen["pulled"] - start


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="runs per backend and size (median shown)")
    p.add_argument("--sizes", type=float, nargs="+", default=[1, 20], help="adapter sizes in MB")
    args = p.parse_args()

    port = free_port()
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H",
                               "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench")
        with tempfile.TemporaryDirectory() as work:
            backends = {"dir": buckets.open_bucket(os.path.join(work, "bucket")),
                        "s3": buckets.open_bucket("s3://bench/run")}
            rows, version = [], 0
            for name, bucket in backends.items():
                for size in args.sizes:
                    runs = []
                    for i in range(args.repeats + 1):  # the first run warms up connections
                        run = one_run(bucket, version, size, work)
                        version += 1
                        if i:
                            runs.append(run)
                    rows.append((name, size, *(statistics.median(r[k] for r in runs) for k in range(3))))
    finally:
        server.kill()
        server.wait()

    print(f"median of {args.repeats} runs, seconds since publish_adapter() was called "
          "('returned' includes pruning, done after LATEST)")
    print(f"{'backend':<8} {'size':>7} {'returned':>10} {'visible':>9} {'pulled':>9}")
    for name, size, published, visible, pulled in rows:
        print(f"{name:<8} {size:>4g} MB {published:>10.3f} {visible:>9.3f} {pulled:>9.3f}")


if __name__ == "__main__":
    main()
