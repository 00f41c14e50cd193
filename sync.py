"""sync.py — the only code that touches storage: versioned LoRA adapters, trainer state, metrics.

A bucket is a directory (also a mounted bucket, e.g. an HF Jobs volume at /bucket) or
s3://bucket/prefix through boto3 (AWS S3, R2, MinIO, HF Storage Buckets), set up by the standard
AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (HF: https://s3.hf.co/<namespace>).

    adapters/v{N:06d}/{adapter_config.json, adapter_model.safetensors, manifest.json}
    adapters/LATEST     {"version": N, "tag": T}, written only after all of v N and its manifest
    trainer/STATE       {"id": ID}: the resume state is trainer/ID/ (with its manifest.json)
    metrics/step-{S:06d}.json   one JSON object per trainer step S (a redone step replaces its own)

The hand-off of an adapter, in this file's order:
    1. publish  the trainer uploads v N's files, then its manifest (sha256 and size of each),
                then adapters/LATEST (publish_adapter)
    2. find     a replica reads adapters/LATEST, one small object (latest_version)
    3. pull     the replica downloads v N and hands it out only once every file matches the
                manifest, and with ADAPTER_KEY once the manifest carries the trainer's tag
                (pull_adapter; AdapterCache keeps a replica's pulls)
The dir and S3 backends, the verified fetch, the trainer state and the metrics:
support/buckets.py.

A mounted bucket is eventually consistent (a file can appear before its bytes, LATEST before the
files it names), so pull_adapter hands out a version only once every file matches manifest.json.
Whoever can write the bucket (replicas hold its keys) could plant anything: every name and number
read from it is checked, and a value that does not fit is a BucketError, never a path outside it;
each read is bounded (a size per key, the manifest's byte counts, JSON depth: support/buckets.py),
so an object too large or too deep is a BucketError too (Foreign), never a MemoryError.
Who wrote a version, support/adapter_tags.py: with ADAPTER_KEY (the trainer and the replicas),
each manifest and LATEST carry an HMAC tag ("tag"), and a replica refuses a version or a LATEST
without one (Untrusted); with TRAINER_STATE_KEY (the trainer alone), each manifest also carries
"trainer_tag" and "state_step" (the step of the newest resume state saved before it), so that the
trainer passes over a LATEST or version it did not publish, and refuses a resume state older than
its own newest. Without the keys nothing is tagged or checked. Manifest fields: version, created,
files ({name: {sha256, bytes}}), the trainer's base_model, step, state_step, and the tags.

    python sync.py ls runs/bucket                          # versions, sizes, ages, LATEST
    python sync.py push runs/bucket ./my-adapter --version 3
    python sync.py pull s3://my-bucket/run1 ./adapters     # newest -> ./adapters/v000003
    ADAPTER_KEY=... python sync.py pull ...                # checks (push: writes) the tags
    python sync.py metrics runs/bucket | tail -n 3         # the trainer's step records (JSON)
    python sync.py push-to-hub you/name --bucket runs/bucket  # the adapter + a card to the Hub
    python -m pytest tests/test_sync.py -q ; python bench/bench_sync.py
"""

import argparse
import atexit
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

# the backends (a directory, S3), the verified fetch, the trainer's resume state and metrics:
# support/buckets.py; with adapter_tags', not needed to follow a hand-off: what it asks of
# them holds in a directory and S3 (tests/test_sync.py::test_publish_pull_round_trip)
from support.buckets import (LATEST, MANIFEST, METRICS_KEY, RECORD_MAX_BYTES, BucketError,
                             DirBucket, Foreign, as_bucket, current_state_id, fetch_verified,
                             manifest_entry, open_bucket, parse_json, read_metrics, safe_name,
                             verified_local)
# who wrote a version: the tags under ADAPTER_KEY / TRAINER_STATE_KEY (support/adapter_tags.py)
from support.adapter_tags import (MAX_VERSION, Untrusted, adapter_key, check_adapter,
                                  check_latest, is_tagged, latest_record, manifest_there,
                                  own_latest_and_folder, read_latest, version_numbers, with_tags)
# the result on the Hub (sync.py push-to-hub): support/hub_push.py
from support.hub_push import add_arguments, push_from_args

PULLED = ".pulled-by-sync"  # the mark pull_adapter leaves in each folder it creates


# ---- ALGO, README's steps 9-10: publish a version (its files, its manifest, then LATEST); find
#           the newest; pull it, verified against its manifest (a replica keeps its pulls in
#           AdapterCache)

def publish_adapter(bucket, adapter_dir, version, keep=6, key=None, trainer_key=None, **meta):
    """Upload a PEFT folder to adapters/v{version:06d}/, then its manifest.json (+ meta such as
    step), then adapters/LATEST; then delete all but the newest `keep` versions up to this one
    (None keeps all). Returns the manifest. Versions are immutable: an existing one, or one not
    newer than LATEST, is refused. key (env ADAPTER_KEY) tags the manifest and LATEST for the
    replicas; trainer_key (env TRAINER_STATE_KEY) tags the manifest as the trainer's own, and then
    only its own LATEST and versions can refuse a publish: one it did not write is named on stderr
    and replaced, so a bucket writer cannot end the run."""
    b, src = as_bucket(bucket), DirBucket(adapter_dir)
    if not isinstance(version, int) or not 0 <= version < MAX_VERSION:
        raise BucketError(f"adapter version must be an int in [0, 2^31), got {version!r}")
    # the adapter's own files (a pulled copy also holds a manifest and the pull's mark)
    files = {safe_name(adapter_dir, n): src.read(n) for n in src.list()
             if "/" not in n and n != MANIFEST and not n.startswith(".")}
    if not files:
        raise BucketError(f"{adapter_dir} holds no files (or is not a folder): pass the folder "
                          "PEFT's save_pretrained wrote")
    prefix = f"adapters/v{version:06d}/"
    # what would refuse it: the version already there, a LATEST not older (with trainer_key, only
    # the trainer's own: support/adapter_tags.py)
    latest, exists = own_latest_and_folder(b, version, trainer_key) if trainer_key else (
        latest_version(b), manifest_there(b, prefix + MANIFEST))
    if exists or (latest is not None and version <= latest):
        what = "already exists" if exists else "is not newer"
        todo = f"publish {(latest or 0) + 1} or later" if (latest or 0) + 1 < MAX_VERSION else (
            f"no version can follow {latest} (versions are < 2^31), and trainer.py never writes "
            f"it: delete {b.url}/{LATEST} (with TRAINER_STATE_KEY the trainer replaces a LATEST "
            "it did not write)")
        raise BucketError(f"{b.url}: adapter v{version:06d} {what} (LATEST is {latest}): versions "
                          f"are immutable, {todo}")
    # The order is the protocol: a reader trusts a version only once its manifest lists every
    # file, and finds it only through LATEST, written last.
    for name, data in files.items():
        b.write(prefix + name, data)
    manifest = with_tags({**meta, "version": version, "created": time.time(),
                          "files": {n: manifest_entry(d) for n, d in files.items()}},
                         key, trainer_key)
    b.write(prefix + MANIFEST, json.dumps(manifest, indent=1).encode())
    b.write(LATEST, json.dumps(latest_record(version, key)).encode())
    # prune the versions below this one (a folder planted above it cannot push this one out)
    older = [v for v in version_numbers(b) if v < version]
    for old in older[:max(0, len(older) + 1 - max(1, keep))] if keep is not None else []:
        b.delete(f"adapters/v{old:06d}/{MANIFEST}")  # first: readers then see it as incomplete
        for stale in b.list(f"adapters/v{old:06d}/"):
            b.delete(stale)
    if isinstance(b, DirBucket):  # S3 writes are whole objects: no temp files
        b.prune_temp()
    return manifest


def latest_version(bucket, key=None):
    """The version adapters/LATEST names; None when nothing was published (or LATEST is torn on a
    mount); Foreign (a BucketError) when it holds anything but {"version": N, ...} with an int
    N >= 0 (or is larger or deeper than trainer.py writes it). With key (env ADAPTER_KEY):
    Untrusted unless it carries the trainer's tag, whatever it holds."""
    b = as_bucket(bucket)
    try:
        version, value = read_latest(b)  # support/adapter_tags.py: {"version": N, "tag": T}
    except Foreign as e:
        raise Untrusted(str(e)) if key else e from None
    if key and version is not None:
        check_latest(value, key, b.url)
    return version


def versions(bucket):
    """Sorted adapter versions that have at least one key in the bucket (complete or not);
    BucketError for a folder numbered 2^31 or more (a number trainer.py never publishes)."""
    b = as_bucket(bucket)
    found = version_numbers(b)
    if found and found[-1] >= MAX_VERSION:
        raise BucketError(f"{b.url}: adapters/v{found[-1]:06d}/ is numbered past the versions' "
                          f"limit 2^31 - 1: not written by trainer.py; delete that folder")
    return found


def pull_adapter(bucket, version, dest_dir, timeout=60.0, key=None):
    """dest_dir/v{version:06d} once every file matches the manifest (retrying up to timeout s,
    then BucketError naming bucket, version and file); with key (env ADAPTER_KEY), only if the
    manifest carries the trainer's tag for this version (else Untrusted). A verified local copy
    costs no transfer."""
    b, name, dest_dir = as_bucket(bucket), f"v{version:06d}", os.fspath(dest_dir)
    dest = os.path.join(dest_dir, name)
    if pulled_copy(dest, version, key):
        return dest
    # with a key, a version the trainer did not tag is refused before any of its files is read
    check = (lambda raw: check_adapter(raw, version, key, b.url)) if key else None
    files = fetch_verified(b, f"adapters/{name}/", timeout, f"adapter {name}", check)
    os.makedirs(dest_dir, exist_ok=True)
    if os.path.exists(dest) and not os.path.exists(os.path.join(dest, PULLED)):
        raise BucketError(f"{dest} exists and was not made by sync.py (no {PULLED} in it): move it "
                          f"away, or pull into another folder than {dest_dir}")
    tmp = tempfile.mkdtemp(prefix=f".{name}.", dir=dest_dir)
    try:
        for fname, data in {**files, PULLED: b""}.items():
            DirBucket(tmp).write(fname, data)
        if os.path.exists(dest) and not pulled_copy(dest, version, key):
            shutil.rmtree(dest, ignore_errors=True)  # ours (marked), but torn or changed since
        try:
            os.rename(tmp, dest)  # the whole folder at once: nobody sees half of it
        except OSError:  # another thread or process got there first
            if not pulled_copy(dest, version, key):
                raise BucketError(f"could not put adapter {name} into {dest}: remove that "
                                  "folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # left only by a failed pull (a full disk): not kept
    return dest


def pulled_copy(folder, version, key=None):
    """folder holds v{version}'s files matching its manifest, tagged by the trainer if there is a
    key."""
    if not verified_local(folder):
        return False
    with open(os.path.join(folder, MANIFEST), "rb") as f:
        return key is None or is_tagged(f.read(), version, key)


# ---- SUPPORT: the replica's cache of pulls (AdapterCache), then the command line

class AdapterCache:
    """Where a replica pulls adapters; os.fspath(cache) is the folder. A given folder (rollout.py
    --cache-dir) may hold anything else: only version folders this cache pulled are ever deleted.
    Without one, a temporary folder is made and removed whole by close(), at exit or on SIGTERM.
    key (env ADAPTER_KEY): each pull is refused unless the trainer tagged the version."""

    def __init__(self, folder=None, prefix="adapters-", key=None):
        self.owned, self.pulled, self.failed, self.key = folder is None, set(), set(), key
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
            path = pull_adapter(bucket, version, self.folder, timeout=timeout, key=self.key)
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


# ---- the command line: python sync.py ls|pull|push|metrics

def listing(bucket):
    """The table `python sync.py ls` prints."""
    b, now = as_bucket(bucket), time.time()
    try:
        latest = latest_version(b)
        named = "none" if latest is None else f"v{latest:06d}"
    except Foreign as e:  # listed, not refused: ls is how one finds what to delete
        latest, named = None, f"(not trainer.py's: {e})"
    lines = [f"{b.url}: LATEST = {named}",
             f"{'version':<9} {'files':>5} {'size':>10} {'age':>8} {'step':>6}"]
    for v in versions(b):
        mark, where = " <- LATEST" if v == latest else "", f"adapters/v{v:06d}/{MANIFEST}"
        try:  # None: no manifest yet
            m = parse_json(b.read(where, RECORD_MAX_BYTES), where)
            size = sum(f["bytes"] for f in m["files"].values()) / 1e6
            age = now - m.get("created", now)
            lines.append(f"v{v:06d}   {len(m['files']):>5} {size:>7.2f} MB {age:>7.0f}s "
                         f"{str(m.get('step', '-')):>6}{mark}")
        except (Foreign, KeyError, TypeError, AttributeError):
            lines.append(f"v{v:06d}   (incomplete: no readable manifest.json){mark}")
    steps = [k for k in b.list("metrics/") if METRICS_KEY.match(k)]
    try:
        state = current_state_id(b) or "none"
    except Foreign as e:
        state = f"(not trainer.py's: {e})"
    lines.append(f"trainer state: {state}; metrics records: {len(steps)}")
    return "\n".join(lines)


def pull_command(args, key):
    """python sync.py pull: the version asked for (default: LATEST's) into args.dest."""
    b = open_bucket(args.bucket)
    version = latest_version(b, key) if args.version is None else args.version
    if version is None:
        raise BucketError(f"{b.url} holds no adapter yet (no adapters/LATEST): publish one first "
                          "(python sync.py push BUCKET DIR --version 0)")
    print(pull_adapter(b, version, args.dest, timeout=args.timeout, key=key))


def push_command(args, key):
    """python sync.py push: a PEFT folder as version args.version."""
    m = publish_adapter(args.bucket, args.dir, args.version, keep=args.keep, key=key)
    size = sum(f["bytes"] for f in m["files"].values()) / 1e6
    print(f"published v{args.version:06d} ({len(m['files'])} files, {size:.2f} MB) to "
          f"{args.bucket}")


def metrics_command(args, key):
    """python sync.py metrics: one JSON line per step record."""
    for record in read_metrics(args.bucket):
        print(json.dumps(record))


def main(argv=None):
    """python sync.py ls|pull|push|metrics BUCKET ... Each subcommand's parser names the function
    that runs it (set_defaults(run=f), f(args, key)); a new one is a parser and a function."""
    p = argparse.ArgumentParser(description="Inspect and move LoRA adapters in a run's bucket.")
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list adapter versions with sizes, ages and LATEST")
    ls.set_defaults(run=lambda args, key: print(listing(args.bucket)))
    pull = sub.add_parser("pull", help="download and verify one adapter version")
    pull.set_defaults(run=pull_command)
    push = sub.add_parser("push", help="publish a PEFT adapter folder as a new version")
    push.set_defaults(run=push_command)
    metrics = sub.add_parser("metrics",
                             help="print the trainer's step records as JSON lines, oldest first")
    metrics.set_defaults(run=metrics_command)
    # the result on the Hub, as TRL's push_to_hub: support/hub_push.py (not needed for a hand-off)
    hub = sub.add_parser("push-to-hub", help="upload an adapter version with a model card to a "
                         "Hub model repository")
    add_arguments(hub)
    hub.set_defaults(run=push_from_args)
    for cmd in (ls, pull, push, metrics):
        cmd.add_argument("bucket", help="a directory or s3://bucket/prefix")
    pull.add_argument("dest", help="local folder; the adapter lands in DEST/v{N:06d}")
    pull.add_argument("--version", type=int, default=None, help="version to pull (default: LATEST)")
    pull.add_argument("--timeout", type=float, default=60.0,
                      help="seconds to keep retrying while the files do not match the manifest")
    push.add_argument("dir", help="folder with adapter_config.json and adapter_model.safetensors")
    push.add_argument("--version", type=int, required=True,
                      help="version number, newer than LATEST")
    push.add_argument("--keep", type=int, default=6,
                      help="newest versions kept; older ones are deleted")
    args = p.parse_args(argv)
    try:  # env ADAPTER_KEY: pull checks the trainer's tags, push writes them
        args.run(args, adapter_key())
    except BucketError as e:
        sys.exit(f"sync.py: error: {e}")


if __name__ == "__main__":
    main()
