"""`bash jobs.sh --local` end to end on the tiny model: real proxy, replica and trainer processes.

Checks the run folder afterwards (metrics with a rising toy reward, several adapter versions,
the before/after table), the live display (each step's line once, with N/STEPS and the time),
and that no process of the run is left behind — after a normal finish and after Ctrl-C.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid

import pytest

from support import buckets
from conftest import free_port, jobs_sh, processes_mentioning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_env(tiny_model, name, **extra):
    env = dict(os.environ, NAME=name, MODEL=tiny_model, TASK="toy", STEPS="24", REPLICAS="1",
               MAX_STALENESS="2", NUM_GENERATIONS="8", GROUPS_PER_STEP="4", MAX_NEW_TOKENS="6",
               LEARNING_RATE="5e-3", LORA_R="8", LORA_ALPHA="16", SAVE_EVERY="5", EVAL_LIMIT="1",
               ENGINE="hf", PROXY_PORT=str(free_port()))
    env.update(extra)
    return env


def processes_of(run_dir, proxy_port):
    """(pid, command) of the run's processes: those whose command line mentions the run's folder
    (replicas and trainer get runs/NAME/bucket) and the proxy on its port."""
    return processes_mentioning(os.path.relpath(run_dir, ROOT),
                                f"proxy.py --host 127.0.0.1 --port {proxy_port} ")


def kill_leftovers(run_dir, proxy_port):
    """Whatever a failed test left running must not load the machine for the rest of the suite."""
    for pid, _ in processes_of(run_dir, proxy_port):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def listening(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.fixture
def run_name():
    name = f"test-{uuid.uuid4().hex[:8]}"
    yield name
    shutil.rmtree(os.path.join(ROOT, "runs", name), ignore_errors=True)


@pytest.fixture(scope="module")
def local_run(tiny_model):
    """One `bash jobs.sh --local` on the tiny model, 24 steps: (its result, the run's folder, the
    run's processes still alive a second after it returned)."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    env, run = run_env(tiny_model, name), os.path.join(ROOT, "runs", name)
    port = int(env["PROXY_PORT"])
    try:
        res = subprocess.run(["bash", "jobs.sh", "--local"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900)
        time.sleep(1)
        left = processes_of(run, port)
    finally:
        kill_leftovers(run, port)
    yield res, run, left
    shutil.rmtree(run, ignore_errors=True)


def test_local_run_learns_and_cleans_up(local_run):
    res, run, left = local_run
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = buckets.read_metrics(os.path.join(run, "bucket"))
    assert [m["step"] for m in metrics] == list(range(1, 25))
    rewards = [m["reward_mean"] for m in metrics]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    print(f"toy reward first 6 steps {first:.3f}, last 6 steps {last:.3f}")
    assert last > first + 0.3 and last > 0.6
    versions = sorted(os.listdir(os.path.join(run, "bucket", "adapters")))
    with open(os.path.join(run, "bucket", "adapters", "LATEST")) as f:
        assert json.load(f)["version"] >= 8  # one per optimizer step that changed the weights
    assert len([v for v in versions if v.startswith("v")]) >= 3
    summary = open(os.path.join(run, "summary.md")).read()
    assert "greedy accuracy, final adapter" in summary and "reward per step" in summary
    for f in ["proxy.log", "trainer.log", "rollout-0.log", "eval-base.json", "eval-final.json", "stats.json"]:
        assert os.path.exists(os.path.join(run, f)), f
    assert "MAX_STALENESS" in res.stdout  # settings printed at start
    with open(os.path.join(run, "stats.json")) as f:
        assert json.load(f)["delivered"] > 0  # /stats, read with the run's token
    # the run ended by itself: the trainer told the proxy, the replica and the proxy exited 0
    assert "rollout-0 exited by itself (status 0)" in res.stdout and "proxy exited by itself (status 0)" in res.stdout
    assert "still running" not in res.stdout, res.stdout[-3000:]
    assert left == []  # replica, trainer and proxy are all gone


def test_local_run_shows_every_step_once(local_run):
    """The live display shows each step line of trainer.log once, as "[N/24 mm:ss] step N v...":
    none skipped between two looks at the log, none repeated, the last ones too."""
    res, run, _ = local_run
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    shown = re.findall(r"^  \[(\d+)/24 (\d\d):(\d\d)\] (step (\d+) v\d+ \|.*)$", res.stdout, re.M)
    assert [int(n) for n, _, _, _, _ in shown] == list(range(1, 25)), res.stdout[-3000:]
    assert all(n == step for n, _, _, _, step in shown)
    elapsed = [int(m) * 60 + int(sec) for _, m, sec, _, _ in shown]
    assert elapsed == sorted(elapsed)  # time since training started, as the lines came
    with open(os.path.join(run, "trainer.log")) as f:
        logged = [line.rstrip("\n") for line in f if re.match(r"step \d+ v\d+ \|", line)]
    assert [line for _, _, _, line, _ in shown] == logged  # each line as the trainer wrote it


def test_local_run_refuses_a_port_another_proxy_answers_on(run_name):
    """Another run's proxy on PROXY_PORT: this run must not attach to it (it would feed that run)."""
    import http.server
    import threading

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"ok": true}')

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    try:
        res = subprocess.run(jobs_sh("--local"), cwd=ROOT, env=dict(os.environ, NAME=run_name, PROXY_PORT=str(port)),
                             capture_output=True, text=True, timeout=60)
    finally:
        other.shutdown()
    assert res.returncode != 0 and f"already listens on 127.0.0.1:{port}" in res.stderr, res.stdout + res.stderr
    assert not os.path.exists(os.path.join(ROOT, "runs", run_name))  # refused before anything started


def test_local_run_refuses_a_thread_count_that_is_not_a_whole_number(run_name):
    for bad in ("0", "00", "two", "-1", "1.5"):
        res = subprocess.run(jobs_sh("--local"), cwd=ROOT, env=dict(os.environ, NAME=run_name, THREADS=bad),
                             capture_output=True, text=True, timeout=60)
        assert res.returncode != 0 and f"THREADS='{bad}'" in res.stderr, res.stdout + res.stderr
    assert not os.path.exists(os.path.join(ROOT, "runs", run_name))  # refused before anything started


def test_local_run_ctrl_c_leaves_no_process(tiny_model, run_name):
    run = os.path.join(ROOT, "runs", run_name)
    env = run_env(tiny_model, run_name, STEPS="500")
    port = int(env["PROXY_PORT"])
    # A shell started with SIGINT ignored (as under a CI runner that put us in the background) can
    # not trap it; a terminal's Ctrl-C reaches a foreground jobs.sh with the default disposition.
    proc = subprocess.Popen(["bash", "jobs.sh", "--local"], cwd=ROOT, start_new_session=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        trainer_log = os.path.join(run, "trainer.log")
        while time.time() < deadline:  # wait until training is under way
            if os.path.exists(trainer_log) and "step " in open(trainer_log).read():
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(1)
        assert len(processes_of(run, port)) >= 3  # trainer, replica and proxy are running
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        time.sleep(1)
        left = processes_of(run, port)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_leftovers(run, port)
    assert proc.returncode == 130, out[-2000:]
    assert "interrupted" in out
    assert left == [] and not listening(port)


def test_gpu_check_small_mode_runs_on_a_cpu_when_allowed():
    """scripts/gpu_check.sh --small: what a GPU box with only torch/transformers/peft runs, here on
    the CPU (GPU_CHECK_ALLOW_CPU=1): the same roles, verdicts and exit codes, CUDA aside."""
    name = f"gpu-check-test-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, NAME=name, STEPS="6")
    try:
        import torch

        if not torch.cuda.is_available():  # without the switch, no GPU is a clear exit 2
            res = subprocess.run(["bash", "scripts/gpu_check.sh", "--small"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode == 2 and "no CUDA GPU" in res.stderr, res.stdout + res.stderr
        res = subprocess.run(["bash", "scripts/gpu_check.sh", "--small"], cwd=ROOT,
                             env=dict(env, GPU_CHECK_ALLOW_CPU="1"), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        verdicts = [line for line in res.stdout.splitlines() if line.startswith("[gpu_check] ")]
        assert "\n[machine] torch " in res.stdout, res.stdout[:2000]  # its machine, as a GPU job's
        for want in ["PASS engine: hf on cpu", "PASS hot reload", "PASS step 1: importance ratio",
                     "PASS exits: proxy 0, replica 0, trainer 0", "[gpu_check] passed"]:
            assert any(want in v for v in verdicts), (want, verdicts)
    finally:
        shutil.rmtree(os.path.join(ROOT, "runs", name), ignore_errors=True)
