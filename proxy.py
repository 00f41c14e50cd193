"""proxy.py — the hub of an async GRPO run, on the standard library: the run's contract, the
rollout buffer, the trainer's version, the generation quota and the end of the run.

The proxy's part of a GRPO step, in this file's order (the state, all of it in RolloutBuffer):
    1. the contract   the settings every role shares (CONTRACT), served by GET /config
    2. the record     a group: one prompt, its G completions, their log-probs and rewards
                      (GROUP and COMPLETION; make_group builds one)
    3. the buffer     replicas POST groups (RolloutBuffer.add); the trainer takes B per step,
                      oldest first (RolloutBuffer.take, GET /batch)
    4. the handshake  the trainer announces each adapter version (set_version, POST /version);
                      each replica asks how many groups to make (quota, GET /quota)
Below the SUPPORT line: validation, credentials, the HTTP routes, serve(), the client, the CLI.

    any token (the trainer's or a replica's):
    GET  /config    the contract (G, groups per step, max staleness, temperature, ...)
    GET  /quota     a replica: how many groups to make now (long poll)
    POST /rollouts  a replica: scored groups
    GET  /stats     counters
    the trainer's token only:
    GET  /batch     the trainer: usable groups, oldest first (long poll)
    POST /version   the trainer: its version, after each adapter it publishes
    POST /done      the trainer: the run is over (/quota says so, then proxy.py exits)
    no token:
    GET  /healthz

A group more than --max-staleness versions behind the trainer is dropped and counted, never handed
out; so is a replica's group beyond what /quota leased it (over_quota). A /batch answer the trainer
does not acknowledge (?ack=, ProxyClient does) comes back to the buffer. Fields and status codes:
docs/protocol.md; hostile peers: docs/hostile-peers.md. ProxyClient (rollout.py, trainer.py) needs
`requests`. Tokens travel as `X-Proxy-Token: <token>` (Authorization is left to a gateway such as
HF Jobs'). A replica's token is the shared ROLLOUT_TOKEN, or one bound to its worker name
(--print-replica-token).

    python proxy.py --port 8000 --num-generations 8 --groups-per-step 16 --max-staleness 4  # local
    # exposed: the trainer's token, and the replicas' token
    PROXY_TOKEN=t ROLLOUT_TOKEN=r python proxy.py --host 0.0.0.0 ...
    python -m pytest tests/test_proxy.py tests/test_proxy_fuzz.py -q; python bench/bench_proxy.py
"""

import argparse
import collections
import hashlib
import hmac
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time

import proxy_http  # the stdlib HTTP hardening: deadlines, bounded bodies, connection classes
from proxy_http import (MAX_POLL_S, RETRY_AFTER_S, ApiError, check, parse_json,  # noqa: F401
                        parse_query, query_int, query_seconds)

log = logging.getLogger("proxy")

MAX_NAME = 256          # characters in a group_id or a worker name
MAX_COMPLETIONS = 4096  # completions in one group
MAX_INT = 2**31         # token ids and versions lie in [0, 2^31)
MAX_ABS = 1e30          # |reward| below this; also rejects NaN and +-Infinity
MIN_LOGPROB = -1000.0   # a sampled token's log-prob lies in [this, 0] (fp32 cannot go below ~-104)
MAX_WORKERS = 1024      # per-worker counters kept; further workers are counted under "(other)"
# a measured replica's lease counts as coming for LEASE_SLACK x the time its own pace says, at
# least LEASE_FLOOR_S: a dead replica's groups go to the others half a lease after they were due
LEASE_SLACK, LEASE_FLOOR_S = 1.5, 0.5
# above max_staleness 0, a lease of a replica this much slower than the asker does not count as
# coming: the asker makes those groups too (RolloutBuffer._coming)
SLOWER = 1.5
# the `why` of a /quota answer of one group to a replica too slow to be leased: is it faster now?
PROBE = "a probe: one group, to measure this replica again"
# counted in total and per worker
WORKER_COUNTS = ("accepted", "duplicates", "dropped_stale", "delivered", "over_quota")
ROUTES = {"/rollouts": "POST", "/quota": "GET", "/config": "GET", "/stats": "GET",
          "/healthz": "GET", "/batch": "GET", "/version": "POST", "/done": "POST"}
# what the replicas' token opens
REPLICA_PATHS = {"/rollouts", "/quota", "/config", "/stats", "/healthz"}
# the proxy's credentials; Authorization belongs to a gateway (HF Jobs)
TOKEN_HEADER = "X-Proxy-Token"


class ProxyError(Exception):
    """An answer that retrying cannot fix (4xx but 429), or the client gave up. `answer`: the
    proxy's JSON."""

    def __init__(self, message, answer=None):
        super().__init__(message)
        self.answer = answer if isinstance(answer, dict) else {}


class ConfigError(ValueError):
    """A serve() setting that cannot work; the message says what to change."""


# ---- ALGO: the run's state. 1. the contract  2. the group record  3. the buffer
#           4. the version handshake (all of it under one lock, in RolloutBuffer)

# The settings every role must share (TRL's names), and their defaults. proxy.py takes them as
# flags; rollout.py and trainer.py read them from GET /config, so a run cannot disagree with itself.
CONTRACT = {"num_generations": 8, "groups_per_step": 16, "max_staleness": 4, "temperature": 1.0,
            "max_new_tokens": 256, "zero_variance": "keep", "max_prompt_length": 1024,
            "reward_range": [0.0, 1.0]}
CONTRACT_HELP = {
    "num_generations": "completions per prompt, G",
    "groups_per_step": "groups the trainer takes per optimizer step, B",
    "max_staleness": "a group of version v is usable while trainer_version - v <= this "
                     "(0: synchronous)",
    "temperature": "sampling temperature (the trainer divides its logits by it)",
    "max_new_tokens": "longest completion (the trainer's max_completion_length)",
    "zero_variance": "groups with equal rewards: keep (they count toward a step, as TRL) or drop "
                     "(DAPO)",
    "max_prompt_length": "longest prompt a group may carry, in tokens (TRL's old GRPOConfig name)",
    "reward_range": "LO HI: every reward lies in [LO, HI] (every task here scores 0 or 1)"}


# ---- ALGO, 2. the group record: the one definition of a group (make_group builds it, the
# proxy checks it field by field in validate_group, trainer.flatten_groups reads it)

# The JSON schema, one row per field: (test, what the value must be). Any other field is refused, so
# that a NaN cannot ride along. Each log-prob gets its own check in validate_group().
INDEX = (lambda v: type(v) is int and 0 <= v < MAX_INT,  # a token id or a version
         f"an integer in [0, {MAX_INT})")
FINITE = (lambda v: type(v) in (int, float) and -MAX_ABS < v < MAX_ABS,  # not a bool; NaN fails
          "a finite number")
NAME = (lambda v: type(v) is str and 0 < len(v) <= MAX_NAME,
        f"a string of 1 to {MAX_NAME} characters")
TEXT = (lambda v: type(v) is str, "a string")
TOKEN_IDS = (lambda v: type(v) is list and all(map(INDEX[0], v)),
             f"a list of token ids in [0, {MAX_INT})")
GROUP = {"group_id": NAME,  # unique: a group_id seen before is a retry
         "policy_version": INDEX,  # the adapter version that sampled it
         "worker": NAME,  # the replica's name (replica-{i})
         "prompt": TEXT, "prompt_ids": TOKEN_IDS,  # the chat-templated prompt, and its ids
         "temperature": (lambda v: FINITE[0](v) and v > 0, "a number > 0"),
         "max_new_tokens": (lambda v: INDEX[0](v) and v > 0, "an integer > 0"),
         "completions": (lambda v: type(v) is list and 0 < len(v) <= MAX_COMPLETIONS,
                         f"a list of 1 to {MAX_COMPLETIONS} completions")}  # G of COMPLETION
COMPLETION = {"ids": TOKEN_IDS,  # the sampled ids, up to and including the first EOS
              "logprobs": (lambda v: type(v) is list, "a list of numbers"),  # one per id, sampler's
              "reward": FINITE, "text": TEXT,
              "finish_reason": (lambda v: type(v) is str and 0 < len(v) <= 64,  # stop or length
                                "a string of 1 to 64 characters")}


def make_group(*, group_id, policy_version, worker, prompt, prompt_ids, temperature,
               max_new_tokens, completions):
    """A group record with exactly GROUP's fields: what a replica POSTs (rollout.Replica.batch)."""
    return {"group_id": group_id, "policy_version": policy_version, "worker": worker,
            "prompt": prompt, "prompt_ids": list(prompt_ids), "temperature": temperature,
            "max_new_tokens": max_new_tokens, "completions": completions}


def make_completion(*, ids, logprobs, reward, text, finish_reason):
    """One completion of a group, with exactly COMPLETION's fields."""
    return {"ids": list(ids), "logprobs": list(logprobs), "reward": reward, "text": text,
            "finish_reason": finish_reason}


# ---- ALGO, 3. and 4.: the buffer and the version handshake, under one lock

class Lease:
    """What /quota gave a replica: n groups still to come (0: asking), counted as coming until
    `until` (monotonic s), made with adapter `version`; `given` groups at `since`."""
    __slots__ = ("n", "until", "version", "since", "given")

    def __init__(self, n, until, version, since=0.0, given=0):
        self.n, self.until, self.version, self.since, self.given = n, until, version, since, given


class RolloutBuffer:
    """The run's state: a queue of usable groups (oldest adapter first) bounded in groups and
    bytes, the trainer's version and pace, the replicas' leases and paces. accepted = delivered +
    dropped_stale + dropped_zero_variance + buffered, always."""

    def __init__(self, contract=None, max_groups=4096, max_bytes=2**30, remember_ids=1_000_000,
                 lease_timeout=120.0):
        c = self.contract = dict(CONTRACT, **(contract or {}))
        lo, hi = c["reward_range"] = [float(x) for x in c["reward_range"]]
        works = {"num_generations": c["num_generations"] >= 2,
                 "groups_per_step": c["groups_per_step"] >= 1,
                 "max_staleness": c["max_staleness"] >= 0, "temperature": c["temperature"] > 0,
                 "max_new_tokens": c["max_new_tokens"] >= 1,
                 "zero_variance": c["zero_variance"] in ("keep", "drop"),
                 "max_prompt_length": c["max_prompt_length"] >= 1,
                 "reward_range": -MAX_ABS < lo < hi < MAX_ABS}
        for key in (k for k, ok in works.items() if not ok):
            raise ConfigError(f"--{key.replace('_', '-')} {c[key]!r} cannot work: need "
                              "num-generations >= 2, groups-per-step >= 1, max-staleness >= 0, "
                              "temperature > 0, max-new-tokens >= 1, zero-variance keep or drop, "
                              "max-prompt-length >= 1, reward-range LO < HI")
        self.max_groups, self.max_bytes, self.remember_ids = max_groups, max_bytes, remember_ids
        self.lease_timeout, self.cond = lease_timeout, threading.Condition()
        # the buffer, oldest first; nbytes: group_bytes() of the buffered groups
        self.groups, self.nbytes = collections.deque(), 0
        self.seen, self.seen_order = set(), collections.deque()  # the last `remember_ids` group_ids
        self.counts = dict.fromkeys(["received", *WORKER_COUNTS, "dropped_zero_variance",
                                     "refused_full", "returned", "rejected",
                                     "refused_connections", "closed_idle"], 0)
        self.workers = {}  # worker name -> its own WORKER_COUNTS
        self.trainer_version = None  # unknown until the trainer announces itself (POST /version)
        # when it announced that version (monotonic s); lately (moving averages): seconds per
        # version, and seconds from a version's announcement to its batch complete (its wait)
        self.version_at, self.step_s, self.fill_s = None, None, 0.0
        # groups delivered at the current trainer_version (a step may take them in parts)
        self.taken = 0
        self.done, self.closed, self.started = False, False, time.time()
        self.leases = {}  # worker -> Lease (n 0: asking)
        self.pace = {}  # worker -> seconds per group it delivered lately (moving average)
        # a replica too slow to be leased (_quota) is probed with one group this long after its
        # last delivery (seconds, doubled per probe), in case it got faster; and when
        self.probe_gap, self.delivered_at = {}, {}
        # for main(): who heard "done", and when the last request came
        self.told_done, self.last_request = set(), time.monotonic()
        # drop mode: did recent groups have unequal rewards?
        self.recent_usable = collections.deque(maxlen=128)
        # groups asked for by GET /batch calls blocked for lack of them (see stats())
        self.waiting = 0
        # trainer_version - policy_version of the delivered groups
        self.staleness = collections.Counter()
        self.unconfirmed, self.deliveries = {}, 0  # delivery id -> (groups, version): see take()

    # ---- ALGO, 3. the buffer: replicas add groups, the trainer takes them, oldest first

    def add(self, groups, limited=False):
        """Buffer the new, usable groups of a validated POST; 429 (nothing kept) when they don't
        fit. `limited` (a replica's credential): new groups beyond the sender's lease are counted,
        dropped."""
        if (size := sum(map(group_bytes, groups))) > self.max_bytes:
            raise ApiError(f"these groups take {size / 2**20:.3g} MB, more than --max-buffer-mb "
                           f"{self.max_bytes / 2**20:.3g}: send fewer per POST", 413)
        with self.cond:
            t = self.trainer_version
            # a group from the future: no adapter of the trainer made it
            ahead = next((g for g in groups if t is not None and g["policy_version"] > t), None)
            if ahead:
                v = ahead["policy_version"]
                raise ApiError(f"policy_version {v} is ahead of the trainer's version {t}: is this "
                               "replica reading another run's bucket?", 409)
            new, dups, ids = [], [], set()
            # a group_id seen before, or twice in this POST, is a retry: counted, not kept
            for g in groups:
                (dups if g["group_id"] in self.seen or g["group_id"] in ids else new).append(g)
                ids.add(g["group_id"])
            new, over = self._within_leases(new) if limited else (new, [])
            self.counts["received"] += len(groups)
            fresh, flat = [g for g in new if self._usable(g)], []
            # equal rewards carry no signal (DAPO's dynamic sampling)
            if self.contract["zero_variance"] == "drop":
                varied = [len({c["reward"] for c in g["completions"]}) > 1 for g in fresh]
                self.recent_usable.extend(varied)
                flat = [g for g, v in zip(fresh, varied) if not v]
                fresh = [g for g, v in zip(fresh, varied) if v]
            size = sum(map(group_bytes, fresh))
            too_many = len(self.groups) + len(fresh) > self.max_groups
            if too_many or self.nbytes + size > self.max_bytes:
                self.counts["refused_full"] += len(groups)
                mb, most_mb = self.nbytes / 2**20, self.max_bytes / 2**20
                raise ApiError(f"buffer full ({len(self.groups)} groups of --max-groups "
                               f"{self.max_groups}, {mb:.3g} MB of --max-buffer-mb "
                               f"{most_mb:.3g}); retry in {RETRY_AFTER_S} s", 429,
                               {"Retry-After": str(RETRY_AFTER_S)})
            self.seen.update(g["group_id"] for g in new)
            self.seen_order.extend(g["group_id"] for g in new)
            while len(self.seen_order) > self.remember_ids:
                self.seen.discard(self.seen_order.popleft())
            self._count("accepted", new)
            self._count("duplicates", dups)
            self._count("over_quota", over)
            self._count("dropped_stale", [g for g in new if not self._usable(g)])
            self.counts["dropped_zero_variance"] += len(flat)
            # a sender's lease shrinks as its groups arrive
            for g in (g for g in new if g["worker"] in self.leases):
                self._delivered(g["worker"])
            self._buffer(fresh)
            self.nbytes += size
            self.cond.notify_all()
            return {"accepted": len(new), "duplicates": len(dups),
                    "stale": len(new) - len(fresh) - len(flat), "zero_variance": len(flat),
                    "over_quota": len(over), "trainer_version": t}

    def take(self, n, timeout, gone=lambda: False, ack=None):
        """(groups, version, delivery): up to n usable groups, oldest first, waiting up to
        `timeout` s for n (no busy wait); none if `gone()`. With `ack` (the last delivery the client
        read, 0: none), the answer is a delivery held until confirmed: by the next take's ack or by
        set_version. One not confirmed then was never read (a trainer killed with it unread): back
        to the buffer."""
        with self.cond:
            # the client answers this by announcing its version again
            if self.trainer_version is None:
                raise ApiError("no trainer version yet: POST /version first (a restarted proxy "
                               "forgets it)", 409, payload={"need_version": True})
            if ack is not None:
                self.unconfirmed.pop(ack, None)
                # newest first: the oldest ends in front
                for d in sorted(self.unconfirmed, reverse=True):
                    self._give_back(*self.unconfirmed.pop(d))
            self.waiting += n  # seen by /stats while wait_for() has released the lock
            self.cond.wait_for(lambda: len(self.groups) >= n or self.done or self.closed, timeout)
            self.waiting -= n
            out = [] if gone() else [self.groups.popleft() for _ in range(min(n, len(self.groups)))]
            self._deliver(out, self.trainer_version)
            if self.taken >= self.contract["groups_per_step"] > self.taken - len(out):  # complete
                self.fill_s = (self.fill_s + time.monotonic() - self.version_at) / 2
            delivery = None
            if out and ack is not None:
                self.deliveries += 1
                delivery = self.deliveries
                self.unconfirmed[delivery] = (out, self.trainer_version)
            return out, self.trainer_version, delivery

    # ---- ALGO, 4. the version handshake: how a new adapter reaches the replicas
    #   a. trainer.publish writes the adapter's files, its manifest, then adapters/LATEST (sync.py)
    #   b. the trainer POSTs /version v: set_version drops the groups now too stale, wakes the polls
    #   c. each replica's GET /quota (quota) returns at once: v is past the adapter it holds
    #   d. rollout.Replica.step sees it, Replica.refresh reads LATEST, pulls v and hot-loads it
    #   e. its next /quota says it holds v: _quota leases it the groups of the steps v can serve

    def set_version(self, version):
        """The trainer is now at `version`: drop the groups that became stale."""
        with self.cond:
            if self.trainer_version is not None and version < self.trainer_version:
                raise ApiError(f"version {version} is lower than this proxy's trainer_version "
                               f"{self.trainer_version} (a trainer resumed from older state, or "
                               "another run's trainer? restart the proxy)", 409)
            # counted per trainer version
            self.taken = self.taken if version == self.trainer_version else 0
            if self.trainer_version is None or version > self.trainer_version:  # the trainer's pace
                now, t = time.monotonic(), self.trainer_version
                if t is not None:
                    sample = (now - self.version_at) / (version - t)
                    self.step_s = sample if self.step_s is None else (self.step_s + sample) / 2
                self.version_at = now
            self.trainer_version = version
            self.unconfirmed.clear()  # the trainer stepped on what it was handed: read, all of it
            self.cond.notify_all()
            return {"dropped": self._drop_stale(), "trainer_version": version}

    def quota(self, worker, version, most, timeout):
        """Long-poll: wait up to `timeout` s for a quota > 0, a newer adapter to load, or the end
        of the run."""
        with self.cond:
            # the leases are bounded: drop the expired ones
            if worker not in self.leases and len(self.leases) >= MAX_WORKERS:
                now = time.monotonic()
                self.leases = {w: lease for w, lease in self.leases.items() if lease.until > now}
                self.pace = {w: p for w, p in self.pace.items() if w in self.leases}
                self.probe_gap = {w: p for w, p in self.probe_gap.items() if w in self.leases}
                self.delivered_at = {w: p for w, p in self.delivered_at.items() if w in self.leases}
                if len(self.leases) >= MAX_WORKERS:
                    raise ApiError(f"worker: {MAX_WORKERS} other names hold leases; retry once one "
                                   "expires (--lease-timeout)", 429,
                                   {"Retry-After": str(RETRY_AFTER_S)})
            # A replica asks again once its last groups are out: its lease ends, but it asks.
            t0 = self.trainer_version
            until = time.monotonic() + timeout + self.lease_timeout
            self.leases[worker] = Lease(0, until, version)
            self.cond.notify_all()
            ready = lambda: (self.done or self.closed or self.trainer_version != t0  # noqa: E731
                             or (t0 is not None and version < t0)  # a newer adapter: at once
                             or self._quota(worker, version, most)[0] > 0)
            deadline = time.monotonic() + timeout
            while not ready() and (left := deadline - time.monotonic()) > 0:
                # another's lease may expire meanwhile: look again the moment it does
                now = time.monotonic()
                ends = [lease.until - now for lease in self.leases.values() if lease.until > now]
                self.cond.wait(min([left, *ends]))
            if self.done:
                self.told_done.add(worker)
                return {"groups": 0, "trainer_version": self.trainer_version, "state": "done",
                        "why": "the trainer is done: exit"}
            n, why = self._quota(worker, version, most)
            now = time.monotonic()
            if why == PROBE:  # the next probe twice as late; a replica leased again is no more
                self.probe_gap[worker] = 2 * self._probe_gap(worker)
            elif n:
                self.probe_gap.pop(worker, None)
            self.leases[worker] = Lease(n, self._expiry(worker, n, now), version, now, n)
            return {"groups": n, "trainer_version": self.trainer_version, "why": why,
                    "state": self.state()}

    def _quota(self, worker, version, most):
        """(groups, why) for a replica holding adapter `version`: how many groups to make now so
        that the trainer never waits and no group is older than it must be. The trainer at version
        t takes B groups per step; groups made now with v are used at trainer versions up to v + S,
        and are wanted only one step ahead (t + 1: the batch the trainer takes when its current step
        ends). So the proxy asks for the groups of steps t .. min(v + S, t + 1), less those this
        step already took, those buffered and those leased to other replicas. Each replica asking
        gets at most its share of a step (_shares: by its measured speed); a lease counts as coming
        until _expiry (its own pace). A replica the others do not wait for (_overtaken) gets only
        the groups it makes, even at LEASE_SLACK x its pace, before the trainer completes its
        batch at v + S, the last that can use them: a slow replica's work is not dropped as stale,
        but for a PROBE now and then (_probe_gap), in case it got faster."""
        c, t, now = self.contract, self.trainer_version, time.monotonic()
        S, B = c["max_staleness"], c["groups_per_step"]
        if t is None:
            return 0, "the trainer has not announced itself yet"
        if version < t - S:
            return 0, (f"v{version} is more than max_staleness {S} behind the trainer's v{t}: load "
                       "a newer adapter")
        # the other replicas' live leases that will arrive in time: groups already coming
        others = [lease.n for w, lease in self.leases.items()
                  if self._coming(worker, w, lease, now)]
        leased, horizon = sum(n for n in others if n > 0), min(version + S, t + 1)
        lack = (horizon - t + 1) * B - self.taken - len(self.groups) - leased
        if lack <= 0:
            return 0, (f"the trainer has what it needs up to v{horizon} ({len(self.groups)} groups "
                       f"buffered, {leased} leased to other replicas)")
        # drop mode: only this share of the groups will be kept, so ask for more
        if c["zero_variance"] == "drop" and self.recent_usable:
            kept = sum(self.recent_usable) / len(self.recent_usable)
            lack = math.ceil(lack / max(0.05, kept))
        shares = self._shares(now, worker)
        n = min(most, lack, max(1, round(B * shares[worker])))
        if S > 0 and worker not in self.pace and len(shares) > 1:
            n = 1  # a new replica among others: one group to measure it on, nobody waits for it
        if self._overtaken(worker, now) and self.step_s and worker in self.pace:
            # the trainer completes its batch at v + S about then (at its pace since set_version)
            left = self.version_at + (version + S - t) * self.step_s + self.fill_s - now
            if (n := min(n, int(left / (LEASE_SLACK * self.pace[worker])))) < 1:  # even if late
                if now - self.delivered_at.get(worker, now) >= self._probe_gap(worker):
                    return 1, PROBE
                return 0, (f"at {self.pace[worker]:.3g} s per group, a group made with v{version} "
                           f"would arrive after the trainer's v{version + S} took its last batch "
                           f"(max_staleness {S}, {self.step_s:.3g} s per step): wait for the next")
        return n, None

    def _probe_gap(self, worker):
        return self.probe_gap.get(worker, 8 * self.step_s)  # first: 8 of the trainer's steps

    def _coming(self, worker, w, lease, now):
        """Does replica w's lease count as coming when `worker` asks? Live, and (above
        max_staleness 0) from a replica known to keep up with the asker: otherwise the asker makes
        those groups as well, and w's arrive on top, used while fresh. So a slow or new replica's
        share is never what the trainer waits for; at max_staleness 0 the step takes exactly B,
        and every lease counts."""
        return w != worker and lease.until > now and not self._slower(w, worker)

    def _slower(self, w, than):
        """Above max_staleness 0: is replica w not known to keep up with replica `than`, being
        unmeasured or, measured, SLOWER x the pace of `than`?"""
        theirs, mine = self.pace.get(w), self.pace.get(than)
        return self.contract["max_staleness"] > 0 and (
            theirs is None or (mine is not None and theirs > SLOWER * mine))

    def _overtaken(self, worker, now):
        """Does a live replica not count `worker`'s leases as coming (_coming)? Then the trainer
        never waits for its groups: they are used only if they arrive in time."""
        return any(self._slower(worker, w) for w, lease in self.leases.items()
                   if w != worker and lease.until > now)

    def _shares(self, now, asking=None):
        """{worker: the fraction of a step it may make} for the replicas with live leases, from
        their measured speed (groups per second). At max_staleness 0 the step waits for every
        lease: a replica's speed over their sum, so that all finish together. Above, the trainer
        waits for no lease in particular: the fastest replica takes a whole step (as a batching
        engine likes it), the others the part their speed makes in the same time, so a slow one
        holds back little. Unmeasured: one group to measure itself on once others are measured;
        equal shares before."""
        live = {w for w, lease in self.leases.items() if lease.until > now} | ({asking} - {None})
        speed = {w: 1 / max(self.pace[w], 1e-6) for w in live if w in self.pace}
        if not speed:
            return dict.fromkeys(live, 1 / max(1, len(live)))  # the first rounds
        unmeasured = len(live) - len(speed)
        if self.contract["max_staleness"] == 0:
            whole = sum(speed.values()) * (1 + unmeasured / len(speed))  # unmeasured: the mean
        else:
            whole = max(speed.values())
        return {w: speed.get(w, 0.0) / whole for w in live}

    def _expiry(self, worker, n, now):
        """When a lease of n groups stops counting as coming: LEASE_SLACK x the time the replica's
        own pace says n groups take, at least LEASE_FLOOR_S; --lease-timeout until its pace is
        measured. A replica that is only late still delivers: its groups are within its lease
        (_within_leases counts groups, not time), used while fresh."""
        if worker not in self.pace or n == 0:
            return now + self.lease_timeout
        most = max(LEASE_FLOOR_S, LEASE_SLACK * n * self.pace[worker])
        return now + min(self.lease_timeout, most)

    def _delivered(self, worker):
        """One group of `worker`'s lease arrived; its last one measures the replica's pace."""
        lease = self.leases[worker]
        lease.n -= 1
        if lease.n == 0 and lease.given > 0:  # seconds per group, from the lease to its last group
            now = time.monotonic()
            sample = (now - lease.since) / lease.given
            # a probe's measure replaces the one that stopped the leases
            old = self.pace.get(worker, sample) if worker not in self.probe_gap else sample
            self.pace[worker], self.delivered_at[worker] = (old + sample) / 2, now

    # ---- SUPPORT: the buffer's bookkeeping, the end of the run, counters

    def _usable(self, g):
        t = self.trainer_version
        return t is None or 0 <= t - g["policy_version"] <= self.contract["max_staleness"]

    def _buffer(self, groups):
        """Into the buffer in adapter order, oldest first (arrival order within a version): a slow
        replica's groups, made with an older adapter, are taken before they turn stale."""
        for g in groups:
            i = len(self.groups)
            while i and self.groups[i - 1]["policy_version"] > g["policy_version"]:
                i -= 1
            self.groups.insert(i, g)

    def _count(self, key, groups, sign=1):  # in total and for each group's worker
        self.counts[key] += sign * len(groups)
        for g in groups:
            known = g["worker"] in self.workers or len(self.workers) < MAX_WORKERS
            name = g["worker"] if known else "(other)"
            self.workers.setdefault(name, dict.fromkeys(WORKER_COUNTS, 0))[key] += sign

    def _within_leases(self, new):
        """(kept, over): a replica's new groups up to what /quota leased to it, in order; the rest
        are over. A group older than the adapter its worker said it held at /quota is refused
        (409)."""
        left, kept, over = {}, [], []
        for g in new:
            w, v = g["worker"], g["policy_version"]
            n, held = (lease.n, lease.version) if (lease := self.leases.get(w)) else (0, 0)
            if v < held:
                raise ApiError(f"policy_version {v} of group {g['group_id'][:80]!r} is older than "
                               f"v{held}, the adapter {w[:80]!r} said it held at GET /quota", 409)
            left[w] = left.get(w, n) - 1
            (kept if left[w] >= 0 else over).append(g)
        return kept, over

    def give_back(self, groups, version, delivery=None):
        """Groups whose GET /batch answer could not be written (the client left): back to the
        front."""
        with self.cond:
            self.unconfirmed.pop(delivery, None)
            self._give_back(groups, version)

    def _give_back(self, groups, version):
        self._deliver(groups, version, -1)
        self.counts["returned"] += len(groups)
        self.groups.extendleft(reversed(groups))
        self._drop_stale()  # if the trainer moved on meanwhile

    def _deliver(self, groups, version, sign=1):  # sign -1: given back
        self.nbytes -= sign * sum(map(group_bytes, groups))
        self._count("delivered", groups, sign)
        self.taken += sign * len(groups) if version == self.trainer_version else 0
        for g in groups:
            self.staleness[version - g["policy_version"]] += sign
        self.cond.notify_all()  # a replica waiting for a quota may now have one

    def _drop_stale(self):
        stale = [g for g in self.groups if not self._usable(g)]
        self.groups = collections.deque(g for g in self.groups if self._usable(g))
        self.nbytes -= sum(map(group_bytes, stale))
        self._count("dropped_stale", stale)
        return len(stale)

    def finish(self):
        """The trainer is done: /quota answers "done" from now on."""
        with self.cond:
            self.done = True
            self.cond.notify_all()
            return {"state": "done", "trainer_version": self.trainer_version}

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def count(self, key):
        with self.cond:
            self.counts[key] += 1

    def state(self):
        return "done" if self.done else "waiting" if self.trainer_version is None else "running"

    def stats(self):
        with self.cond:
            now = time.monotonic()
            staleness = {str(k): v for k, v in sorted(self.staleness.items()) if v}
            return {**self.counts, "buffered": len(self.groups),
                    "buffered_mb": round(self.nbytes / 2**20, 1),
                    # the groups a blocked trainer still lacks
                    "waiting": max(0, self.waiting - len(self.groups)),
                    "leased": {w: l.n for w, l in self.leases.items() if l.until > now and l.n > 0},
                    "replicas": {w: {"share": round(share, 3), "leased": max(0, self.leases[w].n),
                                     "groups_per_s": round(1 / self.pace[w], 3) if w in self.pace
                                     else None} for w, share in self._shares(now).items()},
                    "unconfirmed": sum(len(gs) for gs, _ in self.unconfirmed.values()),
                    "trainer_version": self.trainer_version, "state": self.state(),
                    "max_groups": self.max_groups, "contract": self.contract,
                    "staleness": staleness,
                    "workers": {k: dict(v) for k, v in self.workers.items()},
                    "uptime_s": round(time.time() - self.started, 1)}


# ---- SUPPORT (validation, credentials, HTTP routes, serve, client, CLI): not needed to follow
# a step.



# ---- validation: pure functions, also used by bench/bench_proxy.py

def check_fields(d, where, schema):
    """Raise ApiError naming the first field of the JSON object `d` that `schema` does not allow."""
    check(type(d) is dict, where, "must be a JSON object")
    extra = set(d) - set(schema)
    check(not extra, where, f"unknown fields {sorted(extra)[:5]} (expected {sorted(schema)})")
    for key, (ok, what) in schema.items():
        check(key in d, f"{where}.{key}", "missing")
        check(ok(d[key]), f"{where}.{key}", f"must be {what}, got {type(d[key]).__name__}")


def validate_group(g, contract, where="group"):
    """Raise ApiError naming the first bad field of one group, or a setting that differs from the
    run's."""
    check_fields(g, where, GROUP)
    # a sampler at another temperature would bias every ratio
    for key in ("temperature", "max_new_tokens"):
        flag = "--" + key.replace("_", "-")
        check(g[key] == contract[key], f"{where}.{key}", f"{g[key]}, but this run samples with "
              f"{key} {contract[key]} (proxy.py {flag}): start rollout.py without {flag}, it takes "
              "the proxy's")
    n, G = len(g["completions"]), contract["num_generations"]
    check(n == G, f"{where}.completions", f"{n} completions, but this run has num_generations {G} "
           "(proxy.py --num-generations): start rollout.py without --num-generations")
    n, most = len(g["prompt_ids"]), contract["max_prompt_length"]
    check(0 < n <= most, f"{where}.prompt_ids", f"{n} ids, but a prompt has 1 to "
          f"max_prompt_length {most} (proxy.py --max-prompt-length)")
    lo, hi = contract["reward_range"]
    for j, c in enumerate(g["completions"]):
        check_fields(c, w := f"{where}.completions[{j}]", COMPLETION)
        lps, ids = c["logprobs"], c["ids"]
        check(ids, f"{w}.ids", "empty: a completion has at least one token (the EOS)")
        check(lo <= c["reward"] <= hi, f"{w}.reward", f"{c['reward']:g} is outside this run's "
              f"reward_range [{lo:g}, {hi:g}] (proxy.py --reward-range LO HI)")
        bad = next((i for i, x in enumerate(lps)
                    if type(x) not in (int, float) or not MIN_LOGPROB <= x <= 0), None)
        if bad is not None:
            raise ApiError(f"{w}.logprobs[{bad}]: must be a log-prob in [{MIN_LOGPROB:g}, 0], got "
                           f"{str(lps[bad])[:40]}")
        check(len(lps) == len(ids), f"{w}.logprobs",
              f"{len(lps)} log-probs for {len(ids)} ids (one per token)")
        most = g["max_new_tokens"]
        check(len(ids) <= most, f"{w}.ids", f"{len(ids)} tokens exceed max_new_tokens {most}")


def validate_rollouts(payload, max_groups, contract):
    """The groups of a POST /rollouts body, every one checked before anything is changed."""
    body = {"groups": (lambda v: type(v) is list and v != [], "a non-empty list")}
    check_fields(payload, "body", body)
    groups = payload["groups"]
    check(len(groups) <= max_groups, "groups",
          f"{len(groups)} in one POST exceed --max-groups {max_groups}")
    for i, g in enumerate(groups):
        validate_group(g, contract, f"groups[{i}]")
    return groups


def group_bytes(g):
    """About the memory a buffered group holds (within ~10% by tracemalloc): ~70 bytes per sampled
    token (an int and a float, with their list slots), 36 per prompt id, the text, ~700 per
    completion."""
    return (1000 + 36 * len(g["prompt_ids"]) + len(g["prompt"])
            + sum(700 + 70 * len(c["ids"]) + len(c["text"]) for c in g["completions"]))


# ---- credentials: the trainer's token, the replicas' secret R, a replica's name bound to R

def replica_token(secret, worker):
    """A replica's credential bound to its worker name: `worker:mac`, mac =
    HMAC-SHA256_R(worker)[:32]."""
    mac = hmac.new(secret.encode(), worker.encode(), hashlib.sha256).hexdigest()[:32]
    return f"{worker}:{mac}"


def replica_worker(secret, got):
    """What the credential `got` (bytes) opens under the replicas' secret: "" for R itself (any
    worker name), the bound worker name for replica_token(R, name), None for anything else."""
    if not secret:
        return None
    if hmac.compare_digest(got, secret.encode()):
        return ""
    worker = got.rpartition(b":")[0].decode("latin-1")
    want = replica_token(secret, worker).encode("latin-1", "replace")
    ok = NAME[0](worker) and hmac.compare_digest(got, want)
    return worker if ok else None


# ---- HTTP: the routes (the hardening a service on the internet needs: proxy_http.py)

class ProxyHandler(proxy_http.Handler):
    buffer, token, rollout_token = None, None, None  # serve() binds one server's own

    def _serve(self):
        method, (path, _, query) = self.command, self.path.partition("?")
        # a kept-alive connection to a closed server: hang up, the client reconnects
        if self.buffer.closed:
            self.close_connection = True
            return
        code, headers = 200, {}
        try:
            self._admit(method, path)
            payload = self._route(path, query)
        except ApiError as e:
            code, payload, headers = e.code, {"error": str(e), **e.payload}, e.headers
            self.close_connection |= code in (401, 503)  # no second try on the same connection
        except Exception:
            log.exception("proxy: internal error on %s %s", method, path[:80])
            code, payload = 500, {"error": "internal error (see the proxy's log)"}
        try:
            self.reply(code, payload, headers)
        except OSError:  # the client went away: the groups it did not get go back to the buffer
            self.close_connection = True
            if path == "/batch" and code == 200:
                self.buffer.give_back(payload["groups"], payload["trainer_version"],
                                      payload.get("delivery"))

    do_GET = do_POST = _serve  # every other method gets send_error(501), answered as a 405

    def _admit(self, method, path):
        """404, 405, then the token: the trainer's opens every path, the replicas' (if any)
        REPLICA_PATHS only."""
        if path not in ROUTES:
            raise ApiError(f"no endpoint {path[:80]!r}: proxy.py serves " +
                           ", ".join(f"{m} {p}" for p, m in ROUTES.items()), 404)
        if method != ROUTES[path]:
            raise ApiError(f"{method} {path} is not allowed", 405, {"Allow": ROUTES[path]})
        if path == "/healthz":
            return
        # compared in constant time
        got = self.headers.get(TOKEN_HEADER, "").encode("latin-1", "replace")
        trainer = not self.token or hmac.compare_digest(got, self.token.encode())
        # a replica's: "" when unbound, else its worker name
        self.bound = None if trainer else replica_worker(self.rollout_token, got)
        if not trainer and self.bound is None:
            raise ApiError(f"missing or wrong token: send '{TOKEN_HEADER}: <token>' (the trainer's "
                           "PROXY_TOKEN, or the replicas' ROLLOUT_TOKEN); Authorization is left to "
                           "a gateway", 401,
                           {"WWW-Authenticate": f'ProxyToken header="{TOKEN_HEADER}"'})
        # 503 when the replicas hold their share of connections
        self.server.authenticated(self.connection, "trainer" if trainer else "replica")
        if self.bound is not None and path not in REPLICA_PATHS:
            raise ApiError(f"{path} takes the trainer's token (PROXY_TOKEN); this is the replicas' "
                           "(--rollout-token, ROLLOUT_TOKEN): only the trainer drains /batch, sets "
                           "the version and ends the run", 403)
        # --linger counts quiet seconds from the last request of the run
        self.buffer.last_request = time.monotonic()

    def _check_worker(self, worker, where):
        """A bound credential speaks for its own worker name only."""
        if self.bound and worker != self.bound:
            raise ApiError(f"{where}: {worker[:80]!r}, but this credential is bound to worker "
                           f"{self.bound!r} (proxy.py --print-replica-token NAME makes one per "
                           "replica)", 403)

    def _route(self, path, query):
        b = self.buffer
        if path == "/rollouts":
            groups = validate_rollouts(self.read_json(), b.max_groups, b.contract)
            for i, g in enumerate(groups):
                self._check_worker(g["worker"], f"groups[{i}].worker")
            # a replica's credential: its groups count against its lease
            return b.add(groups, limited=self.bound is not None)
        if path == "/batch":
            q = parse_query(query, {"groups": None, "timeout": "0", "ack": ""})
            ack = query_int(q, "ack", 0, MAX_INT) if q["ack"] else None
            n = query_int(q, "groups", 1, b.max_groups)
            groups, version, delivery = b.take(n, query_seconds(q), self.peer_gone, ack)
            answer = {"groups": groups, "trainer_version": version}
            # a delivery number: the client acknowledges it with its next call
            return answer if delivery is None else {**answer, "delivery": delivery}
        if path == "/quota":
            spec = {"worker": None, "version": None, "max": str(MAX_COMPLETIONS), "timeout": "0"}
            q = parse_query(query, spec)
            check(NAME[0](q["worker"]), "worker", f"must be {NAME[1]}")
            self._check_worker(q["worker"], "worker")
            version = query_int(q, "version", 0, MAX_INT - 1)
            most = query_int(q, "max", 1, MAX_INT - 1)
            return b.quota(q["worker"], version, most, query_seconds(q))
        if path in ("/version", "/done"):
            body = self.read_json()
            check_fields(body, "body", {"version": INDEX} if path == "/version" else {})
            return b.set_version(body["version"]) if path == "/version" else b.finish()
        return b.contract if path == "/config" else b.stats() if path == "/stats" else {"ok": True}


class ProxyServer(proxy_http.Server):
    """proxy_http.Server with the run's buffer: closing it wakes the long polls; a log line a
    minute."""

    def __init__(self, address, handler, max_connections=256, log_every=60.0):
        self.buffer = handler.buffer
        self.log_every, self._last_log = log_every, time.monotonic()
        self._logged = self.buffer.stats()
        super().__init__(address, handler, max_connections)

    def count(self, key):
        self.buffer.count(key)

    def server_close(self):
        super().server_close()
        # wakes the long polls; a kept-alive connection hangs up at its next request
        self.buffer.close()

    def service_actions(self):
        """serve_forever calls this every 0.2 s: a line per log_every, none when idle."""
        if time.monotonic() - self._last_log >= self.log_every:
            self._last_log, s, old = time.monotonic(), self.buffer.stats(), self._logged
            if moved := {k: s[k] - old[k] for k in self.buffer.counts if s[k] != old[k]}:
                changes = ", ".join(f"{k} +{v}" for k, v in moved.items())
                log.info("proxy: %s; buffer %d groups (%.1f MB), trainer v%s", changes,
                         s["buffered"], s["buffered_mb"], s["trainer_version"])
                self._logged = s


def body_limit(c):
    """The default --max-body-mb, in bytes: one POST of groups_per_step groups at full length, at
    ~64 bytes of JSON a sampled token (a real POST weighs ~33: docs/hostile-peers.md) and 32 a
    prompt token; 2.5 MiB at the default contract, never under 1 MiB."""
    per_group = c["num_generations"] * c["max_new_tokens"] * 64 + c["max_prompt_length"] * 32
    return max(2**20, c["groups_per_step"] * per_group)


def serve(host="127.0.0.1", port=0, max_groups=4096, max_buffer_mb=1024, max_body_mb=None,
          token=None, rollout_token=None, request_timeout=30.0, max_connections=256,
          lease_timeout=120.0, log_every=60.0, **contract):
    """Start the proxy in a daemon thread: (server, thread), its port server.server_address[1].
    **contract: CONTRACT's keys"""
    token, rollout_token = token or None, rollout_token or None
    if token is None and host not in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(f"refusing to listen on {host!r} without a token: set PROXY_TOKEN or "
                          "--token (or listen on 127.0.0.1)")
    if rollout_token and (rollout_token == token or not token):
        raise ConfigError("--rollout-token (ROLLOUT_TOKEN) must come with a different --token "
                          "(PROXY_TOKEN): the trainer's token opens every endpoint, the replicas' "
                          "only theirs")
    body_mb = 1 if max_body_mb is None else max_body_mb
    limits = (max_groups, max_buffer_mb, body_mb, request_timeout, max_connections)
    if min(limits) <= 0 or set(contract) - set(CONTRACT):
        raise ConfigError("--max-groups, --max-buffer-mb, --max-body-mb, --request-timeout, "
                          "--max-connections must be > 0; unknown settings "
                          f"{sorted(set(contract) - set(CONTRACT))}")
    buffer = RolloutBuffer(contract, max_groups, int(max_buffer_mb * 2**20),
                           lease_timeout=lease_timeout)
    max_body = body_limit(buffer.contract) if max_body_mb is None else int(max_body_mb * 2**20)
    # the state of this server bound to its handler class: no module globals
    handler = type("BoundProxyHandler", (ProxyHandler,), dict(
        buffer=buffer, token=token, rollout_token=rollout_token, max_body=max_body,
        timeout=request_timeout))
    server = ProxyServer((host, port), handler, max_connections, log_every)
    thread = threading.Thread(target=server.serve_forever, args=(0.2,), name="proxy", daemon=True)
    thread.start()
    return server, thread


# ---- the client rollout.py and trainer.py use, and the CLI

class ProxyClient:
    """Talks to a proxy.py; rides out restarts, 5xx and 429 with backoff. A proxy that restarted has
    forgotten the trainer's version: its 409 on GET /batch is answered by announcing it again (the
    one place a restart is handled). One per thread (it keeps a session). `token` (default:
    PROXY_TOKEN), sent as X-Proxy-Token: the trainer's, or a replica's where the proxy has
    ROLLOUT_TOKEN. `gateway_token` (default: GATEWAY_TOKEN), sent as `Authorization: Bearer`: for a
    gateway only."""
    HINTS = {401: " (check the token: PROXY_TOKEN for the trainer, ROLLOUT_TOKEN for replicas "
                  "when the proxy has one)",
             403: " (a replica's token opens its own endpoints and worker name only: give the "
                  "trainer PROXY_TOKEN)",
             404: " (is the URL a proxy.py?)", 405: " (is the URL a proxy.py?)",
             413: " (send fewer groups per POST or raise the proxy's --max-body-mb / "
                  "--max-buffer-mb)"}

    def __init__(self, url, token=None, max_wait=300.0, gateway_token=None):
        import requests  # the client's only dependency; the server needs none

        self._requests, self.url, self.max_wait = requests, url.rstrip("/"), max_wait
        self.session = requests.Session()
        # the last version this client announced: announced again to a restarted proxy
        self.version = None
        # the last GET /batch answer read, acknowledged by the next call (0: none yet)
        self.delivery = 0
        if token := token or os.environ.get("PROXY_TOKEN"):
            self.session.headers[TOKEN_HEADER] = token
        # a gateway in front (HF Jobs)
        if gateway := gateway_token or os.environ.get("GATEWAY_TOKEN"):
            self.session.headers["Authorization"] = f"Bearer {gateway}"

    def contract(self, flags=None, **given):
        """The run's settings from GET /config. `given`: the flags a role was started with (None:
        not given); one that disagrees with the proxy is an error naming both values. `flags`: the
        role's own name of a flag where it differs
        ({"max_new_tokens": "--max-completion-length"})."""
        config = self._call("GET", "/config")
        for key, value in given.items():
            if value is not None and value != config.get(key):
                flag = (flags or {}).get(key, "--" + key.replace("_", "-"))
                raise ProxyError(f"{flag} {value} disagrees with the proxy's {key} "
                                 f"{config.get(key)} ({self.url}): the run's settings come from "
                                 f"proxy.py; drop {flag}, or restart proxy.py with {flag} {value}")
        return config

    def post_rollouts(self, groups):
        return self._call("POST", "/rollouts", {"groups": groups})

    def quota(self, worker, version, most, timeout=30.0):
        params = {"worker": worker, "version": version, "max": most, "timeout": timeout}
        return self._call("GET", "/quota", params=params, wait=timeout)

    def get_batch(self, n, timeout=30.0):
        """Up to n groups; each call acknowledges the answer read before (the proxy gives back one
        that was never read, e.g. by a trainer killed with it unread)."""
        try:
            answer = self._batch(n, timeout)
        except ProxyError as e:
            if not (e.answer.get("need_version") and self.version is not None):
                raise
            print(f"proxy.py client: {self.url} does not know the trainer's version (restarted?): "
                  f"announcing v{self.version} again", file=sys.stderr, flush=True)
            self.set_version(self.version)
            answer = self._batch(n, timeout)
        self.delivery = answer.get("delivery") or self.delivery
        return answer

    def _batch(self, n, timeout):
        params = {"groups": n, "timeout": timeout, "ack": self.delivery}
        return self._call("GET", "/batch", params=params, wait=timeout)

    def set_version(self, version):
        answer = self._call("POST", "/version", {"version": version})
        self.version = version
        return answer

    def done(self):
        return self._call("POST", "/done", {})

    def stats(self):
        return self._call("GET", "/stats")

    def _call(self, method, path, body=None, params=None, wait=0.0):
        rq, where = self._requests, f"{method} {self.url}{path}"
        try:
            data = None if body is None else json.dumps(body, allow_nan=False).encode()
        except ValueError:
            raise ProxyError(f"{where}: cannot send NaN or Infinity (check the rewards and "
                             "log-probs)") from None
        deadline, delay = time.monotonic() + self.max_wait, 0.5
        while True:
            try:
                r = self.session.request(method, self.url + path, data=data, params=params,
                                         headers={"Content-Type": "application/json"},
                                         timeout=(10.0, wait + 60.0))
            # the proxy is down, or died mid-answer: retried
            except (rq.ConnectionError, rq.Timeout, rq.exceptions.ChunkedEncodingError) as e:
                m = re.search(r"\[Errno -?\d+\] [^'\")]+", str(e))
                why = f"cannot reach the proxy ({m.group(0) if m else type(e).__name__})"
                pause = delay
            except rq.RequestException as e:
                raise ProxyError(f"{where}: {e}") from None
            else:
                try:
                    answer = r.json()
                except ValueError:
                    # one line, even for an HTML page
                    answer = {"error": " ".join(r.text.split())[:200]}
                if r.status_code == 200 and isinstance(answer, dict) and "error" not in answer:
                    return answer
                msg = answer.get("error", answer) if isinstance(answer, dict) else answer
                if r.status_code != 429 and r.status_code < 500:  # 200: not proxy.py's JSON
                    hint = self.HINTS.get(404 if r.status_code == 200 else r.status_code, "")
                    raise ProxyError(f"{where}: HTTP {r.status_code}: {msg}{hint}", answer)
                # 429: the buffer is full; 503: too many connections
                after = r.headers.get("Retry-After", "")
                why = f"HTTP {r.status_code}: {msg}"
                pause = float(after) if after.isdigit() else delay
            if (left := deadline - time.monotonic()) <= 0:
                raise ProxyError(f"{where}: gave up after {self.max_wait:g} s: {why}")
            if delay == 0.5:  # the first retry of this call: one line per streak of retries
                print(f"proxy.py client: {where}: {why}; retrying for up to {self.max_wait:g} s",
                      file=sys.stderr, flush=True)
            time.sleep(min(pause, left, 10.0))
            delay = min(2 * delay, 10.0)


def main(argv=None):
    p = argparse.ArgumentParser(description="The hub of an async GRPO run: contract, rollout "
                                "buffer, quota. Fields and status codes: docs/protocol.md.")
    a = p.add_argument
    a("--host", default="127.0.0.1",
      help="address to listen on; anything but loopback needs a token")
    a("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    # the run's contract: every role takes it from GET /config
    for key, default in CONTRACT.items():
        pair = key == "reward_range"  # LO HI
        a("--" + key.replace("_", "-"), type=float if pair else type(default), default=default,
          help=CONTRACT_HELP[key], choices=("keep", "drop") if key == "zero_variance" else None,
          nargs=2 if pair else None, metavar=("LO", "HI") if pair else None)
    a("--max-groups", type=int, default=4096, help="buffer size in groups (429 when full)")
    a("--max-buffer-mb", type=float, default=1024,
      help="buffer size in MiB, ~70 bytes a token (429 when full)")
    a("--max-body-mb", type=float, help="largest request body in MiB, 413 above (default: "
      "groups-per-step groups at full length, ~64 bytes a token: 2.5 at the default contract)")
    a("--request-timeout", type=float, default=30.0,
      help="seconds a whole request may take to arrive")
    a("--max-connections", type=int, default=256, help="open connections at most (503 above)")
    a("--lease-timeout", type=float, default=120.0,
      help="most seconds a replica's lease counts as coming: 3x its measured pace (>= 2 s) once "
           "it delivered, this until then")
    a("--linger", type=float, default=60.0,
      help="after /done, exit once replicas were told or after this many idle s")
    a("--token", default=os.environ.get("PROXY_TOKEN"),
      help="the trainer's token, sent as X-Proxy-Token (default: $PROXY_TOKEN)")
    a("--rollout-token", default=os.environ.get("ROLLOUT_TOKEN"),
      help="the replicas' shared secret R (default: $ROLLOUT_TOKEN); it also checks bound "
           "credentials")
    a("--print-replica-token", metavar="WORKER",
      help="print the credential bound to WORKER under --rollout-token, and exit")
    args = vars(p.parse_args(argv))
    if worker := args.pop("print_replica_token"):
        if not args["rollout_token"] or not NAME[0](worker):
            sys.exit("proxy.py: error: --print-replica-token needs ROLLOUT_TOKEN (or "
                     f"--rollout-token) and a worker name of 1 to {MAX_NAME} characters")
        print(replica_token(args["rollout_token"], worker))
        return
    linger = args.pop("linger")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    try:
        server, thread = serve(**args)
    except ConfigError as e:
        sys.exit(f"proxy.py: error: {e}")
    except OSError as e:
        sys.exit(f"proxy.py: error: cannot listen on {args['host']}:{args['port']}: {e}")
    buf = server.buffer
    tokens = "required, and the replicas' own" if args["rollout_token"] \
        else "required" if args["token"] else "off"
    log.info("proxy: listening on http://%s:%d (token %s), contract %s", args["host"],
             server.server_address[1], tokens, json.dumps(buf.contract))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop on SIGTERM as on Ctrl-C
    try:
        while thread.is_alive():  # the run ends when the trainer is done and the replicas were told
            thread.join(0.5)
            with buf.cond:
                told = set(buf.leases) <= buf.told_done
                quiet = time.monotonic() - buf.last_request > linger
            if buf.done and (told or quiet):
                why = "every replica was told" if told else f"no request for {linger:g} s"
                log.info("proxy: the trainer is done and %s: exiting", why)
                break
    except KeyboardInterrupt:
        pass
    server.shutdown()
    server.server_close()
    log.info("proxy: stopped: %s", {k: v for k, v in buf.stats().items() if type(v) is int})


if __name__ == "__main__":
    main()
