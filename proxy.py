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
Support, not needed to follow a step: proxy_leases.py (how many groups a lease holds, add()'s
checks), proxy_server.py (validation, credentials, the HTTP routes, serve(), the CLI),
proxy_client.py (ProxyClient), proxy_http.py (stdlib HTTP hardening).

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
docs/protocol.md; hostile peers: docs/hostile-peers.md. Tokens travel as `X-Proxy-Token: <token>`
(Authorization is left to a gateway such as HF Jobs'). A replica's token is the shared
ROLLOUT_TOKEN, or one bound to its worker name (--print-replica-token).

    python proxy.py --port 8000 --num-generations 8 --groups-per-step 16 --max-staleness 4  # local
    # exposed: the trainer's token, and the replicas' token
    PROXY_TOKEN=t ROLLOUT_TOKEN=r python proxy.py --host 0.0.0.0 ...
    python -m pytest tests/test_proxy.py tests/test_proxy_fuzz.py -q; python bench/bench_proxy.py
"""

import collections
import json
import logging
import os
import signal
import sys
import threading
import time

from support.contract import CONTRACT, MAX_ABS, MAX_NAME, NAME, ConfigError
from support.http_hardening import RETRY_AFTER_S, ApiError
# RolloutBuffer's lease sizing and add()'s checks: mixins, their bodies in support/leases.py
from support.leases import PROBE, AddChecks, LeaseSizing, group_bytes
from support.cli import proxy_args
from support.proxy_service import ProxyHandler, ProxyServer, body_limit, replica_token, settle

log = logging.getLogger("proxy")

MAX_WORKERS = 1024      # per-worker counters kept; further workers are counted under "(other)"
# counted in total and per worker
WORKER_COUNTS = ("accepted", "duplicates", "dropped_stale", "delivered", "over_quota")


# ---- ALGO: the run's state. The contract and the group record every role shares are defined in
# support/contract.py (CONTRACT, GROUP); here: 3. the buffer  4. the version handshake (all of it
# under one lock, in RolloutBuffer)

class Lease:
    """What /quota gave a replica: n groups still to come (0: asking), counted as coming until
    `until` (monotonic s), made with adapter `version`; `given` groups at `since`."""
    __slots__ = ("n", "until", "version", "since", "given")

    def __init__(self, n, until, version, since=0.0, given=0):
        self.n, self.until, self.version, self.since, self.given = n, until, version, since, given


class RolloutBuffer(LeaseSizing, AddChecks):
    """The run's state: a queue of usable groups (oldest adapter first) bounded in groups and
    bytes, the trainer's version and pace, the replicas' leases and paces. accepted = delivered +
    dropped_stale + dropped_zero_variance + buffered, always. Its lease sizing and add()'s
    checks are the mixins in proxy_leases.py."""

    def __init__(self, contract=None, max_groups=4096, max_bytes=2**30, remember_ids=1_000_000,
                 lease_timeout=120.0):
        c = self.contract = dict(CONTRACT, **(contract or {}))
        lo, hi = c["reward_range"] = [float(x) for x in c["reward_range"]]
        works = {"num_generations": c["num_generations"] >= 2,
                 "groups_per_step": c["groups_per_step"] >= 1,
                 "max_staleness": c["max_staleness"] >= 0, "temperature": c["temperature"] > 0,
                 "max_completion_length": c["max_completion_length"] >= 1,
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

    # ---- ALGO, 3. the buffer: replicas add groups, the trainer takes them, oldest adapter first

    def add(self, groups, limited=False):
        """Buffer the new, usable groups of a validated POST; 429 (nothing kept) when they don't
        fit. `limited` (a replica's credential): new groups beyond the sender's lease are counted,
        dropped."""
        self._fits(groups)  # 413: more than the whole buffer
        with self.cond:
            t = self.trainer_version
            self._not_ahead(groups, t)  # 409: a group no adapter of the trainer made
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
            self._bound_leases(worker)  # 429 when MAX_WORKERS other names hold one
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
            n, why = self._quota(worker, version, most)  # how many: proxy_leases.py
            now = time.monotonic()
            if why == PROBE:  # the next probe twice as late; a replica leased again is no more
                self.probe_gap[worker] = 2 * self._probe_gap(worker)
            elif n:
                self.probe_gap.pop(worker, None)
            self.leases[worker] = Lease(n, self._expiry(worker, n, now), version, now, n)
            return {"groups": n, "trainer_version": self.trainer_version, "why": why,
                    "state": self.state()}

    # ---- SUPPORT: how many groups a lease holds (_quota: the step's need, the shares by
    # measured pace, leases that expire) and add()'s checks: LeaseSizing and AddChecks in
    # proxy_leases.py. Here: the buffer's bookkeeping, the end of the run, counters

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


# ---- SUPPORT: serve() and main(), the wiring. The command line: support/cli.py. The HTTP routes, credentials and the stdlib
# hardening: support/proxy_service.py and support/http_hardening.py

def serve(host="127.0.0.1", port=0, max_groups=4096, max_buffer_mb=1024, max_body_mb=None,
          token=None, rollout_token=None, request_timeout=30.0, max_connections=256,
          lease_timeout=120.0, log_every=60.0, **contract):
    """Start the proxy in a daemon thread: (server, thread), its port server.server_address[1].
    **contract: CONTRACT's keys (GET /config serves them)"""
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
    buffer = RolloutBuffer(settle(contract), max_groups, int(max_buffer_mb * 2**20),
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


# ---- the command line: `python proxy.py ...`

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
    if stats_file:  # what the run ends with, also when it ended before anyone asked /stats
        with open(stats_file + ".part", "w") as f:
            json.dump(buf.stats(), f)
        os.replace(stats_file + ".part", stats_file)



if __name__ == "__main__":
    main()

