"""proxy.py — the hub of an async GRPO run, on the standard library: the run's settings, the
rollout buffer, the trainer's version, the generation quota and the end of the run.

The proxy's part of a GRPO step, in this file's order (the state, all of it in RolloutBuffer):
    4-5. the buffer   replicas POST groups (RolloutBuffer.add); the trainer takes B per step,
                      oldest first (RolloutBuffer.take, GET /batch)
    9-10. handshake   the trainer announces each adapter version (set_version, POST /version);
                      each replica asks how many groups to make (quota, GET /quota)
The contract (CONTRACT: the settings every role reads from GET /config) and the group record
(GROUP) are shared by all three roles: support/contract.py. The rest is support, not
needed to follow a step: support/leases.py (the lease arithmetic, add()'s checks, counters),
support/proxy_service.py (credentials, the HTTP routes), support/http_hardening.py.

    any token (the trainer's or a replica's):
    GET  /config    the contract          GET  /quota     a replica: how many groups to make now
    POST /rollouts  a replica: groups     GET  /stats     counters
    the trainer's token only:
    GET  /batch     usable groups, oldest first (long poll)
    POST /version   its version, after each adapter it publishes (and what its model takes)
    POST /reject    groups it dropped: back to the quota, their workers banned
    POST /done      the run is over (/quota says so, then proxy.py exits)
    no token:       GET /healthz

A group more than --max-staleness versions behind the trainer is dropped and counted, never handed
out; so is a replica's group beyond what /quota leased it (over_quota). While others supply, a
step takes at most --max-worker-share of its groups from one worker. Fields and status codes:
docs/protocol.md; hostile peers: docs/hostile-peers.md. Tokens travel as `X-Proxy-Token: <token>`.

    python proxy.py --port 8000 --num-generations 8 --groups-per-step 16 --max-staleness 4  # local
    PROXY_TOKEN=t ROLLOUT_TOKEN=r python proxy.py --host 0.0.0.0 ...  # exposed: both tokens
    python -m pytest tests/test_proxy.py tests/test_proxy_fuzz.py -q; python bench/bench_proxy.py
"""

import collections
import json
import logging
import sys
import threading
import time

from support.contract import CONTRACT, MAX_NAME, NAME, ConfigError, check_contract
from support.http_hardening import ApiError
# RolloutBuffer's lease sizing, add()'s checks and its bookkeeping: mixins in support/leases.py
from support.leases import (WORKER_COUNTS, AddChecks, BufferRecords, Lease, LeaseSizing,
                            group_bytes)
from support.cli import proxy_args
from support.proxy_service import (ProxyHandler, ProxyServer, body_limit, check_service,
                                   replica_token, run_until_done, settle)
# one worker's bounded share of a step, the trainer's drops: a mixin in support/worker_bounds.py
from support.worker_bounds import MAX_WORKER_SHARE, WorkerBounds

log = logging.getLogger("proxy")


# ---- ALGO: the run's state, under one lock: 4-5. the buffer  9-10. the version handshake

class RolloutBuffer(LeaseSizing, AddChecks, BufferRecords, WorkerBounds):
    """The run's state: a queue of usable groups (oldest adapter first) bounded in groups and
    bytes, the trainer's version and pace, the replicas' leases and paces. accepted = delivered +
    dropped_stale + dropped_zero_variance + buffered, always. Its lease arithmetic, add()'s
    checks and its counters are mixins in support/leases.py."""

    def __init__(self, contract=None, max_groups=4096, max_bytes=2**30, remember_ids=1_000_000,
                 lease_timeout=120.0, max_worker_share=MAX_WORKER_SHARE):
        c = self.contract = dict(CONTRACT, **(contract or {}))
        check_contract(c)  # ConfigError naming a setting that cannot work
        self.cond = threading.Condition()  # one lock for all of it
        # the state the step reads: the buffer (oldest adapter first), the trainer's version,
        # the groups delivered at that version (a step may take them in parts), the leases
        self.groups = collections.deque()
        self.trainer_version = None  # unknown until the trainer announces itself (POST /version)
        self.taken = 0
        self.leases = {}  # worker -> Lease (n 0: asking)
        self.done, self.closed, self.started = False, False, time.time()

        # ---- bookkeeping for the mixins of support/leases.py and support/worker_bounds.py
        self.max_groups, self.max_bytes, self.remember_ids = max_groups, max_bytes, remember_ids
        self.lease_timeout, self.max_worker_share = lease_timeout, max_worker_share
        self.nbytes = 0  # group_bytes() of the buffered groups
        self.seen, self.seen_order = set(), collections.deque()  # the last `remember_ids` group_ids
        self.counts = dict.fromkeys(["received", *WORKER_COUNTS, "dropped_zero_variance",
                                     "refused_full", "returned", "rejected",
                                     "refused_connections", "closed_idle",
                                     "dropped_by_trainer"], 0)
        self.workers = {}  # worker name -> its own WORKER_COUNTS
        # when the trainer announced its version (monotonic s); lately (moving averages): seconds
        # per version, and seconds from a version's announcement to its batch complete (its wait)
        self.version_at, self.step_s, self.fill_s = None, None, 0.0
        # the groups taken at this version per worker, and their group_ids (POST /reject)
        self.taken_by, self.taken_ids = collections.Counter(), {}
        # the trainer's drops: worker -> why it is banned, worker -> groups the trainer dropped
        self.banned, self.trainer_drops = {}, {}
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

    # ---- ALGO, 4-5. the buffer: replicas add groups, the trainer takes them, oldest adapter first

    def add(self, groups, limited=False):
        """Buffer the new, usable groups of a validated POST; 429 (nothing kept) when they don't
        fit. `limited` (a replica's credential): new groups beyond the sender's lease are counted,
        dropped."""
        self._fits(groups)  # 413: more than the whole buffer
        with self.cond:
            t = self.trainer_version
            self._not_ahead(groups, t)  # 409: a group no adapter of the trainer made
            self._not_banned({g["worker"] for g in groups})  # 403: the trainer caught its sender
            # a group_id seen before, or twice in this POST, is a retry: counted, not kept
            new, dups, over = self._new(groups, limited)
            self.counts["received"] += len(groups)
            fresh, flat = [g for g in new if self._usable(g)], []  # too stale: dropped
            if self.contract["zero_variance"] == "drop":  # equal rewards: no signal (DAPO)
                fresh, flat = self._varied(fresh)
            size = self._room(fresh, len(groups))  # 429, nothing kept, when the buffer is full
            self._remember(new, dups, over, flat)  # the ids, the counters, the senders' leases
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
            self._confirm(ack)  # the trainer read delivery `ack`; any other went unread: back
            self.waiting += n  # seen by /stats while the wait has released the lock
            # no busy wait; at most --max-worker-share of a step from one worker while another
            # supplies (the rest wait for the next step)
            out = self._take_within_shares(n, timeout, gone)
            self.waiting -= n
            self._deliver(out, self.trainer_version)
            return out, self.trainer_version, self._hold(out, ack)  # until the next ack

    # ---- ALGO, 9-10. the version handshake: how a new adapter reaches the replicas
    #   a. trainer.publish writes the adapter's files, its manifest, then adapters/LATEST (sync.py)
    #   b. the trainer POSTs /version v: set_version drops the groups now too stale, wakes the polls
    #   c. each replica's GET /quota (quota) returns at once: v is past the adapter it holds
    #   d. rollout.Replica.step sees it, Replica.refresh reads LATEST, pulls v and hot-loads it
    #   e. its next /quota says it holds v: _quota leases it the groups of the steps v can serve

    def set_version(self, version, limits=None):
        """The trainer is now at `version`: drop the groups that became stale. `limits`: what its
        model takes (vocab_size, context_length), served in GET /config and checked in POST
        /rollouts from now on."""
        with self.cond:
            self.contract.update(limits or {})
            if self.trainer_version is not None and version < self.trainer_version:
                raise ApiError(f"version {version} is lower than this proxy's trainer_version "
                               f"{self.trainer_version} (a trainer resumed from older state, or "
                               "another run's trainer? restart the proxy)", 409)
            if version != self.trainer_version:  # counted per trainer version
                self.taken, self.taken_by, self.taken_ids = 0, collections.Counter(), {}
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
            self._not_banned([worker])  # 403: the trainer caught it (reject)
            self._bound_leases(worker)  # 429 when MAX_WORKERS other names hold one
            # A replica asks again once its last groups are out: its lease ends, but it asks.
            t0 = self.trainer_version
            until = time.monotonic() + timeout + self.lease_timeout
            self.leases[worker] = Lease(0, until, version)
            self.cond.notify_all()
            ready = lambda: (self.done or self.closed or self.trainer_version != t0  # noqa: E731
                             or (t0 is not None and version < t0)  # a newer adapter: at once
                             or self._quota(worker, version, most)[0] > 0)
            self._wait_until(ready, timeout)  # also wakes when another's lease expires
            if self.done:
                self.told_done.add(worker)
                return {"groups": 0, "trainer_version": self.trainer_version, "state": "done",
                        "why": "the trainer is done: exit"}
            n, why = self._quota(worker, version, most)  # how many: _quota below
            self._lease(worker, version, n, why)  # its expiry; a slow replica's next probe
            return {"groups": n, "trainer_version": self.trainer_version, "why": why,
                    "state": self.state()}

    def _quota(self, worker, version, most):
        """(groups, why) for a replica holding adapter `version`: how many groups to make now so
        that the trainer never waits and no group is older than it must be. The trainer at t
        takes B groups a step; groups made now with v serve trainer versions up to v + S and are
        wanted one step ahead (t + 1; more for a pool whose leases outlast a trainer step:
        _ahead). So: the groups of steps t .. min(v + S, t + ahead), less those this step took,
        those buffered and those leased to replicas that keep up (_coming), at most this
        replica's share of a step (_lease_size), and only what arrives in time (_in_time).
        With one replica: min((min(v + S, t + 1) - t + 1) * B - taken - buffered, B) groups."""
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
        leased = sum(n for n in others if n > 0)
        horizon = min(version + S, t + self._ahead(worker, 1 + len(others), now))
        lack = (horizon - t + 1) * B - self.taken - len(self.groups) - leased
        if lack <= 0:
            return 0, (f"the trainer has what it needs up to v{horizon} ({len(self.groups)} groups "
                       f"buffered, {leased} leased to other replicas)")
        # while others supply, one worker makes at most its share of each step (_cap)
        if (mine := self._allowance(worker, horizon - t + 1, now)) <= 0:
            return 0, (f"this worker supplied its share of the steps up to v{horizon} "
                       f"(--max-worker-share {self.max_worker_share:g}): the others make the rest")
        n = self._lease_size(worker, min(lack, mine), most, now)
        return self._in_time(worker, version, n, now)

    # ---- the buffer's order and its staleness; the end of the run. The lease arithmetic
    # (_coming, _ahead, _lease_size, _in_time, _expiry), add()'s checks and the counters: the
    # mixins in support/leases.py

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

    def _deliver(self, groups, version, sign=1):  # sign -1: given back
        self.nbytes -= sign * sum(map(group_bytes, groups))
        self._count("delivered", groups, sign)
        if version == self.trainer_version:  # this step's, in all and per worker
            self.taken += sign * len(groups)
            self._taken_from(groups, sign)
            if sign > 0 and self.taken >= self.contract["groups_per_step"] > self.taken - len(
                    groups):  # the step's batch is complete: how long it took (its wait)
                self.fill_s = (self.fill_s + time.monotonic() - self.version_at) / 2
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


# ---- SUPPORT: serve() and main(), the wiring. The flags: support/cli.py; the HTTP routes and
# credentials: support/proxy_service.py

def serve(host="127.0.0.1", port=0, max_groups=4096, max_buffer_mb=1024, max_body_mb=None,
          token=None, rollout_token=None, request_timeout=30.0, max_connections=256,
          lease_timeout=120.0, log_every=60.0, max_worker_share=MAX_WORKER_SHARE, **contract):
    """Start the proxy in a daemon thread: (server, thread), its port server.server_address[1].
    **contract: CONTRACT's keys (GET /config serves them)"""
    token, rollout_token = token or None, rollout_token or None
    check_service(host, token, rollout_token, contract, max_groups, max_buffer_mb, max_body_mb,
                  request_timeout, max_connections, max_worker_share)  # ConfigError: what to change
    buffer = RolloutBuffer(settle(contract), max_groups, int(max_buffer_mb * 2**20),
                           lease_timeout=lease_timeout, max_worker_share=max_worker_share)
    max_body = body_limit(buffer.contract) if max_body_mb is None else int(max_body_mb * 2**20)
    # the state of this server bound to its handler class: no module globals
    handler = type("BoundProxyHandler", (ProxyHandler,), dict(
        buffer=buffer, token=token, rollout_token=rollout_token, max_body=max_body,
        timeout=request_timeout))
    server = ProxyServer((host, port), handler, max_connections, log_every)
    thread = threading.Thread(target=server.serve_forever, args=(0.2,), name="proxy", daemon=True)
    thread.start()
    return server, thread


def main(argv=None):
    args = vars(proxy_args(argv))  # support/cli.py: every flag, with its help
    if worker := args.pop("print_replica_token"):
        if not args["rollout_token"] or not NAME[0](worker):
            sys.exit("proxy.py: error: --print-replica-token needs ROLLOUT_TOKEN (or "
                     f"--rollout-token) and a worker name of 1 to {MAX_NAME} characters")
        print(replica_token(args["rollout_token"], worker))
        return
    linger, stats_file = args.pop("linger"), args.pop("stats_file")
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
    run_until_done(server, thread, linger, stats_file)  # then exit: the replicas were told


if __name__ == "__main__":
    main()

