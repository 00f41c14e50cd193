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
sys.path.insert(0, os.path.join(ROOT, "bench"))  # the chaos harness and the Jobs emulator the tests drive
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


# ---- jobs.sh: run it as macOS's bash 3.2 would, and clean up after a Hugging Face Jobs run ----

def jobs_sh(*args, script=None):
    """argv that runs jobs.sh (or `script`) under bash 3.2's `set -u` rule for arrays.

    macOS's /bin/bash 3.2 aborts on "${a[@]}" when the array `a` is empty (bash >= 4.4 expands it
    to nothing). Each such expansion is rewritten to "${a[@]?...}", which aborts the same way on an
    empty array and expands the same way otherwise, so a path that would fail on a Mac fails here.
    $0 stays the real jobs.sh, so the script finds its folder as usual. scripts/jobs_lib.sh, which
    jobs.sh sources, is put in its place and rewritten too."""
    import re

    path = script or os.path.join(ROOT, "jobs.sh")
    with open(path) as f:
        text = f.read()
    sourced = '. "$ROOT/scripts/jobs_lib.sh"'  # jobs.sh's plumbing: rewritten the same way
    if sourced in text:
        with open(os.path.join(ROOT, "scripts", "jobs_lib.sh")) as f:
            text = text.replace(sourced, f.read())
    text = re.sub(r"\$\{(\w+)\[@\]\}", r"${\1[@]?bash 3.2 with set -u aborts here: \1 is empty}", text)
    return ["bash", "-c", text, path, *args]


@pytest.fixture
def hf_run_name():
    """A fresh NAME for a Hugging Face Jobs launch; removes runs/NAME and restores runs/.last-hf."""
    import shutil

    name = f"test-{uuid.uuid4().hex[:8]}"
    last = os.path.join(ROOT, "runs", ".last-hf")
    saved = open(last).read() if os.path.exists(last) else None
    yield name
    shutil.rmtree(os.path.join(ROOT, "runs", name), ignore_errors=True)
    if saved is not None:
        with open(last, "w") as f:
            f.write(saved)
    elif os.path.exists(last):
        os.remove(last)


def make_lora_model(tiny_model):
    """trainer_state.build_model on the tiny model with a random (nonzero) LoRA B, so every LoRA
    weight has a gradient: the same weights at every call."""
    import torch

    from support import trainer_state

    model = trainer_state.build_model(tiny_model, lora_r=8, lora_alpha=16, seed=0)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B = 0 at init would leave lora_A without gradient
            torch.nn.init.normal_(p, std=0.05)
    return model


@pytest.fixture(scope="module")
def lora_model(tiny_model):
    return make_lora_model(tiny_model)


def processes_mentioning(*texts):
    """(pid, command line) of the processes (other than this one) whose command line contains
    any of `texts`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(t in cmd for t in texts):
            found.append((int(pid), cmd))
    return found
