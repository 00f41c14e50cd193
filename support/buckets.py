"""sync.py's storage underneath: the bucket backends (a directory, S3), the verified fetch, the
trainer's resume state, the metrics records. To follow an adapter's hand-off (sync.py), each
call's first docstring line says what it does with valid keys and files (tests/test_sync.py).

    python -m pytest tests/test_sync.py -q

A Bucket is the storage interface (read, write, list, delete of '/'-separated keys) that sync.py's
publish, find and pull go through: DirBucket for a local or mounted directory, S3Bucket for
s3://bucket/prefix; both ride out an outage once they worked (Bucket._retrying). The trainer's
resume state is saved as an adapter is published: its files, a manifest, then one small object
naming it (trainer/STATE). This module imports no role file.
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import time
import uuid

LATEST, STATE, MANIFEST = "adapters/LATEST", "trainer/STATE", "manifest.json"
METRICS_KEY = re.compile(r"^metrics/step-(\d{6,})\.json$")
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")  # one part of a file name from the bucket
# the temp files of DirBucket's writes of LATEST and metrics
TEMP_KEY = re.compile(r"^(adapters/\.LATEST|metrics/\.step-\d{6,}\.json)\.[0-9a-f]{8}\.tmp$")
TEMP_MAX_AGE_S = 600.0  # a temp file this old is a killed write's: publish_adapter deletes it
# The most a read takes of each key (Bucket.read's limit): trainer.py writes LATEST and STATE in
# under 200 bytes, a manifest or a metrics record in a few KB, each file the bytes its manifest
# lists; and JSON at most this deep (trainer.py's: 3). A bigger or deeper object is Foreign.
SMALL_MAX_BYTES, RECORD_MAX_BYTES, JSON_MAX_DEPTH = 64 << 10, 1 << 20, 16


class BucketError(Exception):
    """Something the user can fix; the message says what was wrong and what to set or do."""


class Foreign(BucketError):
    """An object trainer.py never writes: over its key's limit, too large to hold in memory,
    nested deeper than JSON_MAX_DEPTH, or not of the shape trainer.py gives it. Named and passed
    over like a planted one (a replica keeps serving; the trainer, with TRAINER_STATE_KEY,
    replaces it)."""


class CorruptAdapter(BucketError):
    """A file holds other bytes than its manifest lists (no lagging mount does: versions never
    change)."""


class _Outage(Exception):
    """A failure that may pass (endpoint unreachable, 5xx, a mount gone): retried, see
    Bucket.retry_s."""


def manifest_entry(data):
    """A file's line in a manifest: its sha256 and its size."""
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def parse_json(raw, where):
    """raw (bytes from the bucket, or None) parsed; None when it is None or not JSON (torn on a
    mount); Foreign when it nests deeper than JSON_MAX_DEPTH or does not fit in memory (no
    RecursionError or MemoryError reaches the caller)."""
    try:
        value = json.loads(raw)
    except (ValueError, TypeError):  # TypeError: json.loads(None), nothing there
        return None
    except (RecursionError, MemoryError) as e:
        raise Foreign(f"{where} cannot be parsed ({type(e).__name__}): not written by "
                      "trainer.py") from None
    level = [value]  # one level of the nesting per turn, without recursion
    for _ in range(JSON_MAX_DEPTH):
        level = [v for x in level if isinstance(x, (dict, list))
                 for v in (x.values() if isinstance(x, dict) else x)]
        if not level:
            return value
    raise Foreign(f"{where} nests JSON deeper than {JSON_MAX_DEPTH}: not written by trainer.py")


# ---- the trainer's resume state, and its metrics records

def save_trainer_state(bucket, local_dir):
    """The files under local_dir become the bucket's trainer state (trainer/ID/, trainer/STATE)
    (tests/test_sync.py::test_trainer_state_round_trip).
    Upload every file under local_dir to trainer/ID/ (+ manifest), switch trainer/STATE to ID,
    then delete older states: a crash at any point leaves the previous state loadable."""
    b, src = as_bucket(bucket), DirBucket(local_dir)
    files = {safe_name(local_dir, rel): src.read(rel) for rel in src.list()}
    if MANIFEST in files:
        raise BucketError(f"{local_dir}/{MANIFEST}: that name is reserved for sync.py's manifest")
    state_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]
    prefix = f"trainer/{state_id}/"
    for rel, data in files.items():
        b.write(prefix + rel, data)
    manifest = {"id": state_id, "created": time.time(),
                "files": {k: manifest_entry(v) for k, v in files.items()}}
    b.write(prefix + MANIFEST, json.dumps(manifest, indent=1).encode())
    b.write(STATE, json.dumps({"id": state_id}).encode())  # the switch: one small object
    for key in b.list("trainer/"):  # the previous state, and leftovers of crashed saves
        if key != STATE and not key.startswith(prefix):
            b.delete(key)


def current_state_id(b):
    """The ID trainer/STATE names (None when there is none); BucketError if it is torn or not an
    ID."""
    if (raw := b.read(STATE, SMALL_MAX_BYTES)) is None:
        return None
    with contextlib.suppress(KeyError, TypeError):
        state_id = parse_json(raw, f"{b.url}: {STATE}")["id"]
        if isinstance(state_id, str) and SAFE_NAME.fullmatch(state_id):
            return state_id
    raise Foreign(f"{b.url}: {STATE} holds {raw[:100]!r}, not {{\"id\": ID}} as "
                      "save_trainer_state writes it: put back the ID of a trainer/ID/ folder, or "
                      "delete it to start training afresh")


def load_trainer_state(bucket, dest_dir, timeout=60.0):
    """None in a bucket with no trainer state; else its files written into dest_dir: dest_dir."""
    b = as_bucket(bucket)
    if (state_id := current_state_id(b)) is None:
        return None
    files = fetch_verified(b, f"trainer/{state_id}/", timeout, f"trainer state {state_id}")
    os.makedirs(dest_dir, exist_ok=True)
    for rel, data in files.items():
        if rel != MANIFEST:
            DirBucket(dest_dir).write(rel, data)
    return dest_dir


def append_metrics(bucket, record):
    """Store one trainer step's record (a dict with an int "step") as metrics/step-{step:06d}.json;
    True once written. Nothing is read back and rewritten, so a bad read (a mount not caught up,
    S3 answering NoSuchKey) cannot lose history, and a step redone after a resume replaces its
    record instead of doubling it. A write that fails (after the bucket's retries) is one stderr
    line and False: a metrics record never ends the run."""
    step = record.get("step")
    if type(step) is not int or step < 0:
        raise BucketError(f"a metrics record needs an int \"step\" >= 0, got {step!r}")
    try:
        as_bucket(bucket).write(f"metrics/step-{step:06d}.json", json.dumps(record).encode())
    except BucketError as e:
        print(f"sync.py: step {step}'s metrics record not written, the run goes on: {e}",
              file=sys.stderr, flush=True)
        return False
    return True


def read_metrics(bucket):
    """Every step's record, oldest step first ([] when there is none; one torn on a mount, or
    one trainer.py did not write, Foreign, is skipped).
    One read per step (on S3 one GET each): for a report, not for a loop."""
    b, records = as_bucket(bucket), []
    steps = sorted((int(m.group(1)), k) for k in b.list("metrics/") if (m := METRICS_KEY.match(k)))
    for _, key in steps:
        with contextlib.suppress(Foreign):
            if isinstance(record := parse_json(b.read(key, RECORD_MAX_BYTES), key), dict):
                records.append(record)
    return records


# ---- the buckets: a directory (DirBucket) or S3 (S3Bucket), behind one interface (Bucket)

def open_bucket(url, retry_s=0.0):
    """A local path (also a mounted bucket) or s3://bucket/prefix -> Bucket (retry_s: see
    Bucket)."""
    url = os.fspath(url)
    if url.startswith("hf://"):
        raise BucketError(f"{url}: mount it (hf jobs run -v hf://buckets/USER/NAME:/bucket) and "
                          "pass /bucket, or use s3://NAME/prefix with "
                          "AWS_ENDPOINT_URL=https://s3.hf.co/USER")
    if not url or ("://" in url and not url.startswith("s3://")):
        raise BucketError(f"unsupported bucket {url!r}: pass a directory or s3://bucket/prefix")
    b = S3Bucket(url) if url.startswith("s3://") else DirBucket(url)
    b.retry_s = retry_s
    return b


def as_bucket(bucket):
    """The Bucket itself, or open_bucket of a path or URL."""
    return open_bucket(bucket) if isinstance(bucket, (str, os.PathLike)) else bucket


def safe_name(where, name):
    """name when each '/'-part is a plain file name (a NUL, .. or /etc/passwd is not); else
    BucketError."""
    if isinstance(name, str) and all(SAFE_NAME.fullmatch(part) for part in name.split("/")):
        return name
    raise BucketError(f"{where}: {name!r} is not a safe file name (each /-part: letters, digits, "
                      "_ . + -, not starting with a dot): rename or remove it")


class Bucket:
    """The storage interface: .url, read(key, limit=None) -> bytes | None, write(key, data: bytes),
    list(prefix) -> sorted keys starting with prefix, delete(key). Keys are '/'-separated. read
    takes at most `limit` bytes: an object larger, or too large for memory, is Foreign, found
    before its bytes are read.
    Once the bucket has worked, a failure that may pass (S3 unreachable or 5xx, a mount gone or
    read-only) is retried for up to retry_s seconds (open_bucket's argument; one stderr line as the
    outage starts, one as it ends), then BucketError. A bucket that never worked fails at once."""

    retry_s = 0.0

    def _too_large(self, key, size, limit):
        return Foreign(f"{self.url}: {key} holds {size} bytes, more than the {limit} bytes "
                       "trainer.py ever writes there (or than this machine's memory)")

    def _retrying(self, what, attempt, retry):
        try:
            return attempt()
        except _Outage as e:
            if not (retry and self.retry_s > 0):
                raise BucketError(str(e)) from None
            error, since, delay = e, time.monotonic(), 0.5
        print(f"sync.py: {what} failed, retrying for up to {self.retry_s:g} s: {error}",
              file=sys.stderr)
        while (left := since + self.retry_s - time.monotonic()) > 0:  # backoff 0.5 s .. 10 s
            time.sleep(min(delay, left))
            delay = min(2 * delay, 10.0)
            try:
                result = attempt()
            except _Outage as e:
                error = e
                continue
            print(f"sync.py: {what} done after {time.monotonic() - since:.1f} s of retries",
                  file=sys.stderr)
            return result
        raise BucketError(f"{error} (still failing after {self.retry_s:g} s of retries)")


class DirBucket(Bucket):
    """A local or mounted directory. write() is a temp file + os.replace: a reader sees the old
    bytes or the new, never half (a mount's upload is still eventually consistent: see above).
    Each folder on a key's way is opened with O_NOFOLLOW: a symlink planted in the bucket is a
    BucketError, never a way to read, write or delete outside it."""

    def __init__(self, root):
        self.url = os.path.abspath(os.path.expanduser(root))
        # the folder was there / a write succeeded: a later failure is an outage to ride out
        self.seen = self.written = False

    def _path(self, key):
        return os.path.join(self.url, *key.split("/"))

    def _open_at(self, fd, name, flags, key):
        """os.open(name, flags, dir_fd=fd), refusing a symlink with a BucketError that says so."""
        try:
            return os.open(name, flags | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        except OSError:
            # readlink works on a symlink only (else the open's own error stands)
            with contextlib.suppress(OSError):
                if os.readlink(name, dir_fd=fd):
                    raise BucketError(f"{self.url}: {key} goes through the symlink {name!r}; a "
                                      "directory bucket follows none (one could lead outside it): "
                                      "put the real file or folder there")
            raise

    @contextlib.contextmanager
    def _folder(self, key, create=False):
        """(fd of key's folder, key's file name), the folders opened one by one from the bucket's
        down."""
        *folders, name = key.split("/")
        if {"", ".", ".."} & {name, *folders}:
            raise BucketError(f"{self.url}: {key!r} is not a key (an empty, . or .. part)")
        fd = os.open(self.url, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i, folder in enumerate(folders, 1):
                if create:
                    with contextlib.suppress(FileExistsError):
                        self._clear(fd, folder, "/".join(folders[:i]), want=stat.S_ISDIR)
                        os.mkdir(folder, dir_fd=fd)
                fd, parent = self._open_at(fd, folder, os.O_RDONLY | os.O_DIRECTORY, key), fd
                os.close(parent)
            yield fd, name
        finally:
            os.close(fd)

    def read(self, key, limit=None):
        """The bytes of the file at key (None if there is none): Bucket.read (tests/test_sync.py's
        round trips)."""
        return self._retrying(f"read {key}", lambda: self._read(key, limit), self.seen)

    def _read(self, key, limit):
        try:
            with self._folder(key) as (fd, name):
                file = self._open_at(fd, name, os.O_RDONLY, key)
                if stat.S_ISDIR((info := os.fstat(file)).st_mode):  # planted, not a missing key:
                    os.close(file)  # a trainer/STATE gone would start the run afresh
                    raise Foreign(f"{self.url}: {key} is a folder, which sync.py never writes "
                                  "there")
                with open(file, "rb") as f:
                    if limit is not None and info.st_size > limit:  # a sparse 1 TiB: never read
                        raise self._too_large(key, info.st_size, limit)
                    try:  # at most limit + 1 bytes: a file growing meanwhile is caught too
                        data = f.read(-1 if limit is None else limit + 1)
                    except MemoryError:
                        raise self._too_large(key, info.st_size, limit) from None
                    if limit is not None and len(data) > limit:
                        raise self._too_large(key, len(data), limit)
        except (FileNotFoundError, NotADirectoryError):
            if os.path.isdir(self.url):
                self.seen = True
            elif self.seen:  # not an empty bucket: the folder was there (a mount that dropped)
                raise _Outage(f"{self.url}: the bucket folder is gone or not a folder any more; "
                              "bring the mount or folder back") from None
            return None
        except OSError as e:  # e.g. a FUSE mount that lost its connection
            raise _Outage(f"cannot read {self._path(key)}: {e.strerror}; check the mount") from None
        self.seen = True
        return data

    def write(self, key, data):
        """The file at key holds data, written whole (temp file + os.replace): Bucket.write."""
        self._retrying(f"write {key}", lambda: self._write(key, data), self.written)
        self.seen = self.written = True

    def _write(self, key, data):
        try:
            os.makedirs(self.url, exist_ok=True)
            with self._folder(key, create=True) as (fd, name):
                # one a kill leaves is listed, so pruned with its folder
                tmp = f".{name}.{uuid.uuid4().hex[:8]}.tmp"
                # O_TRUNC changes nothing for a new file; hf-mount refuses a create without it
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC
                try:
                    with open(self._open_at(fd, tmp, flags, key), "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    self._clear(fd, name, key)
                    os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
                except BaseException:  # a failed write leaves no temp file behind
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=fd)
                    raise
        except OSError as e:
            raise _Outage(f"cannot write {self._path(key)}: {e.strerror}; that folder must be "
                          "writable (mount a bucket read-write) and have free space") from None

    def _clear(self, fd, name, key, want=stat.S_ISREG):
        """Remove a folder planted where the file `key` goes, or a file where the folder `key`
        goes (want=stat.S_ISDIR): a write would fail on it at every try. Said on stderr. A folder's
        contents go with it, inside the bucket only (rmtree by descriptor follows no symlink; a
        symlink is left for _open_at to refuse)."""
        with contextlib.suppress(FileNotFoundError):
            mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode) or want(mode) or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                return
            shutil.rmtree(name, dir_fd=fd) if stat.S_ISDIR(mode) else os.unlink(name, dir_fd=fd)
            print(f"sync.py: {self.url}: {key} was a {'folder' if stat.S_ISDIR(mode) else 'file'}, "
                  "which sync.py never writes there: removed", file=sys.stderr, flush=True)

    def list(self, prefix=""):
        """The sorted keys of the files under the bucket that start with prefix: Bucket.list."""
        folders, keys = prefix.split("/")[:-1], []  # walk only the deepest folder the prefix names
        deepest = "/".join([*folders, "-"])  # "-": a stand-in file name
        with contextlib.suppress(OSError), self._folder(deepest) as (fd, _):
            for folder, _, names, _ in os.fwalk(dir_fd=fd):  # never into a symlinked folder
                rel = "/".join(folders + ([] if folder == "." else [folder[2:]]))
                keys += [k for n in names if (k := f"{rel}/{n}" if rel else n).startswith(prefix)]
        return sorted(keys)

    def prune_temp(self, older_than=TEMP_MAX_AGE_S):
        """Delete the temp files of LATEST and metrics writes a kill cut short (older_than s
        old)."""
        for key in self.list("adapters/.") + self.list("metrics/."):
            with contextlib.suppress(OSError), self._folder(key) as (fd, name):
                age = time.time() - os.lstat(name, dir_fd=fd).st_mtime
                if TEMP_KEY.match(key) and age > older_than:
                    os.unlink(name, dir_fd=fd)

    def delete(self, key):
        """The file at key gone (none there: nothing), then its folders left empty."""
        with contextlib.suppress(OSError):
            with self._folder(key) as (fd, name):
                os.unlink(name, dir_fd=fd)
            path = self._path(key)
            # drop the folders left empty (the key was checked by _folder above)
            while (path := os.path.dirname(path)) != self.url:
                os.rmdir(path)


class S3Bucket(Bucket):
    """s3://bucket/prefix through boto3, which reads AWS_ENDPOINT_URL and the credentials itself."""

    def __init__(self, url):
        import boto3
        from botocore.config import Config

        self.name, _, prefix = url[len("s3://"):].partition("/")
        self.prefix, self.url = prefix.strip("/"), url.rstrip("/")
        if not self.name:
            raise BucketError(f"{url!r} names no bucket: write s3://BUCKET/PREFIX")
        session = boto3.session.Session()
        config = Config(  # what HF Storage Buckets need; AWS S3, R2 and MinIO accept it too
            s3={"addressing_style": "path"},  # bucket in the path, not in the host name
            request_checksum_calculation="when_required",  # no trailing CRC checksums on PUT
            response_checksum_validation="when_required",
            retries={"mode": "standard", "max_attempts": 3}, connect_timeout=5, read_timeout=60)
        region = session.region_name or "us-east-1"
        self.client = session.client("s3", region_name=region, config=config)
        self.endpoint = self.client.meta.endpoint_url
        # once a request succeeded, unreachable / 5xx is an outage to ride out
        self.answered = False

    def _key(self, key):
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what, fn):
        return self._retrying(what, lambda: self._call_once(what, fn), self.answered)

    def _call_once(self, what, fn):
        """One S3 request; botocore's errors become a BucketError saying what to set (or an
        _Outage)."""
        from botocore import exceptions as bx

        outage = False
        try:
            result = fn()
            self.answered = True
            return result
        except (bx.NoCredentialsError, bx.PartialCredentialsError):
            msg = ("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (for HF "
                   "Storage Buckets: the S3 key pair generated from your HF token)")
        except (bx.ConnectionError, bx.HTTPClientError) as e:
            outage = True
            msg = (f"cannot reach the S3 endpoint {self.endpoint} ({type(e).__name__}): set "
                   "AWS_ENDPOINT_URL to your store (https://s3.hf.co/<namespace> for HF Storage "
                   "Buckets; unset for AWS S3) and check the network")
        except bx.ParamValidationError as e:
            msg = f"bad S3 request: {e}"
        except bx.ClientError as e:
            code, text = e.response["Error"].get("Code", ""), e.response["Error"].get("Message", "")
            known = {"NoSuchBucket": f"bucket {self.name!r} does not exist at {self.endpoint}: "
                     "create it (hf buckets create / aws s3 mb) or fix the bucket name",
                     "PermanentRedirect": "the bucket lives in another region: set AWS_REGION"}
            msg = known.get(code, f"{what} failed: {code} {text}")
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                        "ExpiredToken", "InvalidToken", "AllAccessDisabled"):
                msg = (f"access denied ({code}) on {what}: check AWS_ACCESS_KEY_ID / "
                       "AWS_SECRET_ACCESS_KEY and that they may read (replicas) or write "
                       "(trainer) it")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            outage = status >= 500 or code in (
                "SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError")
        raise (_Outage if outage else BucketError)(f"{self.url}: {msg}")

    def read(self, key, limit=None):
        def get():
            try:
                obj = self.client.get_object(Bucket=self.name, Key=self._key(key))
            except self.client.exceptions.NoSuchKey:
                return None
            with contextlib.closing(obj["Body"]) as body:  # the size is known before the bytes
                if limit is not None and (size := obj["ContentLength"]) > limit:
                    raise self._too_large(key, size, limit)
                try:
                    return body.read()
                except MemoryError:
                    raise self._too_large(key, obj["ContentLength"], limit) from None
        return self._call(f"read {key}", get)

    def write(self, key, data):
        self._call(f"write {key}", lambda: self.client.put_object(
            Bucket=self.name, Key=self._key(key), Body=data))

    def list(self, prefix=""):
        full, skip = self._key(prefix), len(self.prefix) + 1 if self.prefix else 0

        def listing():  # ListObjectsV2: HF Storage Buckets do not support V1
            paginator = self.client.get_paginator("list_objects_v2")
            pages = paginator.paginate(Bucket=self.name, Prefix=full)
            return [o["Key"][skip:] for page in pages for o in page.get("Contents", [])]
        return sorted(self._call(f"list {prefix or '/'}", listing))

    def delete(self, key):
        self._call(f"delete {key}", lambda: self.client.delete_object(
            Bucket=self.name, Key=self._key(key)))


# ---- the verified fetch: a version (or a resume state) only once every file matches its
# manifest, waiting out a mount's lag

def fetch_verified(b, prefix, timeout, what, check=None):
    """{name: bytes} of the files at prefix, each matching its manifest's sha256 and size, retried
    with backoff (50 ms .. 2 s) until all match or timeout seconds passed (try_fetch).
    CorruptAdapter when the last look found other bytes than the manifest's, else BucketError.
    check(raw manifest) runs before any file is read (a replica's tag check: sync.pull_adapter)."""
    deadline, delay = time.monotonic() + timeout, 0.05
    files, problem, corrupt = try_fetch(b, prefix, check)
    # the backoff of Bucket._retrying: a mount catching up shows the files within seconds
    while files is None and (left := deadline - time.monotonic()) > 0:
        if delay == 0.05:  # one line per wait, on the role's stderr
            print(f"sync.py: {b.url}: waiting for {what}: {problem}", file=sys.stderr, flush=True)
        time.sleep(min(delay, left))
        delay = min(2 * delay, 2.0)
        files, problem, corrupt = try_fetch(b, prefix, check)
    if corrupt:
        raise CorruptAdapter(f"{b.url}: {what} is corrupt: {problem}; not what its writer wrote "
                             "(someone with write access to the bucket changed it?): the next "
                             "version replaces it")
    if files is None:
        raise BucketError(f"{b.url}: {what} is not complete after {timeout:g}s: {problem}; check "
                          f"that the writer finished (python sync.py ls {b.url}) and was not "
                          "pruned, or raise the timeout")
    return files


def try_fetch(b, prefix, check=None):
    """One look at prefix + manifest.json and every file it lists, each read only up to the size
    the manifest gives it: ({name: bytes} with the manifest, None, False) when all match, else
    (None, what is wrong, e.g. "KEY is missing", corrupt: True when a file has as many bytes as
    listed or more, yet other ones, or the manifest is Foreign: no lag does it). check: see
    fetch_verified."""
    where = f"{prefix}{MANIFEST}"
    try:
        raw = b.read(where, RECORD_MAX_BYTES)
        entries = {n: {"sha256": e["sha256"], "bytes": e["bytes"]}
                   for n, e in parse_json(raw, where)["files"].items()}
    except Foreign as e:
        return None, str(e), True
    except (KeyError, TypeError, AttributeError):  # missing (None), or torn on a mount
        why = "is missing" if raw is None else "is not a complete manifest"
        return None, f"{where} {why}", False
    if check:
        check(raw)
    files = {MANIFEST: raw}
    for name, entry in sorted(entries.items()):
        if type(size := entry["bytes"]) is not int or size < 0:
            return None, f"{where} lists {size!r} bytes for {name!r}, not an int >= 0", True
        try:
            data = files[name] = b.read(prefix + safe_name(f"{b.url}: {where}", name), size)
        except Foreign as e:  # more bytes than listed: not read
            return None, f"{prefix}{name} is not its manifest's: {e}", True
        if data is None:
            return None, f"{prefix}{name} is missing", False
        if manifest_entry(data) != entry:
            # fewer bytes than listed: a mount still filling it in; as many: changed
            return None, (f"{prefix}{name} has {len(data)} bytes not matching the manifest "
                          f"({size} bytes, sha256)"), len(data) >= size
    return files, None, False


def verified_local(folder):
    """True when a local folder holds a manifest.json and every file it lists, bytes matching."""
    return try_fetch(DirBucket(folder), "")[0] is not None
