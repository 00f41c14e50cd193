"""ProxyClient: how rollout.py and trainer.py talk to proxy.py (support code).

Each call is one HTTP request with proxy.py's JSON (docs/protocol.md), ridden through restarts,
5xx and 429 with backoff; an answer that retrying cannot fix raises ProxyError naming the call and
what to check. Needs `requests` (the proxy itself needs only the standard library).

    python -m pytest tests/test_proxy.py -q -k client
"""

import json
import os
import re
import sys
import time

from support.contract import OLD_NAMES

# the proxy's credentials; Authorization belongs to a gateway (HF Jobs)
TOKEN_HEADER = "X-Proxy-Token"


class ProxyError(Exception):
    """An answer that retrying cannot fix (4xx but 429), or the client gave up. `answer`: the
    proxy's JSON."""

    def __init__(self, message, answer=None):
        super().__init__(message)
        self.answer = answer if isinstance(answer, dict) else {}


class ProxyClient:
    """Talks to a proxy.py; rides out restarts, 5xx and 429 with backoff. A proxy that restarted has
    forgotten the trainer's version: its 409 on GET /batch is answered by announcing it again (the
    one place a restart is handled). One per thread (it keeps a session). `token` (default:
    PROXY_TOKEN), sent as X-Proxy-Token: the trainer's, or a replica's where the proxy has
    ROLLOUT_TOKEN. `gateway_token` (default: GATEWAY_TOKEN), sent as `Authorization: Bearer`: for a
    gateway only."""
    HINTS = {401: " (check the token: PROXY_TOKEN for the trainer, ROLLOUT_TOKEN for replicas "
                  "when the proxy has one)",
             403: " (a replica's token opens its own endpoints and worker name only: give the "
                  "trainer PROXY_TOKEN)",
             404: " (is the URL a proxy.py?)", 405: " (is the URL a proxy.py?)",
             413: " (send fewer groups per POST or raise the proxy's --max-body-mb / "
                  "--max-buffer-mb)"}

    def __init__(self, url, token=None, max_wait=300.0, gateway_token=None):
        import requests  # the client's only dependency; the server needs none

        self._requests, self.url, self.max_wait = requests, url.rstrip("/"), max_wait
        self.session = requests.Session()
        # the last version this client announced: announced again to a restarted proxy; and what
        # the trainer's model takes, announced with every version (set_limits)
        self.version, self.limits = None, {}
        # the last GET /batch answer read, acknowledged by the next call (0: none yet); and the
        # run's groups the replicas dropped for a failed reward function, as it said
        self.delivery, self.reward_errors = 0, 0
        if token := token or os.environ.get("PROXY_TOKEN"):
            self.session.headers[TOKEN_HEADER] = token
        # a gateway in front (HF Jobs)
        if gateway := gateway_token or os.environ.get("GATEWAY_TOKEN"):
            self.session.headers["Authorization"] = f"Bearer {gateway}"

    def contract(self, flags=None, **given):
        """The run's settings from GET /config. `given`: the flags a role was started with (None:
        not given); one that disagrees with the proxy is an error naming both values. `flags`: a
        flag's name where it is not the setting's (--max-staleness for max_staleness)."""
        config = self._call("GET", "/config")
        for old, new in OLD_NAMES.items():  # a proxy that serves a setting under its old name only
            if old in config:
                config.setdefault(new, config[old])
        for key, value in given.items():
            if value is not None and value != config.get(key):
                flag = (flags or {}).get(key, "--" + key.replace("_", "-"))
                raise ProxyError(f"{flag} {value} disagrees with the proxy's {key} "
                                 f"{config.get(key)} ({self.url}): the run's settings come from "
                                 f"proxy.py; drop {flag}, or restart proxy.py with {flag} {value}")
        return config

    def post_rollouts(self, groups, worker=None, reward_errors=0):
        """POST /rollouts: a replica's groups, and how many of its lease a reward function
        failed on (dropped there). Returns the proxy's counts (accepted, stale, ...)."""
        failed = {"worker": worker, "reward_errors": reward_errors} if reward_errors else {}
        return self._call("POST", "/rollouts", {"groups": groups, **failed})

    def quota(self, worker, version, most, timeout=30.0):
        """GET /quota: how many groups this replica, holding adapter `version`, makes now (at most
        `most`): the proxy's answer as it is ({groups, trainer_version, state, why}), after up to
        `timeout` s of its long poll."""
        params = {"worker": worker, "version": version, "max": most, "timeout": timeout}
        return self._call("GET", "/quota", params=params, wait=timeout)

    def get_batch(self, n, timeout=30.0):
        """Up to n groups; each call acknowledges the answer read before (the proxy gives back one
        that was never read, e.g. by a trainer killed with it unread)."""
        try:
            answer = self._batch(n, timeout)
        except ProxyError as e:
            if not (e.answer.get("need_version") and self.version is not None):
                raise
            print(f"proxy.py client: {self.url} does not know the trainer's version (restarted?): "
                  f"announcing v{self.version} again", file=sys.stderr, flush=True)
            self.set_version(self.version)
            answer = self._batch(n, timeout)
        self.delivery = answer.get("delivery") or self.delivery
        self.reward_errors = answer.get("reward_errors", self.reward_errors)
        return answer

    def _batch(self, n, timeout):
        params = {"groups": n, "timeout": timeout, "ack": self.delivery}
        return self._call("GET", "/batch", params=params, wait=timeout)

    def set_version(self, version):
        """POST /version: the trainer is at `version` (with set_limits' values); a proxy.py too
        old to take the limits gets the version alone."""
        try:
            answer = self._call("POST", "/version", {"version": version, **self.limits})
        except ProxyError as e:  # an older proxy.py takes no limits: announce the version alone
            if not (self.limits and "unknown fields" in str(e)):
                raise
            print(f"proxy.py client: {self.url} takes no vocab_size / context_length (an older "
                  "proxy.py): it cannot refuse groups the model cannot take", file=sys.stderr)
            self.limits = {}
            answer = self._call("POST", "/version", {"version": version})
        self.version = version
        return answer

    def set_limits(self, **limits):
        """What the trainer's model takes (vocab_size, context_length; None: unknown), sent with
        every POST /version: the proxy refuses other groups (400) from then on."""
        self.limits = {k: v for k, v in limits.items() if v is not None}

    def reject(self, reports):
        """POST /reject: the groups the trainer dropped ([{group_id, worker, kind, why}]), given
        back to the step's quota, their workers banned."""
        return self._call("POST", "/reject", {"groups": reports})

    def done(self):
        """POST /done: the run is over."""
        return self._call("POST", "/done", {})

    def stats(self):
        return self._call("GET", "/stats")

    def _call(self, method, path, body=None, params=None, wait=0.0):
        """The proxy's JSON answer to one request (body sent as JSON, params as the query);
        retried while the proxy is unreachable, full (429) or busy (503), up to max_wait s; any
        other error: ProxyError naming the call and what the proxy said."""
        rq, where = self._requests, f"{method} {self.url}{path}"
        try:
            data = None if body is None else json.dumps(body, allow_nan=False).encode()
        except ValueError:
            raise ProxyError(f"{where}: cannot send NaN or Infinity (check the rewards and "
                             "log-probs)") from None
        deadline, delay = time.monotonic() + self.max_wait, 0.5
        while True:
            try:
                r = self.session.request(method, self.url + path, data=data, params=params,
                                         headers={"Content-Type": "application/json"},
                                         timeout=(10.0, wait + 60.0))
            # the proxy is down, or died mid-answer: retried
            except (rq.ConnectionError, rq.Timeout, rq.exceptions.ChunkedEncodingError) as e:
                m = re.search(r"\[Errno -?\d+\] [^'\")]+", str(e))
                why = f"cannot reach the proxy ({m.group(0) if m else type(e).__name__})"
                pause = delay
            except rq.RequestException as e:
                raise ProxyError(f"{where}: {e}") from None
            else:
                try:
                    answer = r.json()
                except ValueError:
                    # one line, even for an HTML page
                    answer = {"error": " ".join(r.text.split())[:200]}
                if r.status_code == 200 and isinstance(answer, dict) and "error" not in answer:
                    return answer
                msg = answer.get("error", answer) if isinstance(answer, dict) else answer
                if r.status_code != 429 and r.status_code < 500:  # 200: not proxy.py's JSON
                    hint = self.HINTS.get(404 if r.status_code == 200 else r.status_code, "")
                    raise ProxyError(f"{where}: HTTP {r.status_code}: {msg}{hint}", answer)
                # 429: the buffer is full; 503: too many connections
                after = r.headers.get("Retry-After", "")
                why = f"HTTP {r.status_code}: {msg}"
                pause = float(after) if after.isdigit() else delay
            if (left := deadline - time.monotonic()) <= 0:
                raise ProxyError(f"{where}: gave up after {self.max_wait:g} s: {why}")
            if delay == 0.5:  # the first retry of this call: one line per streak of retries
                print(f"proxy.py client: {where}: {why}; retrying for up to {self.max_wait:g} s",
                      file=sys.stderr, flush=True)
            time.sleep(min(pause, left, 10.0))
            delay = min(2 * delay, 10.0)
