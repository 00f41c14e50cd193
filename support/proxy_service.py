"""What the proxy needs as a service on the internet around the run's state (proxy.py's
RolloutBuffer). A valid request with its token reaches proxy.py's Routes._route and gets its
answer as 200 JSON (ProxyHandler); the step itself is proxy.py, top to bottom.

    credentials  the trainer's token, the replicas' secret R, a replica's name bound to R
    HTTP         the handler (ProxyHandler: the token, the worker it is bound to, the errors;
                 the routes to the buffer are proxy.py's Routes), the server (ProxyServer); the
                 stdlib hardening underneath: support/http_hardening.py
    settings     serve()'s defaults from the contract (settle, body_limit)

Fields and status codes: docs/protocol.md; hostile peers: docs/hostile-peers.md.

    python -m pytest tests/test_proxy.py tests/test_proxy_fuzz.py -q; python bench/bench_proxy.py
"""

import hashlib
import hmac
import json
import logging
import os
import signal
import sys
import time

# the stdlib HTTP hardening: deadlines, bounded bodies, connection classes
from support import http_hardening
from support.contract import (CONTRACT, INDEX, MAX_INT, NAME, OLD_NAMES, TEXT, ConfigError,
                              check_fields)
from support.defaults import DEFAULTS
from support.http_hardening import ApiError
from support.proxy_client import TOKEN_HEADER

log = logging.getLogger("proxy")

ROUTES = {"/rollouts": "POST", "/quota": "GET", "/config": "GET", "/stats": "GET",
          "/healthz": "GET", "/batch": "GET", "/version": "POST", "/done": "POST",
          "/reject": "POST"}
# what the replicas' token opens
REPLICA_PATHS = {"/rollouts", "/quota", "/config", "/stats", "/healthz"}


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


# ---- HTTP: the routes (the hardening a service on the internet needs: support/http_hardening.py)

class ProxyHandler(http_hardening.Handler):
    """A valid request with its token: self._route's dict (proxy.py's Routes) as a 200 JSON
    answer (every endpoint over real HTTP: tests/test_proxy.py). Else: 404/405, the token (401,
    403), _route's ApiError as the answer; a /batch answer that cannot be written goes back to
    the buffer."""
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


# POST /version's optional fields: what the trainer's model takes (checked in POST /rollouts)
POSITIVE = (lambda v: INDEX[0](v) and v > 0, f"an integer in [1, {MAX_INT})")
LIMITS = {"vocab_size": POSITIVE, "context_length": POSITIVE}
# POST /reject's record of one group the trainer dropped
REPORT = {"group_id": NAME, "worker": NAME, "kind": NAME, "why": TEXT}


def read_reports(body, max_groups):
    """POST /reject's body, {"groups": [REPORT, ...]}, checked field by field."""
    check_fields(body, "body", {"groups": (lambda v: type(v) is list and 0 < len(v) <= max_groups,
                                           f"a list of 1 to {max_groups} reports")})
    for i, r in enumerate(body["groups"]):
        check_fields(r, f"groups[{i}]", REPORT)
    return body["groups"]


class ProxyServer(http_hardening.Server):
    """http_hardening.Server with the run's buffer: a request goes to its ProxyHandler.
    Closing it wakes the long polls; a log line a minute."""

    def __init__(self, address, handler, max_connections, log_every):
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
    """The contract as given (a copy), its old names (max_new_tokens) under the new ones
    (test_the_completion_length_goes_by_max_completion_length_and_its_old_name).
    A serve() call's settings, with a setting's old name (OLD_NAMES: max_new_tokens) set to the
    new one's value; given under both names, they must agree."""
    c = dict(contract)
    for old, new in OLD_NAMES.items():
        if old in c and new in c and c[old] != c[new]:
            raise ConfigError(f"--{new.replace('_', '-')} {c[new]} and its old name "
                              f"--{old.replace('_', '-')} {c[old]} disagree: give one")
        c[new] = c[old] = c.get(new, c.get(old, CONTRACT[new]))
    return c


def check_service(host, token, rollout_token, contract, max_groups, max_buffer_mb, max_body_mb,
                  request_timeout, max_connections, max_worker_share):
    """Raise ConfigError for serve() settings that cannot work or are unsafe; nothing else: no
    token off loopback, a replicas' token without (or equal to) the trainer's, a limit <= 0, a
    worker share outside (0, 1], a setting the contract does not have
    (test_cli_refuses_a_public_address_without_a_token_and_bad_settings)."""
    if not 0 < max_worker_share <= 1:
        raise ConfigError(f"--max-worker-share {max_worker_share:g} cannot work: it is the most "
                          "of a step one worker may supply, in (0, 1] (1: no bound)")
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


# run_until_done's bounds on the trainer's silence (support/defaults.py): after its first sign,
# and before it (the trainer job's scheduling, image pull, install, model download, first
# publish); env PROXY_TRAINER_TIMEOUT and PROXY_TRAINER_START_TIMEOUT override them
TRAINER_TIMEOUT_S = DEFAULTS["trainer_timeout"]
TRAINER_START_TIMEOUT_S = DEFAULTS["trainer_start_timeout"]


def trainer_signs(buf):
    """What only the trainer's requests change in the buffer: its version (POST /version), the
    groups and deliveries handed out (GET /batch), the end (POST /done). A /batch long poll in
    flight (buf.waiting) is a sign by itself: run_until_done counts it as heard."""
    return buf.trainer_version, buf.counts["delivered"], buf.deliveries, buf.done


def run_until_done(server, thread, linger, stats_file=None, trainer_timeout=None,
                   start_timeout=None):
    """Serve until the run is over (trainer done and replicas told), then stop; nothing else
    (test_cli_exits_by_itself_once_the_replicas_were_told_the_run_is_done).
    `python proxy.py`'s life after serve(): until the trainer is done and every replica was
    told (or nobody asked for `linger` s), SIGTERM or Ctrl-C; then stop and write the final
    /stats to stats_file.

    A trainer that goes silent (killed, its job ended, never started) must not leave the replicas
    generating, and billed, until their jobs time out: after `trainer_timeout` s without a sign
    of it (trainer_signs; None: env PROXY_TRAINER_TIMEOUT, else TRAINER_TIMEOUT_S; 0: never),
    the proxy ends the run as /done would (the replicas hear "done" at their next /quota and
    exit), then exits with status 1 and says why. A live trainer is never that quiet: it polls
    /batch every <= 30 s while it waits, and its silence lasts one step's compute and publish
    (or a restart: set the timeout above the trainer's start-up). That clock starts at the
    trainer's first sign: until then the bound is `start_timeout` (None: env
    PROXY_TRAINER_START_TIMEOUT, else TRAINER_START_TIMEOUT_S; 0: never), since a job's first
    request waits for its GPU, its image, its install and its model."""
    if trainer_timeout is None:
        trainer_timeout = float(os.environ.get("PROXY_TRAINER_TIMEOUT") or TRAINER_TIMEOUT_S)
    if start_timeout is None:
        start_timeout = float(os.environ.get("PROXY_TRAINER_START_TIMEOUT")
                              or TRAINER_START_TIMEOUT_S)
    buf = server.buffer
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop on SIGTERM as on Ctrl-C
    log.info("proxy: the run ends if the trainer has not spoken within %g s "
             "(PROXY_TRAINER_START_TIMEOUT), or is then silent for %g s (PROXY_TRAINER_TIMEOUT); "
             "0: never", start_timeout, trainer_timeout)
    heard, lost = time.monotonic(), False
    signs = first = trainer_signs(buf)  # the trainer has spoken once these change
    spoke = False
    try:
        while thread.is_alive():  # the run ends when the trainer is done and the replicas were told
            thread.join(0.5)
            with buf.cond:
                told = set(buf.leases) <= buf.told_done
                quiet = time.monotonic() - buf.last_request > linger
                now = trainer_signs(buf)
                polling = buf.waiting > 0  # a GET /batch is waiting for groups
            if now != signs or polling:
                heard, signs = time.monotonic(), now
                spoke = spoke or now != first or polling
            limit, name = ((trainer_timeout, "PROXY_TRAINER_TIMEOUT") if spoke
                           else (start_timeout, "PROXY_TRAINER_START_TIMEOUT"))
            if limit and not buf.done and time.monotonic() - heard > limit:
                log.warning("proxy: nothing from the trainer for %g s (%s): ending the run; the "
                            "replicas are told to exit", limit, name)
                buf.finish()  # what POST /done does: /quota answers "done" from now on
                lost = True
            if buf.done and (told or quiet):
                why = "every replica was told" if told else f"no request for {linger:g} s"
                log.info("proxy: the %s and %s: exiting", "trainer was lost" if lost
                         else "trainer is done", why)
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
    if lost:  # the job ends in ERROR: the run did not finish
        sys.exit(f"proxy.py: the trainer was silent for {limit:g} s ({name}): the run was ended "
                 "and its replicas told to exit; run the launch again to resume from the "
                 "trainer's last saved state" + ("" if spoke else ", or raise " + name))
