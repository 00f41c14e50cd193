"""`bash jobs.sh` on emulated Hugging Face Jobs: every job runs, as jobs.sh writes it, as a local process.

The `hf` first on PATH is bench/hf_jobs_emulator.py: huggingface_hub's real CLI, with the Hub's side
of Jobs and Buckets answered on this machine (its docstring lists what is emulated and how). A job
runs chrooted with its volumes at their mount points (`:ro` read-only, and late to show another
job's writes), only its -e/-s/--secrets environment, `python3` but no `python` on PATH, after a
SCHEDULING stage; an exposed port is reached through a gateway that wants the user's HF bearer
and, with HF_EMU_GATEWAY=strip, removes Authorization before forwarding.

The first tests check the emulation itself; then a whole run (proxy + 1 replica + trainer on the
tiny model) through to COMPLETED behind the gateway in both modes, and `jobs.sh preflight`'s
verdicts. Needs root (mount and network namespaces); skipped elsewhere.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from support import buckets
from conftest import ROOT, jobs_sh

EMULATOR = os.path.join(ROOT, "bench", "hf_jobs_emulator.py")


@pytest.fixture
def hf_jobs(tmp_path):
    """Environment whose `hf` is the emulator (state in tmp_path/hub); kills what is left at the end."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "nsenter", "ip", "mount")):
        pytest.skip("the Jobs emulator needs root and unshare, nsenter, ip and mount (namespaces)")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "hf").write_text(f'#!/bin/sh\nexec {sys.executable} {EMULATOR} "$@"\n')
    (bindir / "hf").chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", HF_EMU_DIR=str(tmp_path / "hub"),
               HF_TOKEN="hf_emulated_token")
    yield env
    subprocess.run([sys.executable, EMULATOR, "_teardown"], env=env, timeout=60)


def hf(env, *args):
    return subprocess.run(["hf", *args], env=env, capture_output=True, text=True, timeout=60)


def job_id(res):
    assert res.returncode == 0, res.stdout + res.stderr
    return next(line.split()[1] for line in res.stdout.splitlines() if line.strip().startswith("id:"))


def wait_stage(env, jid, timeout=120):
    """The job's stage once it is neither SCHEDULING nor RUNNING (`hf jobs inspect --format json`)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        res = hf(env, "jobs", "inspect", "--format", "json", jid)
        status = json.loads(res.stdout)[0]["status"]
        if status["stage"] not in ("SCHEDULING", "RUNNING"):
            return status["stage"]
        time.sleep(0.5)
    raise TimeoutError(f"job {jid} still running after {timeout}s")


def job_log(env, jid):
    return hf(env, "jobs", "logs", jid).stdout


ECHO_SERVER = """
import json, http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        data = json.dumps(dict(self.headers)).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""
PROBE = """
import os, sys, time, urllib.request, urllib.error
def get(url, auth):
    headers = {"Authorization": "Bearer " + os.environ["HF_TOKEN"]} if auth else {}
    for attempt in range(40):  # the server job may still be scheduling or starting
        try:
            return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5).read().decode()
        except urllib.error.HTTPError as e:
            if e.code != 502 or url != sys.argv[1]:  # once the first server answered, 502 is final
                return str(e.code)
        except OSError:
            pass
        time.sleep(0.5)
    return "unreachable"
for url in sys.argv[1:]:
    print(url, "with:", get(url, True), "without:", get(url, False))
import requests  # the full image has the project's packages; python:* images only the stdlib
"""


@pytest.mark.parametrize("mode", ["forward", "strip"])
def test_the_emulator_runs_a_job_as_jobs_would(hf_jobs, tmp_path, mode):
    env = dict(hf_jobs, HF_EMU_GATEWAY=mode, HF_HUB_OFFLINE="1")  # the host's offline setting: not the jobs'
    code = tmp_path / "code"
    code.mkdir()
    (code / "echo.py").write_text(ECHO_SERVER)
    (code / "probe.py").write_text(PROBE)
    assert hf(env, "buckets", "create", "alice/b", "--private", "--exist-ok").returncode == 0
    # an echo server on 0.0.0.0:8000 (exposed) and one on 127.0.0.1:8001 (exposed, but loopback only)
    res = hf(env, "jobs", "run", "--detach", "--expose", "8000", "--expose", "8001", "-v", f"{code}:/code",
             "python:3.12-slim", "bash", "-c",
             "cd /code && (python3 -m http.server 8001 --bind 127.0.0.1 &) && exec python3 echo.py")
    server = job_id(res)
    info = json.loads(hf(env, "jobs", "inspect", "--format", "json", server).stdout)[0]
    assert info["status"]["stage"] == "SCHEDULING"  # before RUNNING, as on Jobs
    outside = info["status"]["expose_urls"][0]  # this machine's way in: the same gateway
    client = job_id(hf(env, "jobs", "run", "--detach", "--secrets", "HF_TOKEN", "-e", "GREETING=hi", "-v",
                       "hf://buckets/alice/b:/bucket", "-v", f"{code}:/code", "--",
                       "vllm/vllm-openai:v0.32.0", "bash", "-c",
                       "command -v python || echo 'no python'; echo \"$GREETING $HF_TOKEN $JOB_ID\"; "
                       "echo \"offline=${HF_HUB_OFFLINE:-unset} accelerator=$ACCELERATOR\"; "
                       "echo written > /bucket/out.txt; touch /code/x || echo 'code is read-only'; "
                       f"python3 /code/probe.py https://{server}--8000.hf.jobs https://{server}--8001.hf.jobs && "
                       "python3 -m pip install -q 'peft==0.21.2' && echo 'pip: already there'"))
    assert wait_stage(env, client) == "COMPLETED", job_log(env, client)
    out = job_log(env, client)
    assert "no python" in out and f"hi hf_emulated_token {client}" in out, out
    assert "offline=unset accelerator=none" in out, out  # only -e/-s and what Jobs sets
    assert "code is read-only" in out and "pip: already there" in out, out
    port_8000, port_8001 = re.findall(r"^http://10\.233\.0\.1:\d+ with: (.*) without: (\S+)$", out, re.M)
    assert port_8000[1] == "401" and port_8001[1] == "401", out  # the gateway: no HF bearer, no entry
    assert ("Authorization" in json.loads(port_8000[0])) == (mode == "forward"), out
    assert port_8001[0] == "502", out  # bound to 127.0.0.1: the gateway cannot reach it
    assert (tmp_path / "hub" / "buckets" / "alice" / "b" / "out.txt").read_text() == "written\n"
    got = subprocess.run(["curl", "-s", "-H", "Authorization: Bearer hf_emulated_token", outside + "/x"],
                         capture_output=True, text=True, timeout=30).stdout
    assert json.loads(got)["Host"], got
    # the standard library only in a python:* image; :ro buckets refuse writes; a missing package fails pip
    for image, volume, cmd in [("python:3.12-slim", [], "python3 -c 'import requests'"),
                               ("vllm/vllm-openai:v0.32.0", ["-v", "hf://buckets/alice/b:/bucket:ro"], "touch /bucket/y"),
                               ("vllm/vllm-openai:v0.32.0", [], "pip install -q no-such-package-xyz==1.0")]:
        jid = job_id(hf(env, "jobs", "run", "--detach", *volume, image, "bash", "-c", cmd))
        assert wait_stage(env, jid) == "ERROR", (cmd, job_log(env, jid))
    assert hf(env, "jobs", "cancel", server).returncode == 0
    assert wait_stage(env, server) == "CANCELED"


def test_a_read_only_mount_shows_another_jobs_file_late(hf_jobs):
    env = dict(hf_jobs, HF_EMU_MOUNT_LAG="3 4")
    assert hf(env, "buckets", "create", "alice/lag", "--exist-ok").returncode == 0
    reader = job_id(hf(env, "jobs", "run", "--detach", "-v", "hf://buckets/alice/lag:/b:ro", "python:3.12-slim",
                       "bash", "-c", "until [ -f /b/f ]; do sleep 0.2; done; echo seen $(date +%s.%N)"))
    writer = job_id(hf(env, "jobs", "run", "--detach", "-v", "hf://buckets/alice/lag:/b", "python:3.12-slim",
                       "bash", "-c", "echo x > /b/f; cat /b/f; echo wrote $(date +%s.%N)"))
    assert wait_stage(env, writer) == "COMPLETED" and wait_stage(env, reader) == "COMPLETED"
    wrote = float(job_log(env, writer).split("wrote ")[1])
    seen = float(job_log(env, reader).split("seen ")[1])
    assert 2.5 < seen - wrote < 8, (wrote, seen)  # the writer sees its own write at once ("x" above)
    assert "x" in job_log(env, writer)


@pytest.mark.parametrize("gateway, flavors", [("forward", ""), ("strip", ""), ("forward", "t4-small cpu-upgrade")])
def test_jobs_sh_run_ends_by_itself_on_emulated_jobs(hf_jobs, tiny_model, hf_run_name, gateway, flavors):
    """The whole run behind the strict gateway, whether it passes Authorization on or strips it:
    the roles' own credentials travel in X-Proxy-Token. The replica's bucket view lags 1-3 s.
    With `flavors`: a mixed pool (ROLLOUT_FLAVORS), whose shares `jobs.sh status` shows: a longer
    run, polled more often, so that a loaded machine still sees both replicas hold leases."""
    steps = 16 if flavors else 6
    offline = "HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false"
    # the replicas' own token for the gateway, not the user's HF token: the one the gateway takes
    gateway_token = dict(GATEWAY_TOKEN="hf_emulated_gateway_token", HF_EMU_USER_TOKEN="hf_emulated_gateway_token")
    env = dict(hf_jobs, **gateway_token, NAME=hf_run_name, BUCKET="alice/grpo", MODEL=tiny_model, TASK="toy",
               STEPS=str(steps),
               REPLICAS="1", NUM_GENERATIONS="4", GROUPS_PER_STEP="2", MAX_NEW_TOKENS="6", MAX_STALENESS="2",
               LEARNING_RATE="5e-3", LORA_R="8", LORA_ALPHA="16", SAVE_EVERY="3", ENGINE="hf", TIMEOUT="15m",
               JOB_ENV=offline, HF_EMU_GATEWAY=gateway, HF_EMU_MOUNT_LAG="1 3", STARTUP_TIMEOUT="120",
               ROLLOUT_FLAVORS=flavors)
    res = subprocess.run(jobs_sh(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    with open(os.path.join(ROOT, "runs", hf_run_name, "jobs.txt")) as f:
        jobs = dict(line.split() for line in f)
    pool = [f"rollout-{i}" for i in range(len(flavors.split()) or 1)]
    assert list(jobs) == ["proxy", *pool, "trainer"]
    for role, flavor in zip(pool, flavors.split()):  # one replica per flavor
        assert json.loads(hf(env, "jobs", "inspect", "--format", "json", jobs[role]).stdout)[0]["flavor"] == flavor
    for role, jid in jobs.items():  # the user's HF token is in the trainer's environment only
        with open(os.path.join(env["HF_EMU_DIR"], "jobs", jid, "job.json")) as f:
            held = json.load(f)["job_env"]
        assert ("hf_emulated_token" in held.values()) == (role == "trainer"), (role, sorted(held))

    # every job must end by itself: the trainer after STEPS steps, then the replica and the proxy
    stages, deadline, shares = {}, time.time() + 600, []
    while time.time() < deadline:
        status = subprocess.run(jobs_sh("status"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        shares.append({w[0]: float(w[1]) for w in map(str.split, status.stdout.splitlines())
                       if w and w[0].startswith("replica-") and w[1] != "gone"})
        stages = {w[0]: w[2] for line in status.stdout.splitlines()
                  if (w := line.split()) and w[0] in jobs}  # the job table, not the replicas' shares
        if not {"SCHEDULING", "RUNNING"} & set(stages.values()) or "ERROR" in stages.values():
            break
        time.sleep(0.5 if flavors else 2)
    logs = {role: job_log(env, jid)[-3000:] for role, jid in jobs.items()}
    assert stages == dict.fromkeys(jobs, "COMPLETED"), (stages, logs)
    if flavors:  # while it ran, status showed both replicas' shares of a step, from /stats
        assert any(set(s) == {"replica-0", "replica-1"} and max(s.values()) == 1.0 for s in shares), shares

    bucket = os.path.join(env["HF_EMU_DIR"], "buckets", "alice", "grpo", hf_run_name)
    assert [m["step"] for m in buckets.read_metrics(bucket)] == list(range(1, steps + 1))
    with open(os.path.join(bucket, "adapters", "LATEST")) as f:
        assert json.load(f)["version"] >= 1
    follow = subprocess.run(jobs_sh("logs", "trainer"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert f"step {steps}" in follow.stdout, follow.stdout[-2000:] + follow.stderr


@pytest.mark.parametrize("token, code", [("hf_not_a_token_of_this_user", 401), ("hf_no_namespace_read", 403)])
def test_a_launch_whose_gateway_refuses_the_token_stops_and_cancels(hf_jobs, tiny_model, hf_run_name, token, code):
    """The emulated gateway answers 401 (an unknown token) or 403 (HF_EMU_FORBIDDEN_TOKENS: no read
    access to the namespace) to GATEWAY_TOKEN: jobs.sh stops at that answer, well before
    STARTUP_TIMEOUT, names the token, and the proxy job it started ends CANCELED."""
    env = dict(hf_jobs, GATEWAY_TOKEN=token, HF_EMU_USER_TOKEN="hf_emulated_gateway_token",
               HF_EMU_FORBIDDEN_TOKENS="hf_no_namespace_read", NAME=hf_run_name, BUCKET="alice/grpo",
               MODEL=tiny_model, TASK="toy", STARTUP_TIMEOUT="300")
    t0 = time.time()
    res = subprocess.run(jobs_sh(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and time.time() - t0 < 60, res.stdout + res.stderr
    assert f"the *.hf.jobs gateway answered {code} to GATEWAY_TOKEN" in res.stderr, res.stderr
    assert token not in res.stdout + res.stderr
    jobs = [line.split() for line in open(os.path.join(ROOT, "runs", hf_run_name, "jobs.txt"))]
    assert [r for r, _ in jobs] == ["proxy"] and wait_stage(env, jobs[0][1]) == "CANCELED"


@pytest.mark.parametrize("gateway", ["forward", "strip"])
def test_preflight_answers_each_question_on_emulated_jobs(hf_jobs, hf_run_name, gateway):
    """Preflight tries GATEWAY_TOKEN, the token the launch gives the replicas (the emulated
    gateway takes it as the user's), and sends what a run sends: a 2 MB POST, a request held 35 s."""
    token = "hf_emulated_gateway_token"
    env = dict(hf_jobs, NAME=hf_run_name, BUCKET="alice/pre", HF_EMU_GATEWAY=gateway, HF_EMU_MOUNT_LAG="2 3",
               GATEWAY_TOKEN=token, HF_EMU_USER_TOKEN=token)
    t0 = time.time()
    res = subprocess.run(jobs_sh("preflight"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert time.time() - t0 < 120, "preflight must take under 2 minutes"
    verdicts = [line for line in res.stdout.splitlines() if line.startswith("[preflight] ")]
    text = "\n".join(verdicts)
    assert "reachable with GATEWAY_TOKEN: yes" in text, text
    assert re.search(r"POST of 2\.0 MB through the gateway .*: 200 in [0-9.]+ s, arrived whole", text), text
    held = re.search(r"a request the job holds 35 s .*: 200, answered after ([0-9.]+) s", text)
    assert held and 35 <= float(held.group(1)) < 60, text
    assert "without a token: refused" in text, text
    assert ("Authorization reaches the container: yes, intact" in text) == (gateway == "forward"), text
    assert ("Authorization reaches the container: no: the gateway removes it" in text) == (gateway == "strip")
    assert "X-Proxy-Token reaches the container: yes, intact" in text, text
    lag = float(re.search(r"bucket: the file job 2 wrote was seen by job 1 after ([0-9.]+) s", text).group(1))
    assert 1.5 < lag < 10, text  # HF_EMU_MOUNT_LAG 2-3 s
    assert token not in res.stdout + res.stderr and "hf_emulated_token" not in res.stdout + res.stderr
    jobs = [line.split() for line in open(os.path.join(ROOT, "runs", hf_run_name, "jobs.txt"))]
    assert [r for r, _ in jobs] == ["serve", "write"]
    assert all(wait_stage(env, jid) == "CANCELED" for _, jid in jobs)
