"""Fuzz proxy.py with 600 seeded malformed or hostile requests over raw sockets: every one gets a
4xx (never 429, never 5xx), the proxy stays healthy, and no counter but `rejected` moves (nor the
trainer's version, nor the run's state: a replica's token cannot set them).

    .venv/bin/python -m pytest tests/test_proxy_fuzz.py -q
"""

import copy
import json
import random

import requests

from proxy import serve
from support.contract import MAX_COMPLETIONS
from support.proxy_client import ProxyClient
from support.proxy_service import replica_token
from test_proxy import healthy, make_group, raw_request

TOKEN = "fuzz-token"
REPLICA_TOKEN = "fuzz-replica-token"
MAX_GROUPS = 16
NAN, INF = float("nan"), float("inf")
BAD_STRING = [None, 1, 1.5, True, [], {}, ["x"], NAN]
BAD_INT = [None, -1, -(2**40), 1.5, "1", True, [], {}, 2**31, 2**80, NAN, INF, -INF]
BAD_IDS = [None, "abc", 5, {}, [1, "a"], [1.5], [-1], [2**31], [True], [None], [NAN], [[1]]]
BAD_LOGPROBS = [None, "x", 5, {}, [NAN], [INF], [-INF], ["x"], [True], [1e31], [None], [[-0.1]], [0.5], [1e-300],
                [-1e29], [-1000.5]]
BAD_NUMBER = [None, "1", True, [], {}, NAN, INF, -INF, 1e40, -(10**40), 1e20, -0.5, 1.0001, 2]  # range: [0, 1]
BAD_BODIES = [b"", b"{", b"}", b"[", b"null", b"1", b'"groups"', b"[]", b"{}", b'{"groups": null}',
              b'{"groups": {}}', b'{"groups": []}', b'{"groups": "all"}', b'{"groups": [null]}', b'{"groups": [1]}',
              b'{"groups": [[]]}', b'{"groups": [NaN]}', b'{"groups": [Infinity]}', b'{"groups": -Infinity}',
              b"\xff\xfe\x00garbage", b'{"groups": [{"policy_version": 1e999}]}', b'{"groups": [' + b"9" * 5000 + b"]}",
              b"[" * 50000 + b"]" * 50000, b'{"groups": [{}]}', b'{"groups": [{"group_id": "x"}]}',
              b'{"groups": [], "groups": 5}', b'{"a": 1}', b'\x00' * 100,
              b'{"groups": [' + b'{"x":1},' * 2000 + b'{}]}']


def mutated_group(rnd):
    """A valid group with one field made wrong (or removed, or an unknown one added)."""
    g = make_group(f"fz-{rnd.random()}", version=rnd.randint(1, 3), n=rnd.randint(1, 4), tokens=rnd.randint(1, 8))
    c = rnd.choice(g["completions"])
    kind = rnd.randrange(10)
    if kind == 0:
        g[rnd.choice(["group_id", "worker"])] = rnd.choice(BAD_STRING + ["", "x" * 300])  # 1 to 256 characters
        g["prompt"] = rnd.choice(BAD_STRING) if rnd.random() < 0.3 else g["prompt"]
    elif kind == 1:
        g["policy_version"] = rnd.choice(BAD_INT)
    elif kind == 2:  # or empty, or longer than max_prompt_length (1024)
        g["prompt_ids"] = rnd.choice(BAD_IDS + [[], [5] * 1025])
    elif kind == 3:
        if rnd.random() < 0.1:
            c["ids"], c["logprobs"] = [], []  # a completion without a token
        elif rnd.random() < 0.5:
            c["ids"] = copy.deepcopy(rnd.choice(BAD_IDS))
        else:
            c["logprobs"] = copy.deepcopy(rnd.choice(BAD_LOGPROBS))
    elif kind == 4:
        c["logprobs"] = c["logprobs"][:-1] if rnd.random() < 0.5 else c["logprobs"] + [-1.0]  # one per token, broken
    elif kind == 5:
        c["reward"] = rnd.choice(BAD_NUMBER)
    elif kind == 6:
        if rnd.random() < 0.5:
            c["text"] = rnd.choice(BAD_STRING)
        else:
            c["finish_reason"] = rnd.choice(BAD_STRING + ["", "x" * 100])  # 1 to 64 characters
    elif kind == 7:
        target = rnd.choice([g, c])
        target.pop(rnd.choice(sorted(target)))
        if rnd.random() < 0.5:
            target["unexpected"] = 1
    elif kind == 8:  # sampled with other settings than the run's, or longer than its max_new_tokens
        change = rnd.choice([("temperature", rnd.choice([0.7, 1.0001, 0, -1, NAN, "1", None])),
                             ("max_new_tokens", rnd.choice([255, 0, 2**31, "256", None, 256.0]))])
        g[change[0]] = change[1]
        if rnd.random() < 0.3:  # or: the settings right, one completion too long
            g.update(temperature=1.0, max_new_tokens=256)
            c["ids"], c["logprobs"] = [3] * 257, [-0.1] * 257
    else:
        tiny = {"ids": [3], "logprobs": [-0.1], "reward": 0, "text": "", "finish_reason": "stop"}
        g["completions"] = rnd.choice([[], None, "x", {}, [None], [1], [tiny] * (MAX_COMPLETIONS + 1)])
    return g


def http(method, path, body=None, token=TOKEN, headers=()):
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", *headers]
    if token is not None:
        lines.append(f"X-Proxy-Token: {token}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def hostile_request(rnd, valid_body):
    """One malformed or hostile request: (raw bytes, half-close after sending)."""
    kind = rnd.randrange(12)
    if kind <= 2:  # a group with one bad field, next to valid ones
        groups = [make_group(f"ok-{rnd.random()}") for _ in range(rnd.randint(0, 2))]
        groups.insert(rnd.randint(0, len(groups)), mutated_group(rnd))
        return http("POST", "/rollouts", json.dumps({"groups": groups}).encode()), False
    if kind == 3:
        return http("POST", "/rollouts", rnd.choice(BAD_BODIES)), False
    if kind == 4:  # too many groups in one POST; or a body that is not JSON at all
        body = {"groups": [make_group(f"many-{i}") for i in range(MAX_GROUPS + 1)]}
        return http("POST", "/rollouts", json.dumps(body).encode() if rnd.random() < 0.5 else rnd.randbytes(300)), False
    if kind == 5:  # no token, a wrong one, another scheme: with a perfectly valid request
        bound = replica_token(REPLICA_TOKEN, "w")
        forged = [bound[:-1] + ("1" if bound[-1] == "0" else "0"), "v" + bound[1:], replica_token(TOKEN, "w"),
                  bound + ":"]
        token = rnd.choice([None, "", "fuzz-toke", TOKEN + "n", TOKEN.upper(), "x" * 5000, REPLICA_TOKEN + " ",
                            *forged])
        method, path, body = rnd.choice([("POST", "/rollouts", valid_body), ("GET", "/stats", None),
                                         ("GET", "/batch?groups=1&timeout=0", None), ("GET", "/config", None),
                                         ("GET", "/quota?worker=w&version=1", None), ("POST", "/done", b"{}"),
                                         ("POST", "/version", b'{"version": 9}')])
        extra = [f"Authorization: Bearer {TOKEN}"] if token is None and rnd.random() < 0.5 else []
        if rnd.random() < 0.4:  # the replicas' token, on the trainer's endpoints: 403
            method, path, body = rnd.choice([("GET", "/batch?groups=1&timeout=0", None), ("POST", "/done", b"{}"),
                                             ("POST", "/version", b'{"version": 2147483647}')])
            token = REPLICA_TOKEN
        if rnd.random() < 0.2:  # a credential bound to worker "w", speaking for "w0": 403
            method, path, body = rnd.choice([("POST", "/rollouts", valid_body),
                                             ("GET", "/quota?worker=w0&version=1", None)])
            token = replica_token(REPLICA_TOKEN, "w")
        return http(method, path, body, token=token, headers=extra), False
    if kind == 6:  # wrong methods, on every path
        method = rnd.choice(["PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "FOO", "get", "HEAD"])
        return http(method, rnd.choice(["/rollouts", "/batch", "/version", "/stats", "/healthz", "/quota", "/config",
                                         "/done"]), None), False
    if kind == 7:  # right paths, wrong method; and unknown paths
        method, path = rnd.choice([("GET", "/rollouts"), ("GET", "/version"), ("POST", "/stats"), ("POST", "/batch"),
                                   ("GET", "/done"), ("POST", "/quota"), ("POST", "/config"),
                                   ("POST", "/healthz"), ("GET", "/"), ("GET", "/admin"), ("POST", "/rollouts/"),
                                   ("GET", "/../etc/passwd"), ("GET", "/STATS"), ("GET", "/%00"),
                                   ("GET", "/" + "a" * 8000), ("POST", "/rollouts;x"), ("GET", "http://evil/stats")])
        return http(method, path, valid_body if method == "POST" else None), False
    if kind == 8 and rnd.random() < 0.4:  # GET /quota with a bad query
        q = rnd.choice(["", "worker=w", "version=1", "worker=&version=1", "worker=w&version=-1", "worker=w&version=x",
                        "worker=w&version=1&max=0", "worker=w&version=1&max=-5", "worker=w&version=1&timeout=nan",
                        "worker=w&version=1&timeout=-2", "worker=w&version=1&extra=1", "worker=w&worker=v&version=1",
                        f"worker={'w' * 257}&version=1", "worker=w&version=99999999999999"])
        return http("GET", "/quota?" + q, None, token=rnd.choice([TOKEN, REPLICA_TOKEN])), False
    if kind == 8:  # GET /batch with a bad query
        q = rnd.choice(["", "groups=0", "groups=-1", "groups=abc", "groups=1e3", f"groups={MAX_GROUPS + 1}",
                        "groups=", "groups=99999999999999999999", "groups=1&timeout=nan", "groups=1&timeout=inf",
                        "groups=1&timeout=-1", "groups=1&timeout=x", "groups=1&evil=1", "groups=1&groups=2",
                        "groups=1&" + "&".join(f"k{i}=1" for i in range(20)), "groups=%FF", "timeout=1",
                        "groups=1&ack=-1", "groups=1&ack=x", "groups=1&ack=1e3", "groups=1&ack=1&ack=2"])
        return http("GET", "/batch?" + q, None), False
    if kind == 9 and rnd.random() < 0.3:  # POST /done with a body that is not {}
        return http("POST", "/done", rnd.choice([b'{"now": true}', b"[]", b"null", b"", b"{", b'{"done": 1}'])), False
    if kind == 9:  # POST /version with a bad body, or one going back (409)
        v = rnd.choice([-1, -(2**40), 1.5, "2", True, None, [], {}, 2**31, NAN, INF, 0])
        body = json.dumps({"version": v} if rnd.random() < 0.8 else {"versions": 5}).encode()
        return http("POST", "/version", body if rnd.random() < 0.9 else rnd.choice(BAD_BODIES)), False
    if kind == 10:  # a lying or absent Content-Length, chunked; the body cut short by a half-close
        claim = rnd.choice(["abc", "-1", "1e3", " ", "+5", "0x10", "9" * 30, "99999999999", str(len(valid_body) + 99)])
        head = [f"Content-Length: {claim}"] if rnd.random() < 0.7 else rnd.choice(
            [["Transfer-Encoding: chunked"], [], ["Content-Length: 5", "Content-Length: 6"]])
        head += ["X-Proxy-Token: " + TOKEN, "Connection: close"]
        data = ("POST /rollouts HTTP/1.1\r\n" + "\r\n".join(head) + "\r\n\r\n").encode()
        if "99999999999" in claim:
            return data, False  # far over --max-body-mb: 413 without the body ever being sent
        return data + valid_body[:rnd.randint(0, len(valid_body) - 1)], True
    return rnd.choice([b"HELLO\r\n\r\n", b"GET\r\n\r\n", b"GET /stats FOO/1.1\r\n\r\n", b"GET /stats HTTP/1.x\r\n\r\n",
                       b"GET / HTTP/1.1 extra\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,
                       b"GET /stats HTTP/1.1\r\n" + b"X-Pad: y\r\n" * 120 + b"\r\n",
                       b"GET /stats HTTP/1.1\r\nX-Long: " + b"z" * 70000 + b"\r\n\r\n",
                       b"GET /" + b"q" * 70000 + b" HTTP/1.1\r\n\r\n", b"GET /stats\r\n\r\n"]), True


def test_600_hostile_requests_get_4xx_and_change_no_counter():
    server, _ = serve(token=TOKEN, rollout_token=REPLICA_TOKEN, max_groups=MAX_GROUPS, max_body_mb=0.5, max_staleness=2,
                      request_timeout=5, num_generations=2)
    port = server.server_address[1]
    url = f"http://127.0.0.1:{port}"
    try:
        client = ProxyClient(url, token=TOKEN)  # some state to keep: buffered, delivered, a version
        client.post_rollouts([make_group(f"seed-{i}", version=1) for i in range(4)])  # before the trainer's version
        client.set_version(1)
        assert len(client.get_batch(1)["groups"]) == 1
        before = client.stats()
        rnd = random.Random(20240601)
        valid_body = json.dumps({"groups": [make_group("never-valid-here")]}).encode()
        statuses = {}
        for i in range(600):
            data, half_close = hostile_request(rnd, valid_body)
            status, _, _ = raw_request(port, data, half_close=half_close)
            assert 400 <= status < 500 and status != 429, (i, status, data[:300])
            statuses[status] = statuses.get(status, 0) + 1
        after = client.stats()
        assert healthy(url)
        for key in before:
            if key not in ("rejected", "uptime_s"):
                assert after[key] == before[key], key
        assert after["rejected"] == before["rejected"] + 600  # each counted once as a bad request
        assert {400, 401, 403, 404, 405, 409, 411, 413} <= set(statuses), statuses
        # and it still works: the valid body is accepted, then handed out
        assert client.post_rollouts(json.loads(valid_body)["groups"])["accepted"] == 1
        batch = requests.get(url + "/batch?groups=4", headers={"X-Proxy-Token": TOKEN}).json()["groups"]
        assert "never-valid-here" in [g["group_id"] for g in batch]
    finally:
        server.shutdown()
        server.server_close()


def test_the_chaos_harness_judges_a_future_group_by_the_version_the_proxy_answered_with():
    """bench/chaos.py (issue 49): a group made as t + 1 from a /stats read is from the future only
    if the proxy's answer says so; a trainer that reached t + 1 before the POST makes 200 right
    (a 4-minute run failed on 'trainer_version': 1057 for a group of v1057)."""
    import chaos

    future = {"policy_version": 1057}
    assert chaos.poison_verdict("future version", future, 409, {"error": "ahead"}) is None
    assert chaos.poison_verdict("future version", future, 200, {"trainer_version": 1057}) is None
    assert chaos.poison_verdict("future version", future, 200, {"trainer_version": None}) is None
    assert "expected 409" in chaos.poison_verdict("future version", future, 200,
                                                  {"trainer_version": 1056})
    assert "expected 400" in chaos.poison_verdict("G", future, 200, {"trainer_version": 1056})
    assert chaos.poison_verdict("reward 1e29", future, 200, {}) is None
