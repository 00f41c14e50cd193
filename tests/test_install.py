"""pip's resolver on the exact install sets of a GPU machine and of a Hugging Face Jobs replica.

    .venv/bin/python -m pytest -q tests/test_install.py   # ~2 min: PyPI metadata only

Nothing is installed: `pip install --dry-run --ignore-installed` into a throwaway --target, for
Linux x86_64 and Python 3.12 (the vLLM image's), CUDA wheels included, resolved on this CPU machine.
The sets are read from the scripts themselves: `SETUP_DRY_RUN=1 SETUP_GPU=1 bash setup.sh --test`
prints the pip commands a GPU machine runs, `DRY_RUN=1 bash jobs.sh` the job command, whose
scripts/job_start.sh (`--packages` prints its list) adds requirements.txt (less torch and gguf) to
the image `vllm/vllm-openai:vX` (vLLM X and its torch). pip runs isolated from this machine's configuration (no local wheel folders, no
constraints file): PyPI only. Skipped, with the reason, only when PyPI cannot be reached.
"""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
from conftest import ROOT, jobs_sh

# manylinux tags a Linux x86_64 machine with glibc 2.35 (Ubuntu 22.04, the vLLM image) accepts:
# pip 23 does not widen a given --platform to the older manylinux tags by itself.
PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(35, 16, -1)] + ["manylinux2014_x86_64"]


@pytest.fixture(scope="module")
def pypi():
    try:
        socket.create_connection(("pypi.org", 443), timeout=10).close()
    except OSError as e:
        pytest.skip(f"PyPI is unreachable ({e}): the resolver check needs its metadata")


def resolve(args, tmp_path):
    """pip's resolver on `args` (requirement specifiers and -r files, relative to ROOT).
    Returns (ok, pip's output, {name: version} of what it would install)."""
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed",
           "--quiet", "--disable-pip-version-check", "--report", str(report),
           "--target", str(tmp_path / "target"), "--python-version", "3.12",
           "--only-binary=:all:", *[f"--platform={p}" for p in PLATFORMS], *args]
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
    env = {k: v for k, v in env.items() if not k.startswith("PIP_") or k == "PIP_CONFIG_FILE"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        return False, res.stdout + res.stderr, {}
    items = json.loads(report.read_text())["install"]
    return True, res.stderr, {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in items}


def setup_gpu_set(test):
    """Every requirement setup.sh installs on a GPU machine (its pip commands, one per line)."""
    env = dict(os.environ, SETUP_DRY_RUN="1", SETUP_GPU="1")
    res = subprocess.run(["bash", "setup.sh", *(["--test"] if test else [])], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    lines = [line.split()[2:] for line in res.stdout.splitlines() if line.startswith("pip install ")]
    assert len(lines) == 2, res.stdout  # torch alone, then the rest
    return [a for line in lines for a in line]


def jobs_image_set(name):
    """The image's vLLM pin and the packages a replica job pip-installs into it (jobs.sh's DRY_RUN)."""
    env = dict(os.environ, DRY_RUN="1", BUCKET="me/b", NAME=name)
    res = subprocess.run(jobs_sh(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    replica = next(line for line in res.stderr.splitlines() if " jobs run " in line and "rollout.py" in line)
    version = re.search(r" vllm/vllm-openai:v(\d+\.\d+\.\d+) ", replica).group(1)
    assert " exec bash scripts/job_start.sh python3 rollout.py " in replica, replica  # installs, then runs
    pkgs = subprocess.run(["bash", "scripts/job_start.sh", "--packages"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.split()  # the list job_start.sh installs
    return version, pkgs


def test_setup_gpu_install_set_resolves(pypi, tmp_path):
    args = setup_gpu_set(test=True)  # `bash setup.sh --test`: the roles' set and more
    assert "-r" in args and any(a.startswith("vllm==") for a in args), args
    ok, out, got = resolve(args, tmp_path)
    assert ok, f"`pip install {' '.join(args)}` cannot resolve on a GPU machine:\n{out[-3000:]}"
    torch_pin = next(a for a in args if a.startswith("torch=="))
    assert got["torch"] == torch_pin.split("==")[1] and got["vllm"] in args[-1], got


def test_jobs_image_install_line_resolves(pypi, tmp_path, hf_run_name):
    version, pkgs = jobs_image_set(hf_run_name)
    assert not [p for p in pkgs if p.startswith(("torch", "gguf"))] and "peft==0.21.2" in pkgs, pkgs
    assert f"vllm=={version}" in setup_gpu_set(False)  # the image's vLLM is setup.sh's pin
    ok, out, got = resolve([f"vllm=={version}", *pkgs], tmp_path)
    assert ok, f"the image's vllm=={version} with the job's `pip install {' '.join(pkgs)}`:\n{out[-3000:]}"
    assert got["vllm"] == version and got["torch"] == "2.13.0", got


def test_the_resolver_check_fails_on_a_vllm_that_needs_another_torch(pypi, tmp_path):
    """vllm 0.33.0 requires torch 2.14.0: with requirements.txt's torch 2.13.0 nothing resolves."""
    args = [a if not a.startswith("vllm==") else "vllm==0.33.0" for a in setup_gpu_set(False)]
    ok, out, _ = resolve(args, tmp_path)
    assert not ok and "ResolutionImpossible" in out and "torch" in out, out[-3000:]
