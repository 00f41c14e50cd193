"""proxy.py — the rollout buffer between the rollout replicas and the trainer, on the stdlib.

Replicas POST scored groups of completions; the trainer long-polls GET /batch for fresh ones and
POSTs /version after every adapter it publishes. A group more than --max-staleness versions behind
the trainer is dropped and counted, never handed out. API and accounting: README.md.

    python proxy.py --host 127.0.0.1 --port 8000 --max-staleness 4              # local
    PROXY_TOKEN=secret python proxy.py --host 0.0.0.0 --port 8000               # exposed: token required
    python proxy.py --tls-cert cert.pem --tls-key key.pem ...                   # self-hosted HTTPS
    python -m pytest tests/test_proxy.py tests/test_proxy_fuzz.py -q            # tests
    python tests/bench_proxy.py                                                 # vs FastAPI + uvicorn

The server needs nothing but the standard library. ProxyClient, which rollout.py and trainer.py
use, imports `requests` when it is created.
"""

import argparse
import collections
import hmac
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import socketserver
import ssl
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl

log = logging.getLogger("proxy")

MAX_POLL_S = 300.0      # longest GET /batch wait; a longer ?timeout= is cut to this
MAX_NAME = 256          # characters in a group_id or a worker name
MAX_COMPLETIONS = 4096  # completions in one group
MAX_INT = 2**31         # token ids and versions lie in [0, 2^31)
MAX_ABS = 1e30          # |log-prob| and |reward| below this; also rejects NaN and +-Infinity
MAX_WORKERS = 1024      # per-worker counters kept; further workers are counted under "(other)"
RETRY_AFTER_S = 1       # what a 429 tells a replica to wait
WORKER_COUNTS = ("accepted", "duplicates", "dropped_stale", "delivered")  # counted in total and per worker
ROUTES = {"/rollouts": "POST", "/batch": "GET", "/version": "POST", "/stats": "GET", "/healthz": "GET"}


class ProxyError(Exception):
    """An answer that retrying cannot fix (4xx other than 429), or the client gave up waiting."""


class ConfigError(ValueError):
    """A serve() setting that cannot work; the message says what to change."""


class ApiError(Exception):
    """A refused request: HTTP status `code` (400: malformed), a message naming the field or what to do."""

    def __init__(self, message, code=400, headers=None):
        super().__init__(message)
        self.code, self.headers = code, headers or {}


# ---- validation: pure functions, also used by tests/bench_proxy.py ---------------------------

def _check(ok, where, what):
    if not ok:
        raise ApiError(f"{where}: {what}")


def _finite(x):  # bool is not a number here; NaN fails both comparisons
    return type(x) in (int, float) and -MAX_ABS < x < MAX_ABS


def _index(x):  # a token id or a version
    return type(x) is int and 0 <= x < MAX_INT


# The JSON schema (DESIGN.md), one row per field: (test, what the value must be). Any other field is
# refused, so that a NaN cannot ride along. Each log-prob gets its own check in validate_group().
NAME = (lambda v: type(v) is str and 0 < len(v) <= MAX_NAME, f"a string of 1 to {MAX_NAME} characters")
TEXT = (lambda v: type(v) is str, "a string")
VERSION = (_index, f"an integer in [0, {MAX_INT})")
TOKEN_IDS = (lambda v: type(v) is list and all(map(_index, v)), f"a list of token ids in [0, {MAX_INT})")
GROUP = {"group_id": NAME, "policy_version": VERSION, "worker": NAME, "prompt": TEXT, "prompt_ids": TOKEN_IDS,
         "completions": (lambda v: type(v) is list and 0 < len(v) <= MAX_COMPLETIONS,
                         f"a list of 1 to {MAX_COMPLETIONS} completions")}
COMPLETION = {"ids": TOKEN_IDS, "logprobs": (lambda v: type(v) is list, "a list of numbers"),
              "reward": (_finite, "a finite number"), "text": TEXT,
              "finish_reason": (lambda v: type(v) is str and 0 < len(v) <= 64, "a string of 1 to 64 characters")}


def check_fields(d, where, schema):
    """Raise ApiError naming the first field of the JSON object `d` that `schema` does not allow."""
    _check(type(d) is dict, where, "must be a JSON object")
    extra = set(d) - set(schema)
    _check(not extra, where, f"unknown fields {sorted(extra)[:5]} (expected {sorted(schema)})")
    for key, (ok, what) in schema.items():
        _check(key in d, f"{where}.{key}", "missing")
        _check(ok(d[key]), f"{where}.{key}", f"must be {what}, got {type(d[key]).__name__}")


def validate_group(g, where="group", num_generations=None):
    """Raise ApiError naming the first bad field of one group."""
    check_fields(g, where, GROUP)
    n = len(g["completions"])
    if num_generations and n != num_generations:
        raise ApiError(f"{where}.completions: {n} completions, but this proxy expects {num_generations} "
                       f"per group: start rollout.py with --num-generations {num_generations}")
    for j, c in enumerate(g["completions"]):
        w = f"{where}.completions[{j}]"
        check_fields(c, w, COMPLETION)
        lps, ids = c["logprobs"], c["ids"]
        bad = next((i for i, x in enumerate(lps) if not _finite(x)), None)
        if bad is not None:
            raise ApiError(f"{w}.logprobs[{bad}]: must be a finite number, got {str(lps[bad])[:40]}")
        _check(len(lps) == len(ids), f"{w}.logprobs", f"{len(lps)} log-probs for {len(ids)} ids (one per token)")


def validate_rollouts(payload, max_groups, num_generations=None):
    """The groups of a POST /rollouts body, every one checked before anything is changed."""
    check_fields(payload, "body", {"groups": (lambda v: type(v) is list and v != [], "a non-empty list")})
    groups = payload["groups"]
    _check(len(groups) <= max_groups, "groups", f"{len(groups)} in one POST exceed --max-groups {max_groups}")
    for i, g in enumerate(groups):
        validate_group(g, f"groups[{i}]", num_generations)
    return groups


def parse_json(body):
    """NaN and Infinity parse (as Python's json does) so that validation can name their field."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, ints over 4300 digits, deep nesting
        raise ApiError(f"body: not valid JSON ({str(e)[:120]})") from None


def parse_batch_query(query, max_groups):
    """(groups, timeout) from the query string of GET /batch?groups=N&timeout=S."""
    pairs = parse_qsl(query, keep_blank_values=True)  # http.server caps the request line at 64 KiB
    q = dict(pairs)
    _check(set(q) <= {"groups", "timeout"} and len(q) == len(pairs), "query", "expected groups=N&timeout=S")
    n = q.get("groups", "")
    _check(n.isascii() and n.isdigit() and len(n) <= 12 and 1 <= int(n) <= max_groups, "groups",
           f"must be an integer in [1, {max_groups}]")
    try:
        timeout = float(q.get("timeout", "0"))
    except ValueError:
        timeout = -1.0  # refused just below
    _check(0.0 <= timeout < float("inf"), "timeout", "must be a number of seconds >= 0")
    return int(n), min(timeout, MAX_POLL_S)


# ---- the buffer: all state and counters under one lock ---------------------------------------

class RolloutBuffer:
    """Bounded FIFO of usable groups. accepted = delivered + dropped_stale + buffered, always."""

    def __init__(self, max_staleness=4, max_groups=4096, remember_ids=1_000_000):
        self.max_staleness, self.max_groups, self.remember_ids = max_staleness, max_groups, remember_ids
        self.cond = threading.Condition()
        self.groups = collections.deque()
        self.seen, self.seen_order = set(), collections.deque()  # the last `remember_ids` group_ids
        self.counts = dict.fromkeys(["received", *WORKER_COUNTS, "refused_full", "rejected"], 0)
        self.trainer_version, self.closed, self.started = 0, False, time.time()
        self.waiting = 0  # groups asked for by GET /batch calls blocked for lack of them (see stats())
        self.staleness = collections.Counter()  # trainer_version - policy_version of delivered groups
        self.workers = {}  # worker name -> its own WORKER_COUNTS

    def _usable(self, g):
        return self.trainer_version - g["policy_version"] <= self.max_staleness

    def _count(self, key, groups):
        """Add `groups` to the counter `key`, in total and for each group's worker."""
        self.counts[key] += len(groups)
        for g in groups:
            name = g["worker"] if g["worker"] in self.workers or len(self.workers) < MAX_WORKERS else "(other)"
            self.workers.setdefault(name, dict.fromkeys(WORKER_COUNTS, 0))[key] += 1

    def add(self, groups):
        """Buffer the new, fresh groups of a validated POST; None (nothing kept) when they don't fit."""
        with self.cond:
            self.counts["received"] += len(groups)
            new, dups, ids = [], [], set()
            for g in groups:  # a group_id seen before, or twice in this POST, is a retry: counted, not kept
                (dups if g["group_id"] in self.seen or g["group_id"] in ids else new).append(g)
                ids.add(g["group_id"])
            fresh = [g for g in new if self._usable(g)]
            if len(self.groups) + len(fresh) > self.max_groups:
                self.counts["refused_full"] += len(groups)
                return None
            self.seen.update(g["group_id"] for g in new)
            self.seen_order.extend(g["group_id"] for g in new)
            while len(self.seen_order) > self.remember_ids:
                self.seen.discard(self.seen_order.popleft())
            self._count("accepted", new)
            self._count("duplicates", dups)
            self._count("dropped_stale", [g for g in new if not self._usable(g)])
            self.groups.extend(fresh)
            self.cond.notify_all()
            return {"accepted": len(new), "duplicates": len(dups), "stale": len(new) - len(fresh),
                    "trainer_version": self.trainer_version}

    def take(self, n, timeout):
        """Up to n groups, oldest first, waiting up to `timeout` s for n to be there (no busy wait).
        The buffer only ever holds usable groups: stale ones are dropped on arrival and on /version."""
        with self.cond:
            self.waiting += n  # seen by /stats only while wait_for() has released the lock
            self.cond.wait_for(lambda: len(self.groups) >= n or self.closed, timeout)
            self.waiting -= n
            out = [self.groups.popleft() for _ in range(min(n, len(self.groups)))]
            self.staleness.update(self.trainer_version - g["policy_version"] for g in out)
            self._count("delivered", out)
            return out, self.trainer_version

    def set_version(self, version):
        """The trainer is now at `version`: drop the groups that became stale."""
        with self.cond:
            if version < self.trainer_version:
                raise ApiError(f"version {version} is lower than this proxy's trainer_version {self.trainer_version} "
                               "(a trainer resumed from older state? restart the proxy)", 409)
            self.trainer_version = version
            stale = [g for g in self.groups if not self._usable(g)]
            self.groups = collections.deque(g for g in self.groups if self._usable(g))
            self._count("dropped_stale", stale)
            return {"dropped": len(stale), "trainer_version": version}

    def count_rejected(self):
        with self.cond:
            self.counts["rejected"] += 1

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def stats(self):
        with self.cond:
            return {**self.counts, "buffered": len(self.groups),  # waiting: groups a blocked trainer still lacks
                    "waiting": max(0, self.waiting - len(self.groups)),
                    "trainer_version": self.trainer_version, "max_staleness": self.max_staleness,
                    "max_groups": self.max_groups,
                    "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
                    "workers": {k: dict(v) for k, v in self.workers.items()},
                    "uptime_s": round(time.time() - self.started, 1)}


# ---- HTTP ------------------------------------------------------------------------------------

class ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive: a replica reuses its connection
    disable_nagle_algorithm = True  # an answer goes out at once, not after a delayed ACK
    server_version, sys_version = "proxy.py", ""  # no Python version advertised
    default_request_version = "HTTP/1.0"  # so that even a garbled request line gets a status line back
    buffer, token, max_body, num_generations = None, None, 0, None  # serve() binds one server's own

    def log_message(self, format, *args):  # quiet: the server logs a summary once a minute
        pass

    def _serve(self):
        method, (path, _, query) = self.command, self.path.partition("?")
        self._body_pending = "Content-Length" in self.headers or "Transfer-Encoding" in self.headers
        if self.buffer.closed:  # a kept-alive connection to a closed server: hang up, the client reconnects
            self.close_connection = True
            return
        code, headers = 200, {}
        try:
            if path not in ROUTES:
                raise ApiError(f"no endpoint {path[:80]!r}: proxy.py serves POST /rollouts, GET /batch, "
                               "POST /version, GET /stats, GET /healthz", 404)
            if method != ROUTES[path]:
                raise ApiError(f"{method} {path} is not allowed", 405, {"Allow": ROUTES[path]})
            got = self.headers.get("Authorization", "").encode("latin-1", "replace")  # compared in constant time
            if path != "/healthz" and self.token and not hmac.compare_digest(got, b"Bearer " + self.token.encode()):
                raise ApiError("missing or wrong token: send 'Authorization: Bearer <PROXY_TOKEN>'", 401,
                               {"WWW-Authenticate": "Bearer"})
            payload = getattr(self, "_" + path[1:])(query)  # _rollouts, _batch, ... below
        except ApiError as e:
            code, payload, headers = e.code, {"error": str(e)}, e.headers
        except Exception:
            log.exception("proxy: internal error on %s %s", method, path[:80])
            code, payload = 500, {"error": "internal error (see the proxy's log)"}
        self._reply(code, payload, headers)

    do_GET = do_POST = _serve  # every other method gets send_error(501), answered as a 405

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (bad request line, unknown method) as JSON, like ours."""
        if code == HTTPStatus.NOT_IMPLEMENTED:  # an unknown method is the client's error
            code, message = 405, f"method {str(self.command)[:20]!r} is not allowed"
        self.close_connection = True
        self._reply(code, {"error": message or HTTPStatus(code).phrase})

    def _reply(self, code, payload, headers=None):
        if 400 <= code < 500 and code != 429:  # a bad request; 429 (full) is one to retry
            self.buffer.count_rejected()
        body = json.dumps(payload, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection or getattr(self, "_body_pending", False):
            self.send_header("Connection", "close")  # an unread body must not be parsed as a request
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _read_json(self):
        lengths = self.headers.get_all("Content-Length") or []
        if "Transfer-Encoding" in self.headers or not lengths:
            raise ApiError("Content-Length is required (chunked bodies are not accepted)", 411)
        n = lengths[0].strip()
        _check(len(lengths) == 1 and n.isascii() and n.isdigit() and len(n) <= 18, "Content-Length",
               "must be one non-negative integer")
        n = int(n)
        if n > self.max_body:  # refused from the header alone; the connection is then closed
            raise ApiError(f"body of {n} bytes exceeds --max-body-mb ({self.max_body} bytes): "
                           "send fewer groups per POST", 413)
        try:
            body = self.rfile.read(n)
        except socket.timeout:  # TimeoutError from Python 3.10 on
            raise ApiError(f"body not received within {self.timeout:g} s", 408) from None
        except OSError:
            raise ApiError("body: the connection broke while it was read") from None
        _check(len(body) == n, "body", f"ended after {len(body)} of the {n} bytes of its Content-Length")
        self._body_pending = False
        return parse_json(body)

    def _rollouts(self, query):
        groups = validate_rollouts(self._read_json(), self.buffer.max_groups, self.num_generations)
        result = self.buffer.add(groups)
        if result is None:
            raise ApiError(f"buffer full ({self.buffer.max_groups} groups); retry in {RETRY_AFTER_S} s", 429,
                           {"Retry-After": str(RETRY_AFTER_S)})
        return result

    def _batch(self, query):
        # A group counts as delivered once it is handed to this connection: a trainer that dies
        # mid-answer loses that batch (it is regenerated at the next policy version anyway).
        groups, version = self.buffer.take(*parse_batch_query(query, self.buffer.max_groups))
        return {"groups": groups, "trainer_version": version}

    def _version(self, query):
        body = self._read_json()
        check_fields(body, "body", {"version": VERSION})
        return self.buffer.set_version(body["version"])

    def _stats(self, query):
        return self.buffer.stats()

    def _healthz(self, query):
        return {"ok": True}


class ProxyServer(ThreadingHTTPServer):
    """One thread per connection; closing it wakes the long polls; logs once a minute."""
    daemon_threads = True
    block_on_close = False  # long polls and idle keep-alive connections must not hold up server_close()
    request_queue_size = 1024  # socketserver's 5 drops connections when many replicas (re)connect at once

    def __init__(self, address, handler, log_every=60.0):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.buffer, self.log_every = handler.buffer, log_every
        self._last_log, self._logged = time.monotonic(), self.buffer.stats()
        super().__init__(address, handler)

    def server_bind(self):  # HTTPServer's own looks up the host's FQDN, which can stall for seconds
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def server_close(self):
        super().server_close()
        self.buffer.close()  # wakes the long polls; a kept-alive connection hangs up at its next request

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # a client that hangs up or speaks no TLS is no news
            log.exception("proxy: error while serving %s", client_address[0])

    def service_actions(self):  # serve_forever calls this every 0.2 s
        if time.monotonic() - self._last_log < self.log_every:
            return
        self._last_log, s, old = time.monotonic(), self.buffer.stats(), self._logged
        d = {k: s[k] - old[k] for k in self.buffer.counts}
        if any(d.values()) or s["trainer_version"] != old["trainer_version"]:
            log.info("proxy: in +%(accepted)d (dup +%(duplicates)d), out +%(delivered)d, dropped stale "
                     "+%(dropped_stale)d, refused full +%(refused_full)d, rejected +%(rejected)d, buffer "
                     "%(buffered)d/%(max_groups)d, trainer v%(trainer_version)d", {**s, **d})
            self._logged = s


def _is_loopback(host):
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)} if host else set()
        return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)
    except (OSError, ValueError):
        return False


def serve(host="127.0.0.1", port=0, max_staleness=4, max_groups=4096, max_body_mb=64, token=None,
          tls_cert=None, tls_key=None, num_generations=None, request_timeout=30.0, log_every=60.0):
    """Start the proxy in a daemon thread; returns (server, thread). server.server_address[1] is the port."""
    token = token or None
    if token is None and not _is_loopback(host):
        raise ConfigError(f"refusing to listen on {host!r} without a token: set PROXY_TOKEN or --token "
                          "(or listen on 127.0.0.1)")
    if bool(tls_cert) != bool(tls_key):
        raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
    if max_staleness < 0 or max_groups < 1 or max_body_mb <= 0 or (
            num_generations is not None and num_generations < 1):
        raise ConfigError("--max-staleness must be >= 0, --max-groups and --num-generations >= 1, --max-body-mb > 0")
    context = None
    if tls_cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(tls_cert, tls_key)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"cannot load --tls-cert {tls_cert} / --tls-key {tls_key}: {e}") from None
    buffer = RolloutBuffer(max_staleness, max_groups)
    handler = type("BoundProxyHandler", (ProxyHandler,), dict(  # the state of this server, no module globals
        buffer=buffer, token=token, max_body=int(max_body_mb * 2**20), num_generations=num_generations,
        timeout=request_timeout))
    server = ProxyServer((host, port), handler, log_every)
    if context:  # the handshake happens in the connection's own thread, not in the accept loop
        server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    thread = threading.Thread(target=server.serve_forever, args=(0.2,), name="proxy", daemon=True)
    thread.start()
    return server, thread


# ---- the client rollout.py and trainer.py use -----------------------------------------------

class ProxyClient:
    """Talks to a proxy.py; rides out restarts, 5xx and 429 with backoff, and sends its last version
    again to a proxy that restarted (found at 0 by /batch). One per thread (it keeps a session)."""
    HINTS = {401: " (check PROXY_TOKEN: the proxy and this process must share it)",
             404: " (is the URL a proxy.py?)", 405: " (is the URL a proxy.py?)",
             413: " (send fewer groups per POST or raise the proxy's --max-body-mb)"}

    def __init__(self, url, token=None, max_wait=300.0, verify=True):
        import requests  # the client's only dependency; the server needs none

        self._requests, self.url, self.max_wait, self.verify = requests, url.rstrip("/"), max_wait, verify
        self.session = requests.Session()
        self.version = None  # the last version this client set: re-announced to a proxy that restarted
        token = token or os.environ.get("PROXY_TOKEN")
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def post_rollouts(self, groups):
        return self._call("POST", "/rollouts", {"groups": groups})

    def get_batch(self, n, timeout=30.0):
        answer = self._call("GET", "/batch", params={"groups": n, "timeout": timeout}, wait=timeout)
        if self.version is not None and answer.get("trainer_version", 0) < self.version:
            # a restarted proxy starts at version 0: until told, it would buffer and hand out stale groups
            print(f"proxy.py client: {self.url} is at trainer_version {answer.get('trainer_version')} < "
                  f"{self.version} (restarted?): sending version {self.version} again", file=sys.stderr, flush=True)
            self.set_version(self.version)
        return answer

    def set_version(self, version):
        answer = self._call("POST", "/version", {"version": version})
        self.version = version
        return answer

    def stats(self):
        return self._call("GET", "/stats")

    def healthy(self):
        try:
            return self.session.get(self.url + "/healthz", timeout=5, verify=self.verify).status_code == 200
        except self._requests.RequestException:
            return False

    def _call(self, method, path, body=None, params=None, wait=0.0):
        rq, where = self._requests, f"{method} {self.url}{path}"
        try:
            data = None if body is None else json.dumps(body, allow_nan=False).encode()
        except ValueError:
            raise ProxyError(f"{where}: cannot send NaN or Infinity (check the rewards and log-probs)") from None
        deadline, delay, streak = time.monotonic() + self.max_wait, 0.5, False
        while True:
            try:
                r = self.session.request(method, self.url + path, data=data, params=params, verify=self.verify,
                                         headers={"Content-Type": "application/json"}, timeout=(10.0, wait + 60.0))
            except rq.exceptions.SSLError as e:
                raise ProxyError(f"{where}: TLS failed ({e}); for a self-signed proxy pass verify=<its cert.pem>"
                                 ) from None
            except (rq.ConnectionError, rq.Timeout) as e:
                m = re.search(r"\[Errno -?\d+\] [^'\")]+", str(e))
                why, pause = f"cannot reach the proxy ({m.group(0) if m else type(e).__name__})", delay
            except rq.exceptions.ChunkedEncodingError:  # the proxy died while it answered: retry as above
                why, pause = "the connection broke during the answer (proxy restarted?)", delay
            except rq.RequestException as e:
                raise ProxyError(f"{where}: {e}") from None
            else:
                try:
                    answer = r.json()
                except ValueError:
                    answer = {"error": " ".join(r.text.split())[:200]}  # one line, even for an HTML page
                if r.status_code == 200:
                    if isinstance(answer, dict) and "error" not in answer:
                        return answer
                    raise ProxyError(f"{where}: the answer is not proxy.py's JSON{self.HINTS[404]}")
                msg = answer.get("error", answer) if isinstance(answer, dict) else answer
                if r.status_code == 429:
                    after = r.headers.get("Retry-After", "")
                    why, pause = f"proxy buffer full ({msg})", float(after) if after.isdigit() else delay
                elif r.status_code >= 500:
                    why, pause = f"HTTP {r.status_code}: {msg}", delay
                else:
                    raise ProxyError(f"{where}: HTTP {r.status_code}: {msg}{self.HINTS.get(r.status_code, '')}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProxyError(f"{where}: gave up after {self.max_wait:g} s: {why}")
            if not streak:  # one line per streak of retries
                print(f"proxy.py client: {where}: {why}; retrying for up to {self.max_wait:g} s", file=sys.stderr,
                      flush=True)
                streak = True
            time.sleep(min(pause, left, 10.0))
            delay = min(2 * delay, 10.0)


def main(argv=None):
    p = argparse.ArgumentParser(description="The rollout buffer between rollout replicas and the trainer.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; anything but loopback needs a token")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--max-staleness", type=int, default=4,
                   help="hand out a group only while trainer_version - policy_version <= this (0: synchronous GRPO)")
    p.add_argument("--max-groups", type=int, default=4096,
                   help="buffer size in groups; when full, POST /rollouts gets 429")
    p.add_argument("--max-body-mb", type=float, default=64, help="largest request body in MiB (413 above)")
    p.add_argument("--token", default=os.environ.get("PROXY_TOKEN"),
                   help="bearer token wanted on every endpoint but /healthz (default: $PROXY_TOKEN, which keeps it "
                        "out of the process list)")
    p.add_argument("--tls-cert", help="PEM certificate: serve HTTPS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--num-generations", type=int,
                   help="refuse groups with another number of completions (the trainer's G; default: any)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    try:
        server, thread = serve(**vars(args))
    except ConfigError as e:
        sys.exit(f"proxy.py: error: {e}")
    except OSError as e:
        sys.exit(f"proxy.py: error: cannot listen on {args.host}:{args.port}: {e}")
    log.info("proxy: listening on %s://%s:%d (max staleness %d, buffer %d groups, token %s)",
             "https" if args.tls_cert else "http", args.host, server.server_address[1], args.max_staleness,
             args.max_groups, "required" if args.token else "off")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop on SIGTERM as on Ctrl-C
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    server.shutdown()
    server.server_close()
    log.info("proxy: stopped: %s", {k: v for k, v in server.buffer.stats().items() if type(v) is int})


if __name__ == "__main__":
    main()
