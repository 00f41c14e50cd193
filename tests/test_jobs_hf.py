"""jobs.sh on Hugging Face Jobs, with a stand-in `hf` first on PATH.

The real service cannot be reached from here. The stand-in records every argument vector it is
called with and answers `jobs run --detach` with a fresh 24-hex job id, as the real CLI does; the
test then checks what each of the three launches carries, and that `stop` cancels exactly the
ids that were launched.
"""

import os
import re
import shlex
import shutil
import subprocess
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STAND_IN = r"""#!/usr/bin/env bash
# stand-in for the hf CLI: record the call, answer like the real one
printf '%q ' "$@" >> "$HF_STANDIN_LOG"; echo >> "$HF_STANDIN_LOG"
case "$1 $2" in
  "jobs run")
    n=$(grep -c '^jobs run' "$HF_STANDIN_LOG")
    printf 'Job started with ID: %024x\nView at: https://huggingface.co/jobs/u/%024x\n' $((0xabc000 + n)) $((0xabc000 + n)) ;;
  "auth token") echo hf_standin_token ;;
  "jobs inspect") echo '[{"id": "'"$3"'", "status": {"stage": "RUNNING"}}]' ;;
esac
"""


def run_jobs(tmp_path, *args, **env_extra):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    hf = bindir / "hf"
    hf.write_text(STAND_IN)
    hf.chmod(0o755)
    log = tmp_path / "hf-calls.log"
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", HF_STANDIN_LOG=str(log), **env_extra)
    env.pop("HF_TOKEN", None)
    res = subprocess.run(["bash", "jobs.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    calls = [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []
    return res, calls


def value_after(argv, flag):
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_hf_jobs_launch_and_stop(tmp_path):
    name = f"test-{uuid.uuid4().hex[:8]}"
    last = os.path.join(ROOT, "runs", ".last-hf")
    saved_last = open(last).read() if os.path.exists(last) else None
    try:
        res, calls = run_jobs(tmp_path, NAME=name, BUCKET="alice/grpo-bucket", REPLICAS="2",
                              ROLLOUT_FLAVOR="a10g-small", TRAINER_FLAVOR="a100-large")
        assert res.returncode == 0, res.stderr + res.stdout
        assert ["buckets", "create", "alice/grpo-bucket", "--private", "--exist-ok"] in calls
        runs = [c for c in calls if c[:2] == ["jobs", "run"]]
        assert len(runs) == 4, runs  # proxy, 2 replicas, trainer
        proxy, r0, r1, trainer = runs
        for c in runs:
            assert "--detach" in c and value_after(c, "--secrets") == ["HF_TOKEN"]
            assert any(v.endswith(":/code") for v in value_after(c, "-v")), c  # code shipped as a volume

        # the proxy: CPU flavour, port exposed, bound to 0.0.0.0, token from the HF token secret
        assert value_after(proxy, "--flavor") == ["cpu-basic"]
        assert value_after(proxy, "--expose") == ["8000"]
        assert "--host 0.0.0.0 --port 8000" in proxy[-1] and "PROXY_TOKEN=$HF_TOKEN" in proxy[-1]

        # its job id, as the stand-in printed it, makes the URL the others are given
        proxy_id = re.search(r"proxy: ([0-9a-f]{24})", res.stdout).group(1)
        url = f"https://{proxy_id}--8000.hf.jobs"
        for i, c in enumerate([r0, r1]):
            assert value_after(c, "--flavor") == ["a10g-small"]
            assert "hf://buckets/alice/grpo-bucket:/bucket:ro" in value_after(c, "-v")  # read-only
            assert f"PROXY_URL={url}" in value_after(c, "-e")
            assert c[-4].startswith("vllm/vllm-openai:") and c[-3:-1] == ["bash", "-c"]
            cmd = c[-1]
            assert "rollout.py" in cmd and f"--proxy {url}" in cmd and f"--replica-id {i}" in cmd
            assert f"--bucket /bucket/{name}" in cmd and "--num-replicas 2" in cmd
        assert value_after(trainer, "--flavor") == ["a100-large"]
        assert "hf://buckets/alice/grpo-bucket:/bucket" in value_after(trainer, "-v")  # read-write
        assert f"PROXY_URL={url}" in value_after(trainer, "-e")
        assert "trainer.py" in trainer[-1] and f"--proxy {url}" in trainer[-1]

        # jobs.txt holds the four ids; stop cancels exactly those
        with open(os.path.join(ROOT, "runs", name, "jobs.txt")) as f:
            ids = [line.split()[1] for line in f]
        assert len(set(ids)) == 4 and ids[0] == proxy_id
        (tmp_path / "hf-calls.log").unlink()
        res, calls = run_jobs(tmp_path, "stop", NAME=name)
        assert res.returncode == 0, res.stderr
        assert sorted(c[2] for c in calls if c[:2] == ["jobs", "cancel"]) == sorted(ids)
        assert all(c[:2] == ["jobs", "cancel"] for c in calls)

        res, calls = run_jobs(tmp_path, "status", NAME=name)
        assert res.returncode == 0 and res.stdout.count("RUNNING") == 4, res.stdout + res.stderr
    finally:
        shutil.rmtree(os.path.join(ROOT, "runs", name), ignore_errors=True)
        if saved_last is None:
            if os.path.exists(last):
                os.remove(last)
        else:
            with open(last, "w") as f:
                f.write(saved_last)


def test_hf_jobs_dry_run_runs_nothing(tmp_path):
    name = f"test-{uuid.uuid4().hex[:8]}"
    try:
        res, calls = run_jobs(tmp_path, NAME=name, BUCKET="alice/b", DRY_RUN="1")
        assert res.returncode == 0, res.stderr
        assert calls == []  # nothing reached the CLI
        printed = [line for line in res.stderr.splitlines() if " jobs run " in line]
        assert len(printed) == 4 and "--expose 8000" in printed[0]
    finally:
        shutil.rmtree(os.path.join(ROOT, "runs", name), ignore_errors=True)


def test_hf_jobs_needs_a_bucket(tmp_path):
    res, calls = run_jobs(tmp_path, NAME="x")
    assert res.returncode != 0 and "BUCKET is required" in res.stderr and calls == []
