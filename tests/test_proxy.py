"""proxy.py over real HTTP on 127.0.0.1: every endpoint and status code, the accounting under 32
concurrent posters, TLS, the client's retries across a restart, and the CLI as a subprocess.

    .venv/bin/python -m pytest tests/test_proxy.py -q
"""

import datetime
import ipaddress
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from conftest import ROOT, free_port, wait_port
from proxy import ProxyClient, ProxyError, RolloutBuffer, parse_batch_query, serve

TOKEN = "s3cret-token"


def make_group(gid, version=0, worker="w0", n=2, tokens=4):
    """A valid group: n completions of `tokens` ids each (the last one EOS), one log-prob per id."""
    return {"group_id": gid, "policy_version": version, "worker": worker, "prompt": "Say a digit.",
            "prompt_ids": [5, 6, 7],
            "completions": [{"ids": [10 + i] * (tokens - 1) + [3], "logprobs": [-0.5] * tokens,
                             "reward": float(i % 2), "text": "7" * (tokens - 1), "finish_reason": "stop"}
                            for i in range(n)]}


def raw_request(port, data, half_close=False, timeout=10.0):
    """Send raw bytes, read until the server closes; returns (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                b = s.recv(65536)
            except ConnectionResetError:
                break
            if not b:
                break
            chunks.append(b)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


def counters(stats):
    """The integer counters of /stats, without `rejected` (which counts bad requests)."""
    return {k: v for k, v in stats.items() if k not in ("rejected", "uptime_s")}


def identity_holds(s):
    return s["accepted"] == s["delivered"] + s["dropped_stale"] + s["buffered"]


@pytest.fixture
def proxy():
    """start(**serve_kwargs) -> (url, server); every server started is shut down afterwards."""
    servers = []

    def start(**kw):
        server, _ = serve(**kw)
        servers.append(server)
        return f"{'https' if kw.get('tls_cert') else 'http'}://127.0.0.1:{server.server_address[1]}", server

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def later(seconds, fn):
    """Run fn in a daemon thread after `seconds` (daemon: a failing test must not hang on it)."""
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.start()


def auth(token=TOKEN):
    return {"Authorization": f"Bearer {token}"}


def test_healthz_needs_no_token_and_everything_else_does(proxy):
    url, _ = proxy(token=TOKEN)
    assert requests.get(url + "/healthz").json() == {"ok": True}
    calls = [("GET", "/stats", None), ("GET", "/batch?groups=1&timeout=0", None),
             ("POST", "/rollouts", {"groups": [make_group("a")]}), ("POST", "/version", {"version": 1})]
    for method, path, body in calls:
        for headers in ({}, auth("wrong"), auth(TOKEN + "x"), {"Authorization": TOKEN},
                        {"Authorization": "Basic eDp5"}):
            r = requests.request(method, url + path, json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers)
            assert r.headers["WWW-Authenticate"] == "Bearer" and "PROXY_TOKEN" in r.json()["error"]
    s = requests.get(url + "/stats", headers=auth()).json()
    assert s["accepted"] == 0 and s["trainer_version"] == 0 and s["rejected"] == 20
    assert requests.post(url + "/rollouts", json={"groups": [make_group("a")]}, headers=auth()).status_code == 200


def test_post_rollouts_counts_duplicates_and_balances(proxy):
    url, _ = proxy()
    r = requests.post(url + "/rollouts", json={"groups": [make_group("a"), make_group("b", worker="w1")]})
    assert r.status_code == 200 and r.json() == {"accepted": 2, "duplicates": 0, "stale": 0, "trainer_version": 0}
    # a retried POST (same group_ids) plus one new group, plus a group repeated inside one request
    r = requests.post(url + "/rollouts", json={"groups": [make_group("a"), make_group("c"), make_group("c")]})
    assert r.json() == {"accepted": 1, "duplicates": 2, "stale": 0, "trainer_version": 0}
    s = requests.get(url + "/stats").json()
    assert (s["received"], s["accepted"], s["duplicates"], s["buffered"], s["delivered"]) == (5, 3, 2, 3, 0)
    assert s["workers"] == {"w0": {"accepted": 2, "duplicates": 2, "dropped_stale": 0, "delivered": 0},
                            "w1": {"accepted": 1, "duplicates": 0, "dropped_stale": 0, "delivered": 0}}
    b = requests.get(url + "/batch?groups=5&timeout=0").json()
    assert [g["group_id"] for g in b["groups"]] == ["a", "b", "c"]  # oldest first, each once
    assert b["groups"][0] == make_group("a")  # handed out exactly as posted
    s = requests.get(url + "/stats").json()
    assert (s["delivered"], s["buffered"], s["staleness"]) == (3, 0, {"0": 3}) and identity_holds(s)


BAD_GROUPS = [  # (change to a valid group, text the 400 message must contain)
    (lambda g: g.pop("group_id"), "groups[1].group_id: missing"),
    (lambda g: g.update(group_id=7), "groups[1].group_id: must be a string"),
    (lambda g: g.update(group_id="x" * 300), "groups[1].group_id"),
    (lambda g: g.update(policy_version=-1), "groups[1].policy_version"),
    (lambda g: g.update(policy_version=1.0), "groups[1].policy_version"),
    (lambda g: g.update(policy_version=True), "groups[1].policy_version"),
    (lambda g: g.update(prompt_ids=[1, "2"]), "groups[1].prompt_ids"),
    (lambda g: g.update(prompt_ids=[-4]), "groups[1].prompt_ids"),
    (lambda g: g.update(completions=[]), "groups[1].completions"),
    (lambda g: g["completions"][1]["logprobs"].pop(), "groups[1].completions[1].logprobs: 3 log-probs for 4 ids"),
    (lambda g: g["completions"][0]["logprobs"].__setitem__(2, float("nan")), "groups[1].completions[0].logprobs[2]"),
    (lambda g: g["completions"][0]["logprobs"].__setitem__(0, 1e300), "groups[1].completions[0].logprobs[0]"),
    (lambda g: g["completions"][0]["logprobs"].__setitem__(0, "x"), "groups[1].completions[0].logprobs[0]"),
    (lambda g: g["completions"][1].update(ids=[3, None]), "groups[1].completions[1].ids"),
    (lambda g: g["completions"][1].update(reward="1"), "groups[1].completions[1].reward"),
    (lambda g: g["completions"][1].update(reward=float("inf")), "groups[1].completions[1].reward"),
    (lambda g: g["completions"][1].pop("text"), "groups[1].completions[1].text: missing"),
    (lambda g: g["completions"][1].update(finish_reason=None), "groups[1].completions[1].finish_reason"),
    (lambda g: g["completions"].append("oops"), "groups[1].completions[2]: must be a JSON object"),
    (lambda g: g.update(answer="7"), "groups[1]: unknown fields ['answer']"),
    (lambda g: g["completions"][0].update(extra=float("nan")), "groups[1].completions[0]: unknown fields ['extra']"),
]


def test_malformed_groups_get_400_naming_the_field_and_change_nothing(proxy):
    url, _ = proxy()
    requests.post(url + "/rollouts", json={"groups": [make_group("seed")]})
    before = requests.get(url + "/stats").json()
    for change, expected in BAD_GROUPS:
        bad = make_group("bad")
        change(bad)
        # the first group of the request is valid: nothing of it may be kept either
        r = requests.post(url + "/rollouts", data=_dumps({"groups": [make_group("ok"), bad]}))
        assert r.status_code == 400 and expected in r.json()["error"], (expected, r.text)
    for body, expected in [(b"{", "body: not valid JSON"), (b'{"groups": [NaN]}', "groups[0]: must be a JSON object"),
                           (b"[]", "body: must be"), (b'{"groups": []}', "groups: must be a non-empty list"),
                           (b"{}", "body.groups: missing")]:
        r = requests.post(url + "/rollouts", data=body)
        assert r.status_code == 400 and expected in r.json()["error"], (body, r.text)
    after = requests.get(url + "/stats").json()
    assert counters(after) == counters(before) and after["rejected"] == before["rejected"] + len(BAD_GROUPS) + 5
    # "ok" was not remembered as seen: it is accepted now
    assert requests.post(url + "/rollouts", json={"groups": [make_group("ok")]}).json()["accepted"] == 1


def _dumps(obj):
    import json

    return json.dumps(obj).encode()  # allow_nan: the test sends NaN on purpose


def test_num_generations_mismatch_says_how_to_start_rollout(proxy):
    url, _ = proxy(num_generations=4)
    r = requests.post(url + "/rollouts", json={"groups": [make_group("a", n=2)]})
    assert r.status_code == 400 and "start rollout.py with --num-generations 4" in r.json()["error"]
    assert requests.post(url + "/rollouts", json={"groups": [make_group("a", n=4)]}).status_code == 200


def test_body_limits_411_413_408_and_truncated(proxy):
    url, server = proxy(max_body_mb=0.01, request_timeout=1.0)  # 10 KiB
    port = server.server_address[1]
    # 413 from the header alone: the 1 GB body is never sent, the answer comes at once
    t0 = time.time()
    status, headers, body = raw_request(port, b"POST /rollouts HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\n")
    assert status == 413 and headers["Connection"] == "close" and b"--max-body-mb" in body and time.time() - t0 < 2
    r = requests.post(url + "/rollouts", data=b"x" * 20000)
    assert r.status_code == 413
    assert raw_request(port, b"POST /rollouts HTTP/1.1\r\nConnection: close\r\n\r\n")[0] == 411
    assert raw_request(port, b"POST /rollouts HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")[0] == 411
    # a lying Content-Length: the body ends early (client half-closes) or never comes (timeout)
    request = b'POST /rollouts HTTP/1.1\r\nContent-Length: 500\r\n\r\n{"groups"'
    status, _, body = raw_request(port, request, half_close=True)
    assert status == 400 and b"ended after 9 of the 500 bytes" in body
    t0 = time.time()
    status, _, _ = raw_request(port, b"POST /version HTTP/1.1\r\nContent-Length: 50\r\n\r\n{\"ver")
    assert status == 408 and 0.9 < time.time() - t0 < 5
    assert requests.get(url + "/healthz").status_code == 200


def test_429_when_full_keeps_nothing(proxy):
    url, _ = proxy(max_groups=3)
    post = lambda *ids: requests.post(url + "/rollouts", json={"groups": [make_group(i) for i in ids]})  # noqa: E731
    assert post("a", "b").status_code == 200
    r = post("c", "d")
    assert r.status_code == 429 and r.headers["Retry-After"] == "1" and "buffer full" in r.json()["error"]
    s = requests.get(url + "/stats").json()
    assert (s["accepted"], s["buffered"], s["refused_full"], s["received"], s["rejected"]) == (2, 2, 2, 4, 0)
    assert post("a", "b").json()["duplicates"] == 2  # a retry of what is already in: fine even when full
    assert post("a", "c").json() == {"accepted": 1, "duplicates": 1, "stale": 0, "trainer_version": 0}
    assert post("d").status_code == 429
    assert post(*"efgh").status_code == 400  # more than --max-groups in one POST could never fit
    requests.get(url + "/batch?groups=2")
    assert post("d").status_code == 200  # "d" was not remembered by the refused POSTs
    s = requests.get(url + "/stats").json()
    assert (s["accepted"], s["delivered"], s["buffered"]) == (4, 2, 2) and identity_holds(s)


def test_batch_long_poll_wakes_on_arrival_and_does_not_spin(proxy):
    url, _ = proxy()
    out = {}

    def poll():
        t0 = time.time()
        out["batch"] = requests.get(url + "/batch?groups=2&timeout=20").json()
        out["took"] = time.time() - t0

    th = threading.Thread(target=poll)
    cpu0 = time.process_time()
    th.start()
    time.sleep(1.0)
    requests.post(url + "/rollouts", json={"groups": [make_group("a")]})
    time.sleep(0.5)
    assert th.is_alive()  # one of the two groups it asked for: still waiting
    requests.post(url + "/rollouts", json={"groups": [make_group("b")]})
    th.join(5)
    assert [g["group_id"] for g in out["batch"]["groups"]] == ["a", "b"] and 1.4 < out["took"] < 5
    assert time.process_time() - cpu0 < 0.6  # a busy wait would burn ~1.5 s of CPU here
    # the timeout: returns what there is (here one group of the three asked for) when it runs out
    requests.post(url + "/rollouts", json={"groups": [make_group("c")]})
    t0 = time.time()
    b = requests.get(url + "/batch?groups=3&timeout=0.5").json()
    assert [g["group_id"] for g in b["groups"]] == ["c"] and 0.45 < time.time() - t0 < 3
    assert requests.get(url + "/batch?groups=1").json()["groups"] == []  # timeout defaults to 0
    for q in ["groups=0", "groups=-1", "groups=x", "groups=4097", "timeout=1", "groups=1&timeout=-1",
              "groups=1&timeout=nan", "groups=1&timeout=inf", "groups=1&when=now", "groups=1&groups=2"]:
        r = requests.get(url + "/batch?" + q)
        assert r.status_code == 400 and r.json()["error"].split(":")[0] in ("groups", "timeout", "query"), q
    assert parse_batch_query("groups=3&timeout=1e9", 8) == (3, 300.0)  # long polls are capped at 300 s


def test_version_drops_stale_groups_and_refuses_going_back(proxy):
    url, _ = proxy(max_staleness=1)
    post = lambda *gs: requests.post(url + "/rollouts", json={"groups": list(gs)}).json()  # noqa: E731
    post(make_group("v0", 0), make_group("v1", 1), make_group("v2", 2, worker="w2"))
    r = requests.post(url + "/version", json={"version": 2})
    assert r.status_code == 200 and r.json() == {"dropped": 1, "trainer_version": 2}  # v0 is 2 behind
    r = requests.post(url + "/version", json={"version": 1})
    assert r.status_code == 409 and "lower" in r.json()["error"]
    assert requests.post(url + "/version", json={"version": 2}).json()["dropped"] == 0  # a retry is harmless
    assert post(make_group("late", 0)) == {"accepted": 1, "duplicates": 0, "stale": 1, "trainer_version": 2}
    b = requests.get(url + "/batch?groups=10").json()
    assert [g["group_id"] for g in b["groups"]] == ["v1", "v2"] and b["trainer_version"] == 2
    s = requests.get(url + "/stats").json()
    assert (s["accepted"], s["dropped_stale"], s["delivered"], s["buffered"]) == (4, 2, 2, 0) and identity_holds(s)
    assert s["staleness"] == {"0": 1, "1": 1} and s["workers"]["w0"]["dropped_stale"] == 2
    for body in [{"version": -1}, {"version": "3"}, {"version": 2.0}, {"version": True}, {"v": 3}, [3]]:
        assert requests.post(url + "/version", json=body).status_code == 400, body
    assert requests.get(url + "/stats").json()["trainer_version"] == 2


def test_unknown_paths_404_and_wrong_methods_405(proxy):
    url, _ = proxy()
    for path in ["/", "/rollout", "/rollouts/", "/stats/x", "/admin"]:
        r = requests.get(url + path)
        assert r.status_code == 404 and "proxy.py serves" in r.json()["error"], path
    for method, path, allow in [("GET", "/rollouts", "POST"), ("POST", "/stats", "GET"), ("POST", "/batch", "GET")]:
        r = requests.request(method, url + path)
        assert r.status_code == 405 and r.headers["Allow"] == allow
    for method in ["PUT", "DELETE", "PATCH", "OPTIONS"]:
        assert requests.request(method, url + "/rollouts").status_code == 405
    assert requests.get(url + "/stats").json()["rejected"] == 12


def test_32_concurrent_posters_with_retries_and_a_consumer_bumping_versions(proxy):
    url, _ = proxy(max_staleness=1, max_groups=64)
    threads_n, posts, per = 32, 6, 3
    posted, replies, delivered, snapshots, errors = set(), [], [], [], []
    lock, done = threading.Lock(), threading.Event()

    def poster(t):
        rnd, client, version = random.Random(t), ProxyClient(url, max_wait=60), 0
        try:
            for k in range(posts):
                gs = [make_group(f"t{t}-{k}-{j}", max(0, version - rnd.choice([0, 0, 1, 2])), f"w{t % 4}")
                      for j in range(per)]
                r = client.post_rollouts(gs)
                version = r["trainer_version"]
                retry = client.post_rollouts(gs) if k % 2 == 0 else None  # as if the first answer was lost
                with lock:
                    posted.update(g["group_id"] for g in gs)
                    replies.append(r)
                    if retry is not None:
                        replies.append(retry)
                        assert retry["accepted"] == 0 and retry["duplicates"] == per
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def consumer():
        client, version, batches = ProxyClient(url), 0, 0
        while True:
            b = client.get_batch(8, timeout=0.2)
            for g in b["groups"]:
                assert b["trainer_version"] - g["policy_version"] <= 1  # never a stale one
            delivered.extend(g["group_id"] for g in b["groups"])
            batches += 1
            if batches % 3 == 0:
                version += 1
                client.set_version(version)
            if done.is_set() and not b["groups"]:
                return

    def watcher():
        client = ProxyClient(url)
        while not done.is_set():
            snapshots.append(client.stats())

    posters = [threading.Thread(target=poster, args=(t,)) for t in range(threads_n)]
    others = [threading.Thread(target=consumer), threading.Thread(target=watcher)]
    for th in posters + others:
        th.start()
    for th in posters:
        th.join(60)
    done.set()
    for th in others:
        th.join(30)
    assert not errors, errors
    s = ProxyClient(url).stats()
    assert len(posted) == threads_n * posts * per == s["accepted"] == sum(r["accepted"] for r in replies)
    assert s["duplicates"] == sum(r["duplicates"] for r in replies) == threads_n * (posts // 2) * per
    assert len(delivered) == len(set(delivered)) == s["delivered"] and set(delivered) <= posted  # each at most once
    assert s["buffered"] == 0 and s["delivered"] + s["dropped_stale"] == s["accepted"]  # or else dropped as stale
    assert s["delivered"] > 0 and s["dropped_stale"] > 0 and s["trainer_version"] > 0
    assert sum(r["stale"] for r in replies) <= s["dropped_stale"]
    assert sum(s["staleness"].values()) == s["delivered"] and max(map(int, s["staleness"])) <= 1
    for key in ("accepted", "duplicates", "dropped_stale", "delivered"):
        assert sum(w[key] for w in s["workers"].values()) == s[key]
    assert len(snapshots) > 5 and all(identity_holds(x) for x in snapshots)


def make_cert(tmp_path):
    """A self-signed certificate for 127.0.0.1 and localhost; returns (cert.pem, key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "proxy-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_tls_with_a_self_signed_certificate(proxy, tmp_path):
    cert, key = make_cert(tmp_path)
    url, server = proxy(token=TOKEN, tls_cert=cert, tls_key=key)
    assert url.startswith("https://")
    client = ProxyClient(url, token=TOKEN, verify=cert)
    assert client.healthy()
    assert client.post_rollouts([make_group("a")])["accepted"] == 1
    assert [g["group_id"] for g in client.get_batch(1, timeout=1)["groups"]] == ["a"]
    with pytest.raises(ProxyError, match="verify="):  # the system CAs do not know this certificate
        ProxyClient(url, token=TOKEN).stats()
    # plain HTTP to the TLS port gets no answer; the proxy carries on
    port = server.server_address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        try:
            assert b"HTTP/1.1 200" not in s.recv(1024)
        except ConnectionResetError:
            pass
    with pytest.raises(ProxyError, match="gave up after 1 s"):
        ProxyClient(url.replace("https", "http"), token=TOKEN, max_wait=1).stats()
    assert client.stats()["delivered"] == 1


def test_client_rides_out_a_proxy_restart(proxy, capsys):
    url, server = proxy()
    port = server.server_address[1]
    client = ProxyClient(url, max_wait=30)
    assert client.post_rollouts([make_group("before")])["accepted"] == 1  # its connection is kept alive
    server.shutdown()
    server.server_close()
    later(1.0, lambda: proxy(port=port))  # the same port, a fresh proxy, a second later
    t0 = time.time()
    assert client.post_rollouts([make_group("after")]) == {"accepted": 1, "duplicates": 0, "stale": 0,
                                                           "trainer_version": 0}
    assert 0.9 < time.time() - t0 < 10
    assert client.stats()["accepted"] == 1  # the new proxy: the restart emptied the buffer
    lines = [line for line in capsys.readouterr().err.splitlines() if "retrying" in line]
    assert len(lines) == 1 and "cannot reach the proxy" in lines[0]


def test_client_errors_are_clear_and_not_retried(proxy, capsys):
    url, _ = proxy(token=TOKEN, max_groups=2)
    for call in [lambda c: c.stats(), lambda c: c.post_rollouts([make_group("a")])]:
        with pytest.raises(ProxyError, match="HTTP 401.*check PROXY_TOKEN"):
            call(ProxyClient(url, token="wrong"))
    with pytest.raises(ProxyError, match=r"/sub/stats: HTTP 404.*is the URL a proxy.py"):
        ProxyClient(url + "/sub", token=TOKEN).stats()
    client = ProxyClient(url, token=TOKEN, max_wait=20)
    with pytest.raises(ProxyError, match=r"HTTP 400: groups\[0\].completions\[0\].logprobs: 3 log-probs for 4 ids"):
        bad = make_group("bad")
        bad["completions"][0]["logprobs"].pop()
        client.post_rollouts([bad])
    with pytest.raises(ProxyError, match="NaN"):
        bad["completions"][0]["reward"] = float("nan")
        client.post_rollouts([bad])
    client.set_version(3)
    with pytest.raises(ProxyError, match="HTTP 409"):
        client.set_version(2)
    assert "retrying" not in capsys.readouterr().err
    # 429: retried, honouring Retry-After, until the consumer makes room
    client.post_rollouts([make_group("a", 3), make_group("b", 3)])
    later(1.5, lambda: ProxyClient(url, token=TOKEN, max_wait=5).get_batch(2))
    t0 = time.time()
    assert client.post_rollouts([make_group("c", 3)])["accepted"] == 1 and 1.4 < time.time() - t0 < 8
    assert "proxy buffer full" in capsys.readouterr().err
    # nothing listening: gives up after max_wait
    t0 = time.time()
    with pytest.raises(ProxyError, match="gave up after 1.5 s: cannot reach the proxy"):
        ProxyClient(f"http://127.0.0.1:{free_port()}", max_wait=1.5).stats()
    assert 1.4 < time.time() - t0 < 4
    assert not ProxyClient(f"http://127.0.0.1:{free_port()}").healthy()


def test_remembered_group_ids_are_bounded():
    buf = RolloutBuffer(max_staleness=4, max_groups=100, remember_ids=3)
    for gid in "abcd":
        buf.add([make_group(gid)])
    assert buf.add([make_group("b")])["duplicates"] == 1  # among the last three
    assert buf.add([make_group("a")])["accepted"] == 1    # forgotten: the fifth id pushed it out
    assert len(buf.seen) == len(buf.seen_order) == 3


def test_one_log_line_per_interval_and_quiet_when_idle(proxy, caplog):
    caplog.set_level("INFO", logger="proxy")
    url, _ = proxy(log_every=0.5)
    time.sleep(1.2)
    assert not caplog.records  # nothing happened, nothing said
    for i in range(5):
        requests.post(url + "/rollouts", json={"groups": [make_group(f"g{i}")]})
    requests.get(url + "/nope")
    time.sleep(1.2)
    lines = [r.getMessage() for r in caplog.records]  # one line, or two if an interval ended mid-burst
    assert 1 <= len(lines) <= 2 and "buffer 5/4096" in lines[-1], lines
    assert sum(int(re.search(r"in \+(\d+)", x)[1]) for x in lines) == 5
    assert sum(int(re.search(r"rejected \+(\d+)", x)[1]) for x in lines) == 1
    time.sleep(1.2)
    assert len(caplog.records) == len(lines)


def _exit_message(proc):
    """stderr of a proxy.py that should exit at once; killed if it does not (a failing test leaks nothing)."""
    try:
        return proc.communicate(timeout=20)[1]
    finally:
        proc.kill()


def _start_cli(*args, env_token=None):
    env = {k: v for k, v in os.environ.items() if k != "PROXY_TOKEN"}
    if env_token:
        env["PROXY_TOKEN"] = env_token
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "proxy.py"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_token_from_env_quiet_log_and_clean_exit():
    port = free_port()
    proc = _start_cli("--host", "127.0.0.1", "--port", str(port), "--max-groups", "8", "--num-generations", "2",
                      env_token=TOKEN)
    try:
        wait_port(port)
        url = f"http://127.0.0.1:{port}"
        assert requests.get(url + "/stats").status_code == 401
        client = ProxyClient(url, token=TOKEN)
        assert client.post_rollouts([make_group("a")])["accepted"] == 1
        with pytest.raises(ProxyError, match="--num-generations 2"):
            client.post_rollouts([make_group("b", n=3)])
        assert client.stats()["max_groups"] == 8
        # 128 replicas (re)connecting at once are all let in (socketserver's default backlog of 5 is not)
        answers = []

        def connect():
            try:
                answers.append(raw_request(port, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n", timeout=5)[0])
            except OSError as e:
                answers.append(repr(e))

        burst = [threading.Thread(target=connect) for _ in range(128)]
        for th in burst:
            th.start()
        for th in burst:
            th.join()
        assert answers == [200] * 128, [a for a in answers if a != 200][:3]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert f"listening on http://127.0.0.1:{port}" in err and "token required" in err
    assert "POST" not in err and "GET" not in err and "Traceback" not in err  # no line per request
    assert "proxy: stopped" in err and "'accepted': 1" in err


def test_cli_refuses_a_public_address_without_a_token_and_bad_tls_flags():
    port = free_port()
    proc = _start_cli("--host", "0.0.0.0", "--port", str(port))
    err = _exit_message(proc)
    assert proc.returncode != 0 and err.startswith("proxy.py: error: refusing to listen on '0.0.0.0' without a token")
    assert "PROXY_TOKEN" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    proc = _start_cli("--port", str(port), "--tls-cert", "cert.pem")
    err = _exit_message(proc)
    assert proc.returncode != 0 and "--tls-cert and --tls-key go together" in err
    proc = _start_cli("--host", "0.0.0.0", "--port", str(port), env_token=TOKEN)  # with a token it listens
    try:
        wait_port(port)
        assert requests.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
