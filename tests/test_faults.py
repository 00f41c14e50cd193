"""Faults (issue 7): any role can die, the run goes on and loses nothing it should keep.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_faults.py -q -s
    python bench/chaos.py --minutes 10 --seed 0      # the same harness, killing at random for minutes

Real processes on 127.0.0.1 (bench/chaos.py's LocalSystem: proxy.py, two `rollout.py --engine hf
--task toy` replicas and trainer.py on the tiny model, a directory bucket), killed with SIGKILL.
Tests 1-4 share one running system, in file order, so that its start (~20 s) is paid once; each
test starts from every role alive and ends by checking that none died on its own.

1. A replica killed mid-batch: the other carries on, the trainer keeps stepping (no wait near its
   --wait-timeout); restarted, the replica loads the newest adapter and its groups are current.
2. The proxy killed and restarted on its port: replicas and trainer retry and go on; the counters
   of the new proxy balance; the only groups lost are those the dead proxy buffered (its /stats,
   taken while every other role was frozen with SIGSTOP, so the number is exact); the restarted
   proxy learns the trainer's version again; an answer cut by the kill is retried, not fatal.
3. The trainer killed at 6 points (seeded order): just after a publish and before the state save,
   mid-publish, mid-save, during its start, and twice after a random step and delay. After each
   kill every version in the bucket that has a manifest verifies and LATEST is one of them; the
   restart resumes from exactly the state the bucket holds; no version number is published twice.
4. The bucket fails: the directory is replaced by a file for a few seconds (root ignores chmod) while
   the trainer publishes: it retries with one clear line and goes on, the replicas keep serving the
   adapter they have, nothing partial is loaded, no metrics line is lost. The S3 server cut off
   (a TCP relay in front of moto_server, stopped and started) during a publish: the same retry.
5. Bad input from outside, each one clear line and no traceback: a replica with another
   --num-generations than the proxy, an adapter (or trainer state) made for another base model,
   a trainer pointed at something that is not a proxy. (A wrong token, an unreachable proxy and a
   missing bucket are in test_rollout.py, test_trainer.py and test_sync.py.)
"""

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import chaos
import proxy
from support import buckets, proxy_client, trainer_state
import sync
from chaos import PUBLISHED, RESUMED, STEP, LocalSystem, check_accounting, saved_state, verify_bucket
from conftest import ROOT

WAIT_TIMEOUT = 60  # the trainer's --wait-timeout in the shared system
GROUPS_PER_STEP = 2
SAVE_EVERY = 3
TRAINER_ARGS = ["--learning-rate", "3e-5", "--lora-r", "8", "--lora-alpha", "16", "--micro-batch-tokens", "256",
                "--save-every", str(SAVE_EVERY), "--max-steps", "100000", "--wait-timeout", str(WAIT_TIMEOUT),
                "--bucket-retry", "60", "--seed", "0"]


def steps_in(text):
    return [int(s) for s, _ in STEP.findall(text)]


@pytest.fixture(scope="module")
def system(tiny_model, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("faults"))
    s = LocalSystem(work, tiny_model, os.path.join(work, "bucket"), trainer_args=TRAINER_ARGS,
                    replica_args=chaos.REPLICA_ARGS, proxy_args=chaos.PROXY_ARGS)
    s.scratch = os.path.join(work, "scratch")
    os.makedirs(s.scratch)
    s.start()
    try:
        s.trainer.wait_for(r"^step 2 ", 180)
        for r in s.replicas():
            r.wait_for(r"\] batch 1 ", 120)
        yield s
    finally:
        s.stop()
        left = chaos.processes_mentioning(work)
        assert not left, f"processes left behind: {left}"


@pytest.fixture
def running(system):
    """The shared system with every role up; after the test, none may have died on its own."""
    for role in system.roles.values():
        if not role.alive:  # an earlier test failed: give this one a whole system
            role.start() if role.name != "proxy" else system.start_proxy()
    yield system
    assert not system.dead(), {n: system.roles[n].current()[-2000:] for n in system.dead()}
    for role in system.roles.values():
        assert "Traceback" not in role.text(), role.text()[-3000:]


def next_step(s, more=1, timeout=90):
    """Wait until the trainer's current run prints `more` new step lines; returns the last one's number."""
    m = s.trainer.wait_for(r"^step (\d+) ", timeout, count=len(steps_in(s.trainer.current())) + more)
    return int(m.group(1))


# ----------------------------------------------------------------------------- 1. a replica dies

def test_replica_killed_mid_batch_the_other_carries_on_and_it_rejoins_current(running):
    s = running
    r0 = s.roles["replica-0"]
    t_kill = time.time()
    r0.wait_for(r"\] batch \d+ ", 60, count=len(re.findall(r"\] batch \d+ ", r0.current())) + 1)
    time.sleep(0.05)  # it has just pushed a batch: now it checks LATEST and generates the next
    r0.kill()
    accepted1 = s.stats()["workers"]["replica-1"]["accepted"]
    last = next_step(s, more=3)  # three steps fed by replica-1 alone
    assert s.stats()["workers"]["replica-1"]["accepted"] > accepted1

    latest = sync.latest_version(s.bucket)
    r0.start()
    loaded = int(r0.wait_for(r"adapter v(\d+) loaded", 120).group(1))
    assert loaded >= latest, f"the restarted replica loaded v{loaded}, older than LATEST v{latest} at its start"
    b = r0.wait_for(r"\] batch 1 v(\d+) \(trainer v(\d+)\).* accepted (\d+) stale (\d+)", 120)
    version, trainer_version, accepted, stale = map(int, b.groups())
    assert trainer_version - version <= s.max_staleness and accepted >= 1 and stale == 0, b.group(0)
    next_step(s)
    waits = [m["wait_s"] for m in buckets.read_metrics(s.bucket) if m["time"] >= t_kill]
    print(f"\nreplica-0 killed mid-batch at trainer step {last - 3}; restarted, loaded v{loaded} (LATEST was "
          f"v{latest}), first batch v{version} at trainer v{trainer_version}; longest trainer wait meanwhile "
          f"{max(waits):.1f}s (--wait-timeout {WAIT_TIMEOUT})")
    assert max(waits) < WAIT_TIMEOUT / 2


# ----------------------------------------------------------------------------- 2. the proxy dies

def test_proxy_killed_and_restarted_loses_only_its_buffer(running):
    s = running
    others = [r for r in s.roles.values() if r.name != "proxy"]
    for r in others:  # freeze the clients so that the last /stats is exactly what dies
        r.signal(signal.SIGSTOP)
    try:
        time.sleep(0.5)
        before = s.stats()
        s.proxy.kill()
    finally:
        for r in others:
            r.signal(signal.SIGCONT)
    time.sleep(3)  # every client meets a dead port and retries
    s.start_proxy()
    next_step(s, more=3)
    for r in s.replicas():  # both push to the new proxy
        r.wait_for(r"\] batch \d+ ", 60, count=len(re.findall(r"\] batch \d+ ", r.current())) + 1)
    for r in others:
        assert "cannot reach the proxy" in r.current() or "connection broke" in r.current(), r.name

    # the new proxy learns the trainer's version (announced again on its 409, or at the next publish)
    for _ in range(50):
        after, latest = s.stats(), sync.latest_version(s.bucket)
        if after["trainer_version"] == latest:
            break
        time.sleep(0.2)
    assert after["trainer_version"] == latest, (after["trainer_version"], latest)

    # nothing but the dead buffer is lost: what both proxies delivered is what the trainer consumed,
    # less what the trainer holds in its current, unfinished step (frozen while we count)
    s.trainer.signal(signal.SIGSTOP)
    try:
        time.sleep(0.5)
        after = s.stats()
        recs = buckets.read_metrics(s.bucket)
    finally:
        s.trainer.signal(signal.SIGCONT)
    check_accounting(after)
    assert s.trainer.starts == 1, "this check needs one trainer run (metrics of redone steps would count twice)"
    consumed = sum(m["groups"] for m in recs)
    delivered = before["delivered"] + after["delivered"]
    in_hand = delivered - consumed
    print(f"\nproxy killed with {before['buffered']} groups buffered (lost), {before['accepted']} accepted before; "
          f"new proxy: {after['accepted']} accepted = {after['delivered']} delivered + {after['dropped_stale']} "
          f"stale + {after['buffered']} buffered; trainer consumed {consumed}, {in_hand} in its unfinished step")
    assert 0 <= in_hand <= 5 * GROUPS_PER_STEP, "groups were lost beyond the dead proxy's buffer"


def test_client_re_announces_its_version_to_a_restarted_proxy(capsys):
    server, _ = proxy.serve(port=0, max_staleness=1, num_generations=2)
    port = server.server_address[1]
    client = proxy_client.ProxyClient(f"http://127.0.0.1:{port}", max_wait=10)
    client.set_version(5)
    server.shutdown()
    server.server_close()
    server, _ = proxy.serve(port=port, max_staleness=1, num_generations=2)  # restarted: no trainer version
    try:
        comp = {"ids": [2], "logprobs": [-1.0], "reward": 1.0, "text": "x", "finish_reason": "stop"}
        group = {"group_id": "old", "policy_version": 1, "worker": "w", "prompt": "p", "prompt_ids": [1],
                 "temperature": 1.0, "max_new_tokens": 256, "completions": [comp, dict(comp, reward=0.0)]}
        proxy_client.ProxyClient(f"http://127.0.0.1:{port}").post_rollouts([group])  # kept until the version is known
        got = client.get_batch(1, timeout=1)  # 409: the client announces v5 again; the v1 group is now stale
        assert (got["groups"], got["trainer_version"]) == ([], 5)
        s = server.buffer.stats()
        assert s["trainer_version"] == 5 and s["dropped_stale"] == 1
        assert "announcing v5 again" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def test_client_retries_an_answer_cut_by_a_dying_proxy():
    """A proxy SIGKILLed while it writes an answer leaves a body shorter than its Content-Length."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    body = json.dumps({"trainer_version": 3, "buffered": 0}).encode()

    def serve():
        for i in range(2):
            conn, _ = listener.accept()
            conn.recv(65536)
            head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            conn.sendall(head.encode() + (body[:5] if i == 0 else body))  # the first answer is cut
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        stats = proxy_client.ProxyClient(f"http://127.0.0.1:{listener.getsockname()[1]}", max_wait=10).stats()
        assert stats["trainer_version"] == 3
    finally:
        listener.close()


# ----------------------------------------------------------------------------- 3. the trainer dies

def watch_for_new_dir(parent, known, timeout):
    """Poll (tightly) for a folder under `parent` that is not in `known`; True once one appears."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if set(os.listdir(parent)) - known:
                return True
        except FileNotFoundError:
            pass
        time.sleep(0.0005)
    return False


def test_trainer_killed_at_six_points_resumes_and_never_republishes(running):
    s = running
    t, bucket = s.trainer, s.bucket
    rng = random.Random(7)
    points = rng.sample(["after-publish", "mid-publish", "mid-save", "startup", "random", "random"], 6)
    history = []
    for point in points:
        if point == "after-publish":  # between a publish and its state save: the state is older than LATEST
            n = len(PUBLISHED.findall(t.current()))
            while True:
                m = t.wait_for(PUBLISHED.pattern, 120, count=n + 1)
                if int(m.group(2)) % SAVE_EVERY:
                    break
                n += 1
        elif point == "mid-publish":  # a new adapters/vN folder appears: its files are being written
            adapters = os.path.join(bucket, "adapters")
            t.wait_for(r"^step \d+ ", 120)  # past the start
            hit = watch_for_new_dir(adapters, set(os.listdir(adapters)), 60)
            assert hit, "no publish within 60 s"
        elif point == "mid-save":  # a new trainer/ID folder appears: the state is being written
            folder = os.path.join(bucket, "trainer")
            t.wait_for(r"^step \d+ ", 120)
            assert watch_for_new_dir(folder, set(os.listdir(folder)), 60), "no state save within 60 s"
        elif point == "startup":  # model load, resume, republish
            time.sleep(rng.uniform(0.5, 4.0))
        else:
            next_step(s, more=rng.randint(1, 3))
            time.sleep(rng.uniform(0.0, 1.0))
        t.kill()
        found = verify_bucket(bucket, s.scratch)  # LATEST complete; every manifest verifies
        adapters = os.path.join(bucket, "adapters")
        unfinished = sorted(d for d in os.listdir(adapters)  # folders the kill left without a manifest
                            if d.startswith("v") and not os.path.exists(os.path.join(adapters, d, "manifest.json")))
        state, seen = saved_state(bucket, s.scratch), sync.versions(bucket)
        t.start()
        m = t.wait_for(RESUMED.pattern, 120)
        got = None if m.group(1) == "starting fresh" else (int(m.group(2)), int(m.group(3)))
        assert got == state, f"after the kill at {point}: resumed from {got}, the bucket holds {state}"
        history.append((point, state, found["latest"], unfinished, max(seen), t.starts))
    next_step(s, more=2, timeout=120)

    text = t.text()
    chaos.check_publishes(text)  # strictly rising over all runs: never a number twice
    runs = {int(r.split(" ", 1)[0]): r for r in text.split("=== chaos: start ")[1:]}
    for point, (step, version), latest, unfinished, newest, run in history:
        published = [int(v) for v, _ in PUBLISHED.findall(runs[run])]
        steps = steps_in(runs[run])
        assert not published or published[0] > newest, f"run {run} published v{published[0]}, v{newest} existed"
        assert not steps or steps[0] == step + 1, f"run {run} (after {point}) went on at step {steps[0]}, saved {step}"
        print(f"killed {point:>13}: state step {step} v{version}, LATEST v{latest}, unfinished {unfinished} -> "
              f"restart {run} published {published[:3]}...")
    assert any(h[0] == "after-publish" and h[2] > h[1][1] for h in history), "no kill fell between publish and save"
    cut = {int(v[1:]) for h in history for v in h[3]} - {int(v) for v, _ in PUBLISHED.findall(text)}
    assert not cut & loaded_versions(s), "a replica loaded a version whose publish was cut"  # (a number with
    # only temp files written is not "seen" and may be published whole by the restart: not counted here)


def loaded_versions(s):
    return {int(v) for r in s.replicas() for v in re.findall(r"adapter v(\d+) loaded", r.text())}


# ----------------------------------------------------------------------------- 4. the bucket fails

def test_directory_bucket_outage_trainer_retries_replicas_keep_serving(running):
    s = running
    bucket, away = s.bucket, s.bucket + ".away"
    next_step(s)  # a step just ended: its publish and metrics line land in the outage
    batches = {r.name: len(re.findall(r"\] batch \d+ ", r.current())) for r in s.replicas()}
    # loaded before the outage: not checked below (the kill test before this one can end a trainer
    # between announcing a version and printing "published vN": loaded, never printed)
    before = loaded_versions(s)
    os.rename(bucket, away)
    with open(bucket, "w") as f:  # a file where the folder was: every write fails, even for root
        f.write("outage")
    time.sleep(6)
    os.remove(bucket)
    os.rename(away, bucket)
    last = next_step(s, more=2)
    text = s.trainer.current()
    assert re.search(r"^sync\.py: (write|read) \S+ failed, retrying for up to 60 s: ", text, re.M), text[-3000:]
    assert re.search(r"^sync\.py: (write|read) \S+ done after \d+\.\d s of retries", text, re.M)
    # Replicas read the bucket only when the proxy announces a version, which the trainer does once its
    # publish went through: they do not meet this outage, and go on generating (test_s3_outage_... below
    # shows a reader that does meet one keeping the adapter it has).
    for r in s.replicas():
        r.wait_for(r"\] batch \d+ ", 60, count=batches[r.name] + 1)
    serving = [r.name for r in s.replicas()]
    loaded = loaded_versions(s) - before  # read first: announced, so in LATEST or printed next
    deadline = time.monotonic() + 10  # "printed next": a fast replica can load it before the trainer's line lands
    while not loaded <= (published := {int(v) for v, _ in PUBLISHED.findall(s.trainer.text())}
                         | {sync.latest_version(bucket)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert loaded <= published, "a replica loaded an unpublished version"
    verify_bucket(bucket, s.scratch)
    recs = buckets.read_metrics(bucket)
    # every step has its metrics line, the ones written during the outage included (the trainer prints a
    # step's line after writing its metrics, so counting lines read before next_step() would race)
    assert set(range(1, last + 1)) <= {m["step"] for m in recs}, "a metrics line was lost"
    print(f"\nbucket folder gone for 6 s: the trainer retried and went on to step {last}; replicas {serving} "
          "kept serving their adapter")


def test_what_a_bucket_writer_plants_ahead_of_the_trainer_does_not_end_the_run(running):
    """Issue 48, cases 3-5 in a running system (both keys): with the trainer frozen (SIGSTOP), a
    bucket writer plants empty folders at the metrics records of its next steps and at the weights
    of a version it will publish, a complete manifest whose tags are "é" at the version after,
    and a sparse 1 TiB adapters/LATEST. The trainer removes each folder (one stderr line each),
    replaces the foreign manifest, and keeps stepping; every step keeps its metrics record; no
    role dies (the fixture checks). Before: "Is a directory" retried for --bucket-retry, then the
    end of the run; a TypeError at the manifest; a MemoryError at LATEST."""
    s = running
    b = buckets.open_bucket(s.bucket)
    next_step(s)
    s.trainer.signal(signal.SIGSTOP)
    try:
        step, version = map(int, STEP.findall(s.trainer.current())[-1])  # v{version}: that step's policy
        # the trainer may be frozen inside step + 1's metrics write or v{version + 1}'s publish
        for k in (2, 3):
            os.makedirs(os.path.join(s.bucket, "metrics", f"step-{step + k:06d}.json"))
        os.makedirs(os.path.join(s.bucket, "adapters", f"v{version + 2:06d}", "adapter_model.safetensors"))
        # a version of the trainer's: its files, its manifest with other tags (the newest with a
        # manifest: the frozen trainer may have written v{version + 1}'s files and not yet its own)
        own = next(v for v in reversed(sync.versions(b))
                   if b.read(f"adapters/v{v:06d}/manifest.json") is not None)
        manifest = json.loads(b.read(f"adapters/v{own:06d}/manifest.json"))
        for name in manifest["files"]:
            b.write(f"adapters/v{version + 3:06d}/{name}", b.read(f"adapters/v{own:06d}/{name}"))
        b.write(f"adapters/v{version + 3:06d}/manifest.json",
                json.dumps({**manifest, "version": version + 3, "tag": "é", "trainer_tag": "é"}).encode())
        huge = os.path.join(s.bucket, "adapters", "huge")
        with open(huge, "wb") as f:
            f.truncate(1 << 40)
        os.replace(huge, os.path.join(s.bucket, "adapters", "LATEST"))
    finally:
        s.trainer.signal(signal.SIGCONT)
    s.trainer.wait_for(rf"^step {step + 3} ", 120)
    s.trainer.wait_for(rf"^published v{version + 3} at step ", 120)
    text = s.trainer.current()
    for key in [f"metrics/step-{step + k:06d}.json" for k in (2, 3)] + \
            [f"adapters/v{version + 2:06d}/adapter_model.safetensors"]:
        assert f"{s.bucket}: {key} was a folder, which sync.py never writes there: removed" in text, text[-3000:]
    assert f"adapters/v{version + 3:06d}/ holds a manifest this trainer did not write" in text, text[-3000:]
    assert {step + 2, step + 3} <= {r["step"] for r in buckets.read_metrics(b)}
    assert sync.latest_version(b, chaos.BUCKET_KEYS["ADAPTER_KEY"]) >= version + 3


def test_s3_outage_is_retried_and_readers_keep_what_they_have(tmp_path, capfd):
    moto, moto_port = chaos.start_moto()
    relay = chaos.TcpRelay(moto_port).start()
    old = {k: os.environ.get(k) for k in chaos.aws_env("")}
    os.environ.update(chaos.aws_env(f"http://127.0.0.1:{relay.port}"))
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket="faults")
        writer = buckets.open_bucket("s3://faults/run", retry_s=30)
        reader = buckets.open_bucket("s3://faults/run")  # a replica's: no retries, it keeps its adapter
        for v in (0, 1):
            d = tmp_path / f"a{v}"
            d.mkdir()
            (d / "adapter_config.json").write_text(json.dumps({"r": 8, "v": v}))
            (d / "adapter_model.safetensors").write_bytes(os.urandom(50_000))
        sync.publish_adapter(writer, str(tmp_path / "a0"), 0)
        assert sync.latest_version(reader) == 0
        relay.stop()
        threading.Timer(4.0, relay.start).start()  # the endpoint is back after 4 s
        start = time.monotonic()
        with pytest.raises(buckets.BucketError, match="cannot reach the S3 endpoint"):
            sync.latest_version(reader)
        sync.publish_adapter(writer, str(tmp_path / "a1"), 1)  # waits the outage out
        assert time.monotonic() - start >= 3.5
        err = capfd.readouterr().err
        assert re.search(r"sync\.py: (read|write) \S+ failed, retrying for up to 30 s: .*cannot reach the S3", err)
        assert re.search(r"sync\.py: (read|write) \S+ done after \d+\.\d s of retries", err)
        assert verify_bucket(reader, str(tmp_path))["latest"] == 1
    finally:
        relay.stop()
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        os.killpg(moto.pid, signal.SIGKILL)
        moto.wait()


# ----------------------------------------------------------------------------- 5. bad input

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def one_error_line(r, prog):
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stdout[-1000:] + r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{prog}: error: "), r.stderr[-2000:]
    return line


@pytest.fixture(scope="module")
def other_model(tiny_model, tmp_path_factory):
    """The tiny model's tokenizer on a narrower network (hidden 64): another base model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = str(tmp_path_factory.mktemp("other-model"))
    config = AutoConfig.from_pretrained(tiny_model)
    config.hidden_size, config.intermediate_size, config.head_dim = 64, 128, 16
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in os.listdir(tiny_model):
        if name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(os.path.join(tiny_model, name), out)
    return out


@pytest.fixture(scope="module")
def bad_input(tiny_model, tmp_path_factory):
    """A proxy that wants 8 completions per group, and a bucket with v0 and a trainer state of the tiny model."""
    import torch

    import trainer

    root = tmp_path_factory.mktemp("bad-input")
    bucket = str(root / "bucket")
    model = trainer_state.build_model(tiny_model, lora_r=8, lora_alpha=16)
    optimizer = torch.optim.AdamW(trainer_state.lora_parameters(model), lr=1e-3, weight_decay=0.0)  # as trainer
    trainer.publish(model, buckets.open_bucket(bucket), 0, 4, tiny_model, 0, {"step": 0, "version": 0, "published_step": 0,
                    "groups_consumed": 0, "args": {"model": tiny_model, "lora_r": 8}}, optimizer)
    server, _ = proxy.serve(port=0, num_generations=8, max_new_tokens=4)
    yield {"bucket": bucket, "url": f"http://127.0.0.1:{server.server_address[1]}", "server": server}
    server.shutdown()
    server.server_close()


def rollout_cmd(model, bucket, url, *extra):
    return [sys.executable, "rollout.py", "--engine", "hf", "--task", "toy", "--model", model, "--bucket", bucket,
            "--proxy", url, "--prompts-per-batch", "1", "--max-batches", "1", *extra]


def test_replica_with_another_num_generations_than_the_proxy(tiny_model, bad_input):
    r = subprocess.run(rollout_cmd(tiny_model, bad_input["bucket"], bad_input["url"], "--num-generations", "4"),
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)
    line = one_error_line(r, "rollout.py")
    assert "--num-generations 4 disagrees with the proxy's num_generations 8" in line, line


def test_replica_on_another_base_model_than_the_adapter(tiny_model, other_model, bad_input):
    r = subprocess.run(rollout_cmd(other_model, bad_input["bucket"], bad_input["url"], "--num-generations", "8"),
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)
    line = one_error_line(r, "rollout.py")
    assert f"trained on --model {tiny_model}" in line and f"do not fit --model {other_model}" in line, line
    assert "start rollout.py with the trainer's --model" in line
    assert f"note: adapter v0 was trained on --model {tiny_model}" in r.stdout


def test_trainer_resuming_on_another_base_model(other_model, bad_input, tiny_model):
    r = subprocess.run([sys.executable, "trainer.py", "--model", other_model, "--bucket", bad_input["bucket"],
                        "--proxy", bad_input["url"], "--lora-r", "8", "--max-steps", "1"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)
    line = one_error_line(r, "trainer.py")
    assert f"(--model {tiny_model}, --lora-r 8) does not fit --model {other_model}" in line, line
    assert "run with that run's settings, or another --bucket" in line
    assert sync.latest_version(bad_input["bucket"]) == 0, "nothing may be published"


def test_trainer_pointed_at_something_that_is_not_a_proxy(tiny_model, tmp_path):
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    web = HTTPServer(("127.0.0.1", 0), Quiet)  # a plain web server: 404 for /stats
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        r = subprocess.run([sys.executable, "trainer.py", "--model", tiny_model, "--bucket", str(tmp_path / "b"),
                            "--proxy", f"http://127.0.0.1:{web.server_address[1]}", "--max-steps", "1"],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    finally:
        web.shutdown()
        web.server_close()
    line = one_error_line(r, "trainer.py")
    assert "HTTP 404" in line and "is the URL a proxy.py?" in line, line
    assert not os.path.exists(tmp_path / "b"), "nothing may be written before the proxy answered"


# ----------------------------------------------------------------------------- 6. what the bucket may hold (issue 14)

class RunsCode:
    """Pickles as a call of open(path, "w"): what a state.pt planted in the bucket could run on load."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_trainer_refuses_a_state_whose_pickle_runs_code(tiny_model, bad_input, tmp_path):
    """Replicas hold keys that can write the bucket: a state.pt whose pickle would run code is refused
    (torch.load with weights_only=True) before anything in it runs."""
    import torch

    state, bucket = tmp_path / "state", str(tmp_path / "bucket")
    state.mkdir()
    torch.save({"step": 0, "version": 0, "payload": RunsCode(str(tmp_path / "pwned"))}, state / "state.pt")
    buckets.save_trainer_state(bucket, str(state))
    r = subprocess.run([sys.executable, "trainer.py", "--model", tiny_model, "--bucket", bucket, "--proxy",
                        bad_input["url"], "--max-steps", "1"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=180)
    assert not (tmp_path / "pwned").exists(), "the planted state.pt ran code in the trainer"
    line = one_error_line(r, "trainer.py")
    assert "holds more than tensors and plain values" in line and "weights only load failed" in line.lower(), line
    assert "can still be loaded" not in r.stderr and "Re-running" not in r.stderr, "torch's advice"


def planted_state(bad_input, tmp_path, **optimizer_settings):
    """A bucket whose trainer state is bad_input's, weights-only, with AdamW settings changed."""
    import torch

    src, bucket = tmp_path / "state", str(tmp_path / "bucket")
    buckets.load_trainer_state(bad_input["bucket"], str(src))
    state = torch.load(src / "state.pt", weights_only=True)
    state["optimizer"]["param_groups"][0].update(optimizer_settings)
    torch.save(state, src / "state.pt")
    buckets.save_trainer_state(bucket, str(src))
    return bucket


@pytest.mark.parametrize("key", [None, "the-run's-state-key"])
def test_trainer_refuses_a_planted_optimizer_state(tiny_model, bad_input, tmp_path, key):
    """A bucket writer's weights-only state.pt that would make AdamW ascend (maximize) and decay the
    weights 50x per step: refused in one line, by its settings without a key, by its HMAC with
    one."""
    bucket = planted_state(bad_input, tmp_path, maximize=True, weight_decay=50.0)
    env = {**ENV, **({"TRAINER_STATE_KEY": key} if key else {})}
    r = subprocess.run([sys.executable, "trainer.py", "--model", tiny_model, "--bucket", bucket, "--proxy",
                        bad_input["url"], "--max-steps", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=180)
    line = one_error_line(r, "trainer.py")
    if key:
        assert "has no HMAC tag under TRAINER_STATE_KEY" in line, line
    else:
        assert "does not fit this trainer" in line and ("maximize=True" in line or "weight_decay=50" in line), line
    assert sync.latest_version(bucket) is None, "nothing may be published from a refused state"


def test_a_state_tagged_with_the_key_resumes_and_another_key_is_refused(tiny_model, tmp_path):
    import torch

    import trainer

    bucket = str(tmp_path / "bucket")
    model = trainer_state.build_model(tiny_model, lora_r=8, lora_alpha=16)
    optimizer = torch.optim.AdamW(trainer_state.lora_parameters(model), lr=3e-4, weight_decay=0.0)
    trainer.publish(model, buckets.open_bucket(bucket), 0, 4, tiny_model, 0, {
        "step": 0, "version": 0, "published_step": 0, "groups_consumed": 0, "args": {}}, optimizer, key="k1")
    server, _ = proxy.serve(port=0, num_generations=8, max_new_tokens=4)
    try:
        cmd = [sys.executable, "trainer.py", "--model", tiny_model, "--bucket", bucket, "--proxy",
               f"http://127.0.0.1:{server.server_address[1]}", "--max-steps", "0", "--lora-r", "8",
               "--lora-alpha", "16"]
        r = subprocess.run(cmd, cwd=ROOT, env={**ENV, "TRAINER_STATE_KEY": "k2"}, capture_output=True,
                           text=True, timeout=180)
        assert "has a wrong HMAC tag" in one_error_line(r, "trainer.py")
        r = subprocess.run(cmd, cwd=ROOT, env={**ENV, "TRAINER_STATE_KEY": "k1"}, capture_output=True,
                           text=True, timeout=180)
        assert r.returncode == 0 and r.stdout.startswith("resumed from step 0, version 0"), r.stderr[-2000:]
    finally:
        server.shutdown()
        server.server_close()


KEYS = {"TRAINER_STATE_KEY": "the-run's-state-key", "ADAPTER_KEY": "the-run's-adapter-key"}


def trainer_cmd(model, bucket, url, *extra):
    return [sys.executable, "trainer.py", "--model", model, "--bucket", bucket, "--proxy", url, "--max-steps",
            "0", "--lora-r", "8", "--lora-alpha", "16", *extra]


def test_a_planted_latest_neither_kills_nor_blocks_the_trainer(tiny_model, tmp_path):
    """adapters/LATEST = {"version": 2147483647} planted between two runs of the trainer. With
    TRAINER_STATE_KEY it is named on stderr and passed over: the trainer resumes and publishes its
    next version after its own, and that publish replaces LATEST (tagged under ADAPTER_KEY for the
    replicas). Without the key: one error line saying what to delete, nothing published."""
    bucket = str(tmp_path / "bucket")
    server, _ = proxy.serve(port=0, num_generations=8, max_new_tokens=4)
    cmd = trainer_cmd(tiny_model, bucket, f"http://127.0.0.1:{server.server_address[1]}")
    run = lambda env: subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,  # noqa: E731
                                     timeout=180)
    plant = lambda: buckets.open_bucket(bucket).write("adapters/LATEST", b'{"version": 2147483647}')  # noqa
    try:
        r = run({**ENV, **KEYS})
        assert r.returncode == 0 and "published v0 at step 0" in r.stdout, r.stderr[-2000:]
        for again in (1, 2):  # each restart: passed over again, never a version it cannot exceed
            plant()
            r = run({**ENV, **KEYS})
            assert r.returncode == 0 and f"published v{again} at step 0" in r.stdout, r.stderr[-2000:]
            assert "passed over: adapters/LATEST (v2147483647)" in r.stderr, r.stderr[-2000:]
            assert sync.latest_version(bucket, KEYS["ADAPTER_KEY"]) == again
        plant()
        r = run(ENV)
        line = one_error_line(r, "trainer.py")
        assert "adapters/LATEST (v2147483647) leaves no room below 2^31" in line and "delete it" in line, line
        assert sync.latest_version(bucket) == 2147483647, "nothing may be published"
    finally:
        server.shutdown()
        server.server_close()


def test_a_replayed_old_resume_state_is_refused(tiny_model, tmp_path):
    """trainer/ copied at step 1 and put back after step 3: its HMAC is valid, but the trainer's
    own manifests (tagged under TRAINER_STATE_KEY) record a newer save: one error line, nothing
    published. The newest state put back resumes."""
    import torch

    import trainer

    bucket = str(tmp_path / "bucket")
    b = buckets.open_bucket(bucket)
    model = trainer_state.build_model(tiny_model, lora_r=8, lora_alpha=16)
    optimizer = torch.optim.AdamW(trainer_state.lora_parameters(model), lr=3e-4, weight_decay=0.0)
    saved = None
    for step in range(4):  # v{step} published at step {step}, the state saved with it
        state = {"step": step, "version": step, "published_step": step, "groups_consumed": 0, "args": {}}
        trainer.publish(model, b, step, 4, tiny_model, step, state, optimizer, KEYS["TRAINER_STATE_KEY"],
                        KEYS["ADAPTER_KEY"], saved)
        saved = step
        if step == 1:
            shutil.copytree(os.path.join(bucket, "trainer"), tmp_path / "trainer-at-step-1")
    shutil.copytree(os.path.join(bucket, "trainer"), tmp_path / "trainer-at-step-3")
    server, _ = proxy.serve(port=0, num_generations=8, max_new_tokens=4)
    cmd = trainer_cmd(tiny_model, bucket, f"http://127.0.0.1:{server.server_address[1]}")
    try:
        for copy in ("trainer-at-step-1", "trainer-at-step-3"):
            shutil.rmtree(os.path.join(bucket, "trainer"))
            shutil.copytree(tmp_path / copy, os.path.join(bucket, "trainer"))
            r = subprocess.run(cmd, cwd=ROOT, env={**ENV, **KEYS}, capture_output=True, text=True, timeout=180)
            if copy == "trainer-at-step-1":
                line = one_error_line(r, "trainer.py")
                assert "the resume state is from step 1, but this trainer had saved one at step 2" in line, line
                assert "put back the newest trainer/ state" in line, line
                assert "published" not in r.stdout and sync.latest_version(bucket) == 3
            else:
                assert r.returncode == 0 and r.stdout.startswith("resumed from step 3, version 3"), r.stderr[-2000:]
    finally:
        server.shutdown()
        server.server_close()


def start_replica_on_v0(tiny_model, bucket, url, log, env=ENV):
    """A replica (one batch, --task toy) on bucket and the proxy at url, its output in log; returned
    once it has loaded v0 (or ended)."""
    with open(log, "w") as out:
        replica = subprocess.Popen(rollout_cmd(tiny_model, bucket, url), cwd=ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while "adapter v0 loaded" not in log.read_text() and time.time() < deadline and replica.poll() is None:
        time.sleep(0.2)
    return replica


def test_a_replica_with_the_adapter_key_refuses_a_planted_adapter(tiny_model, bad_input, tmp_path):
    """The trainer publishes v1 (tagged under ADAPTER_KEY), and a bucket writer without the key
    replaces its manifest and files with its own: the replica (ADAPTER_KEY set) says once that v1
    is refused and keeps serving the trainer's v0. (A planted LATEST: test_sync.py.)"""
    bucket = str(tmp_path / "bucket")
    v0 = sync.pull_adapter(bad_input["bucket"], 0, str(tmp_path / "pulled"))
    sync.publish_adapter(bucket, v0, 0, key=KEYS["ADAPTER_KEY"])
    server, _ = proxy.serve(port=0, num_generations=8, max_new_tokens=4)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        log = tmp_path / "replica.log"
        replica = start_replica_on_v0(tiny_model, bucket, url, log, {**ENV, "ADAPTER_KEY": KEYS["ADAPTER_KEY"]})
        sync.publish_adapter(bucket, v0, 1, key=KEYS["ADAPTER_KEY"])  # the trainer's v1, then the writer's
        sync.publish_adapter(str(tmp_path / "writer"), v0, 1)
        planted = tmp_path / "writer" / "adapters" / "v000001"
        for name in os.listdir(planted):
            shutil.copy(planted / name, os.path.join(bucket, "adapters", "v000001", name))
        proxy_client.ProxyClient(url).set_version(1)
        assert replica.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        server.shutdown()
        server.server_close()
    text = log.read_text()
    assert re.search(r"adapter v1 refused \(not the trainer's\), still serving v0: .*adapter v000001's manifest has "
                     r"no tag under ADAPTER_KEY", text), text[-3000:]
    assert "adapter v1 loaded" not in text and text.count("refused (not the trainer's)") == 1, text[-3000:]


@pytest.mark.parametrize("ending", ["eval", "SIGTERM"])
def test_no_rollout_temp_folder_is_left_behind(tiny_model, bad_input, tmp_path, ending):
    """Without --cache-dir, neither an --eval ending normally nor a replica stopped by SIGTERM (docker
    stop, jobs.sh) leaves its rollout-* adapter folder in the temp directory."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**ENV, "TMPDIR": str(tmp)}
    ours = lambda: [n for n in os.listdir(tmp) if n.startswith("rollout-")]  # noqa: E731
    if ending == "eval":
        r = subprocess.run([sys.executable, "rollout.py", "--eval", "--engine", "hf", "--task", "arith", "--model",
                            tiny_model, "--bucket", bad_input["bucket"], "--adapter", "latest", "--limit", "2",
                            "--max-new-tokens", "4", "--eval-out", str(tmp_path / "eval.json")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
    else:
        proc = subprocess.Popen(rollout_cmd(tiny_model, bad_input["bucket"], bad_input["url"], "--max-batches", "0"),
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline and \
                not any(os.path.isdir(tmp / n / "v000000") for n in ours()):
            time.sleep(0.1)
        assert proc.poll() is None and ours(), "the replica ended (or pulled nothing) before it could be stopped"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert ours() == []


def test_a_corrupt_adapter_is_reported_as_corrupt_by_the_replica(tiny_model, bad_input, tmp_path):
    """The trainer announces v1, whose weights in the bucket have the manifest's size but other bytes:
    the replica says v1 is corrupt (once) and keeps serving v0; it does not call it a lagging mount."""
    bucket = str(tmp_path / "bucket")
    v0 = sync.pull_adapter(bad_input["bucket"], 0, str(tmp_path / "pulled"))
    sync.publish_adapter(bucket, v0, 0)
    server, _ = proxy.serve(port=0, num_generations=8, max_new_tokens=4)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        log = tmp_path / "replica.log"
        replica = start_replica_on_v0(tiny_model, bucket, url, log)
        sync.publish_adapter(bucket, v0, 1)
        weights = os.path.join(bucket, "adapters", "v000001", "adapter_model.safetensors")
        size = os.path.getsize(weights)
        with open(weights, "wb") as f:
            f.write(b"\0" * size)
        proxy_client.ProxyClient(url).set_version(1)
        assert replica.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        server.shutdown()
        server.server_close()
    text = log.read_text()
    assert re.search(r"adapter v1 is corrupt, still serving v0: .*adapter v000001 is corrupt", text), text[-3000:]
    assert "a mount lagging" not in text and text.count("is corrupt, still serving") == 1, text[-3000:]


# ---- issue 48: what a bucket writer plants, met by a restarted trainer and by a replica

@pytest.fixture(scope="module")
def keyed_bucket(tiny_model, tmp_path_factory):
    """A bucket a trainer with both keys started (v0 and its resume state)."""
    bucket = str(tmp_path_factory.mktemp("keyed") / "bucket")
    with serving_proxy() as url:
        r = subprocess.run(trainer_cmd(tiny_model, bucket, url), cwd=ROOT, env={**ENV, **KEYS},
                           capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "published v0 at step 0" in r.stdout, r.stderr[-2000:]
    return bucket


@contextlib.contextmanager
def serving_proxy():
    """A fresh proxy (it remembers the trainer's versions) on a free port; yields its URL."""
    server, _ = proxy.serve(port=0, num_generations=8, max_new_tokens=4)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def plant_sparse(path, size=1 << 40):
    """A sparse file of `size` bytes (1 TiB: no disk, but reading it whole needs 1 TiB of memory)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.isfile(path):
        os.remove(path)
    with open(path, "wb") as f:
        f.truncate(size)


def plant_copy_of_v0(bucket, version, **fields):
    """v0's files as `version`, its manifest with `fields` changed."""
    src, dest = os.path.join(bucket, "adapters", "v000000"), os.path.join(bucket, "adapters", f"v{version:06d}")
    shutil.copytree(src, dest)
    manifest = json.load(open(os.path.join(dest, "manifest.json")))
    with open(os.path.join(dest, "manifest.json"), "w") as f:
        json.dump({**manifest, "version": version, **fields}, f)


def plant_for_restart(bucket, what):
    latest = os.path.join(bucket, "adapters", "LATEST")
    if what == "a 1 TiB LATEST":
        plant_sparse(latest)
    elif what == "a LATEST 30,000 brackets deep":
        open(latest, "w").write("[" * 30_000 + "]" * 30_000)
    elif what == "tags that are not ASCII at v1":
        plant_copy_of_v0(bucket, 1, tag="é", trainer_tag="é")
    elif what == "2,000 one-file folders":
        for v in range(1, 2001):
            os.makedirs(os.path.join(bucket, "adapters", f"v{v:06d}"))
            open(os.path.join(bucket, "adapters", f"v{v:06d}", "x"), "w").close()
    else:  # folders at LATEST and at the weights of v1
        os.remove(latest)
        os.makedirs(latest)
        os.makedirs(os.path.join(bucket, "adapters", "v000001", "adapter_model.safetensors"))


@pytest.mark.parametrize("what, published, said", [
    pytest.param("a 1 TiB LATEST", 1, 'passed over: adapters/LATEST (not {"version": N})', id="latest-1TiB"),
    pytest.param("a LATEST 30,000 brackets deep", 1, 'passed over: adapters/LATEST (not {"version": N})',
                 id="latest-deep"),
    # v1: the one folder after the trainer's own read as a publish cut short
    pytest.param("tags that are not ASCII at v1", 2, None, id="tags-not-ascii"),
    pytest.param("2,000 one-file folders", 2, "passed over: adapters/v000002/, adapters/v000003/",
                 id="2000-folders"),
    pytest.param("folders at LATEST and at v1's weights", 1,
                 "adapters/LATEST was a folder, which sync.py never writes", id="folders-at-files"),
])
def test_a_restarted_trainer_passes_over_what_a_bucket_writer_planted(tiny_model, keyed_bucket, tmp_path,
                                                                      what, published, said):
    """Issue 48, cases 3, 4, 5 and 7 at a restart (both keys): each planted object is named (or
    passed over as not the trainer's) and the trainer publishes its next version after its own:
    no MemoryError, RecursionError or TypeError, no "Is a directory" retried until the run ends,
    no version 2,001. (--bucket-retry 5: an error retried ends the run in seconds.)"""
    bucket = str(tmp_path / "bucket")
    shutil.copytree(keyed_bucket, bucket)
    plant_for_restart(bucket, what)
    with serving_proxy() as url:
        r = subprocess.run(trainer_cmd(tiny_model, bucket, url, "--bucket-retry", "5"), cwd=ROOT,
                           env={**ENV, **KEYS}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-1000:] + r.stderr[-3000:]
    assert f"published v{published} at step 0" in r.stdout, r.stdout[-1000:] + r.stderr[-2000:]
    assert said is None or said in r.stderr, r.stderr[-3000:]
    assert sync.latest_version(bucket, KEYS["ADAPTER_KEY"]) == published


@pytest.mark.parametrize("what", [
    pytest.param('LATEST tagged "é"', id="latest-not-ascii"),
    pytest.param("LATEST 30,000 brackets deep", id="latest-deep"),
    pytest.param("LATEST of 1 TiB", id="latest-1TiB"),
    pytest.param("v1's weights swapped for 1 TiB", id="weights-1TiB")])
def test_a_replica_passes_over_a_bucket_object_too_large_deep_or_not_ascii(tiny_model, bad_input, tmp_path, what):
    """Issue 48, cases 3 and 4 at a replica (ADAPTER_KEY): the proxy announces v1 and the bucket
    holds one of these; the replica names it once and keeps serving v0 (exit 0 after its batch).
    Before: a TypeError, RecursionError or MemoryError ended the replica."""
    bucket = str(tmp_path / "bucket")
    v0 = sync.pull_adapter(bad_input["bucket"], 0, str(tmp_path / "pulled"))
    sync.publish_adapter(bucket, v0, 0, key=KEYS["ADAPTER_KEY"])
    latest = os.path.join(bucket, "adapters", "LATEST")
    with serving_proxy() as url:
        log = tmp_path / "replica.log"
        replica = start_replica_on_v0(tiny_model, bucket, url, log, {**ENV, "ADAPTER_KEY": KEYS["ADAPTER_KEY"]})
        if what == 'LATEST tagged "é"':
            open(latest, "w").write(json.dumps({"version": 1, "tag": "é"}))
        elif what == "LATEST 30,000 brackets deep":
            open(latest, "w").write("[" * 30_000 + "]" * 30_000)
        elif what == "LATEST of 1 TiB":
            plant_sparse(latest)
        else:  # the trainer's v1, tagged; then its weights swapped by a bucket writer
            sync.publish_adapter(bucket, v0, 1, key=KEYS["ADAPTER_KEY"])
            plant_sparse(os.path.join(bucket, "adapters", "v000001", "adapter_model.safetensors"))
        proxy_client.ProxyClient(url).set_version(1)
        assert replica.wait(timeout=180) == 0, log.read_text()[-3000:]
    text = log.read_text()
    said = {'LATEST tagged "é"': "adapter v1 refused (not the trainer's), still serving v0: ",
            "LATEST 30,000 brackets deep": "cannot check the bucket for a newer adapter, still serving v0: ",
            "LATEST of 1 TiB": "cannot check the bucket for a newer adapter, still serving v0: ",
            "v1's weights swapped for 1 TiB": "adapter v1 is corrupt, still serving v0: "}[what]
    assert said in text and "Traceback" not in text and "adapter v1 loaded" not in text, text[-3000:]
