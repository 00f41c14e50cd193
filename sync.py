"""sync.py — the only code that touches storage: versioned LoRA adapters, trainer state, metrics.

A bucket is a directory (also a mounted bucket, e.g. an HF Jobs volume at /bucket) or
s3://bucket/prefix through boto3 (AWS S3, R2, MinIO, HF Storage Buckets), set up by the standard
AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (HF: https://s3.hf.co/<namespace>).

    adapters/v{N:06d}/{adapter_config.json, adapter_model.safetensors, manifest.json}
    adapters/LATEST     {"version": N}, written only after all of v N and its manifest
    trainer/STATE       {"id": ID}: the resume state is trainer/ID/ (with its manifest.json)
    metrics/step-{S:06d}.json   one JSON object per trainer step S (a redone step replaces its own)

The hand-off of an adapter, in this file's order:
    1. publish  the trainer uploads v N's files, then its manifest (sha256 and size of each),
                then adapters/LATEST (publish_adapter)
    2. find     a replica reads adapters/LATEST, one small object (latest_version)
    3. pull     the replica downloads v N and hands it out only once every file matches the
                manifest (pull_adapter; AdapterCache keeps a replica's pulls)
The dir and S3 backends, the trainer state, the metrics and the CLI: sync_support.py.

A mounted bucket is eventually consistent (a file can appear before its bytes, LATEST before the
files it names), so pull_adapter hands out a version only once every file matches manifest.json.
Whoever can write the bucket (replicas hold its keys) could plant anything: every name and number
read from it is checked, and a value that does not fit is a BucketError, never a path outside it.

    python sync.py ls runs/bucket                          # versions, sizes, ages, LATEST
    python sync.py push runs/bucket ./my-adapter --version 3
    python sync.py pull s3://my-bucket/run1 ./adapters     # newest -> ./adapters/v000003
    python sync.py metrics runs/bucket | tail -n 3         # the trainer's step records (JSON)
    python -m pytest tests/test_sync.py -q ; python bench/bench_sync.py
"""

import atexit
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time

# the backends, the trainer state, the metrics and the CLI: sync_support.py (not needed to follow
# a hand-off)
from sync_support import (LATEST, MANIFEST, BucketError, CorruptAdapter, DirBucket, _entry, _open,
                          _safe_name, main)
from sync_support import (TEMP_MAX_AGE_S, append_metrics, load_trainer_state,  # noqa: F401
                          open_bucket, read_metrics, save_trainer_state)  # what other code imports

VERSION_KEY = re.compile(r"^adapters/v(\d{6,})/")
MAX_VERSION = 2**31  # versions are < 2^31, as the proxy's
PULLED = ".pulled-by-sync"  # the mark pull_adapter leaves in each folder it creates


# ---- ALGO: 1. publish a version (its files, its manifest, then LATEST)  2. find the newest
#           3. pull it, verified against its manifest (a replica keeps its pulls in AdapterCache)

def publish_adapter(bucket, adapter_dir, version, keep=6, **meta):
    """Upload a PEFT folder to adapters/v{version:06d}/, then its manifest.json (+ meta such as
    step), then adapters/LATEST; then delete all but the newest `keep` versions (None keeps all).
    Returns the manifest. Versions are immutable: an existing one, or one not newer than LATEST,
    is refused."""
    b, src = _open(bucket), DirBucket(adapter_dir)
    if not isinstance(version, int) or not 0 <= version < MAX_VERSION:
        raise BucketError(f"adapter version must be an int in [0, 2^31), got {version!r}")
    # the adapter's own files (a pulled copy also holds a manifest and the pull's mark)
    files = {_safe_name(adapter_dir, n): src.read(n) for n in src.list()
             if "/" not in n and n != MANIFEST and not n.startswith(".")}
    if not files:
        raise BucketError(f"{adapter_dir} holds no files (or is not a folder): pass the folder "
                          "PEFT's save_pretrained wrote")
    prefix, latest = f"adapters/v{version:06d}/", latest_version(b)
    exists = b.read(prefix + MANIFEST) is not None
    if exists or (latest is not None and version <= latest):
        what = "already exists" if exists else "is not newer"
        raise BucketError(f"{b.url}: adapter v{version:06d} {what} (LATEST is {latest}): versions "
                          f"are immutable, publish {(latest or 0) + 1} or later")
    # The order is the protocol: a reader trusts a version only once its manifest lists every
    # file, and finds it only through LATEST, written last.
    for name, data in files.items():
        b.write(prefix + name, data)
    manifest = {**meta, "version": version, "created": time.time(),
                "files": {n: _entry(d) for n, d in files.items()}}
    b.write(prefix + MANIFEST, json.dumps(manifest, indent=1).encode())
    b.write(LATEST, json.dumps({"version": version}).encode())
    for old in versions(b)[:-max(1, keep)] if keep is not None else []:
        b.delete(f"adapters/v{old:06d}/{MANIFEST}")  # first: readers then see it as incomplete
        for key in b.list(f"adapters/v{old:06d}/"):
            b.delete(key)
    if isinstance(b, DirBucket):  # S3 writes are whole objects: no temp files
        b.prune_temp()
    return manifest


def latest_version(bucket):
    """The version adapters/LATEST names; None when nothing was published (or LATEST is torn on a
    mount); BucketError when it holds anything but {"version": N} with an int N >= 0."""
    b = _open(bucket)
    try:
        value = json.loads(raw := b.read(LATEST))
    except (ValueError, TypeError):  # TypeError: json.loads(None), no LATEST
        return None
    if not (isinstance(value, dict) and type(version := value.get("version")) is int
            and 0 <= version < MAX_VERSION):
        raise BucketError(f"{b.url}: {LATEST} holds {raw[:100]!r}, not {{\"version\": N}} with an "
                          "int 0 <= N < 2^31 as trainer.py writes it: delete it (the trainer's "
                          "next publish writes it again)")
    return version


def versions(bucket):
    """Sorted adapter versions that have at least one key in the bucket (complete or not);
    BucketError for a folder numbered 2^31 or more (a number trainer.py never publishes)."""
    b = _open(bucket)
    found = sorted({int(m.group(1)) for k in b.list("adapters/v")
                    if (m := VERSION_KEY.match(k))})
    if found and found[-1] >= MAX_VERSION:
        raise BucketError(f"{b.url}: adapters/v{found[-1]:06d}/ is numbered past the versions' "
                          f"limit 2^31 - 1: not written by trainer.py; delete that folder")
    return found


def pull_adapter(bucket, version, dest_dir, timeout=60.0):
    """dest_dir/v{version:06d} once every file matches the manifest (retrying up to timeout s,
    then BucketError naming bucket, version and file). A verified local copy costs no transfer."""
    b, name, dest_dir = _open(bucket), f"v{version:06d}", os.fspath(dest_dir)
    dest = os.path.join(dest_dir, name)
    if _verified_local(dest):
        return dest
    files = _fetch_verified(b, f"adapters/{name}/", timeout, f"adapter {name}")
    os.makedirs(dest_dir, exist_ok=True)
    if os.path.exists(dest) and not os.path.exists(os.path.join(dest, PULLED)):
        raise BucketError(f"{dest} exists and was not made by sync.py (no {PULLED} in it): move it "
                          f"away, or pull into another folder than {dest_dir}")
    tmp = tempfile.mkdtemp(prefix=f".{name}.", dir=dest_dir)
    try:
        for fname, data in {**files, PULLED: b""}.items():
            DirBucket(tmp).write(fname, data)
        if os.path.exists(dest) and not _verified_local(dest):
            shutil.rmtree(dest, ignore_errors=True)  # ours (marked), but torn or changed since
        try:
            os.rename(tmp, dest)  # the whole folder at once: nobody sees half of it
        except OSError:  # another thread or process got there first
            if not _verified_local(dest):
                raise BucketError(f"could not put adapter {name} into {dest}: remove that "
                                  "folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # left only by a failed pull (a full disk): not kept
    return dest


# ---- SUPPORT: the verified fetch (it waits out a mount's lag), the replica's cache of pulls
# (AdapterCache), then the command line

def _fetch_verified(b, prefix, timeout, what):
    """_try_fetch, retried with backoff (50 ms .. 2 s) until all matches or timeout seconds passed.
    CorruptAdapter when the last look found other bytes than the manifest's, else BucketError."""
    deadline, delay = time.monotonic() + timeout, 0.05
    files, problem, corrupt = _try_fetch(b, prefix)
    # the backoff of Bucket._retrying: a mount catching up shows the files within seconds
    while files is None and (left := deadline - time.monotonic()) > 0:
        if delay == 0.05:  # one line per wait, on the role's stderr
            print(f"sync.py: {b.url}: waiting for {what}: {problem}", file=sys.stderr, flush=True)
        time.sleep(min(delay, left))
        delay = min(2 * delay, 2.0)
        files, problem, corrupt = _try_fetch(b, prefix)
    if corrupt:
        raise CorruptAdapter(f"{b.url}: {what} is corrupt: {problem}; its writer (or someone with "
                             "write access to the bucket) changed it after its manifest: the next "
                             "version replaces it")
    if files is None:
        raise BucketError(f"{b.url}: {what} is not complete after {timeout:g}s: {problem}; check "
                          f"that the writer finished (python sync.py ls {b.url}) and was not "
                          "pruned, or raise the timeout")
    return files


def _try_fetch(b, prefix):
    """One look at prefix + manifest.json and every file it lists: ({name: bytes} with the
    manifest, None, False) when all match, else (None, what is wrong, e.g. "KEY is missing",
    corrupt: True when a file has as many bytes as listed or more, yet other ones: no lag does
    it)."""
    raw = b.read(prefix + MANIFEST)
    try:  # json.loads(None) is a TypeError: a missing manifest lands here too
        entries = {n: {"sha256": e["sha256"], "bytes": e["bytes"]}
                   for n, e in json.loads(raw)["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):  # missing, or torn on a mount
        why = "is missing" if raw is None else "is not a complete manifest"
        return None, f"{prefix}{MANIFEST} {why}", False
    files = {MANIFEST: raw}
    for name, entry in sorted(entries.items()):
        data = files[name] = b.read(prefix + _safe_name(f"{b.url}: {prefix}{MANIFEST}", name))
        if data is None:
            return None, f"{prefix}{name} is missing", False
        if _entry(data) != entry:
            # fewer bytes than listed: a mount still filling it in; as many or more: changed
            corrupt = not isinstance(entry["bytes"], int) or len(data) >= entry["bytes"]
            return None, (f"{prefix}{name} has {len(data)} bytes not matching the manifest "
                          f"({entry['bytes']} bytes, sha256)"), corrupt
    return files, None, False


def _verified_local(folder):
    """True when a local folder holds a manifest.json and every file it lists, bytes matching."""
    return _try_fetch(DirBucket(folder), "")[0] is not None



class AdapterCache:
    """Where a replica pulls adapters; os.fspath(cache) is the folder. A given folder (rollout.py
    --cache-dir) may hold anything else: only version folders this cache pulled are ever deleted.
    Without one, a temporary folder is made and removed whole by close(), at exit or on SIGTERM."""

    def __init__(self, folder=None, prefix="adapters-"):
        self.owned, self.pulled, self.failed = folder is None, set(), set()
        self.folder = tempfile.mkdtemp(prefix=prefix) if self.owned else os.path.abspath(folder)
        if self.owned:
            atexit.register(self.close)
            # SIGTERM -> SystemExit, so that atexit runs (only the main thread may set a handler)
            if threading.current_thread() is threading.main_thread() and \
                    signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))

    def __fspath__(self):
        return self.folder

    def pull(self, bucket, version, timeout=60.0):
        """pull_adapter into the folder. A version that failed to verify gets one more look, not
        another wait."""
        new = not os.path.exists(os.path.join(self.folder, f"v{version:06d}"))
        timeout = 0 if version in self.failed else timeout
        try:
            path = pull_adapter(bucket, version, self.folder, timeout=timeout)
        except BucketError:
            self.failed.add(version)
            raise
        self.pulled |= {path} if new else set()
        return path

    def keep_only(self, path):
        """Delete the version folders this cache pulled, all but path (loaded in the engine
        already)."""
        for old in self.pulled - {path}:
            shutil.rmtree(old, ignore_errors=True)
        self.pulled &= {path}

    def close(self):
        if self.owned:
            shutil.rmtree(self.folder, ignore_errors=True)


# ---- SUPPORT: the command line, python sync.py ls|pull|push|metrics (sync_support.main)

if __name__ == "__main__":
    main()
