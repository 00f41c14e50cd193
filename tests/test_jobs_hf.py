"""jobs.sh on Hugging Face Jobs, with a recording stand-in `hf` first on PATH.

The stand-in records every argument vector it is called with and answers as huggingface_hub 2.4's
CLI does (`hf version`, `hf jobs run --detach` printing "id: <24 hex>", `hf jobs inspect --format
json`); environment variables make it fail where a test needs it to. These tests check what each
launch carries and how jobs.sh handles failures. tests/test_jobs_emulated.py runs the same jobs
for real, through the real CLI. Every jobs.sh here runs under bash 3.2's `set -u` rule (conftest).
"""

import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, jobs_sh

STAND_IN = r"""#!/usr/bin/env bash
# stand-in for the hf CLI: record the call, answer like huggingface_hub 2.4's
printf '%q ' "$@" >> "$HF_STANDIN_LOG"; echo >> "$HF_STANDIN_LOG"
if [ "$1 ${2:-}" = "jobs run" ] && [ -n "${HF_STANDIN_ENV:-}" ]; then  # the values --secrets would read
  for k in $HF_STANDIN_ENV; do printf '%s ' "${!k:-}"; done >> "${HF_STANDIN_LOG%/*}/hf-env.log"
  echo >> "${HF_STANDIN_LOG%/*}/hf-env.log"
fi
if [ "$1 ${2:-}" = "jobs run" ]; then  # what the job receives: each `--secrets NAME`'s value
  prev=; for a in "$@"; do [ "$prev" != --secrets ] || printf '%q ' "$a=${!a:-}"; prev=$a; done \
    >> "${HF_STANDIN_LOG%/*}/hf-secrets.log"
  echo >> "${HF_STANDIN_LOG%/*}/hf-secrets.log"
fi
case "$1 ${2:-}" in
  "version ")
    printf '%s\n' "${HF_STANDIN_VERSION:-✓ hf version
  version: 2.4.0}" ;;
  "jobs run")
    n=$(grep -c '^jobs run' "$HF_STANDIN_LOG")
    if [ "$n" = "${HF_STANDIN_FAIL_RUN:-}" ]; then echo "Error: 402 Payment Required: not enough credits" >&2; exit 1; fi
    echo "✓ Job started"
    [ "$n" = "${HF_STANDIN_NO_ID:-}" ] && exit 0
    printf '  id: %024x\n  url: https://huggingface.co/jobs/alice/%024x\n' $((0xabc000 + n)) $((0xabc000 + n))
    printf 'Use `hf jobs logs -f alice/%024x` to stream logs\n' $((0xabc000 + n)) >&2 ;;
  "auth token") echo hf_standin_token ;;
  "jobs inspect")
    id=${!#}
    urls=null; [ -z "${HF_STANDIN_URL:-}" ] || urls="[\"$HF_STANDIN_URL\"]"
    if [ "$3 $4" = "--format json" ]; then
      echo '[{"id": "'"$id"'", "status": {"stage": "'"${HF_STANDIN_STAGE:-RUNNING}"'", "message": null, "expose_urls": '"$urls"'}}]'
    else printf 'ID                       STATUS\n%s {stage: RUNNING}\n' "$id"; fi ;;
  "jobs cancel")
    if [ "$3" = "${HF_STANDIN_FAIL_CANCEL:-}" ]; then echo "Error: 500 Internal Server Error" >&2; exit 1; fi ;;
esac
"""
CONTRACT_FLAGS = ["--num-generations", "--groups-per-step", "--max-staleness", "--temperature",
                  "--max-new-tokens", "--max-completion-length", "--prompts-per-batch", "--sync-every",
                  "--zero-variance"]


GATEWAY_TOKEN = "hf_gateway_standin"  # the replicas' own token for the gateway (run_jobs's default)


FORBIDDEN_TOKEN = "hf_no_namespace_read"  # a real token the gateway answers 403: no read access


class Gateway(http.server.BaseHTTPRequestHandler):
    """The proxy job behind the Jobs gateway, as jobs.sh's health check meets it: /healthz answers
    200 only with a token that reads the namespace as a bearer: the user's HF token (the stand-in's
    `hf auth token`) or GATEWAY_TOKEN (401 otherwise, 403 for FORBIDDEN_TOKEN). Records each
    request's headers."""

    seen, stats, token = [], None, None  # stats: /stats's answer to the X-Proxy-Token `token`

    def do_GET(self):
        if self.path.startswith("/api/models/"):  # the Hub's model API (HF_ENDPOINT), anonymous
            return self.model_info(self.path.removeprefix("/api/models/"))
        Gateway.seen.append(dict(self.headers))
        if self.headers.get("Authorization") == f"Bearer {FORBIDDEN_TOKEN}":
            self.send_response(403)
            self.end_headers()
            return
        ok = self.headers.get("Authorization") in ("Bearer hf_standin_token", f"Bearer {GATEWAY_TOKEN}")
        if self.path == "/stats":
            ok = ok and Gateway.stats is not None and self.headers.get("X-Proxy-Token") == Gateway.token
        ok = ok and self.path in ("/healthz", "/stats")
        self.send_response(200 if ok else 401)
        self.end_headers()
        body = json.dumps(Gateway.stats if self.path == "/stats" else {"ok": True}).encode()
        self.wfile.write(body if ok else b"401 Unauthorized")

    def model_info(self, model):
        """As huggingface.co answers without a token: 401 for a private model, `gated` for a gated
        one ("manual" here), else false."""
        if model.endswith("private-model"):
            self.send_response(401)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        gated = "manual" if model.endswith("gated-model") else False
        self.wfile.write(json.dumps({"id": model, "private": False, "gated": gated}).encode())

    def log_message(self, *args):
        pass


@pytest.fixture(autouse=True)
def gateway():
    """URL of a Gateway on 127.0.0.1: the stand-in's `jobs inspect` shows it as the expose URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Gateway.seen, Gateway.stats = [], None
    Gateway.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield Gateway.url
    server.shutdown()


def run_jobs(tmp_path, *args, **env_extra):
    """Run jobs.sh with the stand-in first on PATH and GATEWAY_TOKEN set (env_extra may change
    both); returns (result, the stand-in's calls)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    hf = bindir / "hf"
    hf.write_text(STAND_IN)
    hf.chmod(0o755)
    log = tmp_path / "hf-calls.log"
    for f in (log, tmp_path / "hf-secrets.log"):
        if f.exists():
            f.unlink()
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", HF_STANDIN_LOG=str(log),
               HF_STANDIN_URL=Gateway.url, HF_ENDPOINT=Gateway.url)  # the Hub's model API too
    for k in ("HF_TOKEN", "GATEWAY_TOKEN", "PROXY_TOKEN", "ROLLOUT_TOKEN", "TRAINER_STATE_KEY", "ADAPTER_KEY",
              "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "ROLLOUT_AWS_ACCESS_KEY_ID",
              "ROLLOUT_AWS_SECRET_ACCESS_KEY", "DRY_RUN"):
        env.pop(k, None)
    env["GATEWAY_TOKEN"] = GATEWAY_TOKEN
    env.update(env_extra)
    res = subprocess.run(jobs_sh(*args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    calls = [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []
    return res, calls


def value_after(argv, flag):
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def job_runs(calls):
    return [c for c in calls if c[:2] == ["jobs", "run"]]


def secrets_given(tmp_path):
    """{NAME: value} of each `hf jobs run`'s --secrets, as `hf` read them from its environment."""
    path = tmp_path / "hf-secrets.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return [dict(w.split("=", 1) for w in shlex.split(line)) for line in lines]


def dry_run_commands(res):
    """The `hf jobs run` commands DRY_RUN printed, each as the words after `hf`."""
    return [shlex.split(line)[1:] for line in res.stderr.splitlines() if line.startswith("hf jobs run ")]


def recorded_ids(name):
    with open(os.path.join(ROOT, "runs", name, "jobs.txt")) as f:
        return [line.split() for line in f]


def test_hf_jobs_launch_status_and_stop(tmp_path, hf_run_name, gateway):
    name = hf_run_name
    res, calls = run_jobs(tmp_path, NAME=name, BUCKET="alice/grpo-bucket", REPLICAS="2",
                          ROLLOUT_FLAVOR="a10g-small", TRAINER_FLAVOR="a100-large",
                          HF_STANDIN_URL=gateway, JOB_ENV="HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2")
    assert res.returncode == 0, res.stderr + res.stdout
    assert calls[0] == ["version"]  # the CLI's version is checked before anything else
    assert ["buckets", "create", "alice/grpo-bucket", "--private", "--exist-ok"] in calls
    runs = job_runs(calls)
    assert len(runs) == 4, runs  # proxy, 2 replicas, trainer
    proxy, r0, r1, trainer = runs
    # the replicas and the trainer start only once the proxy answered /healthz through the gateway
    first_other = calls.index(r0)
    assert ["jobs", "inspect", "--format", "json", proxy_job_id(res)] in calls[calls.index(proxy):first_other]
    assert [h.get("Authorization") for h in Gateway.seen] == [f"Bearer {GATEWAY_TOKEN}"]
    secrets = {}
    for c, role in zip(runs, ["proxy", "rollout-0", "rollout-1", "trainer"]):
        assert "--detach" in c and value_after(c, "--name") == [f"{name}-{role}"]
        secrets[role] = value_after(c, "--secrets")
        assert all("=" not in s for s in secrets[role]), c  # names only: the values stay off argv
        for e in ["HF_HOME=/tmp/hf", "PYTHONUNBUFFERED=1", "HF_HUB_OFFLINE=1", "OMP_NUM_THREADS=2"]:
            assert e in value_after(c, "-e"), (e, c)
        assert any(v.endswith(":/code") for v in value_after(c, "-v")), c  # code shipped as a volume
        assert c[-5:-3] == ["--", c[-4]] and c[-3:-1] == ["bash", "-c"]  # `--` before the image
        # the images link python3 only: never a bare `python`
        assert re.search(r"exec (bash scripts/job_start\.sh )?python3 ", c[-1]), c[-1]
        assert not re.search(r"\bpython\b(?!3)", c[-1]), c[-1]
    # least privilege: only the trainer holds the trainer's token, the state key and the HF token
    assert secrets == {"proxy": ["PROXY_TOKEN", "ROLLOUT_TOKEN"],
                       "rollout-0": ["ROLLOUT_TOKEN", "GATEWAY_TOKEN", "ADAPTER_KEY"],
                       "rollout-1": ["ROLLOUT_TOKEN", "GATEWAY_TOKEN", "ADAPTER_KEY"],
                       "trainer": ["PROXY_TOKEN", "TRAINER_STATE_KEY", "ADAPTER_KEY", "GATEWAY_TOKEN",
                                   "HF_TOKEN"]}
    kept = dict(line.split("=", 1) for line in open(os.path.join(ROOT, "runs", name, "secrets.env")).read().split())
    assert sorted(kept) == ["ADAPTER_KEY", "PROXY_TOKEN", "ROLLOUT_TOKEN", "TRAINER_STATE_KEY"]
    assert len(set(kept.values())) == 4 and all(re.fullmatch("[0-9a-f]{32}", v) for v in kept.values())
    assert os.stat(os.path.join(ROOT, "runs", name, "secrets.env")).st_mode & 0o777 == 0o600
    assert not [c for c in calls if any(v in " ".join(c) for v in kept.values())]  # in no argv

    # the proxy: CPU flavour, port exposed, bound to 0.0.0.0, and the whole contract, at the GPU
    # experiment's defaults; nothing to install in python:3.12-slim
    assert value_after(proxy, "--flavor") == ["cpu-basic"] and value_after(proxy, "--expose") == ["8000"]
    assert proxy[-4] == "python:3.12-slim" and "job_start.sh" not in proxy[-1]
    # the trainer's silence counts once it has spoken; before, the start-up bound (an hour)
    assert {"PROXY_TRAINER_START_TIMEOUT=3600", "PROXY_TRAINER_TIMEOUT=1200"} <= set(value_after(proxy, "-e"))
    assert "--host 0.0.0.0 --port 8000" in proxy[-1] and "HF_TOKEN" not in proxy[-1]
    for flag in ["--num-generations 8", "--groups-per-step 16", "--max-staleness 4", "--temperature 1.0",
                 "--max-completion-length 256", "--zero-variance keep"]:
        assert flag in proxy[-1], (flag, proxy[-1])

    # the exposed URL `hf jobs inspect` showed is the one the others are given
    for i, c in enumerate([r0, r1]):
        assert value_after(c, "--flavor") == ["a10g-small"]
        assert "hf://buckets/alice/grpo-bucket:/bucket:ro" in value_after(c, "-v")  # read-only
        assert c[-4] == "vllm/vllm-openai:v0.32.0"
        cmd = c[-1]
        assert "rollout.py" in cmd and f"--proxy {gateway}" in cmd and f"--replica-id {i}" in cmd
        assert f"--bucket /bucket/{name}" in cmd and "--num-replicas 2" in cmd
        assert "--model Qwen/Qwen2.5-0.5B-Instruct" in cmd and "--task gsm8k" in cmd
    assert value_after(trainer, "--flavor") == ["a100-large"]
    assert "hf://buckets/alice/grpo-bucket:/bucket" in value_after(trainer, "-v")  # read-write
    assert "trainer.py" in trainer[-1] and f"--proxy {gateway}" in trainer[-1] and "--max-steps 200" in trainer[-1]
    for c in [r0, r1, trainer]:  # the contract reaches them through the proxy's /config only
        assert not [f for f in CONTRACT_FLAGS if f in c[-1]], c[-1]
        # first the machine and the install (with retries), then the role
        assert c[-1].startswith("cd /code && exec bash scripts/job_start.sh python3 "), c[-1]

    # the package list the jobs install: requirements.txt without torch (the image's) and gguf
    installed = subprocess.run(["bash", "scripts/job_start.sh", "--packages"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.split()
    assert "peft==0.21.2" in installed and "requests==2.34.2" in installed
    assert not [p for p in installed if p.startswith(("torch", "gguf"))], installed

    # runs/.last-hf and jobs.txt; status reads `hf jobs inspect --format json`; stop cancels all
    assert open(os.path.join(ROOT, "runs", ".last-hf")).read().strip() == name
    ids = [i for _, i in recorded_ids(name)]
    assert len(set(ids)) == 4 and ids[0] == proxy_job_id(res)
    res, calls = run_jobs(tmp_path, "status", NAME=name)
    assert res.returncode == 0 and res.stdout.count("RUNNING") == 4, res.stdout + res.stderr
    inspected = [c[-1] for c in calls if c[:4] == ["jobs", "inspect", "--format", "json"]]
    assert inspected == ids + ids[:1]  # each job's stage, then the proxy's URL for its /stats
    res, calls = run_jobs(tmp_path, "stop", NAME=name)
    assert res.returncode == 0, res.stderr
    assert [c for c in calls if c[:2] == ["jobs", "cancel"]] == [["jobs", "cancel", i] for i in ids]


def proxy_job_id(res):
    return re.search(r"proxy: ([0-9a-f]{24})", res.stdout).group(1)


def test_hf_jobs_launches_a_mixed_pool_and_status_shows_each_replicas_share(tmp_path, hf_run_name):
    flavors = ["a10g-small", "l4x1", "t4-small"]
    res, calls = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="alice/b", ROLLOUT_FLAVOR="a100-large",
                          ROLLOUT_FLAVORS=" ".join(flavors))
    assert res.returncode == 0, res.stderr + res.stdout
    assert re.search(r"ROLLOUT_FLAVORS +a10g-small l4x1 t4-small", res.stdout)
    runs = job_runs(calls)
    assert [value_after(c, "--name")[0] for c in runs] == [
        f"{hf_run_name}-{r}" for r in ["proxy", "rollout-0", "rollout-1", "rollout-2", "trainer"]]
    assert [value_after(c, "--flavor")[0] for c in runs[1:4]] == flavors  # one replica per entry
    assert all("--num-replicas 3" in c[-1] for c in runs[1:4])
    # status: the job table, then each replica's share from /stats, through the gateway with the
    # user's HF token and the trainer's token from secrets.env (on no command line)
    kept = dict(line.split("=", 1) for line in open(os.path.join(ROOT, "runs", hf_run_name,
                                                                 "secrets.env")).read().split())
    Gateway.token = kept["PROXY_TOKEN"]
    Gateway.stats = {"trainer_version": 7, "replicas": {
        "replica-0": {"share": 0.6, "leased": 9, "groups_per_s": 3.0},
        "replica-1": {"share": 0.3, "leased": 5, "groups_per_s": 1.5},
        "replica-2": {"share": 0.1, "leased": 1, "groups_per_s": 0.5}},
        "workers": {"replica-0": {"accepted": 60, "delivered": 58, "dropped_stale": 0,
                                  "over_quota": 0}}}
    res, calls = run_jobs(tmp_path, "status", NAME=hf_run_name)
    assert res.returncode == 0 and res.stdout.count("RUNNING") == 5, res.stdout + res.stderr
    words = [line.split() for line in res.stdout.splitlines()]
    rows = {w[0]: w[1:] for w in words if w and w[0].startswith("replica-")}
    assert rows == {"replica-0": ["0.600", "3.000", "9", "60", "58", "0", "0"],
                    "replica-1": ["0.300", "1.500", "5", "0", "0", "0", "0"],
                    "replica-2": ["0.100", "0.500", "1", "0", "0", "0", "0"]}, res.stdout
    assert not [c for c in calls if kept["PROXY_TOKEN"] in " ".join(c)]
    Gateway.stats = None  # the proxy gone: the job table still, and one line saying so
    res, _ = run_jobs(tmp_path, "status", NAME=hf_run_name)
    assert res.returncode == 0 and "/stats did not answer" in res.stderr, res.stdout + res.stderr
    res, calls = run_jobs(tmp_path, NAME=hf_run_name + "-x", BUCKET="alice/b", REPLICAS="2",
                          ROLLOUT_FLAVORS="l4x1 t4-small a10g-small")
    assert res.returncode != 0 and "REPLICAS=2, but ROLLOUT_FLAVORS names 3 flavors" in res.stderr
    assert not job_runs(calls)


def test_hf_jobs_replicas_get_their_own_bound_credential(tmp_path, hf_run_name, gateway):
    """Each replica's ROLLOUT_TOKEN (read by `--secrets ROLLOUT_TOKEN` from the environment of
    `hf`) is the run's replica secret bound to its worker name; the proxy gets the secret itself."""
    from support import proxy_service

    res, calls = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="alice/b", REPLICAS="2",
                          HF_STANDIN_ENV="ROLLOUT_TOKEN PROXY_TOKEN GATEWAY_TOKEN")
    assert res.returncode == 0, res.stderr
    kept = dict(line.split("=", 1) for line in open(os.path.join(ROOT, "runs", hf_run_name, "secrets.env")).read().split())
    env_seen = [line.split() for line in (tmp_path / "hf-env.log").read_text().splitlines()]
    assert env_seen[0] == [kept["ROLLOUT_TOKEN"], kept["PROXY_TOKEN"], GATEWAY_TOKEN]  # proxy
    for i in range(2):
        assert env_seen[1 + i][0] == proxy_service.replica_token(kept["ROLLOUT_TOKEN"], f"replica-{i}")


@pytest.mark.parametrize("stage, message", [
    ("RUNNING", "did not answer"),  # nothing answers on the port
    ("ERROR", "ended (ERROR) before it answered")])
def test_hf_jobs_launch_stops_when_the_proxy_never_answers(tmp_path, hf_run_name, stage, message):
    res, calls = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="alice/b", STARTUP_TIMEOUT="3",
                          HF_STANDIN_URL="http://127.0.0.1:9", HF_STANDIN_STAGE=stage)
    assert res.returncode != 0 and message in res.stderr, res.stderr
    assert len(job_runs(calls)) == 1  # the proxy only: nothing else started
    assert [c[2] for c in calls if c[:2] == ["jobs", "cancel"]] == [i for _, i in recorded_ids(hf_run_name)]


@pytest.mark.parametrize("token, code", [("hf_not_known_to_the_gateway", 401), (FORBIDDEN_TOKEN, 403)])
def test_hf_jobs_launch_stops_at_once_when_the_gateway_refuses_the_token(tmp_path, hf_run_name, token, code):
    """The gateway answers 401 or 403 to GATEWAY_TOKEN (STARTUP_TIMEOUT at its 900 s default): the
    launch stops at that answer, says which token and what it needs, and cancels the proxy job."""
    t0 = time.time()
    res, calls = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="alice/b", GATEWAY_TOKEN=token)
    assert res.returncode != 0 and time.time() - t0 < 30, res.stderr
    assert f"the *.hf.jobs gateway answered {code} to GATEWAY_TOKEN" in res.stderr, res.stderr
    assert "read access to the job's namespace" in res.stderr and "bash jobs.sh preflight" in res.stderr
    assert token not in res.stdout + res.stderr  # named, never printed
    assert len(job_runs(calls)) == 1  # the proxy only
    assert [c[2] for c in calls if c[:2] == ["jobs", "cancel"]] == [i for _, i in recorded_ids(hf_run_name)]


@pytest.mark.parametrize("model, message", [
    ("org/gated-model", "MODEL org/gated-model is gated: the replicas (no HF token) cannot download it"),
    ("org/private-model", "the Hub does not serve MODEL org/private-model to anyone (401")])
def test_hf_jobs_refuses_a_model_the_replicas_cannot_download_unless_mounted(tmp_path, hf_run_name, model, message):
    """A gated or private MODEL: the launch stops before any job and says MODEL_MOUNT=1; with it,
    the replicas and the trainer mount the model read-only at /model and load it from there."""
    res, calls = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="alice/b", MODEL=model)
    assert res.returncode != 0 and message in res.stderr and "MODEL_MOUNT=1" in res.stderr, res.stderr
    assert job_runs(calls) == []
    res, calls = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="alice/b", MODEL=model, MODEL_MOUNT="1")
    assert res.returncode == 0, res.stderr
    proxy, *others = job_runs(calls)
    assert not [v for v in value_after(proxy, "-v") if "models" in v]
    for c in others:
        assert f"hf://models/{model}:/model:ro" in value_after(c, "-v") and "--model /model " in c[-1], c


def test_hf_jobs_stop_cancels_every_job_when_one_cancel_fails(tmp_path, hf_run_name):
    res, _ = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="alice/b", REPLICAS="2")
    assert res.returncode == 0, res.stderr
    roles, ids = zip(*recorded_ids(hf_run_name))
    res, calls = run_jobs(tmp_path, "stop", NAME=hf_run_name, HF_STANDIN_FAIL_CANCEL=ids[1])
    assert res.returncode != 0
    assert [c[2] for c in calls if c[:2] == ["jobs", "cancel"]] == list(ids)  # went on after the failure
    assert f"could not cancel {roles[1]} {ids[1]}" in res.stdout and f"not cancelled: {roles[1]}" in res.stderr


@pytest.mark.parametrize("fault, message", [("HF_STANDIN_FAIL_RUN", "'hf jobs run' failed for the rollout-1 job"),
                                            ("HF_STANDIN_NO_ID", "no job id in the output of 'hf jobs run' for the rollout-1 job")])
def test_hf_jobs_failed_launch_cancels_what_it_started(tmp_path, hf_run_name, fault, message):
    res, calls = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="alice/b", REPLICAS="2", **{fault: "3"})
    assert res.returncode != 0 and message in res.stderr, res.stderr
    assert "cancelling the jobs this launch started" in res.stderr
    started = recorded_ids(hf_run_name)  # each id was recorded as soon as it was known
    assert [r for r, _ in started] == ["proxy", "rollout-0"]
    assert [c[2] for c in calls if c[:2] == ["jobs", "cancel"]] == [i for _, i in started]
    assert len(job_runs(calls)) == 3  # nothing launched after the failure
    assert open(os.path.join(ROOT, "runs", ".last-hf")).read().strip() == hf_run_name


@pytest.mark.parametrize("version_output", ["✓ hf version\n  version: 2.0.0", "✓ hf version\n  version: 1.29.0",
                                            "huggingface_hub version: 0.34.0"])
def test_hf_jobs_refuses_an_hf_cli_older_than_2_1(tmp_path, hf_run_name, version_output):
    """hf jobs run --attempts (the trainer's restarts) arrived in 2.1; 2.0 took it for the image."""
    res, calls = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="alice/b", HF_STANDIN_VERSION=version_output)
    assert res.returncode != 0 and "needs hf >= 2.1" in res.stderr, res.stderr
    assert job_runs(calls) == []


def test_hf_jobs_dry_run_prints_the_gpu_experiment_and_runs_nothing(tmp_path, hf_run_name):
    res, calls = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="me/b", DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    assert calls == []  # nothing reached the CLI
    for line in ["MODEL            Qwen/Qwen2.5-0.5B-Instruct", "TASK             gsm8k",
                 "MAX_COMPLETION_LENGTH 256", "GROUPS_PER_STEP  16", "MAX_STALENESS    4", "NUM_GENERATIONS  8"]:
        assert line in res.stdout, res.stdout
    printed = [line for line in res.stderr.splitlines() if " jobs run " in line]
    assert len(printed) == 3 and "--expose 8000" in printed[0]  # proxy, 1 replica, trainer
    assert "exec python3 proxy.py" in printed[0]
    assert all("exec bash scripts/job_start.sh python3 " in p for p in printed[1:])
    # the start-up order and each job's secrets (names; the values stay in runs/NAME/secrets.env)
    steps = [line for line in res.stderr.splitlines() if line.startswith("[jobs] ")]
    assert steps == ["[jobs] proxy: secrets PROXY_TOKEN ROLLOUT_TOKEN",
                     "[jobs] then: wait for RUNNING and GET https://<proxy-job-id>--8000.hf.jobs/healthz "
                     "(Authorization: Bearer $GATEWAY_TOKEN)",
                     "[jobs] rollout-0: secrets ROLLOUT_TOKEN GATEWAY_TOKEN ADAPTER_KEY",
                     "[jobs] trainer: secrets PROXY_TOKEN TRAINER_STATE_KEY ADAPTER_KEY GATEWAY_TOKEN HF_TOKEN"], steps


def test_hf_jobs_s3_bucket_dry_run(tmp_path, hf_run_name):
    """An S3 bucket: no volume arrays, only AWS secrets — the path where bash 3.2 met empty arrays."""
    res, _ = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="s3://b/prefix", DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    printed = [line for line in res.stderr.splitlines() if " jobs run " in line]
    assert len(printed) == 3 and all("hf://buckets" not in p for p in printed)
    assert all("--secrets AWS_ACCESS_KEY_ID" in p for p in printed[1:])
    assert f"--bucket s3://b/prefix/{hf_run_name}" in printed[-1]


def test_hf_jobs_dry_run_prints_the_commands_the_launch_runs(tmp_path, hf_run_name, gateway):
    """DRY_RUN prints the very words that `launch` runs: the launch (stand-in CLI) then receives
    exactly those, but for the proxy's URL, which exists only once the proxy job does."""
    settings = dict(NAME=hf_run_name, BUCKET="alice/b", ROLLOUT_FLAVORS="a10g-small l4x1",
                    JOB_ENV="HF_HUB_OFFLINE=1", TRAINER_ARGS="--epsilon-high 0.28", DATA="gsm8k")
    res, calls = run_jobs(tmp_path, DRY_RUN="1", **settings)
    assert res.returncode == 0 and calls == [], res.stderr
    printed = dry_run_commands(res)
    assert len(printed) == 4, res.stderr  # 2 + N: the proxy, two replicas, the trainer
    assert [line for line in res.stderr.splitlines() if " jobs run " in line] == [
        line for line in res.stderr.splitlines() if line.startswith("hf jobs run ")]
    res, calls = run_jobs(tmp_path, **settings)
    assert res.returncode == 0, res.stderr
    placeholder = r"--proxy https://\<proxy-job-id\>--8000.hf.jobs "  # (printf %q's escapes)
    assert [placeholder in argv[-1] for argv in printed] == [False, True, True, True]
    printed = [[w.replace(placeholder, f"--proxy {gateway} ") for w in argv] for argv in printed]
    assert job_runs(calls) == printed


def test_hf_jobs_no_replica_job_holds_the_accounts_credentials(tmp_path, hf_run_name, gateway):
    """HF_TOKEN set: the replicas get neither its name nor its value, in DRY_RUN's commands or in
    what `hf` reads for their --secrets; on s3:// they get the read-only ROLLOUT_AWS_* keys."""
    account = "hf_the_accounts_own_token"
    res, _ = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="alice/b", REPLICAS="2", DRY_RUN="1",
                      HF_TOKEN=account)
    assert res.returncode == 0, res.stderr
    printed = dry_run_commands(res)
    for argv in printed[1:3]:  # the replicas
        assert value_after(argv, "--secrets") == ["ROLLOUT_TOKEN", "GATEWAY_TOKEN", "ADAPTER_KEY"], argv
        assert "HF_TOKEN" not in " ".join(argv) and account not in " ".join(argv)
    assert "HF_TOKEN" in value_after(printed[-1], "--secrets")  # the trainer's, and only its
    assert account not in res.stdout + res.stderr

    res, calls = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="alice/b", REPLICAS="2", HF_TOKEN=account)
    assert res.returncode == 0, res.stderr
    given = secrets_given(tmp_path)
    assert [sorted(g) for g in given] == [["PROXY_TOKEN", "ROLLOUT_TOKEN"],
                                          ["ADAPTER_KEY", "GATEWAY_TOKEN", "ROLLOUT_TOKEN"],
                                          ["ADAPTER_KEY", "GATEWAY_TOKEN", "ROLLOUT_TOKEN"],
                                          ["ADAPTER_KEY", "GATEWAY_TOKEN", "HF_TOKEN", "PROXY_TOKEN",
                                           "TRAINER_STATE_KEY"]]
    for g in given[:3]:
        assert account not in g.values() and g.get("GATEWAY_TOKEN", GATEWAY_TOKEN) == GATEWAY_TOKEN
    assert given[3]["HF_TOKEN"] == account

    keys = dict(AWS_ACCESS_KEY_ID="AKIATRAINER", AWS_SECRET_ACCESS_KEY="trainer-secret",
                ROLLOUT_AWS_ACCESS_KEY_ID="AKIAREADONLY", ROLLOUT_AWS_SECRET_ACCESS_KEY="read-secret")
    res, calls = run_jobs(tmp_path, NAME=hf_run_name + "-s3", BUCKET="s3://b/p", HF_TOKEN=account, **keys)
    assert res.returncode == 0, res.stderr
    proxy, replica, trainer = secrets_given(tmp_path)
    assert (replica["AWS_ACCESS_KEY_ID"], replica["AWS_SECRET_ACCESS_KEY"]) == ("AKIAREADONLY", "read-secret")
    assert (trainer["AWS_ACCESS_KEY_ID"], trainer["AWS_SECRET_ACCESS_KEY"]) == ("AKIATRAINER", "trainer-secret")
    assert "trainer-secret" not in proxy.values() and account not in replica.values()
    shutil.rmtree(os.path.join(ROOT, "runs", hf_run_name + "-s3"), ignore_errors=True)


@pytest.mark.parametrize("env, message", [
    ({"GATEWAY_TOKEN": ""}, "GATEWAY_TOKEN is not set."),
    ({"GATEWAY_TOKEN": "hf_standin_token"}, "GATEWAY_TOKEN is your HF token"),  # `hf auth token`'s
    ({"GATEWAY_TOKEN": "hf_same", "HF_TOKEN": "hf_same"}, "GATEWAY_TOKEN is your HF token"),
    ({"BUCKET": "s3://b/p", "ROLLOUT_AWS_ACCESS_KEY_ID": "AKIARO"},
     "BUCKET is s3://b/p: set ROLLOUT_AWS_ACCESS_KEY_ID and ROLLOUT_AWS_SECRET_ACCESS_KEY to keys"),
    ({"BUCKET": "s3://b/p", "AWS_ACCESS_KEY_ID": "AKIA1", "ROLLOUT_AWS_ACCESS_KEY_ID": "AKIA1",
      "ROLLOUT_AWS_SECRET_ACCESS_KEY": "s"}, "ROLLOUT_AWS_ACCESS_KEY_ID is the trainer's"),
])
def test_hf_jobs_refuses_to_give_a_replica_the_accounts_credentials(tmp_path, hf_run_name, env, message):
    res, calls = run_jobs(tmp_path, **{"NAME": hf_run_name, "BUCKET": "alice/b", **env})
    assert res.returncode != 0 and f"jobs.sh: error: {message}" in res.stderr, res.stderr
    assert job_runs(calls) == [] and not os.path.exists(os.path.join(ROOT, "runs", hf_run_name))
    if "GATEWAY_TOKEN is not set" in message:  # what to create, and where
        assert "fine-grained token" in res.stderr and "https://huggingface.co/settings/tokens" in res.stderr


def test_hf_jobs_dry_run_says_that_a_launch_would_refuse(tmp_path, hf_run_name):
    """No GATEWAY_TOKEN: DRY_RUN still prints the commands, and the reason a launch stops, once."""
    res, calls = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="me/b", DRY_RUN="1", GATEWAY_TOKEN="")
    assert res.returncode == 0 and calls == [], res.stderr
    assert len(dry_run_commands(res)) == 3
    assert res.stderr.count("jobs.sh: DRY_RUN: a launch would refuse here: GATEWAY_TOKEN is not set") == 1


def test_hf_jobs_needs_a_bucket(tmp_path):
    res, calls = run_jobs(tmp_path, NAME="x")
    assert res.returncode != 0 and "BUCKET is required" in res.stderr and calls == []


@pytest.mark.parametrize("mode", [[], ["--local"], ["stop"]])
@pytest.mark.parametrize("name", ["../x", "a/b", "run:1", "a b", ".hidden"])
def test_jobs_sh_refuses_a_name_that_is_not_a_plain_folder_name(tmp_path, mode, name):
    res, calls = run_jobs(tmp_path, *mode, NAME=name, BUCKET="alice/b")
    assert res.returncode != 0 and f"NAME '{name}'" in res.stderr, res.stderr + res.stdout
    assert calls == [] and not os.path.exists(os.path.join(ROOT, "runs", name))


def test_the_bash_3_2_check_can_fail(tmp_path):
    script = tmp_path / "s.sh"
    script.write_text('set -u\na=()\necho "${a[@]}" done\n')
    assert subprocess.run(["bash", str(script)], capture_output=True).returncode == 0  # bash 5 lets it by
    res = subprocess.run(jobs_sh(script=str(script)), capture_output=True, text=True)
    assert res.returncode != 0 and "bash 3.2" in res.stderr


@pytest.mark.parametrize("script", ["jobs.sh", "scripts/jobs_lib.sh", "scripts/gpu_check.sh"])
def test_launch_scripts_use_nothing_newer_than_bash_3_2(script):
    text = open(os.path.join(ROOT, script)).read()
    code = "\n".join(line.split(" #")[0] for line in text.splitlines() if not line.lstrip().startswith("#"))
    newer = {"associative arrays": r"(declare|local|typeset) -[a-zA-Z]*A", "mapfile/readarray": r"\b(mapfile|readarray)\b",
             "case conversion": r"\$\{\w+(\^|,)", "namerefs": r"(declare|local) -[a-zA-Z]*n\b",
             "negative subscripts": r"\[-\d+\]\}", "coproc": r"\bcoproc\b", "wait -n": r"\bwait -n\b",
             "|& and &>>": r"\|&|&>>", "case fall-through": r";;&|;&", "[[ -v": r"\[\[ -v",
             "EPOCHSECONDS": r"EPOCH(SECONDS|REALTIME)", "${!array[@]}": r"\$\{!\w+\[@\]\}"}
    found = {what: re.findall(rx, code) for what, rx in newer.items() if re.search(rx, code)}
    assert found == {}, f"{script} uses bash >= 4 features: {found}"


# ---- what a GPU job runs before its role: scripts/job_start.sh

NVIDIA_SMI = """#!/bin/sh
# stand-in nvidia-smi: a driver for CUDA 12.8 and one L4, in nvidia-smi's two formats
if [ $# = 0 ]; then
  echo '| NVIDIA-SMI 570.124.06   Driver Version: 570.124.06   CUDA Version: 12.8 |'
else echo '0, NVIDIA L4, 570.124.06, 23034'; fi
"""
PYTHON3 = """#!/bin/sh
# stand-in python3: `-m pip install` fails while the count in $PIP_FAILS is above 0; the rest is
# the real interpreter
if [ "$1 $2 $3" = "-m pip install" ]; then
  echo "pip install $*" >> "$PIP_FAILS.calls"
  n=$(cat "$PIP_FAILS")
  if [ "$n" -gt 0 ]; then
    echo $((n - 1)) > "$PIP_FAILS"
    echo "ERROR: Could not find a version that satisfies the requirement peft==0.21.2 (from versions: none)"
    echo "ERROR: No matching distribution found for peft==0.21.2"; exit 1
  fi
  exit 0
fi
exec {python} "$@"
"""


def job_start(tmp_path, fails, torch_cuda=None):
    """Run scripts/job_start.sh as a GPU job would (a stand-in nvidia-smi and pip; torch_cuda: a
    stand-in torch built for that CUDA, else .venv's CPU torch) with a role that prints a line."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, text in [("nvidia-smi", NVIDIA_SMI), ("python3", PYTHON3.format(python=sys.executable))]:
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    (tmp_path / "fails").write_text(str(fails))
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", PIP_FAILS=str(tmp_path / "fails"),
               JOB_START_RETRY_S="0")
    if torch_cuda:
        (tmp_path / "site" / "torch").mkdir(parents=True, exist_ok=True)
        (tmp_path / "site" / "torch" / "__init__.py").write_text(
            f"__version__ = '2.13.0+cu130'\nclass version:\n    cuda = {torch_cuda!r}\n")
        env["PYTHONPATH"] = str(tmp_path / "site")
    return subprocess.run(["bash", "scripts/job_start.sh", "python3", "-c", "print('the role starts')"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("fails", [0, 3, 4])
def test_a_gpu_job_starts_with_its_machine_and_retries_the_install(tmp_path, fails):
    """The job's log begins with the machine lines; a pip install that fails 3 times is tried a
    4th time and the role starts; one that fails 4 times ends the job naming the package."""
    import torch

    res = job_start(tmp_path, fails)
    lines = res.stdout.splitlines()
    assert lines[:3] == ["[machine] nvidia-smi: driver 570.124.06, runs CUDA up to 12.8",
                         "[machine] GPU 0: NVIDIA L4, 23034 MiB (22.5 GiB) total",
                         f"[machine] torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}"], res.stdout
    tries = len((tmp_path / "fails.calls").read_text().splitlines())
    assert tries == min(fails + 1, 4)
    assert [line for line in lines if line.startswith("[install] pip install failed")] == [
        f"[install] pip install failed (try {i} of 4): again in 0 s" for i in range(1, min(fails, 3) + 1)]
    if fails < 4:
        assert res.returncode == 0 and lines[-1] == "the role starts", res.stdout + res.stderr
    else:
        assert res.returncode == 1 and "the role starts" not in res.stdout
        assert ("[install] error: pip install failed 4 times; the package it could not get: peft==0.21.2"
                in res.stdout), res.stdout


def test_a_gpu_job_whose_driver_is_too_old_for_the_images_cuda_stops_first(tmp_path):
    """torch built for CUDA 13.0 on a driver that runs CUDA 12.8: the job stops before its install,
    saying why and which image to use."""
    res = job_start(tmp_path, 0, torch_cuda="13.0")
    assert res.returncode == 1 and "the role starts" not in res.stdout, res.stdout + res.stderr
    assert "[machine] torch 2.13.0+cu130, built for CUDA 13.0" in res.stdout
    assert ("[machine] error: torch is built for CUDA 13.0, and this driver runs CUDA up to 12.8"
            in res.stdout and "vllm/vllm-openai:v0.32.0-cu129" in res.stdout), res.stdout
    assert not (tmp_path / "fails.calls").exists()  # nothing installed


def test_hub_model_id_pushes_the_adapter_after_the_trainer(tmp_path, hf_run_name):
    """HUB_MODEL_ID: the trainer job runs sync.py push-to-hub after trainer.py (no exec: the
    shell goes on), with the run's names and the job's HF_TOKEN; a failed push ends the job
    well (echo), so TRAINER_ATTEMPTS does not train again. Without it, the command as before."""
    res, _ = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="me/b", DRY_RUN="1",
                      HUB_MODEL_ID="me/grpo-lora", HUB_PRIVATE_REPO="1")
    assert res.returncode == 0, res.stderr
    trainer = [c for c in dry_run_commands(res) if f"{hf_run_name}-trainer" in c][0]
    assert "HF_TOKEN" in value_after(trainer, "--secrets")
    run, push = trainer[-1].split(" && { ")
    assert "exec" not in run.split() and "trainer.py" in run
    words = shlex.split(push)
    assert words[:words.index("||")] == [
        "python3", "sync.py", "push-to-hub", "me/grpo-lora", "--bucket", f"/bucket/{hf_run_name}",
        "--base-model", "Qwen/Qwen2.5-0.5B-Instruct", "--dataset", "gsm8k",
        "--reward-funcs", "gsm8k", "--private"]
    res, _ = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="me/b", DRY_RUN="1")
    trainer = [c for c in dry_run_commands(res) if f"{hf_run_name}-trainer" in c][0]
    assert "push-to-hub" not in trainer[-1] and " exec " in trainer[-1]  # without it: as before
