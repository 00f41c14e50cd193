"""proxy.py over real HTTP on 127.0.0.1: every endpoint and status code, the run's contract, the
generation quota, the two tokens, the accounting under 32 concurrent posters, the hardening
(dead connections, byte budget, request deadline, connection cap, fd exhaustion), the client's
retries across a restart, and the CLI as a subprocess (including how it ends the run).

    .venv/bin/python -m pytest tests/test_proxy.py -q
"""

import collections
import gc
import json
import math
import os
import random
import re
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import requests

from conftest import ROOT, free_port, wait_port
from proxy import RolloutBuffer, serve
from support.group_checks import UsableGroups
from support.worker_bounds import GuardedBuffer
from support.contract import ConfigError
from support.http_hardening import parse_query, query_seconds
from support.proxy_client import ProxyClient, ProxyError
from support.proxy_service import replica_token

TOKEN = "s3cret-token"
REPLICA_TOKEN = "replica-token"


def make_group(gid, version=0, worker="w0", n=2, tokens=4, rewards=None, **fields):
    """A valid group for the default contract (but G = n): n completions of `tokens` ids each (the last one
    EOS), one log-prob per id; rewards 0, 1, 0, ... unless given."""
    rewards = rewards or [float(i % 2) for i in range(n)]
    return {"group_id": gid, "policy_version": version, "worker": worker, "prompt": "Say a digit.",
            "prompt_ids": [5, 6, 7], "temperature": 1.0, "max_new_tokens": 256, **fields,
            "completions": [{"ids": [10 + i] * (tokens - 1) + [3], "logprobs": [-0.5] * tokens,
                             "reward": rewards[i], "text": "7" * (tokens - 1), "finish_reason": "stop"}
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
    """The counters of /stats, without `rejected` (which counts bad requests)."""
    return {k: v for k, v in stats.items() if k not in ("rejected", "uptime_s")}


def identity_holds(s):
    return s["accepted"] == s["delivered"] + s["dropped_stale"] + s["dropped_zero_variance"] + s["buffered"]


@pytest.fixture
def proxy():
    """start(**serve_kwargs) -> (url, server), num_generations 2 unless given; all shut down afterwards."""
    servers = []

    def start(**kw):
        server, _ = serve(**{"num_generations": 2, **kw})
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def later(seconds, fn):
    """Run fn in a daemon thread after `seconds` (daemon: a failing test must not hang on it)."""
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.start()


def until(predicate, timeout=10.0):
    """Wait for predicate() to hold (polling); fails the test when it does not within `timeout` s."""
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.05)


def healthy(url):
    try:
        return requests.get(url + "/healthz", headers={"Connection": "close"}, timeout=5).status_code == 200
    except requests.RequestException:
        return False


def auth(token=TOKEN):
    return {"X-Proxy-Token": token}


def post(url, *groups, **kw):
    return requests.post(url + "/rollouts", json={"groups": list(groups)}, **kw)


def stats(url, **kw):
    return requests.get(url + "/stats", **kw).json()


# ---- endpoints, status codes, validation -----------------------------------------------------

def test_healthz_needs_no_token_and_everything_else_does(proxy):
    url, _ = proxy(token=TOKEN)
    assert requests.get(url + "/healthz").json() == {"ok": True}
    calls = [("GET", "/stats", None), ("GET", "/config", None), ("GET", "/batch?groups=1&timeout=0", None),
             ("GET", "/quota?worker=w&version=0", None), ("POST", "/rollouts", {"groups": [make_group("a")]}),
             ("POST", "/version", {"version": 1}), ("POST", "/done", {})]
    for method, path, body in calls:
        for headers in ({}, auth("wrong"), auth(TOKEN + "x"), {"Authorization": TOKEN},
                        {"Authorization": f"Bearer {TOKEN}"}):  # Authorization is the gateway's, never ours
            r = requests.request(method, url + path, json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers)
            assert "X-Proxy-Token" in r.headers["WWW-Authenticate"] and "PROXY_TOKEN" in r.json()["error"]
    s = stats(url, headers=auth())
    assert s["accepted"] == 0 and s["trainer_version"] is None and s["state"] == "waiting" and s["rejected"] == 35
    s = stats(url, headers={**auth(), "Authorization": "Bearer hf_gateway"})  # a gateway's header rides along
    assert s["state"] == "waiting"
    assert post(url, make_group("a"), headers=auth()).status_code == 200


def test_config_serves_the_contract_and_the_client_checks_given_flags(proxy):
    url, _ = proxy(token=TOKEN, groups_per_step=4, max_staleness=0, temperature=0.7, max_new_tokens=64,
                   zero_variance="drop")
    contract = {"num_generations": 2, "groups_per_step": 4, "max_staleness": 0, "temperature": 0.7,
                "max_completion_length": 64, "zero_variance": "drop", "max_prompt_length": 1024,
                "reward_range": [-1e6, 1e6], "max_new_tokens": 64}  # the length's old name, too
    assert requests.get(url + "/config", headers=auth()).json() == contract
    client = ProxyClient(url, token=TOKEN)
    assert client.contract(temperature=None, max_staleness=0) == contract  # None: a flag not given
    with pytest.raises(ProxyError, match="--temperature 1.0 disagrees with the proxy's temperature 0.7"):
        client.contract(temperature=1.0)
    with pytest.raises(ProxyError, match="--max-completion-length 256 disagrees with the proxy's max_new_tokens 64"):
        client.contract(flags={"max_new_tokens": "--max-completion-length"}, max_new_tokens=256)
    for bad in [{"num_generations": 1}, {"groups_per_step": 0}, {"max_staleness": -1}, {"temperature": 0},
                {"max_completion_length": 0}, {"zero_variance": "maybe"}]:
        with pytest.raises(ConfigError, match="--" + next(iter(bad)).replace("_", "-")):
            serve(**bad)
    with pytest.raises(ConfigError, match="unknown settings"):
        serve(sync_every=2)


def test_post_rollouts_counts_duplicates_and_balances(proxy):
    url, _ = proxy()
    r = post(url, make_group("a"), make_group("b", worker="w1"))
    assert r.status_code == 200
    assert r.json() == {"accepted": 2, "duplicates": 0, "stale": 0, "zero_variance": 0, "over_quota": 0,
                        "trainer_version": None}
    # a retried POST (same group_ids) plus one new group, plus a group repeated inside one request
    r = post(url, make_group("a"), make_group("c"), make_group("c"))
    assert r.json() == {"accepted": 1, "duplicates": 2, "stale": 0, "zero_variance": 0, "over_quota": 0,
                        "trainer_version": None}
    s = stats(url)
    assert (s["received"], s["accepted"], s["duplicates"], s["buffered"], s["delivered"]) == (5, 3, 2, 3, 0)
    zero = {"dropped_stale": 0, "delivered": 0, "over_quota": 0}
    assert s["workers"] == {"w0": {"accepted": 2, "duplicates": 2, **zero}, "w1": {"accepted": 1, "duplicates": 0, **zero}}
    assert requests.post(url + "/version", json={"version": 0}).json() == {"dropped": 0, "trainer_version": 0}
    b = requests.get(url + "/batch?groups=5&timeout=0").json()
    assert [g["group_id"] for g in b["groups"]] == ["a", "b", "c"]  # oldest first, each once
    assert b["groups"][0] == make_group("a")  # handed out exactly as posted
    s = stats(url)
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
    (lambda g: g.pop("temperature"), "groups[1].temperature: missing"),
    (lambda g: g.update(temperature=0), "groups[1].temperature: must be a number > 0"),
    (lambda g: g.update(max_new_tokens="256"), "groups[1].max_new_tokens: must be an integer > 0"),
    (lambda g: g.update(completions=[]), "groups[1].completions"),
    (lambda g: g["completions"][1]["logprobs"].pop(), "groups[1].completions[1].logprobs: 3 log-probs for 4 ids"),
    (lambda g: g["completions"][0]["logprobs"].__setitem__(2, float("nan")), "groups[1].completions[0].logprobs[2]"),
    (lambda g: g["completions"][0]["logprobs"].__setitem__(0, 1e300), "groups[1].completions[0].logprobs[0]"),
    (lambda g: g["completions"][0]["logprobs"].__setitem__(0, "x"), "groups[1].completions[0].logprobs[0]"),
    (lambda g: g["completions"][0]["logprobs"].__setitem__(1, 0.25), "logprobs[1]: must be a log-prob in [-1000, 0]"),
    (lambda g: g["completions"][0]["logprobs"].__setitem__(3, -1e29), "logprobs[3]: must be a log-prob in [-1000, 0]"),
    (lambda g: g["completions"][1].update(ids=[3, None]), "groups[1].completions[1].ids"),
    (lambda g: g["completions"][1].update(reward="1"), "groups[1].completions[1].reward"),
    (lambda g: g["completions"][1].update(reward=float("inf")), "groups[1].completions[1].reward"),
    (lambda g: g["completions"][1].pop("text"), "groups[1].completions[1].text: missing"),
    (lambda g: g["completions"][1].update(finish_reason=None), "groups[1].completions[1].finish_reason"),
    (lambda g: g["completions"].append("oops"), "groups[1].completions: 3 completions, but this run has num_gen"),
    (lambda g: g["completions"].__setitem__(1, "oops"), "groups[1].completions[1]: must be a JSON object"),
    (lambda g: g.update(prompt_ids=[]), "groups[1].prompt_ids: 0 ids, but a prompt has 1 to max_prompt_length"),
    (lambda g: g.update(prompt_ids=[5] * 1025), "1025 ids, but a prompt has 1 to max_prompt_length 1024"),
    (lambda g: g["completions"][1].update(ids=[], logprobs=[]), "groups[1].completions[1].ids: empty"),
    (lambda g: g["completions"][1].update(reward=1e20), "completions[1].reward: 1e+20 is outside this run's "
                                                        "reward_range [0, 1] (proxy.py --reward-range LO HI)"),
    (lambda g: g["completions"][0].update(reward=-0.5), "groups[1].completions[0].reward: -0.5 is outside"),
    (lambda g: g.update(answer="7"), "groups[1]: unknown fields ['answer']"),
    (lambda g: g["completions"][0].update(extra=float("nan")), "groups[1].completions[0]: unknown fields ['extra']"),
]


def test_malformed_groups_get_400_naming_the_field_and_change_nothing(proxy):
    url, _ = proxy(reward_range=(0, 1))  # the built-in tasks' scale: a reward of -0.5 is outside
    post(url, make_group("seed"))
    before = stats(url)
    for change, expected in BAD_GROUPS:
        bad = make_group("bad")
        change(bad)
        # the first group of the request is valid: nothing of it may be kept either
        r = requests.post(url + "/rollouts", data=json.dumps({"groups": [make_group("ok"), bad]}))  # NaN on purpose
        assert r.status_code == 400 and expected in r.json()["error"], (expected, r.text)
    for body, expected in [(b"{", "body: not valid JSON"), (b'{"groups": [NaN]}', "groups[0]: must be a JSON object"),
                           (b"[]", "body: must be"), (b'{"groups": []}', "groups: must be a non-empty list"),
                           (b"{}", "body.groups: missing")]:
        r = requests.post(url + "/rollouts", data=body)
        assert r.status_code == 400 and expected in r.json()["error"], (body, r.text)
    after = stats(url)
    assert counters(after) == counters(before) and after["rejected"] == before["rejected"] + len(BAD_GROUPS) + 5
    # "ok" was not remembered as seen: it is accepted now; a log-prob of exactly 0 is one
    ok = make_group("ok")
    ok["completions"][0]["logprobs"][0] = 0.0
    assert post(url, ok).json()["accepted"] == 1


def test_other_sampling_settings_are_refused_naming_both_values(proxy):
    url, _ = proxy(num_generations=4, temperature=0.7, max_new_tokens=64)
    cases = [(make_group("t", n=4), "groups[0].temperature: 1.0, but this run samples with temperature 0.7"),
             (make_group("m", n=4, temperature=0.7), "groups[0].max_new_tokens: 256, but this run samples with "
                                                     "max_new_tokens 64"),
             (make_group("g", n=2, temperature=0.7, max_new_tokens=64), "2 completions, but this run has "
                                                                        "num_generations 4"),
             (make_group("l", n=4, tokens=65, temperature=0.7, max_new_tokens=64), "65 tokens exceed max_new_tokens 64")]
    for group, expected in cases:
        r = post(url, group)
        assert r.status_code == 400 and expected in r.json()["error"], r.text
        assert "start rollout.py without" in r.json()["error"] or "exceed" in expected
    assert post(url, make_group("ok", n=4, temperature=0.7, max_new_tokens=64)).json()["accepted"] == 1
    assert stats(url)["received"] == 1


def test_the_prompt_length_and_reward_range_come_from_the_contract(proxy):
    url, _ = proxy(max_prompt_length=3, reward_range=(-1, 2))
    config = requests.get(url + "/config").json()
    assert (config["max_prompt_length"], config["reward_range"]) == (3, [-1.0, 2.0])
    assert post(url, make_group("ok", rewards=[-1, 2])).json()["accepted"] == 1  # the ends are inside
    for group, expected in [(make_group("long", prompt_ids=[5, 6, 7, 8]), "4 ids, but a prompt has 1 to "
                                                                          "max_prompt_length 3"),
                            (make_group("hi", rewards=[0, 2.5]), "2.5 is outside this run's reward_range "
                                                                 "[-1, 2]")]:
        r = post(url, group)
        assert r.status_code == 400 and expected in r.json()["error"], r.text
    for bad in [{"reward_range": (1, 1)}, {"reward_range": (0, float("inf"))}, {"max_prompt_length": 0}]:
        with pytest.raises(ConfigError, match="--" + next(iter(bad)).replace("_", "-")):
            serve(**bad)


def test_body_limits_411_413_408_and_truncated(proxy):
    url, server = proxy(max_body_mb=0.01, request_timeout=1.0)  # 10 KiB
    port = server.server_address[1]
    # 413 from the header alone: the 1 GB body is never sent, the answer comes at once
    t0 = time.time()
    status, headers, body = raw_request(port, b"POST /rollouts HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\n")
    assert status == 413 and headers["Connection"] == "close" and b"--max-body-mb" in body and time.time() - t0 < 2
    assert requests.post(url + "/rollouts", data=b"x" * 20000).status_code == 413
    assert raw_request(port, b"POST /rollouts HTTP/1.1\r\nConnection: close\r\n\r\n")[0] == 411
    assert raw_request(port, b"POST /rollouts HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")[0] == 411
    # a lying Content-Length: the body ends early (client half-closes) or never comes (timeout)
    request = b'POST /rollouts HTTP/1.1\r\nContent-Length: 500\r\n\r\n{"groups"'
    status, _, body = raw_request(port, request, half_close=True)
    assert status == 400 and b"ended after 9 of the 500 bytes" in body
    status, _, body = raw_request(port, b"POST /version HTTP/1.1\r\nContent-Length: 50\r\n\r\n{\"ver")
    assert status == 408 and b"--request-timeout 1 s" in body
    assert requests.get(url + "/healthz").status_code == 200


def test_429_when_full_keeps_nothing(proxy):
    url, _ = proxy(max_groups=3)
    send = lambda *ids: post(url, *[make_group(i) for i in ids])  # noqa: E731
    assert send("a", "b").status_code == 200
    r = send("c", "d")
    assert r.status_code == 429 and r.headers["Retry-After"] == "1" and "buffer full" in r.json()["error"]
    s = stats(url)
    assert (s["accepted"], s["buffered"], s["refused_full"], s["received"], s["rejected"]) == (2, 2, 2, 4, 0)
    assert send("a", "b").json()["duplicates"] == 2  # a retry of what is already in: fine even when full
    assert send("a", "c").json() == {"accepted": 1, "duplicates": 1, "stale": 0, "zero_variance": 0,
                                     "over_quota": 0, "trainer_version": None}
    assert send("d").status_code == 429
    assert send(*"efgh").status_code == 400  # more than --max-groups in one POST could never fit
    requests.post(url + "/version", json={"version": 0})
    requests.get(url + "/batch?groups=2")
    assert send("d").status_code == 200  # "d" was not remembered by the refused POSTs
    s = stats(url)
    assert (s["accepted"], s["delivered"], s["buffered"]) == (4, 2, 2) and identity_holds(s)


def test_the_buffer_is_bounded_in_bytes_too(proxy):
    url, _ = proxy(max_buffer_mb=0.05)  # 51 KiB: 16 groups of 2 x 4 tokens (~3 KB each)
    codes = [post(url, make_group(f"g{i}")).status_code for i in range(30)]
    assert codes[:10] == [200] * 10 and codes[-1] == 429 and set(codes) == {200, 429}
    r = post(url, make_group("more"))
    assert r.status_code == 429 and "of --max-buffer-mb 0.05" in r.json()["error"]
    s = stats(url)
    assert s["buffered"] == codes.count(200) and s["buffered_mb"] <= 0.05 and s["refused_full"] == codes.count(429) + 1
    big = make_group("big", tokens=250)  # ~36 KB in a buffer of 51 KiB: not now...
    assert post(url, big).status_code == 429
    big = make_group("big", n=2, tokens=256, prompt="p" * 20_000)  # ~56 KB alone: ...and this one never
    r = post(url, big)
    assert r.status_code == 413 and "more than --max-buffer-mb 0.05" in r.json()["error"]
    requests.post(url + "/version", json={"version": 0})
    assert len(requests.get(url + "/batch?groups=8").json()["groups"]) == 8
    assert post(url, make_group("more")).status_code == 200  # room again
    assert identity_holds(stats(url))


def test_batch_long_poll_wakes_on_arrival_and_does_not_spin(proxy):
    url, _ = proxy()
    requests.post(url + "/version", json={"version": 0})
    out = {}

    def poll():
        t0 = time.time()
        out["batch"] = requests.get(url + "/batch?groups=2&timeout=20").json()
        out["took"] = time.time() - t0

    th = threading.Thread(target=poll)
    cpu0 = time.process_time()
    th.start()
    time.sleep(1.0)
    post(url, make_group("a"))
    time.sleep(0.5)
    assert th.is_alive()  # one of the two groups it asked for: still waiting
    post(url, make_group("b"))
    th.join(5)
    assert [g["group_id"] for g in out["batch"]["groups"]] == ["a", "b"] and 1.4 < out["took"] < 5
    assert time.process_time() - cpu0 < 0.6  # a busy wait would burn ~1.5 s of CPU here
    # the timeout: returns what there is (here one group of the three asked for) when it runs out
    post(url, make_group("c"))
    t0 = time.time()
    b = requests.get(url + "/batch?groups=3&timeout=0.5").json()
    assert [g["group_id"] for g in b["groups"]] == ["c"] and 0.45 < time.time() - t0 < 3
    assert requests.get(url + "/batch?groups=1").json()["groups"] == []  # timeout defaults to 0
    for q in ["groups=0", "groups=-1", "groups=x", "groups=4097", "timeout=1", "groups=1&timeout=-1",
              "groups=1&timeout=nan", "groups=1&timeout=inf", "groups=1&when=now", "groups=1&groups=2"]:
        r = requests.get(url + "/batch?" + q)
        assert r.status_code == 400 and r.json()["error"].split(":")[0] in ("groups", "timeout", "query"), q
    assert query_seconds(parse_query("groups=3&timeout=1e9", {"groups": None, "timeout": "0"})) == 300.0


def test_batch_before_the_trainer_announced_itself_is_409(proxy):
    url, _ = proxy()
    post(url, make_group("a"))
    r = requests.get(url + "/batch?groups=1&timeout=5")
    assert r.status_code == 409 and r.json()["need_version"] is True and "POST /version first" in r.json()["error"]
    with pytest.raises(ProxyError, match="HTTP 409"):  # a client that never announced cannot answer it
        ProxyClient(url).get_batch(1, timeout=0)
    assert stats(url)["buffered"] == 1


def test_client_reannounces_its_version_to_a_restarted_proxy(proxy, capsys):
    url, server = proxy(max_staleness=1)
    port = server.server_address[1]
    trainer = ProxyClient(url, max_wait=20)
    trainer.set_version(5)
    server.shutdown()
    server.server_close()
    url, server = proxy(port=port, max_staleness=1)  # restarted: it knows no version
    post(url, make_group("old", 3))  # accepted: no version known yet, so none is stale
    got = trainer.get_batch(1, timeout=1)
    assert got["trainer_version"] == 5 and got["groups"] == []  # v3 is 2 behind v5: dropped on the announce
    s = stats(url)
    assert (s["trainer_version"], s["dropped_stale"]) == (5, 1) and identity_holds(s)
    assert "announcing v5 again" in capsys.readouterr().err


def test_version_drops_stale_groups_and_refuses_going_back(proxy):
    url, _ = proxy(max_staleness=1)
    post(url, make_group("v0", 0), make_group("v1", 1), make_group("v2", 2, worker="w2"))
    r = requests.post(url + "/version", json={"version": 2})
    assert r.status_code == 200 and r.json() == {"dropped": 1, "trainer_version": 2}  # v0 is 2 behind
    r = requests.post(url + "/version", json={"version": 1})
    assert r.status_code == 409 and "lower" in r.json()["error"]
    assert requests.post(url + "/version", json={"version": 2}).json()["dropped"] == 0  # a retry is harmless
    assert post(url, make_group("late", 0)).json() == {"accepted": 1, "duplicates": 0, "stale": 1, "zero_variance": 0,
                                                       "over_quota": 0, "trainer_version": 2}
    b = requests.get(url + "/batch?groups=10").json()
    assert [g["group_id"] for g in b["groups"]] == ["v1", "v2"] and b["trainer_version"] == 2
    s = stats(url)
    assert (s["accepted"], s["dropped_stale"], s["delivered"], s["buffered"]) == (4, 2, 2, 0) and identity_holds(s)
    assert s["staleness"] == {"0": 1, "1": 1} and s["workers"]["w0"]["dropped_stale"] == 2
    for body in [{"version": -1}, {"version": "3"}, {"version": 2.0}, {"version": True}, {"v": 3}, [3]]:
        assert requests.post(url + "/version", json=body).status_code == 400, body
    assert stats(url)["trainer_version"] == 2


def test_groups_from_the_future_are_refused_with_409(proxy):
    url, _ = proxy()
    requests.post(url + "/version", json={"version": 2})
    before = stats(url)
    r = post(url, make_group("ok", 2), make_group("future", 3))
    assert r.status_code == 409 and "policy_version 3 is ahead of the trainer's version 2" in r.json()["error"]
    with pytest.raises(ProxyError, match="HTTP 409.*another run's bucket"):
        ProxyClient(url).post_rollouts([make_group("future", 7)])
    after = stats(url)
    assert counters(after) == counters(before) and after["rejected"] == before["rejected"] + 2
    assert post(url, make_group("ok", 2)).json()["accepted"] == 1


def test_unknown_paths_404_and_wrong_methods_405(proxy):
    url, _ = proxy()
    for path in ["/", "/rollout", "/rollouts/", "/stats/x", "/admin"]:
        r = requests.get(url + path)
        assert r.status_code == 404 and "proxy.py serves" in r.json()["error"], path
    for method, path, allow in [("GET", "/rollouts", "POST"), ("POST", "/stats", "GET"), ("POST", "/batch", "GET"),
                                ("GET", "/done", "POST"), ("POST", "/quota", "GET"), ("POST", "/config", "GET")]:
        r = requests.request(method, url + path)
        assert r.status_code == 405 and r.headers["Allow"] == allow
    for method in ["PUT", "DELETE", "PATCH", "OPTIONS"]:
        assert requests.request(method, url + "/rollouts").status_code == 405
    assert stats(url)["rejected"] == 15


# ---- the generation quota and the end of the run ---------------------------------------------

def replica_client(url, worker):
    """A ProxyClient holding a replica credential bound to `worker`."""
    return ProxyClient(url, token=replica_token(REPLICA_TOKEN, worker))


def groups_for(worker, version, n, tag):
    return [make_group(f"{tag}-{worker}-{i}", version, worker) for i in range(n)]


def test_quota_at_staleness_0_is_one_batch_per_version_shared_by_two_replicas(proxy):
    url, _ = proxy(max_staleness=0, groups_per_step=5)
    trainer, r1, r2 = ProxyClient(url), ProxyClient(url), ProxyClient(url)
    q = r1.quota("r1", 0, 100, timeout=0)
    assert (q["groups"], q["state"], q["trainer_version"]) == (0, "waiting", None) and "announced" in q["why"]
    trainer.set_version(0)
    assert r1.quota("r1", 0, 100, timeout=0)["groups"] == 5  # the only replica known: the whole step
    q = r2.quota("r2", 0, 100, timeout=0)
    assert q["groups"] == 0 and "5 leased to other replicas" in q["why"]  # r1's lease is out
    r1.post_rollouts(groups_for("r1", 0, 5, "v0"))
    assert r2.quota("r2", 0, 100, timeout=0)["groups"] == 0  # the step's groups are all in
    assert len(trainer.get_batch(5, timeout=0)["groups"]) == 5
    answer = {}
    th = threading.Thread(target=lambda: answer.update(r2.quota("r2", 0, 100, timeout=30)))
    th.start()
    time.sleep(1.0)
    assert th.is_alive()  # r2 waits in its long poll: nothing to make at v0
    trainer.set_version(1)
    th.join(10)
    assert not th.is_alive() and answer["trainer_version"] == 1  # woken by the new version, long before 30 s
    assert answer["groups"] == 0 and "load a newer adapter" in answer["why"]  # max_staleness 0: v0 is too old now
    for v in range(1, 4):  # both replicas known: each makes its share, together exactly one batch
        made = {}
        for i, (w, client) in enumerate([("r1", r1), ("r2", r2), ("r1", r1), ("r2", r2)]):
            n = client.quota(w, v, 100, timeout=0)["groups"]
            client.post_rollouts(groups_for(w, v, n, f"v{v}-{i}")) if n else None
            made[w] = made.get(w, 0) + n
        assert sum(made.values()) == 5, made  # the split follows their speed (here: noise)
        batch = trainer.get_batch(5, timeout=0)["groups"]
        assert len(batch) == 5 and {g["policy_version"] for g in batch} == {v}
        trainer.set_version(v + 1)
    s = trainer.stats()
    assert (s["accepted"], s["delivered"], s["dropped_stale"], s["buffered"]) == (20, 20, 0, 0)
    assert s["staleness"] == {"0": 20}


def test_quota_at_staleness_2_keeps_the_trainer_one_step_ahead(proxy):
    url, _ = proxy(max_staleness=2, groups_per_step=3)
    trainer, replica = ProxyClient(url), ProxyClient(url)
    trainer.set_version(0)
    adapter = 0
    for step in range(6):
        asked = []
        while (q := replica.quota("r", adapter, 100, timeout=0))["groups"]:
            asked.append(q["groups"])
            replica.post_rollouts(groups_for("r", adapter, q["groups"], f"s{step}-{len(asked)}"))
        assert "has what it needs up to v" in q["why"]
        assert stats(url)["buffered"] == 6  # this step's batch and the next one's, no more
        assert asked == ([3, 3] if step == 0 else [3])  # then one batch per step
        assert len(trainer.get_batch(3, timeout=0)["groups"]) == 3  # never waits
        trainer.set_version(step + 1)
        if step % 2:
            adapter = step + 1  # the replica loads every other adapter; its groups stay usable
    s = trainer.stats()
    assert s["dropped_stale"] == 0 and s["delivered"] == 18 and set(s["staleness"]) <= {"0", "1", "2"}


def test_quota_in_drop_mode_scales_by_the_usable_rate_and_drops_equal_rewards(proxy):
    url, _ = proxy(max_staleness=0, groups_per_step=4, zero_variance="drop")
    trainer, replica = ProxyClient(url), ProxyClient(url)
    trainer.set_version(0)
    assert replica.quota("r", 0, 100, timeout=0)["groups"] == 8  # no group seen: a rate of 1/2
    flat = [make_group(f"flat{i}", worker="r", rewards=[1.0, 1.0]) for i in range(3)]
    reply = replica.post_rollouts(flat + [make_group("useful0", worker="r")])
    assert (reply["accepted"], reply["zero_variance"], reply["stale"]) == (4, 3, 0)
    # 3 missing, 1 of r's 4 usable: a rate of (1 + 1) / (4 + 2), one lease of 9 (more than a
    # step's 4), at most `most`
    assert replica.quota("r", 0, 100, timeout=0)["groups"] == 9
    assert replica.quota("r", 0, 5, timeout=0)["groups"] == 5
    batch = trainer.get_batch(4, timeout=0.5)["groups"]
    assert [g["group_id"] for g in batch] == ["useful0"]  # never a group with equal rewards
    s = trainer.stats()
    assert (s["dropped_zero_variance"], s["delivered"], s["buffered"]) == (3, 1, 0) and identity_holds(s)


def test_in_drop_mode_one_workers_flat_groups_do_not_change_anothers_lease(proxy):
    """Issue 48, case 6: the share of groups kept, which scales a lease up in drop mode, is each
    replica's own, and scales a lease at most 1 / MIN_KEPT = 8 times. Before, ~130 honestly
    scored flat groups from one credential drove everyone's estimate to 0.05: the honest
    replica's next lease was 280 groups where ~17 is normal."""
    url, _ = proxy(max_staleness=0, groups_per_step=16, zero_variance="drop")
    trainer, replica = ProxyClient(url), ProxyClient(url)
    trainer.set_version(0)
    varied = [make_group(f"h{i}", worker="honest", rewards=[float(i % 3 != 0), 1.0])
              for i in range(30)]  # 10 of 30 kept: (10 + 1) / (30 + 2)
    replica.post_rollouts(varied[:16])
    replica.post_rollouts(varied[16:])
    assert len(trainer.get_batch(16, timeout=0)["groups"]) == 10
    trainer.set_version(1)
    before = replica.quota("honest", 1, 1000, timeout=0)["groups"]
    assert before == math.ceil(16 / (11 / 32)), before  # 47
    for i in range(0, 130, 10):  # another credential's flat groups: 130, honestly scored
        replica.post_rollouts([make_group(f"f{i + j}", 1, worker="flat", rewards=[1.0, 1.0])
                               for j in range(10)])
    assert replica.quota("honest", 1, 1000, timeout=0)["groups"] == before
    core = RolloutBuffer({"num_generations": 2, "groups_per_step": 16, "zero_variance": "drop"})
    core.add([make_group(f"f{i}", worker="flat", rewards=[1.0, 1.0]) for i in range(130)])
    assert core._lease_size("flat", 1000, 1000) == 16 * 8  # its own: at most 8 steps' worth


def replica_loop(url, worker, seconds_per_group, stop, token=None):
    """A replica that takes longer per group (a sleep: no core taken): ask, make, post, until stop."""
    client, made, v = ProxyClient(url, token=token), 0, 0
    while not stop.is_set():
        q = client.quota(worker, v, 100, timeout=1.0)
        v = q["trainer_version"] if q["trainer_version"] is not None else v
        if q["state"] == "done":
            return
        if q["groups"] and q["trainer_version"] is not None and v >= q["trainer_version"]:
            time.sleep(seconds_per_group * q["groups"])
            client.post_rollouts(groups_for(worker, v, q["groups"], f"{worker}-{made}"))
            made += 1


def test_the_quota_follows_each_replicas_speed_a_slow_one_never_holds_the_trainer(proxy):
    url, _ = proxy(token=TOKEN, rollout_token=REPLICA_TOKEN, max_staleness=0, groups_per_step=4)
    trainer, stop = ProxyClient(url, token=TOKEN), threading.Event()  # synchronous: each step waits
    trainer.set_version(0)
    for worker, pace in (("fast", 0.1), ("slow", 0.4)):  # 4x slower: alone, fast makes a step in 0.4 s
        token = replica_token(REPLICA_TOKEN, worker)
        threading.Thread(target=replica_loop, args=(url, worker, pace, stop, token), daemon=True).start()
    try:
        for step in range(3):  # warm-up: both replicas measured
            assert len(trainer.get_batch(4, timeout=30)["groups"]) == 4
            trainer.set_version(step + 1)
        t0, got = time.monotonic(), collections.Counter()
        for step in range(3, 11):
            batch = trainer.get_batch(4, timeout=30)["groups"]
            assert len(batch) == 4
            got.update(g["worker"] for g in batch)
            trainer.set_version(step + 1)
        per_step = (time.monotonic() - t0) / 8
        s = trainer.stats()
    finally:
        stop.set()
    # equal halves make a step take 2 x 0.4 s (the slow one's 2 groups); by speed, 1 group: ~0.4 s
    assert per_step < 0.6, (per_step, s["replicas"], got)
    assert s["replicas"]["fast"]["share"] > 0.7 and s["replicas"]["slow"]["share"] < 0.3, s["replicas"]
    assert got["fast"] > 2 * got["slow"] and s["over_quota"] == 0, (got, s["over_quota"])
    assert s["replicas"]["fast"]["groups_per_s"] > 2 * s["replicas"]["slow"]["groups_per_s"]


def test_above_staleness_0_the_fastest_replica_takes_whole_steps_and_a_slow_one_a_little(proxy):
    url, _ = proxy(max_staleness=2, groups_per_step=8)
    trainer, stop = ProxyClient(url), threading.Event()
    trainer.set_version(0)
    for worker, pace in (("fast", 0.02), ("slow", 0.16)):  # 8x slower
        threading.Thread(target=replica_loop, args=(url, worker, pace, stop), daemon=True).start()
    try:
        for step in range(8):
            assert len(trainer.get_batch(8, timeout=30)["groups"]) == 8
            trainer.set_version(step + 1)
        s = trainer.stats()
    finally:
        stop.set()
    shares, made = s["replicas"], {w: c["accepted"] for w, c in s["workers"].items()}
    assert shares["fast"]["share"] == 1.0 and 0.05 < shares["slow"]["share"] < 0.3, shares
    assert made["fast"] > 4 * made["slow"] > 0, made  # 8 groups per lease at most, the slow one ~1


def test_a_dead_replicas_lease_is_lost_in_seconds_and_its_groups_made_by_the_others(proxy):
    url, _ = proxy(token=TOKEN, rollout_token=REPLICA_TOKEN, max_staleness=0, groups_per_step=4,
                   lease_timeout=120.0)
    trainer = ProxyClient(url, token=TOKEN)
    r1 = replica_client(url, "r1")
    r2 = replica_client(url, "r2")
    trainer.set_version(0)
    for v in range(2):  # both replicas make (and are measured on) one synchronous step each
        made = 0
        for i, (w, client) in enumerate([("r1", r1), ("r2", r2), ("r1", r1), ("r2", r2)]):
            n = client.quota(w, v, 100, timeout=0)["groups"]
            client.post_rollouts(groups_for(w, v, n, f"v{v}-{i}")) if n else None
            made += n
        assert made == 4 and len(trainer.get_batch(4, timeout=0)["groups"]) == 4
        trainer.set_version(v + 1)
    t0 = time.monotonic()
    held = r2.quota("r2", 2, 100, timeout=0)["groups"]  # r2 takes its lease, then dies (never posts)
    assert held > 0
    n = r1.quota("r1", 2, 100, timeout=0)["groups"]
    r1.post_rollouts(groups_for("r1", 2, n, "v2-a"))
    assert n == 4 - held
    time.sleep(max(0.0, t0 + 0.3 - time.monotonic()))
    q = r1.quota("r1", 2, 100, timeout=30)  # r2's lease stops counting at 1.5x its pace (0.5 s floor)
    waited = time.monotonic() - t0
    # not --lease-timeout's 120 s: r1's long poll wakes the moment r2's lease ends, 0.5 s after
    # it began (not at the next look of a periodic one)
    assert q["groups"] == held and waited < 0.75, (q, waited)
    r1.post_rollouts(groups_for("r1", 2, held, "v2-b"))
    assert len(trainer.get_batch(4, timeout=0)["groups"]) == 4
    late = r2.post_rollouts(groups_for("r2", 2, held, "v2-late"))  # it was only late: not over quota
    assert (late["accepted"], late["over_quota"]) == (held, 0)


def test_an_honest_but_late_replica_loses_nothing_when_its_lease_was_taken_over(proxy):
    url, _ = proxy(token=TOKEN, rollout_token=REPLICA_TOKEN, max_staleness=2, groups_per_step=4)
    trainer = ProxyClient(url, token=TOKEN)
    r1 = replica_client(url, "r1")
    r2 = replica_client(url, "r2")
    trainer.set_version(0)
    for i, (w, client) in enumerate([("r1", r1), ("r2", r2)] * 2):  # both measured
        if n := client.quota(w, 0, 2, timeout=0)["groups"]:
            client.post_rollouts(groups_for(w, 0, n, f"v0-{i}"))
    trainer.get_batch(100, timeout=0)
    trainer.set_version(1)  # nothing buffered: the quota asks for this step's 4 and the next one's
    held = r2.quota("r2", 1, 2, timeout=0)["groups"]  # r2's lease, then r2 stalls past its end
    made, t0 = 0, time.monotonic()
    while made < 8:  # r1 makes 8 - held, then, once r2's lease stops counting, r2's share too
        n = r1.quota("r1", 1, 100, timeout=5)["groups"]
        assert n, (made, held)
        r1.post_rollouts(groups_for("r1", 1, n, f"v1-{made}"))
        made += n
    assert held > 0 and time.monotonic() - t0 < 2.0
    assert [g["worker"] for g in trainer.get_batch(4, timeout=0)["groups"]] == ["r1"] * 4
    trainer.set_version(2)
    late = r2.post_rollouts(groups_for("r2", 1, held, "late"))  # r2 was only late: within its lease
    assert (late["accepted"], late["over_quota"], late["stale"]) == (held, 0, 0)
    used = []
    for v in (2, 3):  # the step after and the next: r2's groups are used while fresh
        used += [g["group_id"] for g in trainer.get_batch(4, timeout=0)["groups"]]
        trainer.set_version(v + 1)
    assert {f"late-r2-{i}" for i in range(held)} <= set(used) and trainer.stats()["dropped_stale"] == 0


def test_the_buffer_hands_out_the_oldest_adapter_first(proxy):
    url, _ = proxy(max_staleness=2, groups_per_step=3)
    trainer, replica = ProxyClient(url), ProxyClient(url)
    trainer.set_version(2)
    replica.post_rollouts(groups_for("fast", 2, 2, "new") + groups_for("fast", 1, 1, "mid"))
    replica.post_rollouts(groups_for("slow", 0, 2, "old"))  # arrives last, made with v0
    batch = trainer.get_batch(3, timeout=0)["groups"]
    assert [(g["worker"], g["policy_version"]) for g in batch] == [("slow", 0), ("slow", 0), ("fast", 1)]
    trainer.set_version(3)  # the v0 groups would have been dropped here, had they waited behind v1, v2
    assert len(trainer.get_batch(2, timeout=0)["groups"]) == 2 and trainer.stats()["dropped_stale"] == 0


def test_a_new_replicas_lease_is_not_what_the_trainer_waits_for(proxy):
    url, _ = proxy(max_staleness=2, groups_per_step=4)
    trainer, stop = ProxyClient(url), threading.Event()
    trainer.set_version(0)
    # both new, one makes a step in 0.2 s, the other a group in 1.5 s: above max_staleness 0 the
    # fast one makes what the trainer needs, the new one's groups (its pace unknown) come on top
    for worker, pace in (("fast", 0.05), ("new", 1.5)):
        threading.Thread(target=replica_loop, args=(url, worker, pace, stop), daemon=True).start()
    try:
        workers = []
        for step in range(4):  # ~1 s: the new replica's first group is not in by then
            workers += [g["worker"] for g in trainer.get_batch(4, timeout=30)["groups"]]
            trainer.set_version(step + 1)
    finally:
        stop.set()
    assert workers == ["fast"] * 16, workers


def test_above_staleness_0_a_new_replica_among_others_is_given_one_group_to_measure_it(proxy):
    url, _ = proxy(max_staleness=2, groups_per_step=4)
    trainer, client = ProxyClient(url), ProxyClient(url)
    trainer.set_version(0)
    assert client.quota("first", 0, 100, timeout=0)["groups"] == 4  # alone: a whole step
    assert client.quota("new", 0, 100, timeout=0)["groups"] == 1  # its speed unknown: one group
    client.post_rollouts(groups_for("new", 0, 1, "measured"))
    assert client.quota("new", 0, 100, timeout=0)["groups"] > 1  # measured: its share (here fast)


def test_a_slow_replica_is_given_only_groups_that_arrive_in_time_to_be_used(proxy):
    url, _ = proxy(max_staleness=2, groups_per_step=4)
    trainer, stop = ProxyClient(url), threading.Event()
    trainer.set_version(0)
    # The fast replica makes a step in 0.4 s, the trainer waits for it. A group of the 5x slower
    # one takes 0.5 s and arrives within the 2 steps max_staleness gives: used. One of the 15x
    # slower one takes 1.5 s, almost 4 steps: it would be dropped as stale, so it is not asked for
    # (but for a probe now and then).
    paces = {"fast": 0.1, "slow": 0.5, "slowest": 1.5}
    for worker, pace in paces.items():
        threading.Thread(target=replica_loop, args=(url, worker, pace, stop), daemon=True).start()
    try:
        step, measured, before = 0, None, None
        while before is None or step < before[0] + 16:
            s = trainer.stats()  # from when all are measured (a first lease may be stale), and
            # their groups of before are used or dropped (max_staleness + 1 steps later)
            if measured is None and all(s["replicas"].get(w, {}).get("groups_per_s") for w in paces):
                measured = step
            if measured is not None and step == measured + 3:
                before = step, s["workers"]
            assert len(trainer.get_batch(4, timeout=30)["groups"]) == 4 and step < 60
            time.sleep(0.05)  # the trainer's step
            step += 1
            trainer.set_version(step)
        after = trainer.stats()["workers"]
    finally:
        stop.set()
    made, stale = ({w: after[w][k] - before[1][w][k] for w in paces} for k in ("accepted", "dropped_stale"))
    # the slowest loses only the probes that ask if it got faster (8 steps after its last
    # group, then 16, ...): at most 2 in 16 steps
    assert stale["fast"] == stale["slow"] == 0 and made["slow"] > 0, (made, stale)
    assert stale["slowest"] == made["slowest"] <= 2, (made, stale)


def test_a_replica_too_slow_to_be_leased_is_probed_and_leased_again_once_fast(proxy):
    url, _ = proxy(max_staleness=2, groups_per_step=4)
    trainer, stop = ProxyClient(url), threading.Event()
    trainer.set_version(0)
    threading.Thread(target=replica_loop, args=(url, "fast", 0.03, stop), daemon=True).start()
    client, made, v = ProxyClient(url), collections.Counter(), 0

    def hiccup():  # its first group takes 3 s (a cold start), then it is as fast as "fast"
        nonlocal v
        while not stop.is_set():
            q = client.quota("hiccup", v, 100, timeout=1.0)
            v = q["trainer_version"]
            if q["groups"] and v is not None:
                time.sleep(3.0 if not made else 0.03 * q["groups"])
                client.post_rollouts(groups_for("hiccup", v, q["groups"], f"h{sum(made.values())}"))
                made[q["why"] or "lease"] += 1

    try:
        threading.Thread(target=hiccup, daemon=True).start()
        for step in range(60):  # ~0.1 s a step: 8 steps after its first group, a probe
            assert len(trainer.get_batch(4, timeout=30)["groups"]) == 4
            time.sleep(0.1)
            trainer.set_version(step + 1)
    finally:
        stop.set()
    # measured at 3 s a group it would never be leased again; a probe measures it at 0.03 s
    assert made["a probe: one group, to measure this replica again"] >= 1 and made["lease"] > 2, made


def test_done_ends_the_quota_long_polls(proxy):
    url, _ = proxy(max_staleness=0, groups_per_step=2)
    trainer, replica = ProxyClient(url), ProxyClient(url)
    trainer.set_version(0)
    replica.quota("r", 0, 100, timeout=0)
    replica.post_rollouts(groups_for("r", 0, 2, "a"))
    answer = {}
    th = threading.Thread(target=lambda: answer.update(replica.quota("r", 0, 100, timeout=30)))
    th.start()
    time.sleep(1.0)
    assert th.is_alive()  # the step's groups are in: nothing to make
    assert trainer.done() == {"state": "done", "trainer_version": 0}
    th.join(10)
    assert answer == {"groups": 0, "trainer_version": 0, "state": "done", "why": "the trainer is done: exit"}
    assert replica.quota("other", 0, 100, timeout=0)["state"] == "done" and stats(url)["state"] == "done"
    for q in ["worker=w", "version=0", "worker=&version=0", "worker=w&version=-1", "worker=w&version=0&max=0",
              "worker=w&version=0&timeout=x", "worker=w&version=0&evil=1", f"worker={'x' * 300}&version=0"]:
        r = requests.get(url + "/quota?" + q)
        assert r.status_code == 400 and r.json()["error"].split(":")[0] in ("worker", "version", "max", "timeout",
                                                                            "query"), q


# ---- tokens: the trainer's and the replicas' ------------------------------------------------

def test_the_replicas_token_cannot_drain_batches_or_set_the_version(proxy, capsys):
    url, _ = proxy(token=TOKEN, rollout_token=REPLICA_TOKEN, max_staleness=0, groups_per_step=2)
    trainer, replica = ProxyClient(url, token=TOKEN), ProxyClient(url, token=REPLICA_TOKEN)
    assert replica.contract()["groups_per_step"] == 2 and replica.stats()["state"] == "waiting"
    trainer.set_version(0)
    assert replica.quota("r", 0, 100, timeout=0)["groups"] == 2
    assert replica.post_rollouts(groups_for("r", 0, 2, "a"))["accepted"] == 2
    for call in [lambda: replica.set_version(2147483647), lambda: replica.get_batch(2, timeout=0), replica.done]:
        with pytest.raises(ProxyError, match=r"HTTP 403: /\w+ takes the trainer's token \(PROXY_TOKEN\).*give the "
                                             "trainer PROXY_TOKEN"):
            call()
    s = trainer.stats()
    assert (s["trainer_version"], s["state"], s["buffered"], s["delivered"], s["rejected"]) == (0, "running", 2, 0, 3)
    assert len(trainer.get_batch(2, timeout=0)["groups"]) == 2  # the trainer's token opens everything
    assert trainer.post_rollouts([make_group("t")])["accepted"] == 1 and trainer.quota("t", 0, 9, timeout=0)["state"] == "running"
    r = requests.post(url + "/rollouts", json={"groups": [make_group("x")]}, headers=auth("other"))
    assert r.status_code == 401 and "ROLLOUT_TOKEN" in r.json()["error"]
    assert "retrying" not in capsys.readouterr().err


def test_a_bound_replica_token_speaks_for_its_own_worker_name_only(proxy):
    url, _ = proxy(token=TOKEN, rollout_token=REPLICA_TOKEN, max_staleness=0, groups_per_step=4)
    cred = replica_token(REPLICA_TOKEN, "replica-0")
    assert cred.startswith("replica-0:") and len(cred.split(":")[1]) == 32
    assert cred != replica_token("R2", "replica-0")
    ProxyClient(url, token=TOKEN).set_version(0)
    r0 = ProxyClient(url, token=cred)
    assert r0.quota("replica-0", 0, 100, timeout=0)["groups"] == 4
    assert r0.post_rollouts(groups_for("replica-0", 0, 2, "a"))["accepted"] == 2
    with pytest.raises(ProxyError, match=r"HTTP 403: worker: 'replica-1', but this credential is bound to worker "
                                         r"'replica-0'.*--print-replica-token"):
        r0.quota("replica-1", 0, 100, timeout=0)
    with pytest.raises(ProxyError, match=r"HTTP 403: groups\[1\].worker: 'replica-1', but .* bound to worker"):
        r0.post_rollouts(groups_for("replica-0", 0, 1, "b") + groups_for("replica-1", 0, 1, "b"))
    with pytest.raises(ProxyError, match="HTTP 403: /batch takes the trainer's token"):
        r0.get_batch(1, timeout=0)
    forged = [cred[:-1] + ("0" if cred[-1] != "0" else "1"), "replica-1:" + cred.split(":")[1],
              replica_token(TOKEN, "replica-0"), "replica-0:", ":" + cred.split(":")[1]]
    for bad in forged:
        r = requests.get(url + "/config", headers=auth(bad))
        assert r.status_code == 401, bad
    # the shared secret itself: any worker name (local runs, older scripts)
    assert ProxyClient(url, token=REPLICA_TOKEN).quota("anyone", 0, 100, timeout=0)["state"] == "running"
    s = ProxyClient(url, token=TOKEN).stats()
    assert (s["accepted"], s["buffered"]) == (2, 2) and s["rejected"] == 3 + len(forged)


def test_the_client_sends_its_token_and_a_gateway_token_in_their_own_headers(proxy, monkeypatch):
    url, _ = proxy(token=TOKEN)
    monkeypatch.setenv("PROXY_TOKEN", TOKEN)
    monkeypatch.setenv("GATEWAY_TOKEN", "hf_gateway")
    client = ProxyClient(url)
    assert client.session.headers["X-Proxy-Token"] == TOKEN
    assert client.session.headers["Authorization"] == "Bearer hf_gateway"
    assert client.stats()["state"] == "waiting"  # the proxy ignores Authorization
    monkeypatch.delenv("GATEWAY_TOKEN")
    assert "Authorization" not in ProxyClient(url, token=TOKEN).session.headers


def test_cli_prints_a_replica_token_bound_to_a_worker():
    env = {k: v for k, v in os.environ.items() if k not in ("PROXY_TOKEN", "ROLLOUT_TOKEN")}
    cmd = [sys.executable, os.path.join(ROOT, "proxy.py"), "--print-replica-token", "replica-3"]
    out = subprocess.run(cmd, env={**env, "ROLLOUT_TOKEN": REPLICA_TOKEN}, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == replica_token(REPLICA_TOKEN, "replica-3") + "\n"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "--print-replica-token needs ROLLOUT_TOKEN" in out.stderr


def test_groups_a_reward_function_failed_on_come_off_the_lease_and_reach_the_trainer(proxy):
    """A replica whose reward function failed on groups of its lease says how many with its POST
    (reward_errors, support/contract.py): they come off its lease at once (at most what it
    owes), so the step asks a replica for them again; each /batch answer carries the run's count,
    which the trainer's step records (UsableGroups.lap: groups_dropped["reward_func_error"])."""
    url, _ = proxy(token=TOKEN, rollout_token=REPLICA_TOKEN, max_staleness=0, groups_per_step=4)
    trainer, replica = ProxyClient(url, token=TOKEN), replica_client(url, "r")
    trainer.set_version(0)
    assert replica.quota("r", 0, 100, timeout=0)["groups"] == 4
    assert replica.post_rollouts(groups_for("r", 0, 3, "a"), "r", reward_errors=1)["accepted"] == 3
    assert (trainer.stats()["reward_errors"], trainer.stats()["leased"]) == (1, {})
    assert replica.quota("r", 0, 100, timeout=0)["groups"] == 1  # the step still lacks one
    replica.post_rollouts([], "r", reward_errors=5)  # all of a lease failed: nothing else to send
    assert trainer.stats()["reward_errors"] == 2  # at most the one it owed
    usable = UsableGroups(trainer, vocab_size=1000)
    assert len(usable(trainer.get_batch(4, timeout=0)["groups"])) == 3
    assert usable.lap() == {"reward_func_error": 2} and usable.lap() == {}
    for body, status, says in [
            ({"groups": [], "reward_errors": 1}, 400, "worker: missing"),
            ({"groups": []}, 400, "groups: must be a non-empty list"),
            ({"groups": [], "worker": "r", "reward_errors": "1"}, 400, "reward_errors: must be"),
            ({"groups": [], "worker": "other", "reward_errors": 1}, 403, "bound to worker 'r'")]:
        r = requests.post(url + "/rollouts", json=body, headers=auth(replica_token(REPLICA_TOKEN,
                                                                                   "r")))
        assert r.status_code == status and says in r.json()["error"], (body, r.text)
    assert trainer.stats()["reward_errors"] == 2


def test_the_quota_is_enforced_a_flood_cannot_fill_the_trainers_batch(proxy):
    url, _ = proxy(token=TOKEN, rollout_token=REPLICA_TOKEN, max_staleness=1, groups_per_step=4)
    trainer = ProxyClient(url, token=TOKEN)
    honest = replica_client(url, "honest")
    flooder = replica_client(url, "flood")
    trainer.set_version(0)
    r = flooder.post_rollouts(groups_for("flood", 0, 50, "unasked"))  # never asked /quota
    assert (r["accepted"], r["over_quota"]) == (0, 50)
    assert honest.quota("honest", 0, 100, timeout=0)["groups"] == 4  # the flood took nothing from it
    n = flooder.quota("flood", 0, 100, timeout=0)["groups"]  # asks, then sends three times its lease
    assert n > 0
    r = flooder.post_rollouts(groups_for("flood", 0, 3 * n + 1, "asked"))
    assert (r["accepted"], r["over_quota"]) == (n, 2 * n + 1)
    assert honest.post_rollouts(groups_for("honest", 0, 4, "h"))["accepted"] == 4
    batch = trainer.get_batch(4 + n, timeout=0)["groups"]
    assert sorted(g["worker"] for g in batch) == ["flood"] * n + ["honest"] * 4
    s = trainer.stats()
    over = 51 + 2 * n
    assert (s["over_quota"], s["workers"]["flood"]["over_quota"], s["accepted"]) == (over, over, 4 + n)
    assert identity_holds(s)
    # a group older than the adapter its replica said it held is refused; the trainer's token is not limited
    trainer.set_version(1)
    assert honest.quota("honest", 1, 100, timeout=0)["groups"] > 0
    with pytest.raises(ProxyError, match=r"HTTP 409: policy_version 0 of group .* older than v1, the adapter "
                                         "'honest' said it held at GET /quota"):
        honest.post_rollouts(groups_for("honest", 0, 1, "old"))
    assert trainer.post_rollouts(groups_for("anyone", 1, 9, "t"))["accepted"] == 9


def test_the_leases_table_is_bounded(proxy, monkeypatch):
    from support import worker_bounds

    monkeypatch.setattr(worker_bounds, "MAX_WORKERS", 8)
    url, _ = proxy(token=TOKEN, rollout_token=REPLICA_TOKEN, lease_timeout=1.0)
    ProxyClient(url, token=TOKEN).set_version(0)
    shared = ProxyClient(url, token=REPLICA_TOKEN, max_wait=0)  # the shared secret: any name
    for i in range(8):
        shared.quota(f"fake-{i}", 0, 1, timeout=0)
    r = requests.get(url + "/quota?worker=one-more&version=0", headers=auth(REPLICA_TOKEN))
    assert r.status_code == 429 and "8 other names hold leases" in r.json()["error"]
    assert shared.quota("fake-3", 0, 1, timeout=0)["state"] == "running"  # a name in the table may ask again
    time.sleep(1.2)  # the fakes' leases expire: their names are dropped for a new one
    assert ProxyClient(url, token=REPLICA_TOKEN).quota("one-more", 0, 1, timeout=0)["state"] == "running"


def test_one_token_serves_every_role_when_there_is_no_replicas_token(proxy):
    url, _ = proxy(token=TOKEN)
    client = ProxyClient(url, token=TOKEN)
    client.post_rollouts([make_group("a")])
    client.set_version(0)
    assert len(client.get_batch(1, timeout=0)["groups"]) == 1 and client.done()["state"] == "done"
    for kw in [{"rollout_token": REPLICA_TOKEN}, {"token": TOKEN, "rollout_token": TOKEN}]:
        with pytest.raises(ConfigError, match="--rollout-token .* must come with a different --token"):
            serve(**kw)


# ---- hardening: dead connections, deadline, connection cap, fd exhaustion -----------------------

def test_a_batch_for_a_client_that_hung_up_stays_in_the_buffer(proxy):
    url, _ = proxy()
    requests.post(url + "/version", json={"version": 0})
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as s:  # a trainer mid-poll...
        s.sendall(b"GET /batch?groups=2&timeout=30 HTTP/1.1\r\nHost: x\r\n\r\n")
        until(lambda: stats(url)["waiting"] == 2)
    # ... killed: its socket is closed before any group arrived
    post(url, make_group("a"), make_group("b"))
    until(lambda: stats(url)["waiting"] == 0)  # the dead poll woke up and handed out nothing
    s = stats(url)
    assert (s["delivered"], s["buffered"]) == (0, 2) and identity_holds(s)
    assert [g["group_id"] for g in requests.get(url + "/batch?groups=2").json()["groups"]] == ["a", "b"]


def test_a_batch_whose_answer_cannot_be_written_goes_back_to_the_buffer_in_order(proxy):
    url, _ = proxy(max_new_tokens=100_000)
    requests.post(url + "/version", json={"version": 0})
    for i in range(6):  # ~2 MB of JSON each: more than the sockets' buffers hold together
        g = make_group(f"big{i}", tokens=100_000, max_new_tokens=100_000)
        for c in g["completions"]:
            c["logprobs"] = [-0.123456789] * 100_000
        assert post(url, g).json()["accepted"] == 1
    post(url, make_group("small", max_new_tokens=100_000), make_group("next", max_new_tokens=100_000))
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing more...
    s.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    s.sendall(b"GET /batch?groups=6&timeout=5 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert s.recv(12) == b"HTTP/1.1 200"  # the answer is on its way (and stuck)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()  # ...and dies: a reset, the proxy's write fails
    until(lambda: stats(url)["returned"] == 6)
    st = stats(url)
    assert (st["delivered"], st["buffered"], st["staleness"]) == (0, 8, {}) and identity_holds(st)
    batch = requests.get(url + "/batch?groups=8").json()["groups"]
    assert [g["group_id"] for g in batch] == [f"big{i}" for i in range(6)] + ["small", "next"]
    st = stats(url)
    assert (st["delivered"], st["buffered"], st["buffered_mb"]) == (8, 0, 0.0) and identity_holds(st)


def test_a_batch_the_trainer_never_acknowledged_comes_back_to_the_next_one(proxy):
    url, server = proxy()
    post(url, *[make_group(f"g{i}") for i in range(5)])
    ProxyClient(url).set_version(0)
    with socket.create_connection(("127.0.0.1", server.server_address[1])) as s:  # a trainer's client...
        s.sendall(b"GET /batch?groups=3&ack=0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status, _, body = answer.partition(b"\r\n\r\n")  # ... read it, and was killed before it used it
    assert status.startswith(b"HTTP/1.1 200") and json.loads(body)["delivery"] == 1
    assert stats(url)["unconfirmed"] == 3
    restarted = ProxyClient(url)  # acknowledges nothing (ack=0): the unacknowledged 3 come back first
    first = restarted.get_batch(2, timeout=0)["groups"]
    assert [g["group_id"] for g in first] == ["g0", "g1"]
    second = restarted.get_batch(3, timeout=0)["groups"]  # this call acknowledges the first answer
    assert [g["group_id"] for g in second] == ["g2", "g3", "g4"]
    s = stats(url)
    assert (s["returned"], s["delivered"], s["unconfirmed"], s["buffered"]) == (3, 5, 3, 0) and identity_holds(s)
    restarted.set_version(1)  # a step was made from them: all read
    s = stats(url)
    assert (s["unconfirmed"], s["delivered"], s["returned"]) == (0, 5, 3) and identity_holds(s)
    assert requests.get(url + "/batch?groups=1&ack=x").status_code == 400


def test_a_request_trickled_byte_by_byte_is_cut_off_at_the_deadline(proxy):
    url, server = proxy(request_timeout=1.0)
    closed_after = None
    with socket.create_connection(("127.0.0.1", server.server_address[1])) as s:
        s.sendall(b"GET /stats HTTP/1.1\r\n")
        for i in range(50):  # one header byte every 0.1 s: each receive is quick, the request never ends
            try:
                s.sendall(b"X")
                if select.select([s], [], [], 0.1)[0] and s.recv(1) == b"":
                    closed_after = i
                    break
            except OSError:  # reset by the proxy
                closed_after = i
                break
    assert closed_after is not None and closed_after < 45, closed_after  # about 10 bytes, not the whole 5 s
    # the deadline is on receiving the request: a long poll may wait longer than it
    requests.post(url + "/version", json={"version": 0})
    later(1.5, lambda: post(url, make_group("a")))
    assert len(requests.get(url + "/batch?groups=1&timeout=10").json()["groups"]) == 1


def test_connections_over_the_cap_get_503_at_once(proxy):
    url, server = proxy(max_connections=2)
    port = server.server_address[1]
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    for s in held:  # both served (no token here: authenticated): each holds a keep-alive connection, a slot
        s.sendall(b"GET /config HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # sends nothing, yet is answered
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer and b"--max-connections" in answer
    held.pop().close()  # a slot frees when its connection ends
    until(lambda: healthy(url))
    held[0].close()

    def refused():  # a read may meet the cap until the server has seen both closes (load)
        try:
            return stats(url, headers={"Connection": "close"}, timeout=5)["refused_connections"] >= 1
        except requests.RequestException:
            return False
    until(refused)


def test_idle_unauthenticated_sockets_cannot_starve_the_trainer(proxy, capsys):
    for cap, idle in [(16, 40), (256, 400)]:  # a small cap, and the default one
        url, server = proxy(token=TOKEN, rollout_token=REPLICA_TOKEN, max_connections=cap)
        port = server.server_address[1]
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(idle)]  # never send a byte
        try:
            time.sleep(0.5)
            t0 = time.time()
            trainer = ProxyClient(url, token=TOKEN, max_wait=5)
            trainer.set_version(0)
            assert trainer.get_batch(1, timeout=0)["groups"] == [] and time.time() - t0 < 3
            replica = ProxyClient(url, token=replica_token(REPLICA_TOKEN, "r0"), max_wait=5)
            assert replica.stats()["closed_idle"] >= idle - cap
        finally:
            for s in socks:
                s.close()
    assert "retrying" not in capsys.readouterr().err  # no 503 on the way


def test_replica_connections_leave_a_reserve_for_the_trainer(proxy):
    url, server = proxy(token=TOKEN, rollout_token=REPLICA_TOKEN, max_connections=16)  # reserve: 16 // 8
    port, cred = server.server_address[1], replica_token(REPLICA_TOKEN, "r0")
    request = f"GET /config HTTP/1.1\r\nHost: x\r\nX-Proxy-Token: {cred}\r\n\r\n".encode()
    held = []
    for _ in range(15):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(request)
        held.append((s, s.recv(4096)))
    codes = [answer.split()[1] for _, answer in held]
    assert codes == [b"200"] * 14 + [b"503"], codes  # the 15th replica connection: over the replicas' share
    assert b"a reserve for the trainer" in held[-1][1] + held[-1][0].recv(4096)
    assert ProxyClient(url, token=TOKEN, max_wait=0).stats()["state"] == "waiting"  # the trainer gets in
    for s, _ in held:
        s.close()


def test_a_big_body_is_refused_from_its_header_and_freezes_nothing(proxy):
    url, server = proxy(token=TOKEN, num_generations=8)
    port, limit = server.server_address[1], 16 * (8 * 256 * 64 + 1024 * 32)  # the default contract's: 2.5 MiB
    slow = []

    def send(size, trickle):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /rollouts HTTP/1.1\r\nX-Proxy-Token: %s\r\nContent-Length: %d\r\n\r\n"
                      % (TOKEN.encode(), size))
            try:
                body = b'{"groups": [' + b"[]," * ((size - 16) // 3) + b"[]"  # valid JSON: parsed whole
                body += b" " * (size - len(body) - 2) + b"]}"
                for i in range(0, size, 2**20):  # a MiB at a time
                    s.sendall(body[i:i + 2**20])
                    time.sleep(trickle)
                slow.append(s.recv(200).split(b" ")[1])
            except OSError:  # refused from the header: the proxy hung up while the body still came
                slow.append(b"closed")

    senders = [threading.Thread(target=send, args=(48 * 2**20, 0.0)),
               threading.Thread(target=send, args=(limit - 10, 0.5))]
    for th in senders:
        th.start()
    latencies = []
    while any(th.is_alive() for th in senders):
        t0 = time.time()
        assert requests.get(url + "/healthz", timeout=10).status_code == 200
        assert stats(url, headers=auth(), timeout=10)["state"] == "waiting"
        latencies.append(time.time() - t0)
        time.sleep(0.05)
    assert len(latencies) > 5 and max(latencies) < 1.5, latencies
    big = raw_request(port, b"POST /rollouts HTTP/1.1\r\nX-Proxy-Token: %s\r\nContent-Length: %d\r\n\r\n"
                      % (TOKEN.encode(), 48 * 2**20))
    assert big[0] == 413 and b"--max-body-mb 2.5 (2621440 bytes)" in big[2]
    assert b"raise proxy.py --max-body-mb" in big[2]
    assert sorted(slow) in ([b"400", b"413"], [b"400", b"closed"]), slow  # the trickled one: parsed, refused
    assert gc.isenabled()  # paused during a parse only


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads CPU time from /proc")
def test_out_of_file_descriptors_the_accept_loop_does_not_spin():
    port = free_port()

    def few_fds():
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    proc = _start_cli("--port", str(port), "--max-connections", "1000", preexec_fn=few_fds)
    socks = []
    try:
        wait_port(port)
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(80)]  # more than it may open
        time.sleep(0.5)
        cpu0 = cpu_seconds(proc.pid)
        time.sleep(2.0)
        assert cpu_seconds(proc.pid) - cpu0 < 0.3  # spinning on accept() burns 0.8 to 2 s here (0.0 without)
    finally:
        for s in socks:
            s.close()
    try:
        until(lambda: healthy(f"http://127.0.0.1:{port}"), 20)
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


# ---- many clients, the client's retries ------------------------------------------------------

def test_32_concurrent_posters_with_retries_and_a_consumer_bumping_versions(proxy):
    url, _ = proxy(max_staleness=1, max_groups=64)
    ProxyClient(url).set_version(0)
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


def test_client_rides_out_a_proxy_restart(proxy, capsys):
    url, server = proxy()
    port = server.server_address[1]
    client = ProxyClient(url, max_wait=30)
    assert client.post_rollouts([make_group("before")])["accepted"] == 1  # its connection is kept alive
    server.shutdown()
    server.server_close()
    later(1.0, lambda: proxy(port=port))  # the same port, a fresh proxy, a second later
    t0 = time.time()
    assert client.post_rollouts([make_group("after")])["accepted"] == 1
    assert 0.9 < time.time() - t0 < 10
    assert client.stats()["accepted"] == 1  # the new proxy: the restart emptied the buffer
    lines = [line for line in capsys.readouterr().err.splitlines() if "retrying" in line]
    assert len(lines) == 1 and "cannot reach the proxy" in lines[0]


def test_client_errors_are_clear_and_not_retried(proxy, capsys):
    url, _ = proxy(token=TOKEN, max_groups=2)
    for call in [lambda c: c.stats(), lambda c: c.post_rollouts([make_group("a")])]:
        with pytest.raises(ProxyError, match="HTTP 401.*check the token: PROXY_TOKEN"):
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
    assert "buffer full" in capsys.readouterr().err
    # nothing listening: gives up after max_wait
    t0 = time.time()
    with pytest.raises(ProxyError, match="gave up after 1.5 s: cannot reach the proxy"):
        ProxyClient(f"http://127.0.0.1:{free_port()}", max_wait=1.5).stats()
    assert 1.4 < time.time() - t0 < 4


def test_remembered_group_ids_are_bounded():
    buf = GuardedBuffer(RolloutBuffer({"num_generations": 2}), max_groups=100, remember_ids=3)
    for gid in "abcd":
        buf.add([make_group(gid)])
    assert buf.add([make_group("b")])["duplicates"] == 1  # among the last three
    assert buf.add([make_group("a")])["accepted"] == 1    # forgotten: the fifth id pushed it out
    assert len(buf.seen) == len(buf.seen_order) == 3


@pytest.mark.parametrize("contract", [
    {"max_staleness": 0, "groups_per_step": 4}, {"max_staleness": 2, "groups_per_step": 3},
    {"max_staleness": 1, "groups_per_step": 4, "zero_variance": "drop"}])
def test_valid_groups_from_one_replica_go_through_the_guarded_buffer_unchanged(contract):
    """STYLE.md: the core does not know it is wrapped. One replica's run, the same calls on
    proxy.RolloutBuffer alone and wrapped in support/worker_bounds.py's GuardedBuffer (as served,
    with the arguments the routes pass: a replica's credential, `limited`, and the trainer's
    `ack` of its last delivery): the same quotas, the same groups taken in the same order, the
    same replies; the replica asks twice now and then, the trainer moves on while groups of
    the next step are made, some groups flat."""
    contract = {"num_generations": 2, **contract}
    plain, guarded = RolloutBuffer(contract), GuardedBuffer(RolloutBuffer(contract))
    trace, delivery = {id(plain): [], id(guarded): []}, [0]

    def both(call, *args):
        replies = []
        for buf in (plain, guarded):
            served = {"add": {"limited": True}, "take": {"ack": delivery[0]}}.get(call, {})
            out = getattr(buf, call)(*args, **(served if buf is guarded else {}))
            if call == "take":  # (groups, version[, delivery]): the ids in order
                delivery[0] = out[2] if buf is guarded else delivery[0]
                out = ([g["group_id"] for g in out[0]], out[1])
            if call == "add":  # the guard adds its counts of retries and groups beyond a lease
                assert (out.pop("duplicates", 0), out.pop("over_quota", 0)) == (0, 0)
            trace[id(buf)].append((call, out))
            replies.append(out)
        assert replies[0] == replies[1], (call, args, replies)
        return replies[0]

    rng, made, v = random.Random(0), 0, 0
    both("set_version", 0)
    for step in range(12):
        for ask in range(2):
            q = both("quota", "r", v, 100 if step % 3 else 5, 0)
            if ask == 0 and q["groups"] and step % 4 == 1:
                both("quota", "r", v, 100, 0)  # asked again before delivering: the same lease
            if q["groups"]:
                made_with = v
                if step % 5 == 4 and ask == 1:  # the trainer moves on while they are made
                    v += 1
                    both("set_version", v)
                groups = [make_group(f"g{made + i}", made_with, worker="r",
                                     rewards=[1.0, float(rng.random() < 0.6)])
                          for i in range(q["groups"])]
                made += len(groups)
                both("add", groups)
        both("take", contract["groups_per_step"], 0)
        v += 1
        both("set_version", v)
    assert trace[id(plain)] == trace[id(guarded)]
    assert sum(len(out[0]) for call, out in trace[id(plain)] if call == "take") >= 24


def test_a_valid_run_passes_the_http_layer_as_sent(proxy):
    """What proxy.py's routes leave to support/proxy_service.py and support/http_hardening.py (the
    tokens, a replica's bound credential, the JSON body, the query's numbers) changes nothing
    valid: over HTTP, a replica with its credential asks its quota and POSTs its groups, the
    trainer with its token announces versions and takes them, and every answer is the one the
    same calls on a RolloutBuffer alone give; the groups come back field for field as POSTed."""
    settings = dict(num_generations=2, max_staleness=2, groups_per_step=2)
    url, _ = proxy(token=TOKEN, rollout_token=REPLICA_TOKEN, **settings)
    trainer, replica = ProxyClient(url, token=TOKEN), replica_client(url, "replica-0")
    plain = RolloutBuffer(settings)
    made = 0
    for v in range(4):
        trainer.set_version(v)
        plain.set_version(v)
        for _ in range(2):
            q = replica.quota("replica-0", v, 100, timeout=0)
            assert q == plain.quota("replica-0", v, 100, 0), (v, q)
            groups = [make_group(f"g{made + i}", v, "replica-0") for i in range(q["groups"])]
            made += len(groups)
            if groups:
                answer = replica.post_rollouts(groups)
                assert {k: n for k, n in answer.items() if k not in ("duplicates", "over_quota")} \
                    == plain.add(groups), answer
        got, want = trainer.get_batch(2, timeout=0), plain.take(2, 0)
        assert (got["groups"], got["trainer_version"]) == want[:2]
    assert made >= 8


def test_one_replicas_long_poll_waits_and_wakes_the_same_plain_and_guarded():
    """The waits as well as the answers: a poll with nothing to lease waits (RolloutBuffer's
    cond.wait_for; GuardedBuffer's _wait_until) through the step's take, the trainer's next
    version wakes it, and the answer is the same."""
    answers = []
    for buf in (RolloutBuffer, lambda c: GuardedBuffer(RolloutBuffer(c))):
        buf = buf({"num_generations": 2, "groups_per_step": 2, "max_staleness": 1})
        buf.set_version(0)
        for step in range(2):  # steps 0 and 1's groups, made with v0
            assert buf.quota("r", 0, 100, 0)["groups"] == 2
            buf.add([make_group(f"g{step}{i}", 0, worker="r") for i in range(2)])
        threading.Timer(0.2, buf.take, (2, 0)).start()  # taken: still none lacking
        threading.Timer(0.4, buf.set_version, (1,)).start()  # v1: the poll answers at once
        t0 = time.monotonic()
        answers.append(buf.quota("r", 0, 100, 5))
        assert 0.35 < time.monotonic() - t0 < 4, time.monotonic() - t0
    assert answers[0] == answers[1] and answers[0]["trainer_version"] == 1, answers


def test_a_forkers_edit_of_the_plain_quota_and_take_reaches_the_guarded_buffer():
    """README's step points a forker at RolloutBuffer.quota, its rule _quota and take:
    GuardedBuffer (as served) calls them, so an edit there changes what the proxy serves. Here a
    quota answer with a field of its own, a rule that leases one group at a time, and a take that
    hands out the newest groups first (RolloutBuffer._oldest)."""
    class Forked(RolloutBuffer):
        def quota(self, *args, **kwargs):
            return {**super().quota(*args, **kwargs), "forked": True}

        def _quota(self, worker, version, most, **pool_terms):
            n, why = super()._quota(worker, version, most, **pool_terms)
            return min(n, 1), why

        def _oldest(self, n):
            return [self.groups.pop() for _ in range(min(n, len(self.groups)))]

    buf = GuardedBuffer(Forked({"num_generations": 2, "groups_per_step": 2}))
    buf.set_version(0)
    q = buf.quota("r", 0, 100, 0)
    assert q.get("forked") and q["groups"] == 1, q
    buf.add([make_group("g0", 0, worker="r")])
    assert buf.quota("r", 0, 100, 0)["groups"] == 1
    buf.add([make_group("g1", 0, worker="r")])
    groups, version, _ = buf.take(2, 0)
    assert ([g["group_id"] for g in groups], version) == (["g1", "g0"], 0)


def test_a_worker_banned_while_its_quota_poll_waits_gets_an_answer():
    """POST /reject bans a worker whose GET /quota long poll is waiting: the poll still answers
    (an in-flight lease; its groups then meet 403), never an internal error."""
    buf = GuardedBuffer(RolloutBuffer({"num_generations": 2, "groups_per_step": 2,
                                       "max_staleness": 0}))
    buf.set_version(0)
    assert buf.quota("honest", 0, 100, 0)["groups"] == 2  # the step is leased: liar's poll waits
    answer = {}
    poll = threading.Thread(target=lambda: answer.update(buf.quota("liar", 0, 100, 2)))
    poll.start()
    time.sleep(0.3)
    buf.reject([{"group_id": "x", "worker": "liar", "kind": "reward_mismatch", "why": "lied"}])
    poll.join(10)
    assert answer["state"] == "running" and "liar" in buf.stats()["banned"], answer


def test_one_log_line_per_interval_and_quiet_when_idle(proxy, caplog):
    caplog.set_level("INFO", logger="proxy")
    url, _ = proxy(log_every=0.5)
    time.sleep(1.2)
    assert not caplog.records  # nothing happened, nothing said
    for i in range(5):
        post(url, make_group(f"g{i}"))
    requests.get(url + "/nope")
    time.sleep(1.2)
    lines = [r.getMessage() for r in caplog.records]  # one line, or two if an interval ended mid-burst
    assert 1 <= len(lines) <= 2 and "buffer 5 groups" in lines[-1], lines
    assert sum(int(m[1]) for x in lines for m in re.finditer(r"accepted \+(\d+)", x)) == 5
    assert sum(int(m[1]) for x in lines for m in re.finditer(r"rejected \+(\d+)", x)) == 1
    time.sleep(1.2)
    assert len(caplog.records) == len(lines)


# ---- the CLI ---------------------------------------------------------------------------------

def _exit_message(proc):
    """stderr of a proxy.py that should exit at once; killed if it does not (a failing test leaks nothing)."""
    try:
        return proc.communicate(timeout=20)[1]
    finally:
        proc.kill()


def _start_cli(*args, env_token=None, preexec_fn=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PROXY_TOKEN", "ROLLOUT_TOKEN")}
    if env_token:
        env["PROXY_TOKEN"] = env_token
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "proxy.py"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)


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
        with pytest.raises(ProxyError, match="num_generations 2"):
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


def test_cli_exits_by_itself_once_the_replicas_were_told_the_run_is_done():
    """`python proxy.py` (run_until_done) serves on after the trainer's POST /done until every
    replica that asked for a quota was told the run is over, then exits 0 by itself."""
    port = free_port()
    proc = _start_cli("--port", str(port), "--num-generations", "2", "--linger", "120")
    try:
        wait_port(port)
        url = f"http://127.0.0.1:{port}"
        trainer, replica = ProxyClient(url), ProxyClient(url)
        trainer.set_version(0)
        replica.quota("r1", 0, 10, timeout=0)
        trainer.done()
        time.sleep(1.5)
        assert proc.poll() is None  # r1 asked for quota before: it must hear that the run is over first
        assert replica.quota("r1", 0, 10, timeout=0)["state"] == "done"
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        err = proc.communicate()[1]
    assert "the trainer is done and every replica was told: exiting" in err and "Traceback" not in err


def test_cli_exits_after_linger_quiet_seconds_when_a_replica_never_comes_back():
    port = free_port()
    proc = _start_cli("--port", str(port), "--num-generations", "2", "--linger", "1")
    try:
        wait_port(port)
        url = f"http://127.0.0.1:{port}"
        trainer = ProxyClient(url)
        trainer.set_version(0)
        ProxyClient(url).quota("dead-replica", 0, 10, timeout=0)
        trainer.done()
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        err = proc.communicate()[1]
    assert "the trainer is done and no request for 1 s: exiting" in err


def test_cli_refuses_a_public_address_without_a_token_and_bad_settings():
    """check_service: settings that cannot work or are unsafe end `python proxy.py` with one line
    saying what to change; valid ones (a public address with a token) serve."""
    port = free_port()
    proc = _start_cli("--host", "0.0.0.0", "--port", str(port))
    err = _exit_message(proc)
    assert proc.returncode != 0 and err.startswith("proxy.py: error: refusing to listen on '0.0.0.0' without a token")
    assert "PROXY_TOKEN" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    for flags, expected in [(["--max-connections", "0"], "--max-connections must be > 0"),
                            (["--rollout-token", "r"], "--rollout-token (ROLLOUT_TOKEN) must come with a different"),
                            (["--max-staleness", "-1"], "--max-staleness -1 cannot work")]:
        proc = _start_cli("--port", str(port), *flags)
        err = _exit_message(proc)
        assert proc.returncode != 0 and expected in err and "Traceback" not in err, err
    proc = _start_cli("--host", "0.0.0.0", "--port", str(port), env_token=TOKEN)  # with a token it listens
    try:
        wait_port(port)
        assert requests.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_make_group_builds_the_one_group_record_the_proxy_checks():
    """One definition of the group record: make_group and make_completion return exactly GROUP's
    and COMPLETION's fields, in their order, and what they build passes validate_group."""
    from support.contract import COMPLETION, CONTRACT, GROUP, make_completion, make_group, validate_group

    c = make_completion(ids=(5, 2), logprobs=(-0.5, -0.1), reward=1.0, text="7",
                        finish_reason="stop")
    g = make_group(group_id="g1", policy_version=0, worker="replica-0", prompt="Say a digit.",
                   prompt_ids=(1, 2, 3), temperature=1.0, max_completion_length=4,
                   completions=[c, dict(c, reward=0.0)])
    assert list(g) == list(GROUP) and list(c) == list(COMPLETION)
    assert g["prompt_ids"] == [1, 2, 3] and c["ids"] == [5, 2]  # JSON lists, not tuples
    validate_group(g, dict(CONTRACT, num_generations=2, max_completion_length=4))


def test_the_completion_length_goes_by_max_completion_length_and_its_old_name(proxy):
    """One setting, TRL's name: GET /config serves max_completion_length and, equal, the old
    max_new_tokens; a group may carry either name or both (equal), and is handed out as posted."""
    url, _ = proxy(max_completion_length=64)
    config = requests.get(url + "/config").json()
    assert config["max_completion_length"] == config["max_new_tokens"] == 64
    assert requests.get(proxy(max_new_tokens=9)[0] + "/config").json()["max_completion_length"] == 9
    with pytest.raises(ConfigError, match="--max-completion-length 8 and its old name --max-new-tokens 9"):
        serve(max_completion_length=8, max_new_tokens=9)
    new = {k: v for k, v in make_group("new").items() if k != "max_new_tokens"}
    both = make_group("both", max_new_tokens=64, max_completion_length=64)
    assert post(url, dict(new, max_completion_length=64), make_group("old", max_new_tokens=64),
                both).json()["accepted"] == 3
    requests.post(url + "/version", json={"version": 0})
    got = requests.get(url + "/batch?groups=3").json()["groups"]
    assert got[1] == make_group("old", max_new_tokens=64) and got[2] == both  # as posted
    for group, expected in [(dict(new, max_completion_length=65), "groups[0].max_completion_length: 65, but "
                             "this run samples with max_completion_length 64 (proxy.py --max-completion-length)"),
                            (make_group("x", max_new_tokens=64, max_completion_length=63),
                             "groups[0].max_new_tokens: 64, but max_completion_length is 63"),
                            (dict(new, max_completion_length="64"), "groups[0].max_completion_length: must be"),
                            (new, "groups[0].max_completion_length: missing")]:
        r = post(url, group)
        assert r.status_code == 400 and expected in r.json()["error"], r.text


def test_equal_replicas_whose_whole_step_leases_outlast_the_trainers_step_work_on_two_steps_at_once(
        proxy):
    url, _ = proxy(max_staleness=2, groups_per_step=4)
    trainer, stop = ProxyClient(url), threading.Event()
    trainer.set_version(0)
    for worker in ("a", "b"):  # each takes a whole step: 0.6 s a lease, against 0.3 s of training
        threading.Thread(target=replica_loop, args=(url, worker, 0.15, stop), daemon=True).start()

    def steps(first, last):
        for step in range(first, last):
            assert len(trainer.get_batch(4, timeout=30)["groups"]) == 4
            time.sleep(0.3)  # the trainer's own step
            trainer.set_version(step + 1)
    try:
        steps(0, 4)  # warm-up: both replicas and the trainer measured
        t0 = time.monotonic()
        steps(4, 12)
        per_step = (time.monotonic() - t0) / 8
        s = trainer.stats()
    finally:
        stop.set()
    # one step ahead only, a replica waits for the trainer's next version before it may lease
    # again: ~0.45 s a step; two steps ahead, the trainer's own 0.3 s
    assert per_step < 0.38, (per_step, s["replicas"])
    assert s["dropped_stale"] == 0 and s["over_quota"] == 0, s


# ---- one credential's influence, bounded (support/worker_bounds.py): issue 39, items 1 and 2

def test_an_instant_worker_supplies_at_most_its_share_of_each_step(proxy):
    """A bound credential that posts the moment it is leased is measured as the fastest replica
    (share 1.0): with --max-worker-share 0.5 a step still takes at most 2 of its 4 groups from
    it once the honest replica is measured, and the honest one's share of a lease is never below
    the floor (1 - 0.5); /stats counts the groups each worker supplied to the trainer."""
    url, _ = proxy(token=TOKEN, rollout_token=REPLICA_TOKEN, max_staleness=2, groups_per_step=4,
                   max_worker_share=0.5)
    trainer, stop = ProxyClient(url, token=TOKEN), threading.Event()
    trainer.set_version(0)
    threading.Thread(target=replica_loop, daemon=True, args=(
        url, "honest", 0.1, stop, replica_token(REPLICA_TOKEN, "honest"))).start()
    threading.Thread(target=replica_loop, daemon=True, args=(
        url, "liar", 0.0, stop, replica_token(REPLICA_TOKEN, "liar"))).start()
    per_step = []
    try:
        for step in range(12):
            batch = trainer.get_batch(4, timeout=30)["groups"]
            assert len(batch) == 4
            per_step.append(collections.Counter(g["worker"] for g in batch))
            time.sleep(0.1)  # the trainer's own step
            trainer.set_version(step + 1)
        s = trainer.stats()
    finally:
        stop.set()
    assert s["replicas"]["liar"]["share"] == 1.0, s["replicas"]  # it is the fastest, by far
    assert s["replicas"]["honest"]["share"] >= 0.5, s["replicas"]  # the floor: 1 - 0.5
    # the first steps may come before the honest replica delivered once (nobody is waited for
    # until measured: its first lease may be a whole step, 0.4 s); from then on, at most half
    first = next(i for i, c in enumerate(per_step) if c["honest"])
    assert first <= 5 and all(c["liar"] <= 2 for c in per_step[first:]), per_step
    liar = sum(c["liar"] for c in per_step)
    assert liar <= 2 * 12 + 2 * first, per_step
    assert s["trained"] == {"honest": 48 - liar, "liar": liar} and s["max_worker_share"] == 0.5


def test_a_group_the_trainer_drops_goes_back_to_the_quota_and_its_worker_is_banned(proxy):
    url, _ = proxy(token=TOKEN, rollout_token=REPLICA_TOKEN, max_staleness=0, groups_per_step=2)
    trainer = ProxyClient(url, token=TOKEN)
    liar, honest = replica_client(url, "liar"), replica_client(url, "honest")
    trainer.set_version(0)
    assert liar.quota("liar", 0, 100, timeout=0)["groups"] == 2  # alone: the whole step
    liar.post_rollouts(groups_for("liar", 0, 2, "lie"))
    assert honest.quota("honest", 0, 100, timeout=0)["groups"] == 0  # the step is in
    batch = trainer.get_batch(2, timeout=0)["groups"]
    assert honest.quota("honest", 0, 100, timeout=0)["groups"] == 0  # taken: nothing is lacking
    reports = [{"group_id": g["group_id"], "worker": g["worker"], "kind": "reward_mismatch",
                "why": "completion 0 claims reward 1; its ids score 0"} for g in batch]
    with pytest.raises(ProxyError, match="HTTP 403"):  # the trainer's endpoint
        honest.reject(reports)
    assert trainer.reject(reports) == {"given_back": 2, "banned": ["liar"]}
    # the step lacks 2 again: leased to a replica at once, not to the banned worker
    assert honest.quota("honest", 0, 100, timeout=0)["groups"] == 2
    for call in (lambda: liar.quota("liar", 0, 100, timeout=0),
                 lambda: liar.post_rollouts(groups_for("liar", 0, 1, "more"))):
        with pytest.raises(ProxyError, match="HTTP 403: worker 'liar' is banned from this run: the "
                                             "trainer dropped its group 'lie-liar-0': reward"):
            call()
    honest.post_rollouts(groups_for("honest", 0, 2, "ok"))
    assert [g["worker"] for g in trainer.get_batch(2, timeout=0)["groups"]] == ["honest"] * 2
    s = trainer.stats()
    assert (s["dropped_by_trainer"], s["trainer_drops"], list(s["banned"])) == (2, {"liar": 2},
                                                                               ["liar"])
    assert s["trained"] == {"honest": 2, "liar": 0} and identity_holds(s)


def test_a_banned_workers_buffered_groups_are_still_handed_out_to_be_checked(proxy):
    url, _ = proxy(max_staleness=2, groups_per_step=2)
    trainer = ProxyClient(url)
    trainer.set_version(0)
    trainer.post_rollouts(groups_for("liar", 0, 3, "a") + groups_for("honest", 0, 1, "b"))
    first = trainer.get_batch(1, timeout=0)["groups"]
    trainer.reject([{"group_id": first[0]["group_id"], "worker": "liar", "kind": "prompt_mismatch",
                     "why": "not the item's prompt"}])
    assert len(trainer.get_batch(4, timeout=0)["groups"]) == 3  # the trainer checks each one
    s = trainer.stats()
    assert (s["buffered"], s["delivered"], list(s["banned"])) == (0, 4, ["liar"])
    assert identity_holds(s) and s["trained"] == {"liar": 2, "honest": 1}
    with pytest.raises(ProxyError, match="HTTP 400: groups\\[0\\].kind: missing"):
        trainer.reject([{"group_id": "x", "worker": "w", "why": ""}])


def test_the_trainer_announces_what_its_model_takes_and_the_proxy_refuses_other_groups(proxy):
    """vocab_size and context_length ride on POST /version (a trainer of this version sends
    them); from then on /config serves them and POST /rollouts refuses a group the trainer
    would drop, with 400 naming the id. An older trainer's POST /version (no limits) still
    works, and keeps what was announced."""
    url, _ = proxy(max_new_tokens=8)
    trainer, replica = ProxyClient(url), ProxyClient(url)

    def group(gid, **kw):
        return make_group(gid, max_new_tokens=8, **kw)
    assert "vocab_size" not in replica.contract()
    assert post(url, group("early", prompt_ids=[100000])).status_code == 200  # no limits yet
    trainer.set_limits(vocab_size=101, context_length=8)
    trainer.set_version(0)
    assert {k: replica.contract()[k] for k in ("vocab_size", "context_length")} == {
        "vocab_size": 101, "context_length": 8}
    r = post(url, group("oov", prompt_ids=[5, 100000]))
    assert r.status_code == 400 and r.json()["error"] == (
        "groups[0].prompt_ids: token id 100000 is outside the trainer's vocabulary of 101 ids "
        "(announced by the trainer): is this replica running the trainer's --model?")
    g = group("oov2")
    g["completions"][1]["ids"][0] = 101
    assert "groups[0].completions[1].ids: token id 101 is outside" in post(url, g).json()["error"]
    r = post(url, group("long", tokens=6))  # 3 prompt + 6 completion ids > 8
    assert r.status_code == 400 and "9 tokens of prompt + completion exceed the trainer's " \
                                    "context_length 8" in r.json()["error"]
    assert post(url, group("fits", tokens=5)).status_code == 200
    assert requests.post(url + "/version", json={"version": 1}).status_code == 200  # an old one
    assert replica.contract()["vocab_size"] == 101
    r = requests.post(url + "/version", json={"version": 2, "vocab_size": 0})
    assert r.status_code == 400 and "body.vocab_size: must be an integer in [1," in r.json()["error"]
    with pytest.raises(ConfigError, match="--max-worker-share 0 cannot work"):
        serve(max_worker_share=0)
