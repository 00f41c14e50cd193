"""Who wrote an adapter: the HMAC tags sync.py puts on each version's manifest and on
adapters/LATEST, and how a restarted trainer tells the versions it published itself from the ones
a bucket writer planted. Without ADAPTER_KEY and TRAINER_STATE_KEY (jobs.sh --local) nothing is
tagged or checked; each call's first docstring line says what it returns.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_sync.py -q -k "tag or planted"

Two keys, each an HMAC-SHA256 key (any string), each tag a hex digest inside the object it tags:

    ADAPTER_KEY        held by the trainer and by every replica. The trainer tags each manifest
                       ("tag") and LATEST ("tag"); a replica with the key refuses a version or a
                       LATEST without a valid tag (Untrusted) and keeps serving the adapter in
                       hand. A replica holds the key, so a replica that can write the bucket can
                       forge a tag: the key stops a bucket writer without it, not a replica.
    TRAINER_STATE_KEY  held by the trainer alone (it tags the resume state with it too:
                       support/trainer_state.py). Each manifest carries "trainer_tag" under it, so
                       that a restarted trainer knows the versions it published itself
                       (own_versions): it passes over a LATEST or a version it did not write, and
                       refuses a resume state older than the newest one it had saved (each of its
                       manifests records that step, "state_step").

A manifest's tags are over its JSON without the tags (keys sorted, no spaces), LATEST's over the
text "adapters/LATEST N". Without a key nothing is tagged or checked, as before there were tags.
This module imports no role file.
"""

import hashlib
import hmac
import json
import os
import re
import sys

from support.buckets import (LATEST, MANIFEST, RECORD_MAX_BYTES, SMALL_MAX_BYTES, BucketError,
                             Foreign, parse_json)

ADAPTER_KEY = "ADAPTER_KEY"  # the environment variable: the trainer tags with it, replicas check
TAGS = ("tag", "trainer_tag")  # a manifest's tags: under ADAPTER_KEY, under TRAINER_STATE_KEY
VERSION_KEY = re.compile(r"^adapters/v(\d{6,})/")
MAX_VERSION = 2**31  # versions are < 2^31, as the proxy's


class Untrusted(BucketError):
    """A version or a LATEST without a valid tag under ADAPTER_KEY: not the trainer's. .version is
    the version it names (None when it names none)."""

    def __init__(self, message, version=None):
        super().__init__(message)
        self.version = version


def adapter_key():
    """ADAPTER_KEY from the environment, or None (then nothing is tagged or checked)."""
    return os.environ.get(ADAPTER_KEY) or None


# ---- the tags

def _mac(key, text):
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()


def manifest_tag(key, manifest):
    """The tag of a manifest (a dict) under key: over its JSON without its tags."""
    body = {k: v for k, v in manifest.items() if k not in TAGS}
    return _mac(key, "manifest " + json.dumps(body, sort_keys=True, separators=(",", ":")))


def with_tags(manifest, key=None, trainer_key=None):
    """The manifest with "tag" under key (ADAPTER_KEY) and "trainer_tag" under trainer_key
    (TRAINER_STATE_KEY), each only when that key is given."""
    tags = {field: manifest_tag(k, manifest) for field, k in zip(TAGS, (key, trainer_key)) if k}
    return {**manifest, **tags}


def latest_record(version, key=None):
    """What adapters/LATEST holds: {"version": N}, and with key its "tag"."""
    return {"version": version, **({"tag": _mac(key, f"{LATEST} {version}")} if key else {})}


def _has(value, field, tag):
    """value (anything parsed from JSON) holds field == tag, compared in constant time (as ASCII
    bytes: compare_digest raises TypeError on a str that is not ASCII, such as "é")."""
    got = value.get(field) if isinstance(value, dict) else None
    return isinstance(got, str) and got.isascii() and hmac.compare_digest(got.encode(),
                                                                          tag.encode())


def _tagged(manifest, version, field, key):
    """manifest (a parsed dict, or anything) is v{version}'s, with a valid `field` under key."""
    return isinstance(manifest, dict) and type(manifest.get("version")) is int \
        and manifest["version"] == version and _has(manifest, field, manifest_tag(key, manifest))


def _parsed(raw):
    """A manifest's bytes parsed, or None (nothing there, torn, or Foreign)."""
    try:
        return parse_json(raw, MANIFEST)
    except Foreign:
        return None


def is_tagged(raw, version, key):
    """The manifest raw (bytes) is v{version}'s with a valid tag under key (ADAPTER_KEY)."""
    return _tagged(_parsed(raw), version, "tag", key)


def check_adapter(raw, version, key, where):
    """Untrusted unless the manifest raw (bytes) is v{version}'s and carries a valid tag under
    key (ADAPTER_KEY)."""
    if is_tagged(raw, version, key):
        return
    manifest = _parsed(raw)
    named = manifest.get("version") if isinstance(manifest, dict) else None
    why = ("has no tag" if not isinstance(manifest, dict) or "tag" not in manifest else
           f"is v{named}'s" if named != version else "has a wrong tag")
    raise Untrusted(f"{where}: adapter v{version:06d}'s manifest {why} under ADAPTER_KEY: the "
                    "trainer did not publish it (planted by someone who can write the bucket?), "
                    "or it runs without ADAPTER_KEY or with another one: give the trainer and "
                    "every replica the same ADAPTER_KEY", version)


def check_latest(value, key, where):
    """Untrusted unless LATEST's object carries the trainer's tag under key (ADAPTER_KEY)."""
    if not _has(value, "tag", latest_record(value["version"], key)["tag"]):
        raise Untrusted(f"{where}: {LATEST} names v{value['version']} without a valid tag under "
                        "ADAPTER_KEY: passed over. Planted (the trainer's next publish replaces "
                        "it), or the trainer runs without ADAPTER_KEY or with another one",
                        value["version"])


# ---- reading the numbers: LATEST, the version folders

def read_latest(b):
    """(N, LATEST's object) when adapters/LATEST is {"version": N, ...}; (None, None) when there
    is none (or it is torn on a mount); Foreign for anything else (N outside [0, 2^31), more
    than SMALL_MAX_BYTES, JSON too deep)."""
    raw = b.read(LATEST, SMALL_MAX_BYTES)
    if (value := parse_json(raw, f"{b.url}: {LATEST}")) is None:
        return None, None
    if not (isinstance(value, dict) and type(version := value.get("version")) is int
            and 0 <= version < MAX_VERSION):
        raise Foreign(f"{b.url}: {LATEST} holds {raw[:100]!r}, not {{\"version\": N}} with an "
                          "int 0 <= N < 2^31 as trainer.py writes it: delete it (the trainer's "
                          "next publish writes it again)")
    return version, value


def version_numbers(b):
    """Sorted numbers of the adapters/vN/ folders, complete or not, whatever N."""
    return sorted({int(m.group(1)) for k in b.list("adapters/v") if (m := VERSION_KEY.match(k))})


def manifest_there(b, key):
    """Whether the bucket holds something at the manifest key (read up to a manifest's limit)."""
    try:
        return b.read(key, RECORD_MAX_BYTES) is not None
    except Foreign:
        return True


# ---- the trainer's own versions (TRAINER_STATE_KEY)

def own_manifest(b, version, key):
    """v{version}'s manifest (a dict) when it carries this trainer's tag under key
    (TRAINER_STATE_KEY), else None."""
    try:
        manifest = _parsed(b.read(f"adapters/v{version:06d}/{MANIFEST}", RECORD_MAX_BYTES))
    except Foreign:  # larger than any manifest trainer.py writes
        return None
    return manifest if _tagged(manifest, version, "trainer_tag", key) else None


def own_versions(b, key):
    """{version: manifest} of the versions this trainer published itself (its tag under key,
    TRAINER_STATE_KEY): one read per version folder."""
    found = {v: own_manifest(b, v, key) for v in version_numbers(b) if v < MAX_VERSION}
    return {v: m for v, m in found.items() if m is not None}


def own_latest_and_folder(b, version, key):
    """(LATEST, whether v{version} is there) for a publish of version, counting only what this
    trainer wrote (its tag under key, TRAINER_STATE_KEY): a LATEST at or past version, or a
    manifest at version, that it did not write is named on stderr and counts as absent (that
    folder is emptied, so that the publish writes it whole). A bucket writer cannot stop it."""
    try:
        latest = read_latest(b)[0]
        foreign = latest is not None and latest >= version and not own_manifest(b, latest, key)
    except Foreign:  # not even {"version": N}, too large or too deep
        latest, foreign = None, True
    if foreign:
        print(f"trainer: {b.url}: {LATEST} names {'nothing valid' if latest is None else latest}"
              ", not a version this trainer published (none tagged under TRAINER_STATE_KEY): "
              f"replaced by v{version}", file=sys.stderr, flush=True)
        latest = None
    prefix = f"adapters/v{version:06d}/"
    there = manifest_there(b, prefix + MANIFEST)
    if there and not own_manifest(b, version, key):
        print(f"trainer: {b.url}: {prefix} holds a manifest this trainer did not write (none "
              "tagged under TRAINER_STATE_KEY): replaced", file=sys.stderr, flush=True)
        for old in b.list(prefix):
            b.delete(old)
        there = False
    return latest, there
