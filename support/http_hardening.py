"""The stdlib HTTP hardening under proxy.py, kept out of its reading path.

What a service on the internet needs and the GRPO run does not explain: JSON and query parsing that
names the bad field, one deadline per request however it is trickled, bodies bounded from the header
and read in chunks, connections that cannot starve the trainer, and no spin when file descriptors
run out. proxy.py subclasses Handler and Server; tests/test_proxy.py and tests/test_proxy_fuzz.py
exercise every line here over real sockets.

Connections, by class (Server.admit):
    new      accepted, not yet authenticated: the oldest idle one is closed to make room for another
    replica  authenticated with a replica's credential: at most max_connections - reserve
    trainer  authenticated with the trainer's token (or on a proxy without tokens): never refused
             while a new or idle connection can make room
"""

import errno
import gc
import io
import json
import logging
import math
import re
import select
import socket
import socketserver
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl

log = logging.getLogger("proxy")

MAX_POLL_S = 300.0  # longest long poll; a longer ?timeout= is cut to this
RETRY_AFTER_S = 1   # what a 429 or 503 tells a client to wait
CHUNK = 2**20       # a body is read a MiB at a time, each read under the request's deadline


class ApiError(Exception):
    """A refused request: HTTP status `code` (400: malformed), a message naming the field or what
    to do."""

    def __init__(self, message, code=400, headers=None, payload=None):
        super().__init__(message)
        self.code, self.headers, self.payload = code, headers or {}, payload or {}


def check(ok, where, what):
    """Nothing when ok; else ApiError "where: what" (a 400 naming the field)."""
    if not ok:
        raise ApiError(f"{where}: {what}")


_parsing, _gc_lock = [0, True], threading.Lock()  # parses under way, was the GC enabled before them


def parse_json(body):
    """NaN and Infinity parse (as Python's json does) so that validation can name their field. The
    cyclic GC is paused meanwhile: a body of a million empty lists parses 4-5x faster without it
    (JSON makes no cycles), and a parse holds the GIL, so every other request waits for it."""
    with _gc_lock:
        if _parsing[0] == 0:
            _parsing[1] = gc.isenabled()
            gc.disable()
        _parsing[0] += 1
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # bad JSON/UTF-8, ints of 4300+ digits, deep nesting
        raise ApiError(f"body: not valid JSON ({str(e)[:120]})") from None
    finally:
        with _gc_lock:
            _parsing[0] -= 1
            if _parsing[0] == 0 and _parsing[1]:
                gc.enable()


def parse_query(query, spec):
    """The query string as {key: str}: spec's keys only, each once; spec's values are defaults
    (None: required)."""
    pairs = parse_qsl(query, keep_blank_values=True)  # http.server caps the request line at 64 KiB
    q = dict(pairs)
    expected = "expected " + "&".join(f"{k}=.." for k in spec)
    check(set(q) <= set(spec) and len(q) == len(pairs), "query", expected)
    for key in (k for k, v in spec.items() if v is None and k not in q):
        raise ApiError(f"{key}: missing")
    return {**spec, **q}


def query_int(q, key, lo, hi):
    """The query's q[key] as an int in [lo, hi], written in plain digits; else ApiError."""
    v = q[key]
    check(v.isascii() and v.isdigit() and len(v) <= 12 and lo <= int(v) <= hi, key,
          f"must be an integer in [{lo}, {hi}]")
    return int(v)


def query_seconds(q):
    """A long poll's timeout: a plain decimal (no sign, NaN, inf), cut to MAX_POLL_S."""
    plain = re.fullmatch(r"(\d+\.?\d*|\.\d+)(e[+-]?\d+)?", q["timeout"], re.ASCII)
    check(plain, "timeout", "must be seconds >= 0")
    return min(float(q["timeout"]), MAX_POLL_S)


class DeadlineReader(socket.SocketIO):
    """A connection's reads under one deadline per request: it must arrive whole (headers and body)
    within --request-timeout, however it is trickled (a per-receive timeout lets one byte a second
    hold a thread)."""
    deadline, timeout = math.inf, None

    def readinto(self, b):
        self._sock.settimeout(max(0.001, self.deadline - time.monotonic()))
        try:
            return super().readinto(b)
        finally:
            self._sock.settimeout(self.timeout)  # writes keep a per-send timeout


class Handler(BaseHTTPRequestHandler):
    """JSON in and out, quiet, keep-alive, one deadline per request. Subclasses set do_GET,
    do_POST."""
    protocol_version = "HTTP/1.1"   # keep-alive: a replica reuses its connection
    disable_nagle_algorithm = True  # an answer goes out at once, not after a delayed ACK
    server_version, sys_version = "proxy.py", ""  # no Python version advertised
    default_request_version = "HTTP/1.0"  # even a garbled request line gets a status line back
    max_body = 0  # bytes; serve() binds one server's own

    def setup(self):
        super().setup()
        self.rfile.close()  # http.server's reader, replaced (the socket stays open)
        self.reader = DeadlineReader(self.connection, "rb")
        self.reader.timeout, self.rfile = self.timeout, io.BufferedReader(self.reader)

    def handle_one_request(self):  # the deadline covers the wait for the request line (keep-alive)
        self.reader.deadline = time.monotonic() + self.timeout
        self._body_pending = False
        super().handle_one_request()
        self.server.idle(self.connection)  # between requests: evictable, if never authenticated

    def parse_request(self):
        if ok := super().parse_request():
            self.server.busy(self.connection)  # a request is being served: not evicted under it
            body_headers = ("Content-Length", "Transfer-Encoding")
            self._body_pending = any(h in self.headers for h in body_headers)
        return ok

    def log_message(self, format, *args):  # quiet: the server logs a summary once a minute
        pass

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (bad request line, unknown method) as JSON, like ours."""
        if code == HTTPStatus.NOT_IMPLEMENTED:  # an unknown method is the client's error
            code, message = 405, f"method {str(self.command)[:20]!r} is not allowed"
        self.close_connection = True
        self.reply(code, {"error": message or HTTPStatus(code).phrase})

    def reply(self, code, payload, headers=None):
        if 400 <= code < 500 and code != 429:  # a bad request; 429 (full) is one to retry
            self.server.count("rejected")
        body = json.dumps(payload, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body)),
                   **(headers or {})}
        if self.close_connection or self._body_pending:
            headers["Connection"] = "close"  # an unread body must not be parsed as a request
            self.close_connection = True
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def read_json(self):
        """The body's JSON value; read only after its size is checked from Content-Length, in
        chunks under the request's deadline."""
        lengths = self.headers.get_all("Content-Length") or []
        if "Transfer-Encoding" in self.headers or not lengths:
            raise ApiError("Content-Length is required (chunked bodies are not accepted)", 411)
        n = lengths[0].strip()
        check(len(lengths) == 1 and n.isascii() and n.isdigit() and len(n) <= 18, "Content-Length",
              "must be one non-negative integer")
        # refused from the header alone; the connection is then closed
        if (n := int(n)) > self.max_body:
            raise ApiError(f"body of {n} bytes exceeds --max-body-mb {self.max_body / 2**20:g} "
                           f"({self.max_body} bytes): send fewer groups per POST, or raise "
                           "proxy.py --max-body-mb", 413)
        body = bytearray()
        try:
            while len(body) < n and (chunk := self.rfile.read(min(CHUNK, n - len(body)))):
                body += chunk
        except TimeoutError:
            raise ApiError(f"request not received within --request-timeout {self.timeout:g} s",
                           408) from None
        except OSError:
            raise ApiError("body: the connection broke while it was read") from None
        check(len(body) == n, "body", f"ended after {len(body)} of the {n} bytes of its "
              "Content-Length")
        self._body_pending = False
        return parse_json(body)

    def peer_gone(self):
        """Whether the client hung up while it waited (a trainer killed mid-poll): False for one
        still there, which gets its answer."""
        poll = select.poll()
        poll.register(self.connection, select.POLLIN)
        try:
            return bool(poll.poll(0)) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


class Server(ThreadingHTTPServer):
    """One thread per connection, at most `max_connections`, by class (the module's docstring).
    `count(key)`: the subclass's counters (rejected, refused_connections, closed_idle)."""
    daemon_threads = True
    # long polls and idle keep-alive connections don't hold up server_close()
    block_on_close = False
    request_queue_size = 1024  # socketserver's 5 drops connections when replicas reconnect at once
    BUSY = json.dumps({"error": "too many connections (--max-connections): retry later"}).encode()

    def __init__(self, address, handler, max_connections):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.max_connections, self.reserve = max_connections, max(1, max_connections // 8)
        self.conns, self.lock = {}, threading.Lock()  # socket -> [class, busy]; oldest first
        super().__init__(address, handler)

    def count(self, key):
        pass

    def server_bind(self):  # HTTPServer's own looks up the host's FQDN, which can stall for seconds
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def get_request(self):
        try:
            return super().get_request()
        # out of file descriptors, the socket stays readable: back off, no spin
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.1)
            raise

    def _evict_idle(self):
        """Close the oldest connection that never authenticated and sits idle (no request under way,
        nothing unread): it makes room for a new one, perhaps the trainer's."""
        for sock, (cls, busy) in self.conns.items():
            if cls == "new" and not busy and not select.select([sock], [], [], 0)[0]:
                del self.conns[sock]
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # its thread's read ends; the thread closes it
                except OSError:
                    pass
                return True
        return False

    def process_request(self, request, client_address):
        with self.lock:
            evicted = len(self.conns) >= self.max_connections and self._evict_idle()
            if ok := len(self.conns) < self.max_connections:
                self.conns[request] = ["new", False]
        if evicted:
            self.count("closed_idle")
        if ok:
            return super().process_request(request, client_address)
        self.refuse(request)

    def refuse(self, request):
        self.count("refused_connections")
        try:  # answered at once from the accept loop, without waiting on the client
            request.setblocking(False)
            request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nRetry-After: %d\r\nContent-Length: %d\r\n\r\n%s"
                         % (RETRY_AFTER_S, len(self.BUSY), self.BUSY))
        except OSError:
            pass
        self.shutdown_request(request)

    def authenticated(self, sock, cls):
        """A request on `sock` authenticated as `cls` ("replica" or "trainer"). ApiError 503 when
        the replicas' share (max_connections - reserve) is taken: the rest stays for the
        trainer."""
        with self.lock:
            entry = self.conns.get(sock)
            if entry is None or entry[0] == cls or entry[0] == "trainer":
                return
            if cls == "replica" and sum(c == "replica" for c, _ in self.conns.values()) >= (
                    self.max_connections - self.reserve):
                raise ApiError("too many replica connections (--max-connections less a reserve "
                               "for the trainer): retry later", 503,
                               {"Retry-After": str(RETRY_AFTER_S)})
            entry[0] = cls

    def busy(self, sock):
        with self.lock:
            if entry := self.conns.get(sock):
                entry[1] = True

    def idle(self, sock):
        with self.lock:
            if entry := self.conns.get(sock):
                entry[1] = False

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.conns.pop(request, None)

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # a client that hangs up is no news
            log.exception("proxy: error while serving %s", client_address[0])
