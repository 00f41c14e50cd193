"""proxy_server.py — proxy.py's support half: what a service on the internet needs around the
run's state. Not needed to follow a GRPO step (that is proxy.py, top to bottom).

    validation   every field of a POST checked before anything changes (validate_group: the group
                 record's schema, proxy.GROUP, and the run's settings)
    credentials  the trainer's token, the replicas' secret R, a replica's name bound to R
    HTTP         the routes (ProxyHandler), the server (ProxyServer), serve(), the command line
                 (main: `python proxy.py` runs it); the stdlib hardening underneath: proxy_http.py

Fields and status codes: docs/protocol.md; hostile peers: docs/hostile-peers.md.

    python -m pytest tests/test_proxy.py tests/test_proxy_fuzz.py -q; python bench/bench_proxy.py
"""

import argparse
import hashlib
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time

import proxy_http  # the stdlib HTTP hardening: deadlines, bounded bodies, connection classes
from proxy import (COMPLETION, CONTRACT, CONTRACT_HELP, GROUP, INDEX, MAX_COMPLETIONS, MAX_INT,
                   MAX_NAME, MIN_LOGPROB, NAME, OLD_NAMES, ConfigError, RolloutBuffer)
from proxy_client import TOKEN_HEADER
from proxy_http import ApiError, check, parse_query, query_int, query_seconds

log = logging.getLogger("proxy")

ROUTES = {"/rollouts": "POST", "/quota": "GET", "/config": "GET", "/stats": "GET",
          "/healthz": "GET", "/batch": "GET", "/version": "POST", "/done": "POST"}
# what the replicas' token opens
REPLICA_PATHS = {"/rollouts", "/quota", "/config", "/stats", "/healthz"}


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
    run's. The length may come under its old name, max_new_tokens, beside or instead of
    max_completion_length: each checked under the name it came as."""
    check(type(g) is dict, where, "must be a JSON object")
    schema = dict(GROUP)
    if "max_new_tokens" in g:
        schema["max_new_tokens"] = GROUP["max_completion_length"]
        if "max_completion_length" not in g:
            del schema["max_completion_length"]
    check_fields(g, where, schema)
    length = "max_completion_length" if "max_completion_length" in g else "max_new_tokens"
    check(g.get("max_new_tokens") in (None, g[length]), f"{where}.max_new_tokens",
          f"{g.get('max_new_tokens')}, but max_completion_length is {g[length]}: send one value")
    # a sampler at another temperature would bias every ratio
    for key, ours in (("temperature", "temperature"), (length, "max_completion_length")):
        flag = "--" + ours.replace("_", "-")
        check(g[key] == contract[ours], f"{where}.{key}", f"{g[key]}, but this run samples with "
              f"{key} {contract[ours]} (proxy.py {flag}): start rollout.py without {flag}, it "
              "takes the proxy's")
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
        check(len(ids) <= g[length], f"{w}.ids", f"{len(ids)} tokens exceed {length} {g[length]}")


def validate_rollouts(payload, max_groups, contract):
    """The groups of a POST /rollouts body, every one checked before anything is changed (kept as
    posted: a group with the length's old name, max_new_tokens, is handed out with it)."""
    body = {"groups": (lambda v: type(v) is list and v != [], "a non-empty list")}
    check_fields(payload, "body", body)
    groups = payload["groups"]
    check(len(groups) <= max_groups, "groups",
          f"{len(groups)} in one POST exceed --max-groups {max_groups}")
    for i, g in enumerate(groups):
        validate_group(g, contract, f"groups[{i}]")
    return groups


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
    per_group = c["num_generations"] * c["max_completion_length"] * 64 + c["max_prompt_length"] * 32
    return max(2**20, c["groups_per_step"] * per_group)


def settle(contract):
    """A serve() call's settings, with a setting's old name (OLD_NAMES: max_new_tokens) set to the
    new one's value; given under both names, they must agree."""
    c = dict(contract)
    for old, new in OLD_NAMES.items():
        if old in c and new in c and c[old] != c[new]:
            raise ConfigError(f"--{new.replace('_', '-')} {c[new]} and its old name "
                              f"--{old.replace('_', '-')} {c[old]} disagree: give one")
        c[new] = c[old] = c.get(new, c.get(old, CONTRACT[new]))
    return c


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
    p = argparse.ArgumentParser(description="The hub of an async GRPO run: contract, rollout "
                                "buffer, quota. Fields and status codes: docs/protocol.md.")
    a = p.add_argument
    a("--host", default="127.0.0.1",
      help="address to listen on; anything but loopback needs a token")
    a("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    # the run's contract: every role takes it from GET /config
    for key, default in CONTRACT.items():
        if key in OLD_NAMES:  # an old name: a second spelling of its new name's flag
            continue
        pair = key == "reward_range"  # LO HI
        olds = ["--" + k.replace("_", "-") for k, new in OLD_NAMES.items() if new == key]
        a("--" + key.replace("_", "-"), *olds, type=float if pair else type(default),
          default=default, help=CONTRACT_HELP[key],
          choices=("keep", "drop") if key == "zero_variance" else None,
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
      help="most seconds a replica's lease counts as coming: 1.5x its measured pace (>= 0.5 s) "
           "once it delivered, this until then")
    a("--linger", type=float, default=60.0,
      help="after /done, exit once replicas were told or after this many idle s")
    a("--stats-file", help="write the final /stats there (JSON) when the proxy stops")
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
