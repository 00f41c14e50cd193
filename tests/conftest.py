"""Shared fixtures: the tiny model, a real S3 server (moto_server on 127.0.0.1), free ports.

Everything here is real: the S3 server is a separate process spoken to over HTTP with boto3,
exactly as the roles speak to AWS S3, R2 or Hugging Face Storage Buckets.
"""

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Folder of the tiny Qwen3 + character tokenizer (tests/tiny_model.py), built once."""
    import tiny_model as tm

    return tm.build(str(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1; sets the standard AWS_* variables for boto3. Yields the endpoint."""
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield endpoint
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.kill()
    proc.wait()


def make_s3_bucket(prefix="run"):
    """Create a fresh bucket on the moto server; return its s3:// URL with a prefix."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return f"s3://{name}/{prefix}"


@pytest.fixture(params=["dir", "s3"])
def bucket_url(request, tmp_path):
    """The same test against a directory bucket and against the S3 server."""
    if request.param == "dir":
        return str(tmp_path / "bucket")
    request.getfixturevalue("s3_server")
    return make_s3_bucket()
