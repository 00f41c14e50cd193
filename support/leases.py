"""RolloutBuffer's mixins (proxy.py): how many groups a lease holds, the checks add() makes on a
POST, and the buffer's counters. Not needed to follow a GRPO step: RolloutBuffer._quota names
each piece of the arithmetic it calls, and RolloutBuffer.add each check in a comment beside its
call. The rules in words: docs/protocol.md (the quota, shares by speed, leases that expire).

    LeaseSizing    the arithmetic under RolloutBuffer._quota: how far ahead (_ahead), a lease's
                   size (_lease_size: the shares by measured pace, _shares), which leases count
                   as coming (_coming, _slower, _overtaken), what arrives in time (_in_time), when
                   a lease expires (_expiry), a replica's pace from its deliveries (_delivered)
    AddChecks      add()'s checks, in the order add() calls them: the size (_fits), a version
                   ahead of the trainer (_not_ahead), retries and groups beyond a lease (_new,
                   _within_leases), drop mode (_varied), room (_room), the bookkeeping (_remember)
    BufferRecords  the bounded lease table, the counters, redelivery of unread batches, /stats

They are mixins of RolloutBuffer, never used alone: they read and write its state (contract,
leases, pace, groups, counts, ...) under its lock (all but _fits, which reads max_bytes only) and
call its methods (_usable, _deliver, _drop_stale). This module imports no role file.

    python -m pytest tests/test_proxy.py -q
"""

import math
import time

from support.http_hardening import RETRY_AFTER_S, ApiError

MAX_WORKERS = 1024      # per-worker counters kept; further workers are counted under "(other)"
# counted in total and per worker
WORKER_COUNTS = ("accepted", "duplicates", "dropped_stale", "delivered", "over_quota")

# a measured replica's lease counts as coming for LEASE_SLACK x the time its own pace says, at
# least LEASE_FLOOR_S: a dead replica's groups go to the others half a lease after they were due
LEASE_SLACK, LEASE_FLOOR_S = 1.5, 0.5
# above max_staleness 0, a lease of a replica this much slower than the asker does not count as
# coming: the asker makes those groups too (LeaseSizing._coming)
SLOWER = 1.5
# the `why` of a /quota answer of one group to a replica too slow to be leased: is it faster now?
PROBE = "a probe: one group, to measure this replica again"


def group_bytes(g):
    """About the memory a buffered group holds (within ~10% by tracemalloc): ~70 bytes per sampled
    token (an int and a float, with their list slots), 36 per prompt id, the text, ~700 per
    completion."""
    return (1000 + 36 * len(g["prompt_ids"]) + len(g["prompt"])
            + sum(700 + 70 * len(c["ids"]) + len(c["text"]) for c in g["completions"]))


class LeaseSizing:
    """RolloutBuffer's lease sizing: how many groups /quota leases a replica. RolloutBuffer._quota
    calls _coming, _ahead, _lease_size and _in_time; quota calls _wait_until and _lease (which
    calls _probe_gap and _expiry); stats() calls _shares; add() calls _delivered (_remember)."""

    def _lease_size(self, worker, lack, most, now):
        """How many of the `lack` groups the trainer still needs this replica is leased: at most
        `most`, its share of a step (_shares: by its measured speed), one for a new replica among
        others (nobody waits for it: its measure). In drop mode each is scaled up by the share of
        groups kept lately, in one lease (one engine batch): Laplace's rule of succession over
        the recent groups (a prior of one kept, one dropped), so 0 kept of 4 reads 1/6."""
        c = self.contract
        S, B = c["max_staleness"], c["groups_per_step"]
        kept = 1.0
        if c["zero_variance"] == "drop":
            kept = max(0.05, (sum(self.recent_usable) + 1) / (len(self.recent_usable) + 2))
        shares = self._shares(now, worker)
        n = min(most, math.ceil(lack / kept), max(1, math.ceil(round(B * shares[worker]) / kept)))
        if S > 0 and worker not in self.pace and len(shares) > 1:
            n = 1  # a new replica among others: one group to measure it on, nobody waits for it
        return n

    def _in_time(self, worker, version, n, now):
        """(n, None), or fewer for a replica the others do not wait for (_overtaken): only the
        groups it makes, even at LEASE_SLACK x its pace, before the trainer completes its batch at
        v + S, the last that can use them, so a slow replica's work is not dropped as stale; but
        for a PROBE now and then (_probe_gap), in case it got faster."""
        S, t = self.contract["max_staleness"], self.trainer_version
        # not for a replica whose groups the step needs (the others' shares cannot fill it)
        if self._overtaken(worker, now) and self.step_s and worker in self.pace and \
                not self._needed(worker, now):
            # the trainer completes its batch at v + S about then (at its pace since set_version)
            left = self.version_at + (version + S - t) * self.step_s + self.fill_s - now
            if (n := min(n, int(left / (LEASE_SLACK * self.pace[worker])))) < 1:  # even if late
                if now - self.delivered_at.get(worker, now) >= self._probe_gap(worker):
                    return 1, PROBE
                return 0, (f"at {self.pace[worker]:.3g} s per group, a group made with v{version} "
                           f"would arrive after the trainer's v{version + S} took its last batch "
                           f"(max_staleness {S}, {self.step_s:.3g} s per step): wait for the next")
        return n, None

    def _ahead(self, worker, keeping, now):
        """How many steps ahead of the trainer groups are wanted: one, so that they are as fresh
        as can be; but when `keeping` replicas keep up with each other (the asker and those whose
        leases count as coming) and a lease of the asker's share takes longer than the trainer's
        own step (its pace less its wait for a batch), as many steps as that lease spans, at most
        `keeping`: such replicas then work on different steps at once, not one after the other
        while the trainer waits."""
        if keeping < 2 or not self.step_s or worker not in self.pace:
            return 1
        B = self.contract["groups_per_step"]
        lease_s = max(1, round(B * self._shares(now, worker)[worker])) * self.pace[worker]
        train_s = max(self.step_s - self.fill_s, 1e-3)
        return max(1, min(keeping, math.ceil(lease_s / train_s)))

    def _wait_until(self, ready, timeout):
        """Wait (the lock released) until ready() or `timeout` s; another's lease may expire
        meanwhile, which can make ready() true: look again the moment it does."""
        deadline = time.monotonic() + timeout
        while not ready() and (left := deadline - time.monotonic()) > 0:
            now = time.monotonic()
            ends = [lease.until - now for lease in self.leases.values() if lease.until > now]
            self.cond.wait(min([left, *ends]))

    def _lease(self, worker, version, n, why):
        """Record the lease of n groups and when it expires. A slow replica's probe (PROBE): the
        next one twice as late; a replica leased again is no longer probed."""
        now = time.monotonic()
        if why == PROBE:
            self.probe_gap[worker] = 2 * self._probe_gap(worker)
        elif n:
            self.probe_gap.pop(worker, None)
        self.leases[worker] = Lease(n, self._expiry(worker, n, now), version, now, n)

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
        equal shares before. However fast the fastest (a credential that posts made-up groups the
        moment it is leased), each of the others keeps a floor: its part of the 1 -
        max_worker_share of a step no worker may supply alone (support/worker_bounds.py)."""
        live = {w for w, lease in self.leases.items() if lease.until > now} | ({asking} - {None})
        speed = {w: 1 / max(self.pace[w], 1e-6) for w in live if w in self.pace}
        if not speed:
            return dict.fromkeys(live, 1 / max(1, len(live)))  # the first rounds
        unmeasured = len(live) - len(speed)
        if self.contract["max_staleness"] == 0:
            whole = sum(speed.values()) * (1 + unmeasured / len(speed))  # unmeasured: the mean
        else:
            whole = max(speed.values())
        floor = (1 - self.max_worker_share) / (len(live) - 1) if len(live) > 1 else 0.0
        return {w: max(floor, speed[w] / whole) if w in speed else 0.0 for w in live}

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


class AddChecks:
    """RolloutBuffer.add's checks and bookkeeping: what a POST's groups are (too big, ahead of the
    trainer, retries, beyond the sender's lease, all rewards equal), whether they fit, and what
    is remembered of them."""

    def _fits(self, groups):
        if (size := sum(map(group_bytes, groups))) > self.max_bytes:
            raise ApiError(f"these groups take {size / 2**20:.3g} MB, more than --max-buffer-mb "
                           f"{self.max_bytes / 2**20:.3g}: send fewer per POST", 413)

    def _not_ahead(self, groups, t):
        ahead = next((g for g in groups if t is not None and g["policy_version"] > t), None)
        if ahead:
            v = ahead["policy_version"]
            raise ApiError(f"policy_version {v} is ahead of the trainer's version {t}: is this "
                           "replica reading another run's bucket?", 409)

    def _new(self, groups, limited):
        """(new, retries, over the sender's lease): a group_id seen before or twice in the POST
        is a retry."""
        new, dups, ids = [], [], set()
        for g in groups:
            (dups if g["group_id"] in self.seen or g["group_id"] in ids else new).append(g)
            ids.add(g["group_id"])
        new, over = self._within_leases(new) if limited else (new, [])
        return new, dups, over

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

    def _varied(self, fresh):
        """(groups with unequal rewards, groups with equal ones): --zero-variance drop."""
        varied = [len({c["reward"] for c in g["completions"]}) > 1 for g in fresh]
        self.recent_usable.extend(varied)
        return ([g for g, v in zip(fresh, varied) if v],
                [g for g, v in zip(fresh, varied) if not v])

    def _room(self, fresh, posted):
        """The bytes `fresh` takes; 429 (the whole POST refused) when the buffer cannot hold it."""
        size = sum(map(group_bytes, fresh))
        too_many = len(self.groups) + len(fresh) > self.max_groups
        if too_many or self.nbytes + size > self.max_bytes:
            self.counts["refused_full"] += posted
            mb, most_mb = self.nbytes / 2**20, self.max_bytes / 2**20
            raise ApiError(f"buffer full ({len(self.groups)} groups of --max-groups "
                           f"{self.max_groups}, {mb:.3g} MB of --max-buffer-mb "
                           f"{most_mb:.3g}); retry in {RETRY_AFTER_S} s", 429,
                           {"Retry-After": str(RETRY_AFTER_S)})
        return size

    def _remember(self, new, dups, over, flat):
        """Kept groups' ids (the last remember_ids), the counters, and each sender's lease, which
        shrinks as its groups arrive."""
        self.seen.update(g["group_id"] for g in new)
        self.seen_order.extend(g["group_id"] for g in new)
        while len(self.seen_order) > self.remember_ids:
            self.seen.discard(self.seen_order.popleft())
        self._count("accepted", new)
        self._count("duplicates", dups)
        self._count("over_quota", over)
        self._count("dropped_stale", [g for g in new if not self._usable(g)])
        self.counts["dropped_zero_variance"] += len(flat)
        for g in (g for g in new if g["worker"] in self.leases):
            self._delivered(g["worker"])


class Lease:
    """What /quota gave a replica: n groups still to come (0: asking), counted as coming until
    `until` (monotonic s), made with adapter `version`; `given` groups at `since`."""
    __slots__ = ("n", "until", "version", "since", "given")

    def __init__(self, n, until, version, since=0.0, given=0):
        self.n, self.until, self.version, self.since, self.given = n, until, version, since, given


class BufferRecords:
    """RolloutBuffer's bookkeeping: the bounded table of leases (_bound_leases), the counters per
    worker (_count, count), a delivery held until read (_hold) and, never read, back to the
    buffer (_confirm, give_back), the end (close), and what GET /stats shows (state, stats)."""

    def _bound_leases(self, worker):
        """The leases are bounded: a new name beyond MAX_WORKERS drops the expired ones, or 429."""
        if worker in self.leases or len(self.leases) < MAX_WORKERS:
            return
        now = time.monotonic()
        self.leases = {w: lease for w, lease in self.leases.items() if lease.until > now}
        self.pace = {w: p for w, p in self.pace.items() if w in self.leases}
        self.probe_gap = {w: p for w, p in self.probe_gap.items() if w in self.leases}
        self.delivered_at = {w: p for w, p in self.delivered_at.items() if w in self.leases}
        if len(self.leases) >= MAX_WORKERS:
            raise ApiError(f"worker: {MAX_WORKERS} other names hold leases; retry once one "
                           "expires (--lease-timeout)", 429, {"Retry-After": str(RETRY_AFTER_S)})

    def _count(self, key, groups, sign=1):  # in total and for each group's worker
        self.counts[key] += sign * len(groups)
        for g in groups:
            known = g["worker"] in self.workers or len(self.workers) < MAX_WORKERS
            name = g["worker"] if known else "(other)"
            self.workers.setdefault(name, dict.fromkeys(WORKER_COUNTS, 0))[key] += sign

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
                    # per worker: groups delivered to the trainer and not dropped by it (the
                    # groups trained on), what a step may take from it, the trainer's drops
                    "trained": {w: c["delivered"] - self.trainer_drops.get(w, 0)
                                for w, c in self.workers.items() if c["delivered"]},
                    "max_worker_share": self.max_worker_share,
                    "caps": {w: self._cap(w, now) for w in self._suppliers(now)},
                    "trainer_drops": dict(self.trainer_drops), "banned": dict(self.banned),
                    "uptime_s": round(time.time() - self.started, 1)}

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

    def _hold(self, groups, ack):
        """With `ack` (the client confirms what it reads), the groups are a numbered delivery,
        held until the next take's ack or set_version confirms it: its number, else None."""
        if not groups or ack is None:
            return None
        self.deliveries += 1
        self.unconfirmed[self.deliveries] = (groups, self.trainer_version)
        return self.deliveries

    def _confirm(self, ack):
        """The client read delivery `ack` (0: none; None: it does not confirm): the other
        unconfirmed deliveries were never read (a trainer killed with them unread): back to the
        buffer, the oldest in front."""
        if ack is None:
            return
        self.unconfirmed.pop(ack, None)
        for d in sorted(self.unconfirmed, reverse=True):  # newest first: the oldest ends in front
            self._give_back(*self.unconfirmed.pop(d))
