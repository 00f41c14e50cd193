"""proxy.py — the hub of an async GRPO run, on the standard library: the run's settings, the
rollout buffer, the trainer's version, the generation quota and the end of the run.

The proxy's part of a GRPO step (README's numbers), in this file's order:
    4-5. the buffer   replicas POST groups (RolloutBuffer.add); the trainer takes B per step,
                      oldest first (RolloutBuffer.take, GET /batch)
    9-10. handshake   the trainer announces each adapter version (set_version, POST /version);
                      each replica asks how many groups to make (quota, GET /quota)
RolloutBuffer is complete for valid groups from honest replicas. Around it, without a line
inside it: support/worker_bounds.py's GuardedBuffer (what a hostile or broken peer meets, one
worker's bounded share, the leases of an unequal pool), support/proxy_service.py and
support/http_hardening.py (credentials, HTTP). The contract and the group record: contract.py.

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
import math
import sys
import threading

from support.cli import proxy_args
from support.contract import (CONTRACT, INDEX, MAX_COMPLETIONS, MAX_INT, MAX_NAME, NAME,
                              ConfigError, check_contract, check_fields, validate_rollouts)
from support.defaults import DEFAULTS  # serve()'s keywords: proxy.py's flags' defaults
from support.http_hardening import ApiError, check, parse_query, query_int, query_seconds
from support.proxy_service import (LIMITS, ProxyHandler, ProxyServer, body_limit, check_service,
                                   read_reports, replica_token, run_until_done, settle)
from support.worker_bounds import GuardedBuffer

log = logging.getLogger("proxy")

MIN_KEPT = 0.125  # --zero-variance drop: a lease scaled up at most 1 / MIN_KEPT times (_lease_size)


# ---- ALGO: the run's state, under one lock: 4-5. the buffer  9-10. the version handshake

class RolloutBuffer:
    """The run's state: the usable groups (oldest adapter first), the trainer's version, the
    groups this step took, the groups each replica was leased and has not delivered yet.
    Complete for valid groups (support/contract.py's validate_rollouts) from honest replicas."""

    def __init__(self, contract=None):
        c = self.contract = dict(CONTRACT, **(contract or {}))
        check_contract(c)  # ConfigError naming a setting that cannot work
        self.cond = threading.Condition()  # one lock for all of it
        self.groups = collections.deque()  # usable groups, oldest adapter first
        self.trainer_version = None  # unknown until the trainer announces itself (POST /version)
        self.taken = 0  # groups handed out at this version (a step may take them in parts)
        self.leases = {}  # worker -> groups /quota leased it that have not arrived yet
        self.kept = {}  # drop mode: worker -> did its last 128 groups have a signal?
        self.done = self.closed = False

    # ---- ALGO, 4-5. the buffer: replicas add groups, the trainer takes them, oldest adapter first

    def add(self, groups):
        """Buffer the usable groups of a POST: one more than --max-staleness versions behind the
        trainer is dropped, and under --zero-variance drop one whose rewards are all equal
        (DAPO: no signal). Each group counts against its sender's lease."""
        with self.cond:
            usable = [g for g in groups if self._usable(g)]
            fresh = [g for g in usable if self._varied(g)]
            if self.contract["zero_variance"] == "drop":  # each replica's share kept: _lease_size
                for g in usable:
                    mine = self.kept.setdefault(g["worker"], collections.deque(maxlen=128))
                    mine.append(self._varied(g))
            for w in (g["worker"] for g in groups if self.leases.get(g["worker"], 0) > 0):
                self.leases[w] -= 1
            self._buffer(fresh)
            self.cond.notify_all()
            return {"accepted": len(groups), "stale": len(groups) - len(usable),
                    "zero_variance": len(usable) - len(fresh),
                    "trainer_version": self.trainer_version}

    def take(self, n, timeout, gone=lambda: False, enough=None, wait=None, pick=None):
        """(groups, version): the n oldest usable groups, waiting up to `timeout` s for n (no
        busy wait; fewer at the timeout or the end); none if `gone()` (the client left). Its
        parts, each replaceable (GuardedBuffer passes a pool's): `enough` (n buffered), `wait`
        (cond.wait_for), `pick` the groups handed out (_oldest)."""
        enough = enough or (lambda: len(self.groups) >= n)
        with self.cond:
            # the client answers this by announcing its version again
            if self.trainer_version is None:
                raise ApiError("no trainer version yet: POST /version first (a restarted proxy "
                               "forgets it)", 409, payload={"need_version": True})
            (wait or self.cond.wait_for)(lambda: enough() or self.done or self.closed, timeout)
            out = [] if gone() else (pick or self._oldest)(n)
            self.taken += len(out)
            self.cond.notify_all()  # a replica waiting for a quota may now have one
            return out, self.trainer_version

    def _oldest(self, n):
        """Out of the buffer: its n oldest groups (all of them if it holds fewer)."""
        return [self.groups.popleft() for _ in range(min(n, len(self.groups)))]

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
                self.taken = 0
            self.trainer_version = version
            self.cond.notify_all()
            return {"dropped": len(self._drop_stale()), "trainer_version": version}

    def quota(self, worker, version, most, timeout, rule=None, wait=None, lease=None):
        """Long-poll: wait up to `timeout` s for a quota > 0, a newer adapter to load, or the end
        of the run. The answer is the replica's lease: the groups to make now (a replica asks
        again once its last groups are out). Its parts, each replaceable (GuardedBuffer passes a
        pool's): `rule` how many (_quota; a pool's calls it with its terms), `wait` the wait
        (cond.wait_for), `lease` its record (self.leases)."""
        rule, wait = rule or self._quota, wait or self.cond.wait_for
        with self.cond:
            t0 = self.trainer_version
            wait(lambda: (self.done or self.closed or self.trainer_version != t0
                          or (t0 is not None and version < t0)  # a newer adapter: at once
                          or rule(worker, version, most)[0] > 0), timeout)
            if self.done:
                return {"groups": 0, "trainer_version": self.trainer_version, "state": "done",
                        "why": "the trainer is done: exit"}
            n, why = rule(worker, version, most)  # how many: _quota below
            (lease or self.leases.__setitem__)(worker, n)
            return {"groups": n, "trainer_version": self.trainer_version, "why": why,
                    "state": self.state()}

    def _quota(self, worker, version, most, leased=None, ahead=1, step=None, share=None):
        """(groups, why) for a replica holding adapter `version`: how many groups to make now so
        that the trainer never waits and no group is older than it must be. The trainer at t
        takes B groups a step; groups made now with v serve trainer versions up to v + S and are
        wanted one step ahead (t + 1). So: the groups of steps t .. min(v + S, t + 1), less those
        this step took, those buffered and those leased to the other replicas (_lack), at most
        a step's B (_lease_size; at most `most`). With one replica: min((min(v + S, t + 1) - t +
        1) * B - taken - buffered, B) groups.
        A pool of unequal replicas (GuardedBuffer) passes its terms; None is one replica's:
        `leased` the other replicas' groups that will come (all their leases), `ahead` steps
        ahead (1), `step` this replica's lease for a step (B), `share` the groups it may still
        make of those steps (all of them)."""
        if leased is None:
            leased = sum(n for w, n in self.leases.items() if w != worker)
        lack, why = self._lack(version, ahead, leased)
        if lack <= 0:
            return 0, why
        if share is not None and share <= 0:
            return 0, ("this replica made its share of the steps it can serve "
                       "(--max-worker-share): the others make the rest")
        lack = lack if share is None else min(lack, share)
        return self._lease_size(worker, lack, most, step), None

    def _lack(self, version, ahead, leased):
        """(groups, why): how many groups made now with adapter `version` the trainer lacks: those
        of steps t .. min(v + S, t + ahead), less those this step took, those buffered and
        `leased` on their way; 0 and why when none."""
        c, t = self.contract, self.trainer_version
        S, B = c["max_staleness"], c["groups_per_step"]
        if t is None:
            return 0, "the trainer has not announced itself yet"
        if version < t - S:
            return 0, (f"v{version} is more than max_staleness {S} behind the trainer's v{t}: load "
                       "a newer adapter")
        horizon = min(version + S, t + ahead)
        lack = (horizon - t + 1) * B - self.taken - len(self.groups) - leased
        if lack <= 0:
            return 0, (f"the trainer has what it needs up to v{horizon} ({len(self.groups)} groups "
                       f"buffered, {leased} leased to other replicas)")
        return lack, None

    def _lease_size(self, worker, lack, most, step=None):
        """How many of the `lack` groups one lease holds: at most `most` and a `step` of groups
        (a whole step's B unless given). Under --zero-variance drop each is scaled up by the share
        of this replica's groups kept lately, in one lease (one engine batch): Laplace's rule of
        succession over its recent groups (a prior of one kept, one dropped), so 0 kept of 4
        reads 1/6; at least MIN_KEPT. Another replica's flat groups do not move it."""
        step = self.contract["groups_per_step"] if step is None else step
        kept = 1.0
        if self.contract["zero_variance"] == "drop":
            mine = self.kept.get(worker, ())
            kept = max(MIN_KEPT, (sum(mine) + 1) / (len(mine) + 2))
        return min(most, math.ceil(lack / kept), max(1, math.ceil(step / kept)))

    # ---- the buffer's order and its staleness; the end of the run

    def _usable(self, g):
        t = self.trainer_version
        return t is None or 0 <= t - g["policy_version"] <= self.contract["max_staleness"]

    def _varied(self, g):
        """Is the group kept: rewards not all equal, or --zero-variance keep?"""
        return self.contract["zero_variance"] != "drop" or len(
            {c["reward"] for c in g["completions"]}) > 1

    def _buffer(self, groups):
        """Into the buffer in adapter order, oldest first (arrival order within a version): a slow
        replica's groups, made with an older adapter, are taken before they turn stale."""
        for g in groups:
            i = len(self.groups)
            while i and self.groups[i - 1]["policy_version"] > g["policy_version"]:
                i -= 1
            self.groups.insert(i, g)

    def _drop_stale(self):
        """Drop the buffered groups the trainer's version made too stale; returns them."""
        stale = [g for g in self.groups if not self._usable(g)]
        self.groups = collections.deque(g for g in self.groups if self._usable(g))
        return stale

    def state(self):
        return "done" if self.done else "waiting" if self.trainer_version is None else "running"

    def finish(self):
        """The trainer is done: /quota answers "done" from now on."""
        with self.cond:
            self.done = True
            self.cond.notify_all()
            return {"state": "done", "trainer_version": self.trainer_version}

    def close(self):
        """The server stops: the long polls return."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()


# ---- SUPPORT: the routes that reach the buffer, serve() and main(). Credentials and HTTP
# (support/proxy_service.py, support/http_hardening.py) hand a valid request to _route as sent
# (tests/test_proxy.py::test_a_valid_run_passes_the_http_layer_as_sent)

class Routes(ProxyHandler):
    """ProxyHandler (the token, its bound worker, the errors) with the routes to the buffer b,
    serve()'s GuardedBuffer: RolloutBuffer's add and take plus a pool's bookkeeping (add's
    `limited`: a replica's credential, its groups count against its lease, and `failed`; take's
    `ack`, and a delivery number back), with the same answers to one replica's valid groups
    (test_valid_groups_from_one_replica_go_through_the_guarded_buffer_unchanged)."""

    def _route(self, path, query):
        b = self.buffer
        if path == "/rollouts":  # each group checked (400 naming the field) before anything
            body = self.read_json()
            groups = validate_rollouts(body, b.max_groups, b.contract)
            for i, g in enumerate(groups):
                self._check_worker(g["worker"], f"groups[{i}].worker")
            # groups a reward function failed on, dropped by the replica: against its lease too
            failed = (body["worker"], body["reward_errors"]) if body.get("reward_errors") else None
            if failed:
                self._check_worker(failed[0], "worker")
            return b.add(groups, limited=self.bound is not None, failed=failed)
        if path == "/batch":
            q = parse_query(query, {"groups": None, "timeout": "0", "ack": ""})
            ack = query_int(q, "ack", 0, MAX_INT) if q["ack"] else None
            n = query_int(q, "groups", 1, b.max_groups)
            groups, version, delivery = b.take(n, query_seconds(q), self.peer_gone, ack)
            # reward_errors: the run's groups the replicas dropped for a failed reward function
            answer = {"groups": groups, "trainer_version": version,
                      "reward_errors": b.counts["reward_errors"]}
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
        if path == "/version":  # and, from a trainer of this version, what its model takes
            body = self.read_json()
            check_fields(body, "body", {"version": INDEX, **{k: v for k, v in LIMITS.items()
                                                               if k in body}})
            return b.set_version(body.pop("version"), body)
        if path == "/reject":
            return b.reject(read_reports(self.read_json(), b.max_groups))
        if path == "/done":
            check_fields(self.read_json(), "body", {})
            return b.finish()
        return b.contract if path == "/config" else b.stats() if path == "/stats" else {"ok": True}


def serve(host=DEFAULTS["host"], port=0, max_groups=DEFAULTS["max_groups"], max_body_mb=None,
          max_buffer_mb=DEFAULTS["max_buffer_mb"], token=None, rollout_token=None, log_every=60.0,
          request_timeout=DEFAULTS["request_timeout"], max_connections=DEFAULTS["max_connections"],
          lease_timeout=DEFAULTS["lease_timeout"], max_worker_share=DEFAULTS["max_worker_share"],
          **contract):
    """Start the proxy in a daemon thread: (server, thread), its port server.server_address[1]
    (port 0: any free one). The keywords: proxy.py's flags; **contract: GET /config's."""
    token, rollout_token = token or None, rollout_token or None
    check_service(host, token, rollout_token, contract, max_groups, max_buffer_mb, max_body_mb,
                  request_timeout, max_connections, max_worker_share)  # ConfigError: what to change
    buffer = GuardedBuffer(RolloutBuffer(settle(contract)), max_groups,
                           int(max_buffer_mb * 2**20), lease_timeout=lease_timeout,
                           max_worker_share=max_worker_share)
    max_body = body_limit(buffer.contract) if max_body_mb is None else int(max_body_mb * 2**20)
    # the state of this server bound to its handler class: no module globals
    handler = type("BoundRoutes", (Routes,), dict(
        buffer=buffer, token=token, rollout_token=rollout_token, max_body=max_body,
        timeout=request_timeout))
    server = ProxyServer((host, port), handler, max_connections, log_every)
    thread = threading.Thread(target=server.serve_forever, args=(0.2,), name="proxy", daemon=True)
    thread.start()
    return server, thread


def main(argv=None):
    args = vars(proxy_args(argv))  # support/cli.py: the flags, from support/defaults.py's rows
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

