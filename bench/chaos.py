"""Chaos run: a whole local system (proxy + 2 replicas + trainer on the tiny model, toy task) while
random roles are SIGKILLed at random moments and restarted with the same command (seeded).

    python bench/chaos.py --minutes 10 --seed 0          # directory bucket
    python bench/chaos.py --minutes 3 --seed 1 --s3      # s3://... on a moto_server of its own

At the end (and after every kill) it checks the run's invariants and prints a summary:
  - no adapter version is published twice ("published vN" lines of every trainer run, strictly
    rising), and a restarted trainer resumes from the state the bucket holds at that moment;
  - every version in the bucket that has a manifest verifies, and LATEST verifies (checked while
    the trainer is dead, so nothing is being written);
  - the proxy's accounting balances (accepted = delivered + dropped_stale + buffered) after every
    restart and at the end; the groups lost with a proxy are the ones its last /stats buffered;
  - the trainer kept making progress; no role died on its own; no process is left behind.

Two hostile peers run all along, with the replicas' token (ROLLOUT_TOKEN; the trainer holds PROXY_TOKEN):
  - a poisoner (the harness itself) POSTs, at random moments, groups that are valid JSON but hostile:
    ones the schema allows (log-prob -999 on a low-reward completion; the crafted-ratio group: the
    trainer's current log-probs - 19.9, ratio ~4.4e8, computed with trainer.py's own forward on the
    adapter the bucket holds), ones a proxy may refuse or the trainer must drop (rewards of +-1e29,
    the longest prompt the model takes, completions with no ids), and ones the proxy must refuse (a
    positive, NaN or too small log-prob, an infinite reward, another temperature, max_new_tokens or
    G, a policy_version from the future); now and then it floods 200 groups it was never leased and
    POSTs an 8 MB body;
  - a lying replica follows /quota but posts groups of random log-probs tagged with the trainer's version,
    and tries the trainer's endpoints (POST /version 2147483647, GET /batch, POST /done): each must get 403.
At the end every adapter in the bucket must hold finite weights, no step whose loss or gradient was not
finite may have been applied, no group from the future may have been trained on, and every step's
gradient must be dominated by honest groups: its norm before clipping at most GRAD_BOUND = 1e3 (a
crafted group that reached the gradient makes it ~1e7..1e8; honest steps here stay below ~10).

The same harness (Role, LocalSystem, verify_bucket, TcpRelay) is what tests/test_faults.py uses.
This file is not collected by pytest (its name does not start with test_).
"""

import argparse
import collections
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import sync  # noqa: E402
from support import buckets, trainer_state
from conftest import free_port, processes_mentioning, wait_port  # noqa: E402
from support.contract import make_completion, make_group
from support.proxy_client import ProxyClient, ProxyError

TOKEN = "chaos-token"  # the trainer's (PROXY_TOKEN): every endpoint
ROLLOUT_TOKEN = "chaos-rollout-token"  # the replicas' (ROLLOUT_TOKEN): /rollouts, /quota, /config, /stats only
# the bucket's keys, as jobs.sh gives them: the trainer tags its adapters and state, the replicas check the tags
BUCKET_KEYS = {"ADAPTER_KEY": "chaos-adapter-key", "TRAINER_STATE_KEY": "chaos-state-key"}
PUBLISHED = re.compile(r"^published v(\d+) at step (\d+)$", re.M)
STEP = re.compile(r"^step (\d+) v(\d+) ", re.M)
RESUMED = re.compile(r"^(resumed from step (\d+), version (\d+)|starting fresh)", re.M)


class Role:
    """One role's command, run as a process in its own session (so a kill takes all of it), with
    stdout + stderr appended to one log across restarts; each start writes a marker line."""

    def __init__(self, name, cmd, log_path, env):
        self.name, self.cmd, self.log_path, self.env = name, cmd, log_path, env
        self.proc, self.starts, self.kills = None, 0, 0

    def start(self):
        self.starts += 1
        with open(self.log_path, "a") as log:
            log.write(f"=== chaos: start {self.starts} of {self.name} ===\n")
            log.flush()
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.offset = os.path.getsize(self.log_path)

    @property
    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig):
        if self.alive:
            os.killpg(self.proc.pid, sig)

    def kill(self):
        """SIGKILL the process group of this role (only what this harness started)."""
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.kills += 1
        if self.proc is not None:
            self.proc.wait()

    def stop(self, grace=10.0):
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def text(self):
        """The whole log, every run of this role."""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def current(self):
        """The log of the current (latest) run only."""
        with open(self.log_path, errors="replace") as f:
            f.seek(self.offset)
            return f.read()

    def wait_for(self, pattern, timeout, count=1, flags=re.M):
        """The count-th match of `pattern` in the current run's log; fails if the role exits first."""
        deadline = time.time() + timeout
        while True:
            found = list(re.finditer(pattern, self.current(), flags))
            if len(found) >= count:
                return found[count - 1]
            if not self.alive:
                raise AssertionError(f"{self.name} exited (rc {self.proc.returncode}) while waiting for "
                                     f"{pattern!r}:\n{self.current()[-3000:]}")
            if time.time() > deadline:
                raise AssertionError(f"{self.name}: no {pattern!r} after {timeout:.0f}s:\n{self.current()[-3000:]}")
            time.sleep(0.1)


class TcpRelay:
    """127.0.0.1:port -> 127.0.0.1:target, in threads. stop() closes the listener and every open
    connection (clients see 'connection refused'); start() listens on the same port again. Put in
    front of the S3 server, it cuts the network without losing the server's in-memory data."""

    def __init__(self, target, port=None):
        self.target, self.port = target, port or free_port()
        self.sock, self.conns, self.lock = None, [], threading.Lock()

    def start(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(64)
        threading.Thread(target=self._accept, args=(self.sock,), daemon=True).start()
        return self

    def _accept(self, listener):
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept(): stop listening now
        except OSError:
            pass
        self.sock.close()
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def start_moto():
    """A moto S3 server of our own (so that it can be stopped); returns (process, endpoint)."""
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_port(port)
    return proc, port


def aws_env(endpoint):
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1"}


# ----------------------------------------------------------------------------- invariants

def verify_bucket(bucket, scratch):
    """Every version with a manifest.json must verify against it, and LATEST must name one that
    does. Call it while no trainer writes. Returns {"latest", "complete", "torn"} (torn: versions
    with files but no manifest, left by a kill mid-publish or mid-prune)."""
    b = buckets.open_bucket(bucket) if isinstance(bucket, str) else bucket
    latest, complete, torn = sync.latest_version(b), [], []
    for v in sync.versions(b):
        if b.read(f"adapters/v{v:06d}/{buckets.MANIFEST}") is None:
            torn.append(v)
            continue
        dest = tempfile.mkdtemp(dir=scratch)
        try:
            sync.pull_adapter(b, v, dest, timeout=2.0)  # raises BucketError if a file does not match
        except buckets.BucketError as e:
            raise AssertionError(f"adapter v{v} has a manifest but does not verify: {e}") from None
        finally:
            shutil.rmtree(dest, ignore_errors=True)
        complete.append(v)
    assert latest is None or latest in complete, f"LATEST = v{latest} is not a complete version (torn: {torn})"
    return {"latest": latest, "complete": complete, "torn": torn}


def saved_state(bucket, scratch):
    """(step, version) of the trainer state the bucket holds now, or None."""
    import torch

    d = buckets.load_trainer_state(bucket, tempfile.mkdtemp(dir=scratch))
    if d is None:
        return None
    state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
    shutil.rmtree(d, ignore_errors=True)
    return state["step"], state["version"]


def check_accounting(stats):
    s = stats
    assert s["accepted"] == s["delivered"] + s["dropped_stale"] + s["dropped_zero_variance"] + s["buffered"], \
        f"accounting broken: {s}"


def check_publishes(trainer_log):
    """Version numbers over every run of the trainer: strictly rising, so never one twice."""
    versions = [int(v) for v, _ in PUBLISHED.findall(trainer_log)]
    assert versions == sorted(set(versions)), f"a version was published twice or out of order: {versions}"
    return versions

# ----------------------------------------------------------------------------- the system

class LocalSystem:
    """proxy.py, N rollout.py replicas (hf engine, toy task) and trainer.py as separate processes
    on 127.0.0.1, one thread each, logs under `workdir`. Each role holds only its own token: the
    trainer PROXY_TOKEN, the replicas ROLLOUT_TOKEN, the proxy both; the bucket keys (BUCKET_KEYS):
    the trainer both, the replicas ADAPTER_KEY."""

    def __init__(self, workdir, model, bucket, replicas=2, max_staleness=2, num_generations=8, env=None,
                 trainer_args=(), replica_args=(), proxy_args=()):
        self.workdir, self.model, self.bucket = workdir, model, bucket
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.max_staleness = max_staleness
        self.env = {**os.environ, "PROXY_TOKEN": TOKEN, "ROLLOUT_TOKEN": ROLLOUT_TOKEN, "OMP_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}  # the proxy's
        replica_env = {k: v for k, v in self.env.items() if k != "PROXY_TOKEN"}  # rollout.py takes ROLLOUT_TOKEN
        trainer_env = {k: v for k, v in self.env.items() if k != "ROLLOUT_TOKEN"}
        replica_env.setdefault("ADAPTER_KEY", BUCKET_KEYS["ADAPTER_KEY"])  # checks the trainer's tags
        trainer_env = {**BUCKET_KEYS, **trainer_env}  # only the trainer holds TRAINER_STATE_KEY
        self.rollout_token = self.env["ROLLOUT_TOKEN"]
        py, G, S = sys.executable, str(num_generations), str(max_staleness)
        self.roles = {"proxy": Role("proxy", [py, "proxy.py", "--port", str(self.port), "--max-staleness", S,
                                              "--num-generations", G, "--linger", "1e9", *proxy_args],
                                    os.path.join(workdir, "proxy.log"), self.env)}
        for i in range(replicas):
            cmd = [py, "rollout.py", "--engine", "hf", "--task", "toy", "--model", model, "--bucket", bucket,
                   "--proxy", self.url, "--replica-id", str(i),
                   "--num-replicas", str(replicas), "--seed", "0", "--poll-interval", "0.5", *replica_args]
            self.roles[f"replica-{i}"] = Role(f"replica-{i}", cmd, os.path.join(workdir, f"replica-{i}.log"),
                                              replica_env)
        self.roles["trainer"] = Role("trainer", [py, "trainer.py", "--model", model, "--bucket", bucket, "--proxy",
                                                 self.url, *trainer_args], os.path.join(workdir, "trainer.log"), trainer_env)

    @property
    def trainer(self):
        return self.roles["trainer"]

    @property
    def proxy(self):
        return self.roles["proxy"]

    def replicas(self):
        return [r for name, r in self.roles.items() if name.startswith("replica-")]

    def start(self):
        self.start_proxy()
        for role in self.roles.values():
            if role.name != "proxy":
                role.start()

    def start_proxy(self):
        self.proxy.start()
        wait_port(self.port)

    def client(self, max_wait=10.0):
        """A client with the trainer's token (every endpoint)."""
        return ProxyClient(self.url, token=self.env["PROXY_TOKEN"], max_wait=max_wait)

    def rollout_client(self, max_wait=10.0):
        """A client with the replicas' token: what a hostile replica holds."""
        return ProxyClient(self.url, token=self.rollout_token, max_wait=max_wait)

    def stats(self):
        s = self.client().stats()
        check_accounting(s)
        return s

    def steps(self):
        """The step numbers the trainer printed, over all its runs."""
        return [int(s) for s, _ in STEP.findall(self.trainer.text())]

    def dead(self):
        """Roles that exited on their own (a kill by the harness is followed by a restart)."""
        return {name: role.proc.returncode for name, role in self.roles.items() if not role.alive}

    def stop(self):
        for role in self.roles.values():  # the trainer first would also do; order does not matter
            role.stop()


# ----------------------------------------------------------------------------- the chaos run

# lr 5e-6: slow enough that the toy task is not solved (no usable groups, nothing to publish) in 10 min
TRAINER_ARGS = ["--learning-rate", "5e-6", "--lora-r", "8", "--lora-alpha", "16",
                "--micro-batch-tokens", "256", "--save-every", "3",
                "--max-steps", "100000", "--wait-timeout", "180", "--bucket-retry", "120", "--seed", "0"]
REPLICA_ARGS = ["--proxy-wait", "600"]
PROXY_ARGS = ["--max-groups", "24", "--groups-per-step", "2", "--max-new-tokens", "6"]


class Report:
    """What a chaos run counts: kills per role, invariant checks passed, groups lost, failures."""

    def __init__(self, roles):
        self.kills = dict.fromkeys(roles, 0)
        self.checks = collections.Counter()
        self.lost, self.failures, self.trainer_runs = [], [], []  # trainer_runs: (run number, versions seen)
        self.poison = collections.Counter()  # (kind, "accepted" | "refused" | "not delivered") of the poisoner's POSTs
        self.lies = collections.Counter()  # what the lying replica sent and what it was answered

    def check(self, name, ok=True, failure=None):
        if ok:
            self.checks[name] += 1
        else:
            self.failures.append(failure)


def kill_proxy(system, rng, report):
    """SIGKILL the proxy, note what it buffered (its /stats just before), restart it on its port."""
    last = system.stats()  # raises if the counters do not balance
    report.check("accounting balanced")
    system.proxy.kill()
    report.lost.append(last["buffered"])
    time.sleep(rng.uniform(0.5, 5))
    system.start_proxy()
    time.sleep(3)
    system.stats()
    report.check("accounting balanced")


def kill_trainer(system, rng, scratch, report):
    """SIGKILL the trainer; while it is dead, verify the bucket; restart it and compare its first
    line with the state the bucket holds."""
    system.trainer.kill()
    verify_bucket(system.bucket, scratch)  # raises AssertionError: LATEST incomplete or a manifest broken
    report.check("bucket verified")
    state, seen = saved_state(system.bucket, scratch), sync.versions(system.bucket)
    time.sleep(rng.uniform(0, 3))
    system.trainer.start()
    m = system.trainer.wait_for(RESUMED.pattern, 120)
    got = None if m.group(1) == "starting fresh" else (int(m.group(2)), int(m.group(3)))
    report.check("resume matched the saved state", got == state,
                 f"trainer resumed from {got}, but the bucket held state {state}")
    report.trainer_runs.append((system.trainer.starts, seen))


def kill_replica(role, rng):
    time.sleep(rng.uniform(0, 1))  # somewhere in a batch
    role.kill()
    time.sleep(rng.uniform(0, 3))
    role.start()


# ----------------------------------------------------------------------------- hostile peers

LIAR_VERSION = 2**31 - 1  # the version the lying replica tries to set: the trainer's next would get 409
ALLOWED = ("logprob -999", "crafted ratio")  # the schema allows them; the trainer must survive them
EITHER = ("reward 1e29", "longest", "empty ids")  # a proxy with reward_range, max_prompt_length or
# non-empty ids refuses them (400), an older one takes them: the trainer drops or survives them
GRAD_BOUND = 1e3  # a step's gradient norm before clipping; a crafted group without delta: ~1e7..1e8
FLOOD, BIG_BODY_MB = 200, 8  # groups the flooder posts unasked; the oversized POST's body
REFUSED = ("logprob > 0", "logprob NaN", "logprob < -1000", "reward inf", "temperature", "max_new_tokens", "G",
           "future version")  # the proxy must refuse them: 400, or 409 for the future


def model_limits(model):
    """(vocabulary size, longest sequence) of the base model: hostile groups stay within what it takes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    return config.vocab_size, min(config.max_position_embeddings, 4096)


def hostile_group(kind, contract, version, limits, rng, worker="chaos-poisoner", crafter=None):
    """One group as a replica POSTs it, made hostile as `kind` (ALLOWED, EITHER or REFUSED) says."""
    (vocab, longest), G, T = limits, contract["num_generations"], contract["max_completion_length"]
    completions = [make_completion(ids=[rng.randrange(vocab) for _ in range(T)],
                                   logprobs=[-4.6] * T, reward=float(j % 2), text="",
                                   finish_reason="length") for j in range(G)]
    g = make_group(group_id=f"{worker}-{uuid.uuid4().hex}", policy_version=version, worker=worker,
                   prompt=kind, prompt_ids=[rng.randrange(vocab) for _ in range(8)],
                   temperature=contract["temperature"], max_completion_length=T, completions=completions)
    first = completions[0]
    if kind == "logprob -999":  # negative advantage: exp(new - old) ~ e^995 without the trainer's log-ratio cap
        for c in completions[::2]:
            c["logprobs"] = [-999.0] * T
    elif kind == "reward 1e29":  # the squares in the std overflow float32
        first["reward"], completions[1]["reward"] = 1e29, -1e29
    elif kind == "longest":  # the longest prompt and completions the model takes (the tokens are all real ids)
        g["prompt_ids"] = [rng.randrange(vocab) for _ in range(longest - T)]
    elif kind.startswith("logprob"):
        first["logprobs"][0] = {"logprob > 0": 0.5, "logprob NaN": math.nan, "logprob < -1000": -1e4}[kind]
    elif kind == "crafted ratio":  # the trainer's current log-probs - 19.9: ratio ~4.4e8, just under the cap
        crafter.craft(g, version)
    elif kind == "empty ids":
        for c in completions:
            c["ids"], c["logprobs"] = [], []
    elif kind == "reward inf":
        first["reward"] = math.inf
    elif kind == "temperature":
        g[kind] = contract[kind] * 2
    elif kind == "max_new_tokens":  # another length than the run's, under the length's old name
        del g["max_completion_length"]
        g[kind] = T * 2
    elif kind == "G":
        g["completions"] = completions[:-1]
    elif kind == "future version":  # no adapter of the trainer made it
        g["policy_version"] = version + 1
    return g


def post_raw(client, groups):
    """POST /rollouts as a hostile peer would (NaN and Infinity written as JS literals): (status, answer)."""
    r = client.session.post(client.url + "/rollouts", data=json.dumps({"groups": groups}),
                            headers={"Content-Type": "application/json"}, timeout=60)
    return r.status_code, r.json()


class Crafter:
    """The trainer's current log-probs of a group, computed as a replica that holds the current
    adapter can (trainer.py's own forward on the adapter the bucket holds for that version)."""

    def __init__(self, model, bucket, scratch):
        import trainer

        self.trainer, self.bucket, self.scratch = trainer, bucket, scratch
        self.model = trainer_state.build_model(model, lora_r=8, lora_alpha=16)  # as TRAINER_ARGS
        self.model.eval()

    def craft(self, g, version, shift=-19.9):
        import torch
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        dest = tempfile.mkdtemp(dir=self.scratch)
        try:
            path = sync.pull_adapter(self.bucket, version, dest, timeout=5.0)
            weights = load_file(os.path.join(path, "adapter_model.safetensors"))
        finally:
            shutil.rmtree(dest, ignore_errors=True)
        set_peft_model_state_dict(self.model, weights)
        seqs = self.trainer.flatten_groups([g], 10**6)
        with torch.no_grad():  # the current policy's log-probs, = trainer.plain_logprobs
            lp = self.trainer.plain_logprobs(self.model, seqs, list(range(len(seqs))),
                                             g["temperature"])  # (G, C)
        for r, c in enumerate(g["completions"]):
            c["logprobs"] = [x + shift for x in lp[r, :len(c["ids"])].tolist()]


def flood_and_big_post(client, contract, version, limits, rng, report):
    """A replica that posts FLOOD groups it was never leased (in POSTs of 8), and one POST of
    BIG_BODY_MB of `[],`: counted by answer; neither may stop a role or the trainer's steps."""
    import requests

    for _ in range(FLOOD // 8):
        groups = [lying_group(contract, version, limits, rng) for _ in range(8)]
        for g in groups:
            g["worker"] = "chaos-flooder"
        try:
            code, _ = post_raw(client, groups)
        except (requests.RequestException, ValueError):
            code = None
        report.poison["unasked flood", code] += 8
    body = b'{"groups": [' + b"[]," * (BIG_BODY_MB * 2**20 // 3) + b"[]]}"
    try:
        r = client.session.post(client.url + "/rollouts", data=body, timeout=60,
                                headers={"Content-Type": "application/json"})
        code = r.status_code
    except requests.RequestException as e:
        code = type(e).__name__  # the proxy may hang up on a body it will not read
    report.poison["oversized POST", code] += 1
    if code == 200:
        report.failures.append(f"an oversized POST of {BIG_BODY_MB} MB was answered 200")


def poisoner(system, limits, rng, stop, report):
    """Every few seconds, POST two hostile groups (one each) and count how the proxy answered;
    once in a while, flood unasked and send an oversized body."""
    import requests

    client, crafter = system.rollout_client(max_wait=30), Crafter(system.model, system.bucket, system.workdir)
    first = ["crafted ratio", "empty ids"]  # the first rounds send these; then random kinds
    while not stop.wait(rng.uniform(3, 12)):
        if rng.random() < 0.1:
            with contextlib.suppress(ProxyError):
                s = client.stats()
                flood_and_big_post(client, s["contract"], s["trainer_version"] or 0, limits, rng, report)
        try:
            s = client.stats()
        except ProxyError:
            continue  # the proxy is down for longer than 30 s: try again later
        t = s["trainer_version"]
        for kind in [first.pop(0)] if first and t is not None else rng.sample(ALLOWED + EITHER + REFUSED, 2):
            if kind in ("future version", "crafted ratio") and t is None:
                continue  # a restarted proxy knows no trainer version yet: nothing is "the future"
            try:
                group = hostile_group(kind, s["contract"], t or 0, limits, rng, crafter=crafter)
                code, answer = post_raw(client, [group])
            except (requests.RequestException, ValueError, buckets.BucketError):  # BucketError: v pruned
                code, answer = None, {}
            if code is None or code == 429 or code >= 500:  # down, restarting, or full
                report.poison[kind, "not delivered"] += 1
                continue
            report.poison[kind, "accepted" if code == 200 else "refused"] += 1
            if wrong := poison_verdict(kind, group, code, answer):
                report.failures.append(wrong)


def poison_verdict(kind, group, code, answer):
    """None if the proxy answered a hostile group of this kind as it must, else the failure. A group
    from the future is judged against the version the proxy answered with, not the /stats read it was
    made from: the trainer may reach the group's version before the POST (a restarted proxy: none)."""
    want = 200 if kind in ALLOWED else 409 if kind == "future version" else 400
    if kind in EITHER and code in (200, 400):
        return None
    if kind == "future version" and code == 200:
        answered = answer.get("trainer_version", -1)
        want = 200 if answered is None or answered >= group["policy_version"] else want
    return None if code == want else f"poisoned group {kind!r}: HTTP {code} {str(answer)[:300]}, expected {want}"


def lying_group(contract, version, limits, rng):
    """A group tagged with the trainer's version whose log-probs no policy made (random in [-30, 0])."""
    vocab, T = limits[0], contract["max_completion_length"]
    completions = []
    for _ in range(contract["num_generations"]):
        n = rng.randint(1, T)
        completions.append(make_completion(ids=[rng.randrange(vocab) for _ in range(n)], text="",
                                           finish_reason="length",
                                           logprobs=[rng.uniform(-30, 0) for _ in range(n)],
                                           reward=float(rng.random() < 0.5)))
    prompt_ids = [rng.randrange(vocab) for _ in range(rng.randint(4, 40))]
    return make_group(group_id=f"chaos-liar-{uuid.uuid4().hex}", policy_version=version,
                      worker="chaos-liar", prompt="lie", prompt_ids=prompt_ids,
                      temperature=contract["temperature"], max_completion_length=T,
                      completions=completions)


def liar(system, limits, rng, stop, report):
    """A replica that lies: it follows /quota, posts random groups under the trainer's version, and every
    third round tries the trainer's endpoints. Each must get 403 and leave the proxy's version alone."""
    client, rounds = system.rollout_client(max_wait=30), 0
    trainer_only = {"POST /version": lambda: client.set_version(LIAR_VERSION), "POST /done": client.done,
                    "GET /batch": lambda: client.get_batch(system.max_staleness + 1, timeout=0)}
    while not stop.wait(rng.uniform(2, 6)):
        rounds += 1
        try:
            contract = client.contract()
            q = client.quota("chaos-liar", client.stats()["trainer_version"] or 0, 4, timeout=5)
            if q["groups"] and q["trainer_version"] is not None:
                answer = client.post_rollouts([lying_group(contract, q["trainer_version"], limits, rng)
                                               for _ in range(q["groups"])])
                report.lies["groups sent"] += q["groups"]
                report.lies["groups accepted"] += answer["accepted"] - answer["stale"] - answer["zero_variance"]
            for name, call in trainer_only.items() if rounds % 3 == 0 else ():
                report.lies["trainer calls"] += 1
                try:
                    call()
                    report.failures.append(f"the lying replica's {name} was answered 200 (it holds the replicas' token)")
                except ProxyError as e:
                    report.lies["403"] += "HTTP 403" in str(e)
                    report.lies["trainer calls unanswered"] += "gave up" in str(e)
                s = client.stats()
                if s["trainer_version"] == LIAR_VERSION or s["state"] == "done":
                    report.failures.append(f"after the lying replica's {name}: proxy at v{s['trainer_version']}, "
                                           f"state {s['state']}")
        except ProxyError as e:
            report.lies["rounds cut short by the proxy"] += 1
            if "gave up" not in str(e):  # a proxy down for over 30 s is a kill, not news
                report.failures.append(f"lying replica: {str(e)[:300]}")


def start_hostile_peers(system, model, seed, report):
    """The poisoner and the lying replica, as threads of this process; returns stop() for the end."""
    limits, stop = model_limits(model), threading.Event()
    threads = [threading.Thread(target=watched, args=(fn, report, system, limits, random.Random(seed * 1000 + i),
                                                       stop, report), name=fn.__name__, daemon=True)
               for i, fn in enumerate((poisoner, liar))]
    for t in threads:
        t.start()

    def stop_all():
        stop.set()
        for t in threads:
            t.join(120)
    return stop_all


def watched(fn, report, *args):
    """Run a hostile peer; an exception of the harness itself becomes a failure, not a silent thread death."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001  (reported, and the run fails)
        report.failures.append(f"{fn.__name__} thread crashed: {type(e).__name__}: {str(e)[:300]}")


def adapter_finite(bucket, version, scratch):
    """True when every tensor of adapter `version` (adapter_model.safetensors) is finite."""
    import torch
    from safetensors.torch import load_file

    dest = tempfile.mkdtemp(dir=scratch)
    try:
        path = sync.pull_adapter(bucket, version, dest, timeout=5.0)
        return all(torch.isfinite(t).all().item() for t in load_file(os.path.join(path, "adapter_model.safetensors")).values())
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def learning_checks(system, scratch, report, final):
    """Finite weights in every adapter kept, no non-finite step applied, no group from the future trained on."""
    finite = [v for v in final["complete"] if adapter_finite(system.bucket, v, scratch)]
    report.check("every adapter in the bucket has finite weights", finite == final["complete"],
                 f"adapters with NaN or inf weights: {sorted(set(final['complete']) - set(finite))}")
    records = buckets.read_metrics(system.bucket)
    finite_number = lambda x: type(x) in (int, float) and math.isfinite(x)  # noqa: E731
    applied = [r["step"] for r in records if not r.get("skipped_non_finite")
               and not (finite_number(r.get("loss")) and finite_number(r.get("grad_norm")))]
    report.check("no non-finite step applied", not applied, f"steps applied with a non-finite loss or gradient: {applied}")
    steered = [r["step"] for r in records if not r.get("grad_norm", 0) <= GRAD_BOUND]
    report.check("every step's gradient dominated by honest groups", not steered,
                 f"steps with a gradient norm over {GRAD_BOUND:g} before clipping (a group's absurd ratio "
                 f"reached the gradient): {steered}")
    future = [r["step"] for r in records if max(r.get("policy_versions") or [0]) > r["version"]]
    report.check("no group from the future trained on", not future, f"steps with groups from the future: {future}")
    versions = [int(v) for v, _ in PUBLISHED.findall(system.trainer.text())]
    report.check("the liar never set the version", LIAR_VERSION not in versions and report.lies["403"] ==
                 report.lies["trainer calls"] - report.lies["trainer calls unanswered"],
                 f"trainer-only calls of the lying replica: {dict(report.lies)}")
    return {"finite": finite, "records": records, "applied_non_finite": applied}


def final_checks(system, scratch, report, work):
    """After the run (every role stopped): bucket, version numbers, logs, processes."""
    try:
        final = verify_bucket(system.bucket, scratch)
        report.check("bucket verified")
    except (AssertionError, buckets.BucketError) as e:
        report.failures.append(str(e))
        final = {"latest": None, "complete": [], "torn": []}
    try:
        final.update(learning_checks(system, scratch, report, final))
    except (OSError, ValueError, buckets.BucketError) as e:
        report.failures.append(f"learning checks: {type(e).__name__}: {str(e)[:500]}")
    log = system.trainer.text()
    try:
        check_publishes(log)
        report.check("no version published twice")
    except AssertionError as e:
        report.failures.append(str(e))
    runs = {r.split(" ", 1)[0]: r for r in log.split("=== chaos: start ")[1:]}
    for run, seen in report.trainer_runs:
        first = [int(v) for v, _ in PUBLISHED.findall(runs[str(run)])][:1]
        if first:
            report.check("first publish after a restart above every version seen", not seen or first[0] > max(seen),
                         f"trainer run {run} published v{first[0]}, not above v{max(seen)} already in the bucket")
    for role in system.roles.values():
        text = role.text()
        report.check("no traceback or error line in a log", "Traceback" not in text and ": error: " not in text,
                     f"a traceback or error line in {role.log_path}")
    left = processes_mentioning(work)
    report.check("no process left behind", not left, f"processes left behind: {left}")
    return final


def chaos(args):
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix=f"chaos-{args.seed}-")
    scratch = os.path.join(work, "scratch")
    os.makedirs(scratch)
    print(f"chaos: seed {args.seed}, {args.minutes} min, logs in {work}", flush=True)
    import tiny_model

    model = args.model or tiny_model.build(os.path.join(work, "tiny"))
    moto, env, bucket = None, {}, os.path.join(work, "bucket")
    if args.s3:
        moto, moto_port = start_moto()
        env = aws_env(f"http://127.0.0.1:{moto_port}")
        os.environ.update(env)  # this process verifies the bucket too
        import boto3

        name = f"chaos-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=name)
        bucket = f"s3://{name}/run"
    system = LocalSystem(work, model, bucket, env=env, trainer_args=TRAINER_ARGS, replica_args=REPLICA_ARGS,
                         proxy_args=PROXY_ARGS)
    report = Report(system.roles)
    before = 0
    system.start()
    stop_hostile_peers = lambda: None  # noqa: E731
    try:
        stop_hostile_peers = start_hostile_peers(system, model, args.seed, report)
        system.trainer.wait_for(r"^step 1 ", 240)
        deadline = time.time() + args.minutes * 60
        while (left := deadline - time.time()) > 0:
            time.sleep(min(rng.uniform(5, 25), left))
            if system.dead() or time.time() >= deadline:
                break
            name = rng.choice(list(system.roles))
            if name == "proxy":
                kill_proxy(system, rng, report)
            elif name == "trainer":
                kill_trainer(system, rng, scratch, report)
            else:
                kill_replica(system.roles[name], rng)
            report.kills[name] += 1
            print(f"chaos: {time.strftime('%H:%M:%S')} killed {name}; trainer at step "
                  f"{max(system.steps(), default=0)}", flush=True)
        gone = system.dead()
        report.check("no role died on its own", not gone, f"died on their own (exit codes): {gone}")
        before = max(system.steps(), default=0)
        system.trainer.wait_for(r"^step \d+ ", 180, count=len(STEP.findall(system.trainer.current())) + 1)
        report.check("the trainer still steps at the end")
        system.stats()
        report.check("accounting balanced")
    except (AssertionError, OSError, ProxyError, buckets.BucketError) as e:
        report.failures.append(f"{type(e).__name__}: {str(e)[:2000]}")
    finally:
        stop_hostile_peers()
        system.stop()
    try:
        final = final_checks(system, scratch, report, work)
    finally:
        if moto is not None:
            os.killpg(moto.pid, signal.SIGKILL)
            moto.wait()

    log, steps = system.trainer.text(), system.steps()
    versions = [int(v) for v, _ in PUBLISHED.findall(log)]
    resent = len(re.findall(r"announcing v\d+ again", log))
    print("\n==== chaos summary ====")
    print(f"seed {args.seed}, {args.minutes:g} min, bucket {'s3' if args.s3 else 'directory'}, logs {work}")
    print("kills: " + ", ".join(f"{k} {v}" for k, v in report.kills.items()) +
          f"; restarts: {sum(r.starts - 1 for r in system.roles.values())}")
    print(f"trainer: {system.trainer.starts} runs, {len(steps)} step lines (redone steps included), last step "
          f"{max(steps, default=0)} ({before} when the killing stopped)")
    print(f"versions published: {len(versions)} (v{min(versions, default=0)}..v{max(versions, default=0)}); "
          f"bucket at the end: LATEST v{final['latest']}, complete {final['complete']}, torn {final['torn']}")
    print(f"groups lost with the proxy: {sum(report.lost)} over {len(report.lost)} proxy kills "
          f"(buffered at its last /stats: {report.lost})")
    print(f"the trainer announced its version again to a restarted proxy {resent} times")
    p = report.poison
    by = lambda kinds, outcome: ", ".join(f"{k} {p[k, outcome]}" for k in kinds if p[k, outcome])  # noqa: E731
    print(f"poisoned groups the proxy may take or refuse: accepted {by(EITHER, 'accepted') or 0}; refused "
          f"{by(EITHER, 'refused') or 0}")
    print(f"poisoned groups (replicas' token): accepted {sum(p[k, 'accepted'] for k in ALLOWED)} ({by(ALLOWED, 'accepted')}); "
          f"refused {sum(p[k, 'refused'] for k in REFUSED)} ({by(REFUSED, 'refused')}); not delivered (proxy down or "
          f"full) {sum(n for (_, o), n in p.items() if o == 'not delivered')}")
    lies, records = report.lies, final.get("records", [])
    print(f"lying replica: {lies['groups sent']} groups of random log-probs under the trainer's version "
          f"({lies['groups accepted']} buffered); trainer-only calls (POST /version {LIAR_VERSION}, GET /batch, POST /done) "
          f"{lies['trainer calls']}, answered 403: {lies['403']}; rounds cut short by a dead proxy "
          f"{lies['rounds cut short by the proxy']}")
    print(f"learning: {len(re.findall(r'not finite, update skipped', log))} steps skipped as not finite, "
          f"{sum(not r.get('skipped_non_finite') for r in records)} applied ({len(final.get('applied_non_finite', []))} "
          f"of them not finite); largest ratio of a step "
          f"{max((r['ratio_max'] for r in records if r.get('ratio_max') is not None), default=0):.4g}; adapters with "
          f"finite weights {len(final.get('finite', []))} of {len(final['complete'])} (LATEST v{final['latest']})")
    dropped = collections.Counter()
    for r in records:
        dropped.update(r.get("groups_dropped") or {})
    print(f"the trainer dropped {sum(dropped.values())} groups it could not use ({dict(dropped)}); it named "
          f"{sum(r.get('groups_absurd_ratio', 0) for r in records)} groups with an absurd ratio; largest "
          f"gradient norm before clipping {max((r['grad_norm'] for r in records), default=0):.3g} "
          f"(bound {GRAD_BOUND:g}); flood and oversized POST answered: "
          f"{ {f'{k} {c}': n for (k, c), n in p.items() if k in ('unasked flood', 'oversized POST')} }")
    print("invariant checks passed: " + ", ".join(f"{k} x{v}" for k, v in report.checks.items()) +
          f" ({sum(report.checks.values())} in all)")
    print("FAILURES:\n  " + "\n  ".join(report.failures) if report.failures else "no failures")
    if not args.keep and not report.failures:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if report.failures else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=3.0, help="how long to keep killing roles")
    p.add_argument("--seed", type=int, default=0, help="seed for which role dies when")
    p.add_argument("--s3", action="store_true", help="use an s3:// bucket on a moto_server of its own")
    p.add_argument("--model", help="base model folder (default: build tests/tiny_model.py's)")
    p.add_argument("--keep", action="store_true", help="keep the logs and bucket even when all checks pass")
    sys.exit(chaos(p.parse_args(argv)))


if __name__ == "__main__":
    main()
