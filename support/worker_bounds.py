"""What one worker's credential can make the run do, bounded: RolloutBuffer's mixin (proxy.py).
Not needed to follow a GRPO step: RolloutBuffer.take, _quota and quota each call one of these,
named for what it guarantees.

    a bounded share  a step takes at most --max-worker-share of its groups from one worker
                     (_cap) while another worker supplies groups (_suppliers), however fast the
                     first one answers: a credential that posts made-up groups the moment it is
                     leased is measured as the fastest replica, and would otherwise be leased
                     the whole step (take: _pick; quota: _allowance; the others' floor:
                     LeaseSizing._shares)
    the trainer's drops  a group the trainer dropped after delivery (POST /reject) is given back
                     to the step's quota, so the trainer never waits on a group nobody makes;
                     its worker is banned: /quota and /rollouts answer it 403 (reject)

The rules in words, with the tests that show them: docs/hostile-peers.md. This module imports no
role file.

    python -m pytest tests/test_proxy.py -q -k "share or reject or banned"
"""

import math
import time

from support.http_hardening import ApiError
from support.leases import LEASE_FLOOR_S, LEASE_SLACK, MAX_WORKERS

MAX_WORKER_SHARE = 0.9  # --max-worker-share's default (docs/hostile-peers.md: why this number)


class WorkerBounds:
    """RolloutBuffer's bounds on one worker: its share of a step (_cap, _pick, _allowance), the
    trainer's drops given back and their senders banned (reject, _not_banned)."""

    def _suppliers(self, now):
        """The workers a step can count on for groups: measured (they delivered a lease), not
        banned, not being probed (LeaseSizing._in_time found them too slow), and holding a lease
        of groups still to come, or just done with one. Both with a grace of LEASE_SLACK x one
        group's time, at least LEASE_FLOOR_S (_supplier_end): the moment between its last group
        and its next /quota, a lease a little late. A dead replica stops counting that long
        after its lease expired."""
        def supplies(w, lease):
            if w not in self.pace or w in self.banned or w in self.probe_gap:
                return False
            return now < self._supplier_end(w, lease)
        return {w for w, lease in self.leases.items() if supplies(w, lease)}

    def _supplier_end(self, w, lease):
        """When measured worker w stops counting as a supplier (monotonic s)."""
        grace = max(LEASE_FLOOR_S, LEASE_SLACK * self.pace[w])
        return max(lease.until + grace if lease.n > 0 else -math.inf,
                   self.delivered_at.get(w, -math.inf) + grace)

    def _cap(self, worker, now, suppliers=None):
        """How many of a step's B groups `worker` may supply: all of them while nobody else
        supplies (one replica, or the others dead); else --max-worker-share of them, rounded up
        to whole groups, and never less than an even split among the suppliers (or no step
        could fill)."""
        B = self.contract["groups_per_step"]
        others = (self._suppliers(now) if suppliers is None else suppliers) - {worker}
        if not others:
            return B
        return max(math.ceil(self.max_worker_share * B - 1e-9), math.ceil(B / (len(others) + 1)))

    def _needed(self, worker, now):
        """Can the other suppliers not fill a step without `worker` (their caps, _cap, sum to
        less than B)? Then its groups are never too late to be asked for (LeaseSizing._in_time):
        the step waits for them."""
        suppliers = self._suppliers(now) | {worker}
        caps = sum(self._cap(w, now, suppliers) for w in suppliers - {worker})
        return caps < self.contract["groups_per_step"]

    def _pick(self, n, now):
        """The buffer positions of up to n groups this step may take, oldest first: a worker's
        groups beyond its cap (_cap, less what this step already took from it) wait in the
        buffer for the next step. A trainer that takes more than B groups at one version takes
        as many caps as steps' worth."""
        steps = max(1, math.ceil((self.taken + n) / self.contract["groups_per_step"]))
        room, picked, suppliers = {}, [], self._suppliers(now)
        for i, g in enumerate(self.groups):
            if len(picked) == n:
                break
            w = g["worker"]
            if w not in room:
                room[w] = steps * self._cap(w, now, suppliers) - self.taken_by[w]
            if room[w] > 0:
                room[w] -= 1
                picked.append(i)
        return picked

    def _take_within_shares(self, n, timeout, gone):
        """Take() under the bound: wait (the lock released) up to `timeout` s for n groups this
        step may take (_pick), the end of the run or a closed proxy; a supplier whose lease or
        grace ends meanwhile is looked at again the moment it ends. Removes and returns them."""
        deadline = time.monotonic() + timeout
        while not (self.done or self.closed):
            now = time.monotonic()
            if len(self._pick(n, now)) >= n or (left := deadline - now) <= 0:
                break
            ends = [end - now for w, lease in self.leases.items() if w in self.pace
                    and (end := self._supplier_end(w, lease)) > now]
            self.cond.wait(min([left, *ends]))
        picked = set() if gone() else set(self._pick(n, time.monotonic()))
        out = [g for i, g in enumerate(self.groups) if i in picked]
        if picked:
            self.groups = type(self.groups)(g for i, g in enumerate(self.groups) if i not in picked)
        return out

    def _taken_from(self, groups, sign=1):
        """This step's groups per worker, and their ids (reject); sign -1: given back."""
        for g in groups:
            self.taken_by[g["worker"]] += sign
            if sign > 0:
                self.taken_ids[g["group_id"]] = g["worker"]
            else:
                self.taken_ids.pop(g["group_id"], None)

    def _allowance(self, worker, steps, now):
        """The groups `worker` may still be leased for the `steps` steps a lease serves: its cap
        for each, less what it supplied to the current step and what it has buffered. So groups
        of one worker never pile up beyond its share."""
        mine = sum(g["worker"] == worker for g in self.groups)
        return steps * self._cap(worker, now) - self.taken_by[worker] - mine

    # ---- the trainer's drops

    def reject(self, reports):
        """The trainer dropped these delivered groups (POST /reject: [{group_id, worker, kind,
        why}]): each one delivered at the current version is given back to the step's quota (the
        step still needs a group; a replica is leased it at once); its worker is banned. Returns
        {"given_back", "banned"}."""
        with self.cond:
            back, banned = 0, []
            for r in reports:
                worker = self.taken_ids.pop(r["group_id"], None)
                if worker is not None:  # delivered at this version: the step still lacks it
                    self.taken -= 1
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
            self.cond.notify_all()
            return {"given_back": back, "banned": banned}

    def _ban(self, worker, why):
        """Lease `worker` nothing more and refuse its groups. Those it has buffered are still
        handed out: the trainer checks each one as it checks everyone's."""
        if len(self.banned) < MAX_WORKERS:
            self.banned[worker] = why
        self.leases.pop(worker, None)

    def _not_banned(self, workers):
        """403 for a worker the trainer caught (reject)."""
        for w in workers:
            if w in self.banned:
                raise ApiError(f"worker {w[:80]!r} is banned from this run: {self.banned[w]}. "
                               "A replica of this repository never sends such a group: check its "
                               "--task, --model and version (rollout.py)", 403)
