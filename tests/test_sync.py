"""Tests of sync.py against a directory and a real S3 server (moto_server on 127.0.0.1).

    cd /work/main && OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_sync.py -q

Nothing of sync.py is mocked: eventual consistency is simulated by writing the bucket's files by
hand in the wrong order, and the crash of a trainer-state save is a real SIGKILL of a real save.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import sync
from support import adapter_tags, buckets
from conftest import ROOT, free_port, wait_port


def make_adapter(folder, size=4096):
    """A fake PEFT folder with distinct random content; returns {name: bytes}."""
    os.makedirs(folder, exist_ok=True)
    weights = os.urandom(size)
    files = {"adapter_model.safetensors": weights,
             "adapter_config.json": json.dumps({"r": 8, "tag": weights[:8].hex()}).encode()}
    for name, data in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return files


def read_folder(folder, skip=("manifest.json", sync.PULLED)):  # PULLED: the mark of a pulled folder
    out = {}
    for d, _, names in os.walk(folder):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), folder).replace(os.sep, "/")
            if rel not in skip:
                with open(os.path.join(d, n), "rb") as f:
                    out[rel] = f.read()
    return out


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "sync.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60, env=env)


def test_empty_bucket(bucket_url, tmp_path):
    assert sync.latest_version(bucket_url) is None
    assert sync.versions(bucket_url) == []
    assert buckets.read_metrics(bucket_url) == []
    assert buckets.load_trainer_state(bucket_url, str(tmp_path / "state")) is None


def test_publish_pull_round_trip(bucket_url, tmp_path):
    """What sync.py's hand-off asks of support/buckets.py and support/adapter_tags.py, in a
    directory and in S3: publish writes the files, then the manifest with each file's sha256 and
    size, then LATEST; latest_version reads it; a pull hands out the published bytes, verified
    (a corrupted local copy is fetched again, a verified one costs no transfer)."""
    content = make_adapter(tmp_path / "a0")
    manifest = sync.publish_adapter(bucket_url, str(tmp_path / "a0"), 0, base_model="tiny", step=0)
    assert manifest["version"] == 0 and manifest["base_model"] == "tiny" and manifest["step"] == 0
    assert manifest["files"] == {n: {"sha256": hashlib.sha256(d).hexdigest(), "bytes": len(d)}
                                 for n, d in content.items()}
    b = buckets.open_bucket(bucket_url)
    assert b.list("adapters/") == ["adapters/LATEST", "adapters/v000000/adapter_config.json",
                                   "adapters/v000000/adapter_model.safetensors",
                                   "adapters/v000000/manifest.json"]
    assert json.loads(b.read("adapters/LATEST")) == {"version": 0}
    assert sync.latest_version(b) == 0

    dest = sync.pull_adapter(bucket_url, 0, str(tmp_path / "pulled"))
    assert dest == str(tmp_path / "pulled" / "v000000")
    assert read_folder(dest) == content
    assert json.loads(open(os.path.join(dest, "manifest.json")).read()) == manifest

    weights = os.path.join(dest, "adapter_model.safetensors")
    with open(weights, "wb") as f:  # a corrupted local copy is not trusted: fetched again
        f.write(b"garbage")
    assert read_folder(sync.pull_adapter(b, 0, str(tmp_path / "pulled"))) == content

    for key in b.list("adapters/v000000/"):  # a verified local copy costs no transfer at all
        b.delete(key)
    assert b.list("adapters/v000000/") == []
    assert read_folder(sync.pull_adapter(b, 0, str(tmp_path / "pulled"))) == content

    with open(weights, "wb") as f:  # ...but only while it verifies
        f.write(b"garbage")
    with pytest.raises(buckets.BucketError, match="v000000"):
        sync.pull_adapter(b, 0, str(tmp_path / "pulled"), timeout=0.3)


def test_refuses_republishing(bucket_url, tmp_path):
    first = make_adapter(tmp_path / "a")
    sync.publish_adapter(bucket_url, str(tmp_path / "a"), 0)
    sync.publish_adapter(bucket_url, str(tmp_path / "a"), 1, keep=1)  # v0 is pruned
    assert sync.versions(bucket_url) == [1]
    make_adapter(tmp_path / "b")
    with pytest.raises(buckets.BucketError, match=r"v000001 already exists \(LATEST is 1\).*publish 2 or later"):
        sync.publish_adapter(bucket_url, str(tmp_path / "b"), 1)
    with pytest.raises(buckets.BucketError, match=r"v000000 is not newer \(LATEST is 1\)"):
        sync.publish_adapter(bucket_url, str(tmp_path / "b"), 0)  # gone, but its number was used
    for bad in (-1, 2**31):
        with pytest.raises(buckets.BucketError, match=r"an int in \[0, 2\^31\)"):
            sync.publish_adapter(bucket_url, str(tmp_path / "b"), bad)
    assert sync.latest_version(bucket_url) == 1
    assert read_folder(sync.pull_adapter(bucket_url, 1, str(tmp_path / "p"))) == first


def test_prune_keeps_newest(bucket_url, tmp_path):
    for v in range(8):
        make_adapter(tmp_path / f"a{v}", size=256)
        sync.publish_adapter(bucket_url, str(tmp_path / f"a{v}"), v, keep=3)
    assert sync.versions(bucket_url) == [5, 6, 7]
    b = buckets.open_bucket(bucket_url)
    assert {k.split("/")[1] for k in b.list("adapters/")} == {"LATEST", "v000005", "v000006", "v000007"}
    assert read_folder(sync.pull_adapter(b, 5, str(tmp_path / "p"))) == read_folder(tmp_path / "a5")
    with pytest.raises(buckets.BucketError, match="v000004"):
        sync.pull_adapter(b, 4, str(tmp_path / "p"), timeout=0.2)
    make_adapter(tmp_path / "a8", size=256)
    sync.publish_adapter(b, str(tmp_path / "a8"), 8, keep=None)
    assert sync.versions(b) == [5, 6, 7, 8]


def test_metrics(bucket_url):
    records = [{"step": i, "reward": i / 10, "staleness": [0, 1]} for i in range(3)]
    for r in records:
        buckets.append_metrics(bucket_url, r)
    assert buckets.read_metrics(bucket_url) == records


def test_trainer_state_round_trip(bucket_url, tmp_path):
    state = tmp_path / "state"
    (state / "rng").mkdir(parents=True)
    first = {"adapter_model.safetensors": os.urandom(3000), "optimizer.pt": os.urandom(5000),
             "rng/cuda.bin": os.urandom(100), "trainer.json": b'{"step": 10, "version": 2}'}
    for rel, data in first.items():
        (state / rel).write_bytes(data)
    buckets.save_trainer_state(bucket_url, str(state))
    assert read_folder(buckets.load_trainer_state(bucket_url, str(tmp_path / "l1")), skip=()) == first

    (state / "optimizer.pt").write_bytes(b"newer")
    buckets.save_trainer_state(bucket_url, str(state))
    assert read_folder(buckets.load_trainer_state(bucket_url, str(tmp_path / "l2")), skip=()) == {
        **first, "optimizer.pt": b"newer"}
    b = buckets.open_bucket(bucket_url)
    state_id = json.loads(b.read("trainer/STATE"))["id"]
    assert all(k == "trainer/STATE" or k.startswith(f"trainer/{state_id}/") for k in b.list("trainer/"))


def test_concurrent_publish_and_pull(bucket_url, tmp_path):
    """One writer publishes as fast as it can (pruning to keep=4) while 3 readers pull LATEST over
    and over: every adapter a reader gets is byte for byte what the writer published as that version."""
    n_versions = 40
    published, done = {}, threading.Event()
    results = {"ok": 0, "pruned": 0, "during_write": set(), "bad": []}
    lock = threading.Lock()

    def writer():
        b = buckets.open_bucket(bucket_url)
        try:
            for v in range(n_versions):
                published[v] = make_adapter(tmp_path / "w" / f"a{v}", size=64 * 1024)
                sync.publish_adapter(b, str(tmp_path / "w" / f"a{v}"), v, keep=4)
        finally:
            done.set()

    def reader(i):
        b = buckets.open_bucket(bucket_url)
        while True:
            finished = done.is_set()
            v = sync.latest_version(b)
            if v is not None:
                try:
                    dest = sync.pull_adapter(b, v, str(tmp_path / f"r{i}"), timeout=0.5)
                    got = read_folder(dest)
                    shutil.rmtree(dest)  # so that every pull is a real transfer
                except buckets.BucketError as e:  # fine only if the writer pruned v meanwhile
                    still_there = v in sync.versions(b)
                    with lock:
                        results["bad" if still_there else "pruned"] += [str(e)] if still_there else 1
                    continue
                with lock:
                    if got != published[v]:
                        results["bad"].append(f"reader {i} got wrong bytes for v{v}")
                    results["ok"] += 1
                    if not finished:
                        results["during_write"].add(v)
            if finished:
                return

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert results["bad"] == []
    assert sync.latest_version(bucket_url) == n_versions - 1 and len(published) == n_versions
    assert results["ok"] >= 10, results
    assert len(results["during_write"]) >= 3, results  # the readers really raced the writer


def _scratch_version(tmp_path, version):
    """The exact keys publish_adapter writes for one version, taken from a scratch bucket."""
    make_adapter(tmp_path / "src", size=50_000)
    scratch = buckets.open_bucket(str(tmp_path / "scratch"))
    sync.publish_adapter(scratch, str(tmp_path / "src"), version)
    return {k: scratch.read(k) for k in scratch.list(f"adapters/v{version:06d}/")}


def _put(root, key, data):  # what a mount shows: the file in place, bytes as they are right now
    path = os.path.join(root, *key.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def test_eventual_consistency_reader_waits(tmp_path):
    """LATEST is visible before the version's files; then the files appear with wrong bytes (one
    truncated, one the right size but other bytes). The reader waits and loads only the real thing."""
    keys = _scratch_version(tmp_path, 1)
    root = str(tmp_path / "bucket")
    _put(root, "adapters/LATEST", b'{"version": 1}')
    out = {}

    def read():
        v = sync.latest_version(root)
        out["dest"] = sync.pull_adapter(root, v, str(tmp_path / "pulled"), timeout=30)
        out["at"] = time.monotonic()

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.4)
    assert reader.is_alive()  # nothing but LATEST yet
    weights, config = "adapters/v000001/adapter_model.safetensors", "adapters/v000001/adapter_config.json"
    _put(root, "adapters/v000001/manifest.json", keys["adapters/v000001/manifest.json"])
    _put(root, weights, keys[weights][:1000])
    _put(root, config, bytes(len(keys[config])))
    time.sleep(0.6)
    assert reader.is_alive() and not os.path.exists(tmp_path / "pulled" / "v000001")

    def land():  # another thread: the mount finishes its uploads
        out["landed"] = time.monotonic()
        _put(root, config, keys[config])
        _put(root, weights, keys[weights])
    lander = threading.Thread(target=land)
    lander.start()
    lander.join()
    reader.join(timeout=30)
    assert out["at"] >= out["landed"]
    assert read_folder(out["dest"], skip=(sync.PULLED,)) == {k.split("/")[-1]: d for k, d in keys.items()}


def test_eventual_consistency_timeout_names_the_file(tmp_path):
    keys = _scratch_version(tmp_path, 3)
    root = str(tmp_path / "bucket")
    _put(root, "adapters/LATEST", b'{"version": 3}')
    for key in ("adapters/v000003/manifest.json", "adapters/v000003/adapter_config.json"):
        _put(root, key, keys[key])  # adapter_model.safetensors never lands
    start = time.monotonic()
    with pytest.raises(buckets.BucketError) as err:
        sync.pull_adapter(root, sync.latest_version(root), str(tmp_path / "pulled"), timeout=1.0)
    assert 1.0 <= time.monotonic() - start < 5.0
    msg = str(err.value)
    assert root in msg and "v000003" in msg and "adapters/v000003/adapter_model.safetensors is missing" in msg
    assert not os.path.exists(tmp_path / "pulled" / "v000003")


def test_kill_during_trainer_state_save(bucket_url, tmp_path):
    """SIGKILL a real save of a big state half-way: the previous state still loads intact."""
    small = tmp_path / "small"
    small.mkdir()
    before = {"trainer.json": b'{"step": 5}', "optimizer.pt": os.urandom(2000)}
    for rel, data in before.items():
        (small / rel).write_bytes(data)
    buckets.save_trainer_state(bucket_url, str(small))
    b = buckets.open_bucket(bucket_url)
    old_id = json.loads(b.read("trainer/STATE"))["id"]

    big = tmp_path / "big"
    big.mkdir()
    for i in range(2000):  # many files, so that the save takes long enough to be caught midway
        (big / f"shard{i:04d}.bin").write_bytes(os.urandom(4096))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from support import buckets; buckets.save_trainer_state(*sys.argv[1:])",
                             bucket_url, str(big)], cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        new = [k for k in b.list("trainer/") if k != "trainer/STATE" and not k.startswith(f"trainer/{old_id}/")]
        if len(new) >= 5:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    assert proc.wait(timeout=30) == -signal.SIGKILL, "the save ended before it could be killed"
    assert json.loads(b.read("trainer/STATE"))["id"] == old_id
    assert read_folder(buckets.load_trainer_state(b, str(tmp_path / "loaded")), skip=()) == before

    (small / "trainer.json").write_bytes(b'{"step": 6}')  # the next save also clears the leftovers
    buckets.save_trainer_state(b, str(small))
    new_id = json.loads(b.read("trainer/STATE"))["id"]
    assert all(k == "trainer/STATE" or k.startswith(f"trainer/{new_id}/") for k in b.list("trainer/"))
    assert buckets.load_trainer_state(b, str(tmp_path / "loaded2"))
    assert (tmp_path / "loaded2" / "trainer.json").read_bytes() == b'{"step": 6}'


def test_cli(bucket_url, tmp_path):
    r = run_cli("pull", bucket_url, tmp_path / "p")
    assert r.returncode == 1 and r.stderr.startswith("sync.py: error:") and "no adapter yet" in r.stderr
    content = make_adapter(tmp_path / "a")
    r = run_cli("push", bucket_url, tmp_path / "a", "--version", 0)
    assert r.returncode == 0 and "published v000000" in r.stdout, r.stderr
    r = run_cli("push", bucket_url, tmp_path / "a", "--version", 0)
    assert r.returncode == 1 and "already exists" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1
    r = run_cli("ls", bucket_url)
    assert r.returncode == 0 and "LATEST = v000000" in r.stdout and "v000000" in r.stdout.split("\n")[2]
    r = run_cli("pull", bucket_url, tmp_path / "p")
    assert r.returncode == 0 and r.stdout.strip() == str(tmp_path / "p" / "v000000"), r.stderr
    assert read_folder(tmp_path / "p" / "v000000") == content
    r = run_cli("pull", bucket_url, tmp_path / "p", "--version", 7, "--timeout", 0.2)
    assert r.returncode == 1 and "adapters/v000007/manifest.json is missing" in r.stderr


def test_import_without_torch():
    code = "import sys, sync; assert 'torch' not in sys.modules and 'boto3' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_bad_urls():
    with pytest.raises(buckets.BucketError, match="mount it"):
        buckets.open_bucket("hf://buckets/me/run")
    with pytest.raises(buckets.BucketError, match="a directory or s3://bucket/prefix"):
        buckets.open_bucket("gs://bucket/x")


def test_missing_s3_bucket(s3_server, tmp_path):
    url = "s3://no-such-bucket-4242/run"
    with pytest.raises(buckets.BucketError, match="bucket 'no-such-bucket-4242' does not exist"):
        sync.latest_version(url)
    make_adapter(tmp_path / "a")
    with pytest.raises(buckets.BucketError, match="does not exist.*create it"):
        sync.publish_adapter(url, str(tmp_path / "a"), 0)
    r = run_cli("ls", url)
    assert r.returncode == 1 and r.stderr.startswith("sync.py: error: s3://no-such-bucket-4242/run: bucket")
    assert "Traceback" not in r.stderr


def test_unreachable_endpoint(monkeypatch):
    port = free_port()  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    start = time.monotonic()
    with pytest.raises(buckets.BucketError, match=f"cannot reach the S3 endpoint http://127.0.0.1:{port}.*AWS_ENDPOINT_URL"):
        sync.latest_version("s3://bucket/run")
    assert time.monotonic() - start < 20


def test_no_credentials(monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(buckets.BucketError, match="no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        sync.latest_version("s3://bucket/run")


def test_wrong_credentials(monkeypatch):
    """A second moto server that checks signatures (INITIAL_NO_AUTH_ACTION_COUNT=1: only the
    create_bucket below goes unchecked): made-up keys are refused with InvalidAccessKeyId."""
    import boto3

    port = free_port()
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1",
                             "-p", str(port)], env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "made-up")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "made-up")
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="locked")
        with pytest.raises(buckets.BucketError, match=r"access denied \(InvalidAccessKeyId\).*AWS_ACCESS_KEY_ID"):
            sync.latest_version("s3://locked/run")
    finally:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------- a broken or hostile bucket (issue 14)

def test_metrics_a_redone_step_replaces_its_record(bucket_url):
    for step in (1, 2, 3):
        buckets.append_metrics(bucket_url, {"step": step, "loss": step / 10})
    buckets.append_metrics(bucket_url, {"step": 2, "loss": 0.25})  # the trainer resumed from step 1 and redid step 2
    want = [{"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.25}, {"step": 3, "loss": 0.3}]
    assert buckets.read_metrics(bucket_url) == want
    r = run_cli("metrics", bucket_url)
    assert r.returncode == 0 and [json.loads(line) for line in r.stdout.splitlines()] == want, r.stderr


def test_metrics_survive_a_read_that_misses_the_history(bucket_url):
    """The history is invisible while step 4 is recorded (a mount not caught up, S3 answering
    NoSuchKey); once it shows again every step is there: nothing was rewritten from the bad read."""
    b = buckets.open_bucket(bucket_url)
    for step in (1, 2, 3):
        buckets.append_metrics(b, {"step": step})
    hidden = {k: b.read(k) for k in b.list()}
    for k in hidden:
        b.delete(k)
    buckets.append_metrics(b, {"step": 4})
    for k, data in hidden.items():  # the old objects show again; what was written meanwhile is newer and stays
        if b.read(k) is None:
            b.write(k, data)
    assert [r["step"] for r in buckets.read_metrics(b)] == [1, 2, 3, 4]


@pytest.mark.parametrize("value", [b'{"version": Infinity}', b'{"version": NaN}', b'{"version": -1}',
                                   b'{"version": "3"}', b'{"version": true}', b'{"version": 2.5}', b"[3]",
                                   b'{"version": 100000000000000000000}', b'{"version": 2147483648}'])
def test_a_corrupt_latest_is_a_clear_error(tmp_path, value):
    b = buckets.open_bucket(str(tmp_path / "bucket"))
    b.write("adapters/LATEST", value)
    with pytest.raises(buckets.BucketError, match=r"adapters/LATEST holds .*not \{\"version\": N\}.*delete it"):
        sync.latest_version(b)
    b.write("adapters/LATEST", b'{"version": 1')  # torn on a mount: as if not written yet
    assert sync.latest_version(b) is None


@pytest.mark.parametrize("value", [b'{"id": "../../outside"}', b'{"id": "a\\u0000b"}', b'{"id": ""}',
                                   b'{"id": 7}', b'{"id": "20250101-000000-0a1b', b'["x"]', b"{}"])
def test_the_trainer_state_id_is_checked(tmp_path, value):
    """trainer/STATE names the folder the trainer loads its state from: one naming a folder outside
    trainer/ (here a complete planted state at bucket/trainer/../../outside), or torn, is one clear error."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "state.pt").write_bytes(b"planted")
    entry = {"sha256": hashlib.sha256(b"planted").hexdigest(), "bytes": 7}
    (outside / "manifest.json").write_text(json.dumps({"files": {"state.pt": entry}}))
    b = buckets.open_bucket(str(tmp_path / "bucket"))
    b.write("trainer/STATE", value)
    with pytest.raises(buckets.BucketError, match=r"trainer/STATE holds .*delete it to start training afresh"):
        buckets.load_trainer_state(b, str(tmp_path / "loaded"), timeout=0.5)
    assert not (tmp_path / "loaded").exists()


@pytest.mark.parametrize("name", ["a\x00b", "../../outside", "/etc/passwd", "sub/../x", ".hidden", ""])
def test_unsafe_names_in_a_manifest_are_refused(bucket_url, tmp_path, name):
    make_adapter(tmp_path / "a")
    manifest = sync.publish_adapter(bucket_url, str(tmp_path / "a"), 0)
    manifest["files"][name] = {"sha256": "0" * 64, "bytes": 1}
    b = buckets.open_bucket(bucket_url)
    b.write("adapters/v000000/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(buckets.BucketError, match=r"adapters/v000000/manifest.json: .* is not a safe file name"):
        sync.pull_adapter(b, 0, str(tmp_path / "pulled"), timeout=0.5)


def test_publish_refuses_an_unsafe_local_name_and_skips_hidden_files(tmp_path):
    make_adapter(tmp_path / "a")
    (tmp_path / "a" / ".DS_Store").write_bytes(b"x")
    assert ".DS_Store" not in sync.publish_adapter(str(tmp_path / "b"), str(tmp_path / "a"), 0)["files"]
    (tmp_path / "a" / "my notes.txt").write_bytes(b"x")
    with pytest.raises(buckets.BucketError, match="'my notes.txt' is not a safe file name"):
        sync.publish_adapter(str(tmp_path / "b"), str(tmp_path / "a"), 1)


def test_a_directory_bucket_follows_no_symlink(tmp_path, capfd):
    """A symlink planted in a directory bucket leads neither a reader nor a writer outside it (a
    metrics write says so on stderr and returns False: it never ends the run)."""
    outside, root = tmp_path / "outside", tmp_path / "bucket"
    make_adapter(tmp_path / "a")
    sync.publish_adapter(str(outside), str(tmp_path / "a"), 1)  # a complete v1, outside the bucket
    b = buckets.open_bucket(str(root))
    b.write("adapters/LATEST", b'{"version": 1}')
    os.symlink(outside / "adapters" / "v000001", root / "adapters" / "v000001")
    with pytest.raises(buckets.BucketError, match="goes through the symlink 'v000001'"):
        sync.pull_adapter(b, 1, str(tmp_path / "pulled"), timeout=0.5)
    os.remove(root / "adapters" / "LATEST")
    os.symlink(outside / "adapters" / "LATEST", root / "adapters" / "LATEST")
    with pytest.raises(buckets.BucketError, match="symlink 'LATEST'"):
        sync.latest_version(b)
    before = read_folder(outside, skip=())
    os.symlink(outside, root / "trainer")  # the writer's turn: folders that lead outside
    os.symlink(outside, root / "metrics")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.pt").write_bytes(b"x")
    with pytest.raises(buckets.BucketError, match="symlink 'trainer'"):
        buckets.save_trainer_state(b, str(tmp_path / "state"))
    assert buckets.append_metrics(b, {"step": 1}) is False
    assert "step 1's metrics record not written, the run goes on: " in capfd.readouterr().err
    assert read_folder(outside, skip=()) == before, "something was written outside the bucket"


def test_no_temp_file_outlives_a_write(tmp_path):
    """A write that fails leaves no temp file; one a kill left behind is pruned with its version or state."""
    root = tmp_path / "bucket"
    b = buckets.open_bucket(str(root))
    with pytest.raises(TypeError):  # a str, not bytes: the write fails once its temp file is made
        b.write("adapters/LATEST", '{"version": 0}')
    assert os.listdir(root / "adapters") == []
    make_adapter(tmp_path / "a")
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "state.pt").write_bytes(b"x")
    sync.publish_adapter(b, str(tmp_path / "a"), 0)
    (root / "adapters" / "v000000" / ".adapter_model.safetensors.1a2b3c4d.tmp").write_bytes(b"half")  # a kill's
    (root / "trainer" / "20250101-000000-0a1b2c3d").mkdir(parents=True)  # a killed save's first file
    (root / "trainer" / "20250101-000000-0a1b2c3d" / ".state.pt.1a2b3c4d.tmp").write_bytes(b"half")
    sync.publish_adapter(b, str(tmp_path / "a"), 1, keep=1)
    buckets.save_trainer_state(b, str(tmp_path / "s"))
    assert sorted(os.listdir(root / "adapters")) == ["LATEST", "v000001"]
    assert [p.name for p in root.rglob("*.tmp")] == []


def test_adapter_cache_deletes_only_what_it_pulled(tmp_path):
    """rollout.py --cache-dir ~/.cache: what else lives there, and a version another replica pulled, stays."""
    bucket, cache_dir = str(tmp_path / "bucket"), tmp_path / "cache"
    for v in range(3):
        make_adapter(tmp_path / f"a{v}")
        sync.publish_adapter(bucket, str(tmp_path / f"a{v}"), v)
    (cache_dir / "models").mkdir(parents=True)
    (cache_dir / "models" / "weights.bin").write_bytes(b"keep me")
    other = sync.pull_adapter(bucket, 0, str(cache_dir))  # another replica pulled v0 there
    cache = sync.AdapterCache(str(cache_dir))
    assert cache.pull(bucket, 0) == other and os.fspath(cache) == str(cache_dir)
    for v in (1, 2):
        cache.keep_only(cache.pull(bucket, v))
    cache.close()
    assert sorted(os.listdir(cache_dir)) == ["models", "v000000", "v000002"]
    assert (cache_dir / "models" / "weights.bin").read_bytes() == b"keep me"


@pytest.mark.parametrize("ending", ["exit", "SIGTERM"])
def test_adapter_cache_temp_folder_is_removed_when_the_process_ends(tmp_path, ending):
    bucket, tmp = str(tmp_path / "bucket"), tmp_path / "tmp"
    make_adapter(tmp_path / "a")
    sync.publish_adapter(bucket, str(tmp_path / "a"), 0)
    tmp.mkdir()
    # the child says whether the pulled file is there: with "exit" it may be gone by the time we look
    code = ("import os, sys, time, sync; cache = sync.AdapterCache(prefix='rollout-0-'); "
            "p = cache.pull(sys.argv[1], 0); "
            "print(p, os.path.isfile(os.path.join(p, 'adapter_config.json')), flush=True); "
            "sys.argv[2] == 'SIGTERM' and time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, bucket, ending], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "TMPDIR": str(tmp)})
    path, pulled = proc.stdout.readline().split()
    assert path.startswith(str(tmp / "rollout-0-")) and pulled == "True"
    if ending == "SIGTERM":
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == (128 + signal.SIGTERM if ending == "SIGTERM" else 0)
    assert os.listdir(tmp) == []


def test_a_bad_adapter_is_reported_on_stderr_and_not_waited_for_twice(tmp_path, capfd):
    """LATEST names a version whose weights do not match its manifest (bad, not late): the wait says
    so on stderr, and the cache's next look at that version fails at once instead of waiting again."""
    root = str(tmp_path / "bucket")
    make_adapter(tmp_path / "a")
    sync.publish_adapter(root, str(tmp_path / "a"), 0)
    _put(root, "adapters/v000000/adapter_model.safetensors", b"garbage")
    cache = sync.AdapterCache(str(tmp_path / "cache"))
    with pytest.raises(buckets.BucketError, match="adapter_model.safetensors has 7 bytes not matching"):
        cache.pull(root, 0, timeout=0.5)
    assert (f"sync.py: {root}: waiting for adapter v000000: adapters/v000000/adapter_model.safetensors has 7 "
            "bytes not matching") in capfd.readouterr().err
    with pytest.raises(buckets.BucketError, match="not matching"):
        cache.pull(root, 0, timeout=60)  # one look, no second wait
    assert "waiting for" not in capfd.readouterr().err


# ---- what a bucket writer or a killed write can leave (hostile peers, the learner's side) ----

def test_temp_files_of_killed_writes_are_pruned_at_publish(tmp_path):
    """A kill between a DirBucket write's temp file and its os.replace leaves .NAME.XXXXXXXX.tmp:
    the next publish deletes those of LATEST and metrics once they are TEMP_MAX_AGE_S old."""
    root = tmp_path / "bucket"
    make_adapter(tmp_path / "a")
    sync.publish_adapter(str(root), str(tmp_path / "a"), 0)
    buckets.append_metrics(str(root), {"step": 1})
    old = ["adapters/.LATEST.0a1b2c3d.tmp", "metrics/.step-000002.json.deadbeef.tmp"]
    fresh, other = "adapters/.LATEST.11111111.tmp", "metrics/.notes.tmp"  # in flight / not ours
    for key in old + [fresh, other]:
        _put(str(root), key, b"{")
    for key in old + [other]:
        os.utime(root / key, (time.time() - buckets.TEMP_MAX_AGE_S - 5,) * 2)
    sync.publish_adapter(str(root), str(tmp_path / "a"), 1)
    left = set(buckets.open_bucket(str(root)).list())
    assert not left & set(old), left
    assert {fresh, other} <= left and sync.latest_version(str(root)) == 1


def test_a_folder_of_the_user_named_like_a_version_is_not_deleted(tmp_path):
    """rollout.py --cache-dir ~/work: a v000001/ there that sync.py did not pull stays as it is."""
    bucket, cache_dir = str(tmp_path / "bucket"), tmp_path / "cache"
    make_adapter(tmp_path / "a")
    sync.publish_adapter(bucket, str(tmp_path / "a"), 1)
    (cache_dir / "v000001").mkdir(parents=True)
    (cache_dir / "v000001" / "thesis.tex").write_bytes(b"mine")
    cache = sync.AdapterCache(str(cache_dir))
    with pytest.raises(buckets.BucketError, match=r"v000001 exists and was not made by sync.py.*move it away"):
        cache.pull(bucket, 1, timeout=0.5)
    assert (cache_dir / "v000001" / "thesis.tex").read_bytes() == b"mine"
    path = sync.pull_adapter(bucket, 1, str(tmp_path / "ok"))  # a copy sync.py made, then changed: replaced
    with open(os.path.join(path, "adapter_model.safetensors"), "ab") as f:
        f.write(b"x")
    assert sync.pull_adapter(bucket, 1, str(tmp_path / "ok")) == path and buckets.verified_local(path)


def test_a_version_folder_past_the_limit_is_refused(tmp_path):
    root = str(tmp_path / "bucket")
    make_adapter(tmp_path / "a")
    sync.publish_adapter(root, str(tmp_path / "a"), 0)
    _put(root, "adapters/v100000000000000000000/manifest.json", b"{}")
    with pytest.raises(buckets.BucketError, match=r"past the versions' limit 2\^31 - 1.*delete that folder"):
        sync.versions(root)


def test_a_corrupt_adapter_is_reported_as_corrupt_not_as_late(tmp_path):
    """As many bytes as the manifest lists (or more) but other ones: no lagging mount shows that."""
    root = str(tmp_path / "bucket")
    make_adapter(tmp_path / "a")
    sync.publish_adapter(root, str(tmp_path / "a"), 0)
    sync.publish_adapter(root, str(tmp_path / "a"), 1)
    _put(root, "adapters/v000000/adapter_model.safetensors", b"\0" * 4096)  # same size, other bytes
    _put(root, "adapters/v000001/adapter_model.safetensors", b"\0" * 10)  # fewer: a lag, or torn
    with pytest.raises(buckets.CorruptAdapter, match="adapter v000000 is corrupt: .* not matching the manifest"):
        sync.pull_adapter(root, 0, str(tmp_path / "p"), timeout=0)
    with pytest.raises(buckets.BucketError, match="not complete after") as e:
        sync.pull_adapter(root, 1, str(tmp_path / "p"), timeout=0)
    assert not isinstance(e.value, buckets.CorruptAdapter)


# ---- a bucket writer: planted versions and LATEST (ADAPTER_KEY, TRAINER_STATE_KEY)

def test_with_the_adapter_key_a_planted_version_or_latest_is_refused(tmp_path):
    """ADAPTER_KEY: the trainer tags each manifest and LATEST. A replica with the key refuses an
    untagged version (even one it pulled before without the key), one tagged under another key,
    a tagged manifest copied into another version's folder, and an untagged LATEST; without the
    key it takes them, as before there were tags."""
    root, pulled, a = str(tmp_path / "bucket"), str(tmp_path / "pulled"), str(tmp_path / "a")
    make_adapter(a)
    sync.publish_adapter(root, a, 0, key="k")
    assert sync.latest_version(root, "k") == 0
    assert os.path.isdir(sync.pull_adapter(root, 0, pulled, timeout=0, key="k"))
    sync.publish_adapter(root, a, 1)  # a bucket writer without the key
    sync.publish_adapter(root, a, 2, key="another")
    v0 = os.path.join(root, "adapters", "v000000")
    for name in os.listdir(v0):  # v0's tagged manifest and files, as v3
        _put(root, f"adapters/v000003/{name}", open(os.path.join(v0, name), "rb").read())
    for v, why in [(1, "has no tag"), (2, "has a wrong tag"), (3, "is v0's")]:
        assert sync.pull_adapter(root, v, str(tmp_path / "no-key"), timeout=0)  # as before
        for dest in (pulled, str(tmp_path / "no-key")):  # a copy pulled without the key: the same
            with pytest.raises(adapter_tags.Untrusted,
                               match=f"adapter v{v:06d}'s manifest {why} under ADAPTER_KEY"):
                sync.pull_adapter(root, v, dest, timeout=0, key="k")
        assert not os.path.exists(os.path.join(pulled, f"v{v:06d}"))
    _put(root, "adapters/LATEST", b'{"version": 2147483647}')
    with pytest.raises(adapter_tags.Untrusted, match="LATEST names v2147483647 without a valid tag"):
        sync.latest_version(root, "k")
    assert sync.latest_version(root) == 2147483647  # without the key: as before


def test_a_trainer_publish_replaces_a_latest_or_version_it_did_not_write(tmp_path, capfd):
    """With trainer_key (TRAINER_STATE_KEY) only the trainer's own LATEST and versions can refuse
    its publish: LATEST = 2^31 - 1 or a complete planted version in its way is named on stderr
    and replaced. Without it, a LATEST no version can follow is one error saying what to delete."""
    root, a = str(tmp_path / "bucket"), str(tmp_path / "a")
    make_adapter(a)
    sync.publish_adapter(root, a, 0, key="k", trainer_key="t")
    _put(root, "adapters/LATEST", b'{"version": 2147483647}')
    with pytest.raises(buckets.BucketError, match=r"no version can follow 2147483647 .*delete "
                                                  r".*adapters/LATEST"):
        sync.publish_adapter(root, a, 1)
    sync.publish_adapter(root, a, 1, key="k", trainer_key="t")
    assert sync.latest_version(root, "k") == 1
    assert "LATEST names 2147483647, not a version this trainer published" in capfd.readouterr().err
    sync.publish_adapter(root, a, 2)  # a bucket writer's complete v2, and one more file
    _put(root, "adapters/v000002/extra.bin", b"x")
    sync.publish_adapter(root, a, 2, key="k", trainer_key="t")
    assert "adapters/v000002/ holds a manifest this trainer did not write" in capfd.readouterr().err
    assert "extra.bin" not in os.listdir(os.path.join(root, "adapters", "v000002"))
    assert sync.pull_adapter(root, 2, str(tmp_path / "p"), timeout=0, key="k")
    with pytest.raises(buckets.BucketError, match="already exists"):  # its own: immutable
        sync.publish_adapter(root, a, 2, key="k", trainer_key="t")


def test_pruning_keeps_the_version_just_published_whatever_is_planted_above(tmp_path):
    """Folders planted above the trainer's numbers (one past 2^31 among them) neither push its
    newest versions out of `keep` nor stop a publish."""
    root, a = str(tmp_path / "bucket"), str(tmp_path / "a")
    make_adapter(a)
    for v in (5, 6, 7, 2147483647, 10**20):
        _put(root, f"adapters/v{v:06d}/manifest.json", b"{}")
    for v in range(3):
        sync.publish_adapter(root, a, v, keep=2)
    numbers = adapter_tags.version_numbers(buckets.open_bucket(root))
    assert numbers == [1, 2, 5, 6, 7, 2147483647, 10**20]
    assert sync.pull_adapter(root, 2, str(tmp_path / "p"), timeout=0)


# ---- issue 48: a bucket object too large, too deep or not ASCII; a folder where a file goes

HUGE = 1 << 40  # a sparse 1 TiB file: no disk, but reading it whole needs 1 TiB of memory


def _plant(b, key, size=None, data=b""):
    """data at key; with size (directory bucket): a sparse file of that many bytes."""
    if size is None or not isinstance(b, buckets.DirBucket):
        return b.write(key, data if size is None else b"\0" * min(size, 4 << 20))
    path = os.path.join(b.url, *key.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


def test_a_tag_that_is_not_ascii_is_a_foreign_object(tmp_path, capfd):
    """"tag": "é" in LATEST or in a manifest, "trainer_tag": "é" in the manifest of the version the
    trainer publishes next: Untrusted, or not the trainer's own (replaced), never the TypeError
    hmac.compare_digest raises on a str that is not ASCII."""
    root, a = str(tmp_path / "bucket"), str(tmp_path / "a")
    make_adapter(a)
    sync.publish_adapter(root, a, 0, key="k", trainer_key="t")
    _put(root, "adapters/LATEST", json.dumps({"version": 0, "tag": "é"}).encode())
    with pytest.raises(adapter_tags.Untrusted, match="LATEST names v0 without a valid tag"):
        sync.latest_version(root, "k")
    sync.publish_adapter(str(tmp_path / "writer"), a, 1)  # a complete v1 with tags that are not ASCII
    planted = json.load(open(tmp_path / "writer" / "adapters" / "v000001" / "manifest.json"))
    for name in os.listdir(tmp_path / "writer" / "adapters" / "v000001"):
        _put(root, f"adapters/v000001/{name}",
             (tmp_path / "writer" / "adapters" / "v000001" / name).read_bytes())
    _put(root, "adapters/v000001/manifest.json",
         json.dumps({**planted, "tag": "é", "trainer_tag": "\u00e9"}).encode())
    with pytest.raises(adapter_tags.Untrusted, match="adapter v000001's manifest has a wrong tag"):
        sync.pull_adapter(root, 1, str(tmp_path / "p"), timeout=0, key="k")
    sync.publish_adapter(root, a, 1, key="k", trainer_key="t")  # the trainer's publish of v1
    assert "adapters/v000001/ holds a manifest this trainer did not write" in capfd.readouterr().err
    assert sync.latest_version(root, "k") == 1 and sync.pull_adapter(root, 1, str(tmp_path / "p"), key="k")


@pytest.mark.parametrize("what", ["too large", "too deep"])
def test_a_latest_too_large_or_too_deep_is_foreign_and_passed_over(bucket_url, tmp_path, capfd, what):
    """A LATEST of 1 TiB (sparse, directory bucket; 4 MiB on S3) or of 30,000 nested brackets: a
    Foreign error (no MemoryError, no RecursionError), found before its bytes are read; Untrusted
    for a replica with ADAPTER_KEY; named and replaced by the trainer's next publish."""
    a, b = str(tmp_path / "a"), buckets.open_bucket(bucket_url)
    make_adapter(a)
    sync.publish_adapter(b, a, 0, key="k", trainer_key="t")
    if what == "too large":
        _plant(b, "adapters/LATEST", size=HUGE)
        match = r"adapters/LATEST holds \d+ bytes, more than the 65536 bytes trainer.py ever writes"
    else:
        _plant(b, "adapters/LATEST", data=b"[" * 30_000 + b"]" * 30_000)
        match = r"adapters/LATEST cannot be parsed \(RecursionError\)"
    with pytest.raises(buckets.BucketError, match=match):  # Foreign
        sync.latest_version(b)
    with pytest.raises(adapter_tags.Untrusted, match=match):
        sync.latest_version(b, "k")
    sync.publish_adapter(b, a, 1, key="k", trainer_key="t")
    assert "LATEST names nothing valid, not a version this trainer published" in capfd.readouterr().err
    assert sync.latest_version(b, "k") == 1
    b.write("adapters/LATEST", json.dumps({"version": 1, "x": [[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]}).encode())
    with pytest.raises(buckets.BucketError, match="nests JSON deeper than 16"):
        sync.latest_version(b)


def test_files_larger_than_their_manifest_says_are_not_read(bucket_url, tmp_path):
    """The next version's weights swapped for 1 TiB (sparse; 4 MiB on S3): the pull reads at most
    the manifest's byte count and says the version is corrupt; with ADAPTER_KEY an untagged
    manifest is refused before any file is read. A manifest, a trainer/STATE or a metrics record
    past its key's limit or too deep is Foreign too."""
    a, b = str(tmp_path / "a"), buckets.open_bucket(bucket_url)
    make_adapter(a)
    for v in (0, 1):
        sync.publish_adapter(b, a, v, key="k")
    _plant(b, "adapters/v000001/adapter_model.safetensors", size=HUGE)
    for key in (None, "k"):
        with pytest.raises(buckets.CorruptAdapter, match=r"adapter_model.safetensors is not its manifest's: "
                                                         r".* holds \d+ bytes, more than the 4096 bytes"):
            sync.pull_adapter(b, 1, str(tmp_path / "p"), timeout=0, key=key)
    sync.publish_adapter(str(tmp_path / "w"), a, 2)  # an untagged v2, its weights 1 TiB
    for name in ("manifest.json", "adapter_config.json"):
        b.write(f"adapters/v000002/{name}", open(tmp_path / "w" / "adapters" / "v000002" / name, "rb").read())
    _plant(b, "adapters/v000002/adapter_model.safetensors", size=HUGE)
    with pytest.raises(adapter_tags.Untrusted, match="v000002's manifest has no tag"):
        sync.pull_adapter(b, 2, str(tmp_path / "p"), timeout=0, key="k")
    _plant(b, "adapters/v000000/manifest.json", size=2 << 20)
    with pytest.raises(buckets.CorruptAdapter, match=r"manifest.json holds \d+ bytes, more than the 1048576"):
        sync.pull_adapter(b, 0, str(tmp_path / "q"), timeout=0)
    assert adapter_tags.own_versions(b, "k") == {}
    _plant(b, "trainer/STATE", data=b'{"id": ' * 20 + b"1" + b"}" * 20)
    with pytest.raises(buckets.BucketError, match="trainer/STATE cannot be parsed|nests JSON deeper"):
        buckets.load_trainer_state(b, str(tmp_path / "state"), timeout=0)
    _plant(b, "trainer/STATE", size=HUGE)
    with pytest.raises(buckets.BucketError, match=r"trainer/STATE holds \d+ bytes, more than the 65536"):
        buckets.load_trainer_state(b, str(tmp_path / "state"), timeout=0)
    buckets.append_metrics(b, {"step": 1})
    _plant(b, "metrics/step-000002.json", data=b"[" * 30_000 + b"]" * 30_000)
    _plant(b, "metrics/step-000003.json", size=HUGE)
    buckets.append_metrics(b, {"step": 4})
    assert [r["step"] for r in buckets.read_metrics(b)] == [1, 4]
    r = run_cli("ls", b.url, env={**os.environ})
    assert r.returncode == 0 and "v000000   (incomplete: no readable manifest.json)" in r.stdout, r.stderr


def test_a_folder_planted_where_the_trainer_writes_is_removed(tmp_path, capfd):
    """An empty folder at metrics/step-000006.json, adapters/LATEST, trainer/STATE, one holding a
    file at the next version's weights, a file where a version's folder goes (a directory bucket;
    S3 has no folders): each write removes it, says so on stderr, and writes the file (before: "Is
    a directory", retried, then the end of the run). A read meets a folder as Foreign."""
    root, a, state = tmp_path / "bucket", str(tmp_path / "a"), tmp_path / "state"
    make_adapter(a)
    state.mkdir()
    (state / "state.pt").write_bytes(b"x")
    b = buckets.open_bucket(str(root))
    sync.publish_adapter(b, a, 0, key="k", trainer_key="t")
    os.remove(root / "adapters" / "LATEST")
    for key in ("metrics/step-000006.json", "adapters/LATEST", "trainer/STATE",
                "adapters/v000001/adapter_model.safetensors/inside"):
        os.makedirs(root / key)
    (root / "adapters" / "v000001" / "adapter_model.safetensors" / "inside" / "f").write_bytes(b"x")
    with pytest.raises(buckets.BucketError, match="trainer/STATE is a folder"):  # not "no state": start afresh
        buckets.load_trainer_state(b, str(tmp_path / "loaded"), timeout=0)
    with pytest.raises(adapter_tags.Untrusted, match="adapters/LATEST is a folder"):
        sync.latest_version(b, "k")
    assert buckets.append_metrics(b, {"step": 6}) is True
    sync.publish_adapter(b, a, 1, key="k", trainer_key="t")
    buckets.save_trainer_state(b, str(state))
    err = capfd.readouterr().err
    for key in ("metrics/step-000006.json", "adapters/LATEST", "trainer/STATE",
                "adapters/v000001/adapter_model.safetensors"):
        assert f"{root}: {key} was a folder, which sync.py never writes there: removed" in err, err
    assert buckets.read_metrics(b) == [{"step": 6}] and sync.latest_version(b, "k") == 1
    assert sync.pull_adapter(b, 1, str(tmp_path / "p"), timeout=0, key="k")
    assert buckets.load_trainer_state(b, str(tmp_path / "loaded"), timeout=0)
    (root / "adapters" / "v000002").write_bytes(b"x")  # a file where the next version's folder goes
    sync.publish_adapter(b, a, 2, key="k", trainer_key="t")
    assert f"{root}: adapters/v000002 was a file, which sync.py never writes there: removed" in capfd.readouterr().err
    assert sync.pull_adapter(b, 2, str(tmp_path / "p"), timeout=0, key="k")
