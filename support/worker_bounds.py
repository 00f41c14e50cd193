"""RolloutBuffer (proxy.py) as the proxy serves it: GuardedBuffer wraps the plain buffer, which
does not know it is wrapped, with what a service facing unknown peers and an unequal pool adds.
Each of its methods calls the plain one (quota and take with the pool's parts as arguments: how
many groups, which ones, the wait, the leases); valid groups from one replica go through
unchanged (the same groups, in the same order, the same quotas: tests/test_proxy.py::
test_valid_groups_from_one_replica_go_through_the_guarded_buffer_unchanged).

    the checks       a POST too big for the buffer (413), a version ahead of the trainer (409), a
                     banned sender (403), retries (duplicates) and groups beyond the sender's
                     lease (over_quota): counted, not kept; a full buffer (429); the table of
                     leases bounded (429)
    a bounded share  a step takes at most --max-worker-share of its groups from one worker (_cap)
                     while another supplies (_suppliers), however fast the first answers: a
                     credential that posts made-up groups the moment it is leased is measured as
                     the fastest replica, and would otherwise be leased the whole step
    the trainer's drops  a group it dropped after delivery (POST /reject) goes back to the step's
                     quota; its worker is banned: /quota and /rollouts answer it 403
    an unequal pool  leases by each replica's measured pace (_shares), how far ahead (_ahead),
                     which leases count as coming (_coming), only groups that arrive in time for
                     a slow replica (_in_time) and a probe now and then, when a lease expires
                     (_expiry). A lease is owed work, not a seat: asking again keeps its expiry,
                     one that expires unfilled counts against its holder (_default), and only a
                     worker that delivers is waited for (_silent)
    deliveries       a batch the trainer never read (ack) or whose answer could not be written
                     goes back to the buffer; the counters; GET /stats

The rules in words, with the tests that show them: docs/protocol.md, docs/hostile-peers.md. This
module imports no role file.

    python -m pytest tests/test_proxy.py -q -k "share or reject or banned or lease"
"""

import collections
import math
import time

from support.defaults import DEFAULTS  # --max-groups, --lease-timeout, --max-worker-share's
from support.http_hardening import RETRY_AFTER_S, ApiError

MAX_WORKERS = 1024      # per-worker counters kept; further workers are counted under "(other)"
# counted in total and per worker
WORKER_COUNTS = ("accepted", "duplicates", "dropped_stale", "delivered", "over_quota")
# a measured replica's lease counts as coming for LEASE_SLACK x the time its own pace says, at
# least LEASE_FLOOR_S: a dead replica's groups go to the others half a lease after they were due
LEASE_SLACK, LEASE_FLOOR_S = 1.5, 0.5
# above max_staleness 0, a lease of a replica this much slower than the asker does not count as
# coming: the asker makes those groups too (_coming)
SLOWER = 1.5
# the `why` of a /quota answer of one group to a replica too slow to be leased: is it faster now?
PROBE = "a probe: one group, to measure this replica again"


def group_bytes(g):
    """About the memory a buffered group holds (within ~10% by tracemalloc): ~70 bytes per sampled
    token (an int and a float, with their list slots), 36 per prompt id, the text, ~700 per
    completion."""
    return (1000 + 36 * len(g["prompt_ids"]) + len(g["prompt"])
            + sum(700 + 70 * len(c["ids"]) + len(c["text"]) for c in g["completions"]))


class Lease:
    """The terms of a worker's lease (its groups still owed: RolloutBuffer.leases): counted as
    coming until `until` (monotonic s), made with adapter `version`, `given` groups at `since`."""
    __slots__ = ("until", "version", "since", "given")

    def __init__(self, until, version, since=0.0, given=0):
        self.until, self.version, self.since, self.given = until, version, since, given


class GuardedBuffer:
    """RolloutBuffer as served: to valid groups from one replica it changes nothing.

    Around it: the checks a hostile or broken peer meets, one worker's bounded share, the leases
    of an unequal pool, deliveries held until read, the counters of GET /stats."""

    def __init__(self, core, max_groups=DEFAULTS["max_groups"],
                 max_bytes=int(DEFAULTS["max_buffer_mb"] * 2**20), remember_ids=1_000_000,
                 lease_timeout=DEFAULTS["lease_timeout"],
                 max_worker_share=DEFAULTS["max_worker_share"]):
        self.core = core  # proxy.RolloutBuffer: its lock (cond) guards this state too
        self.max_groups, self.max_bytes, self.remember_ids = max_groups, max_bytes, remember_ids
        self.lease_timeout, self.max_worker_share = lease_timeout, max_worker_share
        self.terms = {}  # worker -> Lease: the terms of its lease in core.leases
        self.nbytes = 0  # group_bytes() of the buffered groups
        self.seen, self.seen_order = set(), collections.deque()  # the last `remember_ids` group_ids
        self.counts = dict.fromkeys(["received", *WORKER_COUNTS, "dropped_zero_variance",
                                     "refused_full", "returned", "rejected",
                                     "refused_connections", "closed_idle",
                                     "dropped_by_trainer", "reward_errors"], 0)
        self.workers = {}  # worker name -> its own WORKER_COUNTS
        # when the trainer announced its version (monotonic s); lately (moving averages): seconds
        # per version, and seconds from a version's announcement to its batch complete (its wait)
        self.version_at, self.step_s, self.fill_s = None, None, 0.0
        # the groups taken at this version per worker, and their group_ids (POST /reject)
        self.taken_by, self.taken_ids = collections.Counter(), {}
        # the trainer's drops: worker -> why it is banned, worker -> groups the trainer dropped
        self.banned, self.trainer_drops = {}, {}
        self.pace = {}  # worker -> seconds per group it delivered lately (moving average)
        # a replica too slow to be leased (_in_time) is probed with one group this long after its
        # last delivery (seconds, doubled per probe), in case it got faster; and when
        self.probe_gap, self.delivered_at = {}, {}
        self.silent = set()  # workers whose last lease expired unfilled, none delivered since
        # for run_until_done: who heard "done", and when the last request came
        self.told_done, self.last_request = set(), time.monotonic()
        self.started = time.time()
        self.waiting = 0  # groups asked for by GET /batch calls blocked for lack of them
        self.staleness = collections.Counter()  # trainer_version - policy_version, delivered
        self.unconfirmed, self.deliveries = {}, 0  # delivery id -> (groups, version): see take()

    # the plain buffer's state, as the routes and run_until_done read it
    contract = property(lambda self: self.core.contract)
    cond = property(lambda self: self.core.cond)
    leases = property(lambda self: self.core.leases)
    trainer_version = property(lambda self: self.core.trainer_version)
    done = property(lambda self: self.core.done)
    closed = property(lambda self: self.core.closed)

    # ---- RolloutBuffer's methods, wrapped

    def add(self, groups, limited=False, failed=None):
        """RolloutBuffer.add; valid new groups within the sender's lease: its answer, unchanged.

        Before it, the checks (413, 409, 403, 429); retries and (`limited`: a replica's
        credential) groups beyond the sender's lease are counted, not passed on. `failed`:
        (worker, n), n groups of its lease dropped by the replica because a reward function
        failed: off its lease (at most what it owes) and counted (reward_errors, handed to the
        trainer with each batch). After it, the counters and the senders' paces."""
        core = self.core
        self._fits(groups)  # 413: more than the whole buffer
        with core.cond:
            self._not_ahead(groups, core.trainer_version)  # 409: no adapter of the trainer's
            # 403: the trainer caught its sender
            self._not_banned({g["worker"] for g in groups} | ({failed[0]} if failed else set()))
            # a group_id seen before, or twice in this POST, is a retry: counted, not kept
            new, dups, over = self._new(groups, limited)
            self.counts["received"] += len(groups)
            # 429, nothing kept, when the buffer cannot hold what it would keep
            size = self._room([g for g in new if core._usable(g) and core._varied(g)], len(groups))
            owed = {g["worker"]: core.leases.get(g["worker"], 0) for g in new}
            if failed:  # made and dropped: no longer owed
                worker, n = failed[0], min(failed[1], core.leases.get(failed[0], 0))
                owed.setdefault(worker, core.leases.get(worker, 0))
                core.leases[worker] = core.leases.get(worker, 0) - n
                self.counts["reward_errors"] += n
            reply = core.add(new)
            self._remember(new, dups, over, reply["zero_variance"], owed)
            self.nbytes += size
            return {**reply, "duplicates": len(dups), "over_quota": len(over)}

    def take(self, n, timeout, gone=lambda: False, ack=None):
        """RolloutBuffer.take; one replica's groups: its n oldest, unchanged, and a delivery number.

        (groups, version, delivery): at most --max-worker-share of a step from one worker while
        another supplies (the rest wait for the next step: _within_caps). With `ack` (the last
        delivery the client read, 0: none), the answer is a delivery held until confirmed: by the
        next take's ack or by set_version; one not confirmed then was never read (a trainer
        killed with it unread): back to the buffer."""
        core = self.core
        with core.cond:
            self._confirm(ack)  # the trainer read delivery `ack`; any other went unread: back
            self.waiting += n  # seen by /stats while the wait has released the lock
            try:  # n groups this step may take (_pick)
                out, version = core.take(n, timeout, gone, wait=self._wait_until,
                                         enough=lambda: len(self._pick(n, time.monotonic())) >= n,
                                         pick=self._within_caps)
            finally:
                self.waiting -= n
            self._deliver(out, version)
            return out, version, self._hold(out, ack)  # until the next ack

    def set_version(self, version, limits=None):
        """RolloutBuffer.set_version, its answer unchanged; and the trainer's pace measured.

        Also: this version's counts per worker reset, every delivery confirmed, the stale groups
        counted."""
        core = self.core
        with core.cond:
            t, before = core.trainer_version, list(core.groups)
            reply = core.set_version(version, limits)  # 409 for a lower version
            if version != t:
                self.taken_by, self.taken_ids = collections.Counter(), {}
            if t is None or version > t:  # the trainer's pace
                now = time.monotonic()
                if t is not None:
                    sample = (now - self.version_at) / (version - t)
                    self.step_s = sample if self.step_s is None else (self.step_s + sample) / 2
                self.version_at = now
            self.unconfirmed.clear()  # the trainer stepped on what it was handed: read, all of it
            left = set(map(id, core.groups))
            self._dropped_stale([g for g in before if id(g) not in left])
            return reply

    def quota(self, worker, version, most, timeout):
        """RolloutBuffer.quota with a pool's rule (_quota); one replica that delivers what it is
        leased, from its first ask: the same answers
        (test_valid_groups_from_one_replica_go_through_the_guarded_buffer_unchanged).

        Before it: 403 for a banned worker, 429 while the table of leases is full; a lease still
        owed keeps its groups and expiry, one that expired unfilled is charged (_default). Its
        wait also wakes when another's lease expires (_wait_until). After it: the lease's terms
        (_lease), a slow replica's next probe (_probed), who heard "done"."""
        core = self.core
        with core.cond:
            self._not_banned([worker])  # 403: the trainer caught it (reject)
            self._bound_leases(worker)  # 429 when MAX_WORKERS other names hold one
            now, lease = time.monotonic(), self.terms.get(worker)
            owed = lease is not None and core.leases.get(worker, 0) > 0 and lease.until > now
            if lease is not None and not owed:
                self._default(worker, now)  # an expired lease with groups owed counts against it
            if not owed:  # its lease ends: the terms of its next one
                core.leases[worker] = 0
                self.terms[worker] = Lease(now + timeout + self.lease_timeout, version)
            core.cond.notify_all()

            def record(w, n):  # the lease of n groups, and its terms
                self._lease(w, version, n, owed)
            reply = core.quota(worker, version, most, timeout, rule=self._quota,
                               wait=self._wait_until, lease=record)
            if core.done:
                self.told_done.add(worker)
            else:
                self._probed(worker, reply["groups"], reply["why"])
            return reply

    def finish(self):
        """RolloutBuffer.finish, nothing added."""
        return self.core.finish()

    def close(self):
        """RolloutBuffer.close, nothing added."""
        self.core.close()

    def state(self):
        """RolloutBuffer.state, nothing added."""
        return self.core.state()

    # ---- the pool's quota: RolloutBuffer._quota's terms for replicas of unequal speed

    def _quota(self, worker, version, most):
        """RolloutBuffer._quota with a pool's terms: leased to others counts only the leases that
        will arrive in time (_coming); more steps ahead for a pool whose leases outlast a trainer
        step (_ahead); at most this worker's share of each step (_allowance) and of a lease, by
        its measured speed (_shares); then only what arrives in time (_in_time)."""
        core, now, t = self.core, time.monotonic(), self.core.trainer_version
        # the other replicas' live leases that will arrive in time: groups already coming
        others = [core.leases.get(w, 0) for w in self.terms if self._coming(worker, w, now)]
        ahead = self._ahead(worker, 1 + len(others), now)
        share = step = None
        if t is not None:  # while others supply, one worker makes at most its share (_cap)
            horizon = min(version + core.contract["max_staleness"], t + ahead)
            share = self._allowance(worker, horizon - t + 1, now)
            shares = self._shares(now, worker)
            step = round(core.contract["groups_per_step"] * shares[worker])
        n, why = core._quota(worker, version, most, leased=sum(n for n in others if n > 0),
                             ahead=ahead, step=step, share=share)
        if n == 0:
            return 0, why
        if core.contract["max_staleness"] > 0 and worker not in self.pace and len(shares) > 1:
            n = 1  # a new replica among others: one group to measure it on, nobody waits for it
        return self._in_time(worker, version, n, now)

    def _in_time(self, worker, version, n, now):
        """(n, None), or fewer for a replica the others do not wait for (_overtaken): only the
        groups it makes, even at LEASE_SLACK x its pace, before the trainer completes its batch at
        v + S, the last that can use them, so a slow replica's work is not dropped as stale; but
        for a PROBE now and then (_probe_gap), in case it got faster."""
        S, t = self.core.contract["max_staleness"], self.core.trainer_version
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
        B = self.core.contract["groups_per_step"]
        lease_s = max(1, round(B * self._shares(now, worker)[worker])) * self.pace[worker]
        train_s = max(self.step_s - self.fill_s, 1e-3)
        return max(1, min(keeping, math.ceil(lease_s / train_s)))

    def _wait_until(self, ready, timeout):
        """Wait (the lock released) until ready() or `timeout` s; a lease that expires or a
        supplier's grace that ends meanwhile (_quota's, _pick's terms) can make ready() true:
        look again the moment it does."""
        deadline = time.monotonic() + timeout
        while not ready() and (left := deadline - time.monotonic()) > 0:
            now = time.monotonic()
            ends = [lease.until for lease in self.terms.values()]
            ends += [self._supplier_end(w) for w in self.terms if w in self.pace]
            self.core.cond.wait(min([left, *(end - now for end in ends if end > now)]))

    def _lease(self, worker, version, n, owed=False):
        """Record the lease of n groups and when it expires; a lease still owed (`owed`) keeps
        its start and expiry."""
        now, lease = time.monotonic(), self.terms.get(worker)  # none: banned while it waited
        if owed and lease is not None:  # the groups it is given now, on the same expiry
            lease.given += n - self.core.leases[worker]
        else:
            self.terms[worker] = Lease(self._expiry(worker, n, now), version, now, n)
        self.core.leases[worker] = n

    def _probed(self, worker, n, why):
        """A slow replica's probe (PROBE): the next one twice as late; a replica leased again is
        no longer probed."""
        if why == PROBE:
            self.probe_gap[worker] = 2 * self._probe_gap(worker)
        elif n:
            self.probe_gap.pop(worker, None)

    def _probe_gap(self, worker):
        return self.probe_gap.get(worker, 8 * self.step_s)  # first: 8 of the trainer's steps

    def _coming(self, worker, w, now):
        """Does replica w's lease count as coming when `worker` asks? Live, from a worker that is
        not silent (_silent), and (above max_staleness 0) from a replica known to keep up with
        the asker: otherwise the asker makes those groups as well, and w's arrive on top, used
        while fresh. So a slow, new or silent replica's share is never what the trainer waits
        for; at max_staleness 0 the step takes exactly B, and every other lease counts."""
        return (w != worker and self.terms[w].until > now and w not in self.silent
                and not self._slower(w, worker))

    def _slower(self, w, than):
        """Above max_staleness 0: is replica w not known to keep up with replica `than`, being
        unmeasured or, measured, SLOWER x the pace of `than`?"""
        theirs, mine = self.pace.get(w), self.pace.get(than)
        return self.core.contract["max_staleness"] > 0 and (
            theirs is None or (mine is not None and theirs > SLOWER * mine))

    def _overtaken(self, worker, now):
        """Does a live replica that delivers not count `worker`'s leases as coming (_coming)? Then
        the trainer never waits for its groups: they are used only if they arrive in time."""
        return any(self._slower(worker, w) for w, lease in self.terms.items()
                   if w != worker and lease.until > now and w not in self.silent)

    def _shares(self, now, asking=None):
        """{worker: the fraction of a step it may make} for the replicas with live leases, from
        their measured speed (groups per second). At max_staleness 0 the step waits for every
        lease: a replica's speed over their sum, so that all finish together. Above, the trainer
        waits for no lease in particular: the fastest replica takes a whole step (as a batching
        engine likes it), the others the part their speed makes in the same time, so a slow one
        holds back little. Unmeasured: one group to measure itself on once others are measured;
        equal shares before. However fast the fastest (a credential that posts made-up groups the
        moment it is leased), each of the others keeps a floor: its part of the 1 -
        max_worker_share of a step no worker may supply alone."""
        live = {w for w, lease in self.terms.items() if lease.until > now} | ({asking} - {None})
        speed = {w: 1 / max(self.pace[w], 1e-6) for w in live if w in self.pace}
        if not speed:
            return dict.fromkeys(live, 1 / max(1, len(live)))  # the first rounds
        unmeasured = len(live) - len(speed)
        if self.core.contract["max_staleness"] == 0:
            whole = sum(speed.values()) * (1 + unmeasured / len(speed))  # unmeasured: the mean
        else:
            whole = max(speed.values())
        floor = (1 - self.max_worker_share) / (len(live) - 1) if len(live) > 1 else 0.0
        return {w: max(floor, speed[w] / whole) if w in speed else 0.0 for w in live}

    def _expiry(self, worker, n, now):
        """When a lease of n groups stops counting as coming: LEASE_SLACK x the time the replica's
        own pace says n groups take (a new replica's: the slowest live measured one's), at least
        LEASE_FLOOR_S; --lease-timeout while nobody is measured. A replica that is only late still
        delivers: its groups are within its lease (_within_leases counts groups, not time), used
        while fresh; one that asks again after it expired unfilled is charged (_default)."""
        pace = self.pace.get(worker)
        if pace is None:  # a new replica among measured ones: the slowest of them, at most
            pace = max((self.pace[w] for w, lease in self.terms.items() if w in self.pace
                        and w not in self.silent and lease.until > now), default=None)
        if pace is None or n == 0:
            return now + self.lease_timeout
        return now + min(self.lease_timeout, max(LEASE_FLOOR_S, LEASE_SLACK * n * pace))

    def _measured(self, worker):
        """The last group of `worker`'s lease arrived: seconds per group, from the lease to its
        last group, its pace. The leases of replicas not measured yet now count as coming only
        as long as the slowest measured one would take for them (_expiry)."""
        lease = self.terms.get(worker)
        if lease is None or lease.given <= 0:
            return
        now = time.monotonic()
        sample = (now - lease.since) / lease.given
        # a probe's measure replaces the one that stopped the leases
        old = self.pace.get(worker, sample) if worker not in self.probe_gap else sample
        self.pace[worker], self.delivered_at[worker] = (old + sample) / 2, now
        for w, new in self.terms.items():
            if w not in self.pace and new.given > 0:
                new.until = min(new.until, self._expiry(w, new.given, new.since))
        self.core.cond.notify_all()  # a poll waiting for such a lease to end looks again

    def _default(self, worker, now):
        """A lease that expired with groups owed counts against its holder: its pace takes the
        lease's seconds per group delivered (at least one), as a slow replica's would, so its next
        leases shrink; and it is silent (_coming, _suppliers) until it delivers again."""
        lease, owed = self.terms[worker], self.core.leases.get(worker, 0)
        if owed > 0 and lease.given > 0:
            sample = (now - lease.since) / max(1, lease.given - owed)
            self.pace[worker] = (self.pace.get(worker, sample) + sample) / 2
            self.silent.add(worker)

    # ---- one worker's bounded share of a step

    def _suppliers(self, now):
        """The workers a step can count on for groups: measured (they delivered a lease), not
        banned, not being probed (_in_time found them too slow), not silent (their last lease
        expired unfilled, none delivered since: _default), and holding a lease of groups still to
        come, or just done with one. Both with a grace of LEASE_SLACK x one group's
        time, at least LEASE_FLOOR_S (_supplier_end): the moment between its last group and its
        next /quota, a lease a little late. A dead replica stops counting that long after its
        lease expired."""
        def supplies(w):
            if w not in self.pace or w in self.banned or w in self.probe_gap or w in self.silent:
                return False
            return now < self._supplier_end(w)
        return {w for w in self.terms if supplies(w)}

    def _supplier_end(self, w):
        """When measured worker w stops counting as a supplier (monotonic s)."""
        grace = max(LEASE_FLOOR_S, LEASE_SLACK * self.pace[w])
        return max(self.terms[w].until + grace if self.core.leases.get(w, 0) > 0 else -math.inf,
                   self.delivered_at.get(w, -math.inf) + grace)

    def _cap(self, worker, now, suppliers=None):
        """How many of a step's B groups `worker` may supply: all of them while nobody else
        supplies (one replica, or the others dead); else --max-worker-share of them, rounded up
        to whole groups, and never less than an even split among the suppliers (or no step
        could fill)."""
        B = self.core.contract["groups_per_step"]
        others = (self._suppliers(now) if suppliers is None else suppliers) - {worker}
        if not others:
            return B
        return max(math.ceil(self.max_worker_share * B - 1e-9), math.ceil(B / (len(others) + 1)))

    def _needed(self, worker, now):
        """Can the other suppliers not fill a step without `worker` (their caps, _cap, sum to
        less than B)? Then its groups are never too late to be asked for (_in_time): the step
        waits for them."""
        suppliers = self._suppliers(now) | {worker}
        caps = sum(self._cap(w, now, suppliers) for w in suppliers - {worker})
        return caps < self.core.contract["groups_per_step"]

    def _pick(self, n, now):
        """The buffer positions of up to n groups this step may take, oldest first: a worker's
        groups beyond its cap (_cap, less what this step already took from it) wait in the
        buffer for the next step. A trainer that takes more than B groups at one version takes
        as many caps as steps' worth."""
        core = self.core
        steps = max(1, math.ceil((core.taken + n) / core.contract["groups_per_step"]))
        room, picked, suppliers = {}, [], self._suppliers(now)
        for i, g in enumerate(core.groups):
            if len(picked) == n:
                break
            w = g["worker"]
            if w not in room:
                room[w] = steps * self._cap(w, now, suppliers) - self.taken_by[w]
            if room[w] > 0:
                room[w] -= 1
                picked.append(i)
        return picked

    def _within_caps(self, n):
        """RolloutBuffer._oldest of the groups this step may take (_pick): up to n, oldest first;
        the groups before them it may not take stay in the buffer, in order."""
        k, held = self._over_caps(n)
        try:
            return self.core._oldest(k)
        finally:
            self.core.groups.extendleft(reversed(held))

    def _over_caps(self, n):
        """(k, held): the k groups this step may take (_pick) first in the buffer; out of it, in
        order, `held`: those before the last of them that it may not take."""
        core = self.core
        picked = self._pick(n, time.monotonic())
        if not picked:
            return 0, []
        mine, last = set(picked), picked[-1]
        held = [g for i, g in enumerate(core.groups) if i < last and i not in mine]
        core.groups = collections.deque(g for i, g in enumerate(core.groups)
                                        if i in mine or i > last)
        return len(picked), held

    def _allowance(self, worker, steps, now):
        """The groups `worker` may still be leased for the `steps` steps a lease serves: its cap
        for each, less what it supplied to the current step and what it has buffered. So groups
        of one worker never pile up beyond its share."""
        mine = sum(g["worker"] == worker for g in self.core.groups)
        return steps * self._cap(worker, now) - self.taken_by[worker] - mine

    # ---- the trainer's drops

    def reject(self, reports):
        """The trainer dropped these delivered groups (POST /reject: [{group_id, worker, kind,
        why}]): each one delivered at the current version is given back to the step's quota (the
        step still needs a group; a replica is leased it at once); its worker is banned. Returns
        {"given_back", "banned"}."""
        with self.core.cond:
            back, banned = 0, []
            for r in reports:
                worker = self.taken_ids.pop(r["group_id"], None)
                if worker is not None:  # delivered at this version: the step still lacks it
                    self.core.taken -= 1
                    self.taken_by[worker] -= 1
                    back += 1
                worker = worker or r["worker"]
                self.counts["dropped_by_trainer"] += 1
                if worker in self.trainer_drops or len(self.trainer_drops) < MAX_WORKERS:
                    self.trainer_drops[worker] = self.trainer_drops.get(worker, 0) + 1
                if worker not in self.banned:
                    banned.append(worker)
                    self._ban(worker, f"the trainer dropped its group {r['group_id'][:80]!r}: "
                                      f"{r['kind']}: {r['why'][:200]}")
            self.core.cond.notify_all()
            return {"given_back": back, "banned": banned}

    def _ban(self, worker, why):
        """Lease `worker` nothing more and refuse its groups. Those it has buffered are still
        handed out: the trainer checks each one as it checks everyone's."""
        if len(self.banned) < MAX_WORKERS:
            self.banned[worker] = why
        self.core.leases.pop(worker, None)
        self.terms.pop(worker, None)

    def _not_banned(self, workers):
        """403 for a worker the trainer caught (reject)."""
        for w in workers:
            if w in self.banned:
                raise ApiError(f"worker {w[:80]!r} is banned from this run: {self.banned[w]}. "
                               "A replica of this repository never sends such a group: check its "
                               "--task, --model and version (rollout.py)", 403)

    # ---- add()'s checks, in the order add() calls them

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
            held = lease.version if (lease := self.terms.get(w)) else 0
            if v < held:
                raise ApiError(f"policy_version {v} of group {g['group_id'][:80]!r} is older than "
                               f"v{held}, the adapter {w[:80]!r} said it held at GET /quota", 409)
            left[w] = left.get(w, self.core.leases.get(w, 0)) - 1
            (kept if left[w] >= 0 else over).append(g)
        return kept, over

    def _room(self, fresh, posted):
        """The bytes `fresh` takes; 429 (the whole POST refused) when the buffer cannot hold it."""
        size, buffered = sum(map(group_bytes, fresh)), len(self.core.groups)
        if buffered + len(fresh) > self.max_groups or self.nbytes + size > self.max_bytes:
            self.counts["refused_full"] += posted
            mb, most_mb = self.nbytes / 2**20, self.max_bytes / 2**20
            raise ApiError(f"buffer full ({buffered} groups of --max-groups "
                           f"{self.max_groups}, {mb:.3g} MB of --max-buffer-mb "
                           f"{most_mb:.3g}); retry in {RETRY_AFTER_S} s", 429,
                           {"Retry-After": str(RETRY_AFTER_S)})
        return size

    def _remember(self, new, dups, over, flat, owed):
        """Kept groups' ids (the last remember_ids), the counters; a sender whose lease (`owed`
        before the POST) its groups completed is measured (_measured)."""
        self.seen.update(g["group_id"] for g in new)
        self.seen_order.extend(g["group_id"] for g in new)
        while len(self.seen_order) > self.remember_ids:
            self.seen.discard(self.seen_order.popleft())
        self._count("accepted", new)
        self._count("duplicates", dups)
        self._count("over_quota", over)
        self._count("dropped_stale", [g for g in new if not self.core._usable(g)])
        self.counts["dropped_zero_variance"] += flat
        for w, n in owed.items():
            if n > 0 and self.core.leases.get(w, 0) == 0:
                self._measured(w)
        self.silent.difference_update(owed)  # it delivers again

    # ---- the bookkeeping: the bounded table of leases, the counters, deliveries, /stats

    def _bound_leases(self, worker):
        """The leases are bounded: a new name beyond MAX_WORKERS drops the expired ones, or 429."""
        if worker in self.terms or len(self.terms) < MAX_WORKERS:
            return
        now = time.monotonic()
        self.terms = {w: lease for w, lease in self.terms.items() if lease.until > now}
        self.core.leases = {w: n for w, n in self.core.leases.items() if w in self.terms}
        self.pace = {w: p for w, p in self.pace.items() if w in self.terms}
        self.probe_gap = {w: p for w, p in self.probe_gap.items() if w in self.terms}
        self.delivered_at = {w: p for w, p in self.delivered_at.items() if w in self.terms}
        self.silent &= set(self.terms)
        self.core.kept = {w: k for w, k in self.core.kept.items() if w in self.terms}
        if len(self.terms) >= MAX_WORKERS:
            raise ApiError(f"worker: {MAX_WORKERS} other names hold leases; retry once one "
                           "expires (--lease-timeout)", 429, {"Retry-After": str(RETRY_AFTER_S)})

    def _count(self, key, groups, sign=1):  # in total and for each group's worker
        self.counts[key] += sign * len(groups)
        for g in groups:
            known = g["worker"] in self.workers or len(self.workers) < MAX_WORKERS
            name = g["worker"] if known else "(other)"
            self.workers.setdefault(name, dict.fromkeys(WORKER_COUNTS, 0))[key] += sign

    def count(self, key):
        with self.core.cond:
            self.counts[key] += 1

    def _dropped_stale(self, stale):
        self.nbytes -= sum(map(group_bytes, stale))
        self._count("dropped_stale", stale)

    def _deliver(self, groups, version, sign=1):  # sign -1: given back
        """The counters of groups handed to the trainer at `version`: in all, per worker, this
        step's (its wait when it completes the batch), their staleness."""
        core = self.core
        self.nbytes -= sign * sum(map(group_bytes, groups))
        self._count("delivered", groups, sign)
        if version == core.trainer_version:  # this step's, in all and per worker
            if sign < 0:
                core.taken -= len(groups)
            self._taken_from(groups, sign)
            if sign > 0 and core.taken >= core.contract["groups_per_step"] > core.taken - len(
                    groups):  # the step's batch is complete: how long it took (its wait)
                self.fill_s = (self.fill_s + time.monotonic() - self.version_at) / 2
        for g in groups:
            self.staleness[version - g["policy_version"]] += sign
        core.cond.notify_all()  # a replica waiting for a quota may now have one

    def _taken_from(self, groups, sign=1):
        """This step's groups per worker, and their ids (reject); sign -1: given back."""
        for g in groups:
            self.taken_by[g["worker"]] += sign
            if sign > 0:
                self.taken_ids[g["group_id"]] = g["worker"]
            else:
                self.taken_ids.pop(g["group_id"], None)

    def give_back(self, groups, version, delivery=None):
        """Groups whose GET /batch answer could not be written (the client left): back to the
        front."""
        with self.core.cond:
            self.unconfirmed.pop(delivery, None)
            self._give_back(groups, version)

    def _give_back(self, groups, version):
        self._deliver(groups, version, -1)
        self.counts["returned"] += len(groups)
        self.core.groups.extendleft(reversed(groups))
        self._dropped_stale(self.core._drop_stale())  # if the trainer moved on meanwhile

    def _hold(self, groups, ack):
        """With `ack` (the client confirms what it reads), the groups are a numbered delivery,
        held until the next take's ack or set_version confirms it: its number, else None."""
        if not groups or ack is None:
            return None
        self.deliveries += 1
        self.unconfirmed[self.deliveries] = (groups, self.core.trainer_version)
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

    def stats(self):
        core = self.core
        with core.cond:
            now = time.monotonic()
            staleness = {str(k): v for k, v in sorted(self.staleness.items()) if v}
            live = {w: n for w, n in core.leases.items()
                    if w in self.terms and self.terms[w].until > now}
            return {**self.counts, "buffered": len(core.groups),
                    "buffered_mb": round(self.nbytes / 2**20, 1),
                    # the groups a blocked trainer still lacks
                    "waiting": max(0, self.waiting - len(core.groups)),
                    "leased": {w: n for w, n in live.items() if n > 0},
                    "replicas": {w: {"share": round(share, 3),
                                     "leased": max(0, core.leases.get(w, 0)),
                                     "groups_per_s": round(1 / self.pace[w], 3) if w in self.pace
                                     else None} for w, share in self._shares(now).items()},
                    "unconfirmed": sum(len(gs) for gs, _ in self.unconfirmed.values()),
                    "trainer_version": core.trainer_version, "state": core.state(),
                    "max_groups": self.max_groups, "contract": core.contract,
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
