"""One replica credential against a real run (issue 39, items 1 and 2), as processes: proxy.py
and trainer.py on the tiny model, and two replicas as threads of this test that speak the
protocol with their own bound credentials (support/proxy_client.py): an honest one that takes
its time, and a hostile one.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_hostile_credentials.py -q

1. An instant credential (it posts the moment it is leased, so the proxy measures it as by far
   the fastest replica): with --max-worker-share 0.5 it supplies at most 2 of each step's 4
   groups once the honest replica delivered; the step records say so (groups_by_worker).
2. An instant credential whose rewards are made up (every completion 1.0) on --task arith: the
   trainer recomputes them, drops its groups (named on stderr), the proxy bans it (403), and
   the run goes on with the honest replica's groups only: none of the liar's is trained on.
3. A credential that sends token id 100000 (the tiny model has 101): refused by the proxy with
   400 once the trainer announced its vocabulary, and the trainer never waits for groups
   nobody makes (before, it dropped them after the proxy had counted them as taken, and waited
   until --wait-timeout ended it).
4. A credential that holds leases it never fills (issue 48, case 1: /quota every 0.2 s, never
   posting) at max_staleness 0 and, measured after one honest delivery, at 2 with B = 12: every
   step completes (before, the trainer ended with "have 3/4" and "have 11/12").
"""

import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, free_port, wait_port
from support import buckets
from support.proxy_client import ProxyClient, ProxyError
from support.proxy_service import replica_token
from support.rewards import make_task, templated
from support.tasks import completion_text

TOKEN, R = "trainer-secret", "replicas-secret"  # PROXY_TOKEN, ROLLOUT_TOKEN
G, B, S, T = 2, 4, 2, 8  # num_generations, groups_per_step, max_staleness, max_new_tokens
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
       "PROXY_TOKEN": TOKEN, "ROLLOUT_TOKEN": R}


class Replica:
    """A replica as a thread: it asks /quota with its bound credential, waits `pace` s a group
    (0: answers at once), posts make(version, rng) groups; it stops at the end of the run or at
    an answer it cannot retry (kept in `refused`)."""

    def __init__(self, url, worker, pace, make):
        self.worker, self.pace, self.make, self.refused, self.posted = worker, pace, make, [], 0
        self.client = ProxyClient(url, token=replica_token(R, worker), max_wait=30)
        self.rng, self.stop = random.Random(worker), threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        v = 0
        while not self.stop.is_set():
            try:
                q = self.client.quota(self.worker, v, 100, timeout=1.0)
                if q["state"] == "done":
                    return
                v = q["trainer_version"] if q["trainer_version"] is not None else v
                if q["groups"] and q["trainer_version"] is not None:
                    time.sleep(self.pace * q["groups"])
                    self.client.post_rollouts([self.make(self, v) for _ in range(q["groups"])])
                    self.posted += q["groups"]
            except ProxyError as e:
                self.refused.append(str(e))
                if "HTTP 403" in str(e) or "gave up" in str(e):
                    return
                time.sleep(0.2)


def group(replica, version, prompt_ids, completions, **extra):
    return {"group_id": f"{replica.worker}-{replica.rng.getrandbits(64):016x}",
            "policy_version": version, "worker": replica.worker, "prompt": "",
            "prompt_ids": prompt_ids, "temperature": 1.0, "max_completion_length": T,
            "completions": completions, **extra}


def completion(ids, reward_):
    return {"ids": ids, "logprobs": [-4.6] * len(ids), "reward": reward_, "text": "",
            "finish_reason": "length"}


def toy_group(replica, version, oov=False):
    """Made-up completions (toy: the trainer checks no reward); with oov, one id past the
    tiny model's 101."""
    rnd = replica.rng
    comps = [completion([rnd.randrange(4, 101) for _ in range(rnd.randint(1, T))], float(j % 2))
             for j in range(G)]
    if oov:
        comps[0]["ids"][0] = 100000
    return group(replica, version, [rnd.randrange(4, 101) for _ in range(12)], comps)


class Arith:
    """arith groups as rollout.py makes them (the row's prompt, rewards from the decoded ids by
    the task's reward function), or with every reward claimed 1.0 (lie)."""

    def __init__(self, model):
        from transformers import AutoTokenizer

        self.tok, self.task = AutoTokenizer.from_pretrained(model), make_task({"task": "arith"})
        self.items = self.task.rows("train")

    def __call__(self, replica, version, lie=False):
        rnd, i = replica.rng, replica.rng.randrange(len(self.items))
        sampled = [[rnd.randrange(4, 101) for _ in range(rnd.randint(1, T))] for _ in range(G)]
        scores, _ = self.task.score(self.items[i], [completion_text(self.tok, x) for x in sampled],
                                    sampled, f"train row {i}")
        comps = [completion(ids, 1.0 if lie else score) for ids, score in zip(sampled, scores)]
        prompt_ids = templated(self.tok, self.items[i]["prompt"])[1]
        return group(replica, version, prompt_ids, comps, item=i)


def run(tmp_path, tiny_model, replicas, steps, proxy_flags=(), trainer_flags=()):
    """proxy.py and trainer.py as processes, `replicas` (worker -> (pace, make), or url -> [Replica])
    as threads,
    until the trainer's `steps` steps are done. Returns (trainer's CompletedProcess, the
    proxy's final /stats, the step records, the replicas)."""
    port, bucket = free_port(), str(tmp_path / "bucket")
    url, stats_file = f"http://127.0.0.1:{port}", str(tmp_path / "stats.json")
    proxy = subprocess.Popen([sys.executable, "proxy.py", "--port", str(port),
                              "--num-generations", str(G), "--groups-per-step", str(B),
                              "--max-staleness", str(S), "--max-new-tokens", str(T),
                              "--linger", "3", "--stats-file", stats_file, *proxy_flags],
                             cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    threads = []
    try:
        wait_port(port)
        threads = replicas(url) if callable(replicas) else [
            Replica(url, w, pace, make) for w, (pace, make) in replicas.items()]
        for r in threads:
            r.thread.start()
        trainer = subprocess.run(
            [sys.executable, "trainer.py", "--model", tiny_model, "--bucket", bucket, "--proxy",
             url, "--learning-rate", "1e-5", "--lora-r", "8", "--lora-alpha", "16",
             "--micro-batch-tokens", "256", "--max-steps", str(steps), "--save-every", "100",
             "--wait-timeout", "40", *trainer_flags],
            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
        if trainer.returncode:  # no POST /done: SIGTERM stops the proxy, its /stats written
            proxy.terminate()
        proxy.wait(timeout=60)
    finally:
        for r in threads:
            r.stop.set()
        if proxy.poll() is None:
            proxy.kill()
            proxy.wait()
    with open(stats_file) as f:
        stats = json.load(f)
    records = buckets.read_metrics(bucket) if os.path.isdir(bucket) else []
    return trainer, stats, records, {r.worker: r for r in threads}


def test_an_instant_credential_supplies_at_most_its_share_of_each_step(tiny_model, tmp_path):
    trainer, stats, records, _ = run(
        tmp_path, tiny_model, {"honest": (0.3, toy_group), "instant": (0.0, toy_group)}, 12,
        proxy_flags=["--max-worker-share", "0.5"])
    assert trainer.returncode == 0, trainer.stdout[-2000:] + trainer.stderr[-3000:]
    by_step = [r["groups_by_worker"] for r in records]
    print("groups per step by worker:", by_step)
    assert len(by_step) == 12 and all(sum(c.values()) == B for c in by_step), by_step
    # until the honest replica delivered its first lease (2 groups, 0.6 s: 3 to 5 steps here,
    # with the trainer's start-up) nobody is waited for; from then on at most half of each step
    first = next(i for i, c in enumerate(by_step) if c.get("honest"))
    assert first <= 6 and all(c.get("instant", 0) <= 2 for c in by_step[first:]), by_step
    assert sum(c.get("instant", 0) for c in by_step) <= 2 * 12 + 2 * first, by_step
    assert stats["replicas"]["instant"]["share"] == 1.0 or stats["replicas"] == {}  # the fastest
    assert stats["max_worker_share"] == 0.5


def test_made_up_rewards_are_caught_and_their_credential_banned(tiny_model, tmp_path):
    arith = Arith(tiny_model)
    trainer, stats, records, replicas = run(
        tmp_path, tiny_model, {"honest": (0.3, arith),
                               "liar": (0.0, lambda r, v: arith(r, v, lie=True))}, 6,
        trainer_flags=["--task", "arith"])
    assert trainer.returncode == 0, trainer.stdout[-2000:] + trainer.stderr[-3000:]
    assert "reward check: on (arith" in trainer.stdout
    assert "from liar: completion 0 claims reward 1; its ids score 0" in trainer.stderr
    assert "from honest" not in trainer.stderr, trainer.stderr[-3000:]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(set(r["groups_by_worker"]) == {"honest"} for r in records), records
    assert any(r["groups_dropped"].get("reward_mismatch") for r in records)
    assert all(r["reward_check_s"] >= 0 for r in records)
    assert "liar" in stats["banned"] and stats["trained"].get("liar", 0) == 0, stats
    assert any("is banned from this run" in e for e in replicas["liar"].refused), \
        replicas["liar"].refused


def test_out_of_vocabulary_ids_are_refused_and_the_trainer_never_waits(tiny_model, tmp_path):
    trainer, stats, records, replicas = run(
        tmp_path, tiny_model, {"honest": (0.5, toy_group),
                               "oov": (0.0, lambda r, v: toy_group(r, v, oov=True))}, 8)
    assert trainer.returncode == 0, trainer.stdout[-2000:] + trainer.stderr[-3000:]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(r["groups_dropped"] == {} for r in records), records
    refused = replicas["oov"].refused
    assert refused and all("HTTP 400" in e and "token id 100000 is outside the trainer's "
                           "vocabulary of 101 ids" in e for e in refused), refused
    assert stats["workers"].get("oov", {}).get("accepted", 0) == 0, stats["workers"]
    assert stats["contract"]["vocab_size"] == 101 and stats["contract"]["context_length"] == 2048


class Squatter(Replica):
    """A credential that holds leases it never fills (issue 48, case 1): after `honest` groups
    posted at once (to be measured: 0 for none), GET /quota?max=100&timeout=0 every 0.2 s, never
    posting again."""

    def __init__(self, url, worker, honest):
        super().__init__(url, worker, 0.0, toy_group)
        self.honest, self.asked, self.answers = honest, 0, []

    def run(self):
        v = 0
        while not self.stop.is_set():
            try:
                q = self.client.quota(self.worker, v, 100, timeout=0)
                if q["state"] == "done":
                    return
                v = q["trainer_version"] if q["trainer_version"] is not None else v
                self.asked += 1
                self.answers.append(q["groups"])
                if self.honest and q["groups"] and q["trainer_version"] is not None:
                    k = min(self.honest, q["groups"])
                    self.client.post_rollouts([self.make(self, v) for _ in range(k)])
                    self.honest -= k
            except ProxyError as e:
                self.refused.append(str(e))
                if "HTTP 403" in str(e) or "gave up" in str(e):
                    return
            time.sleep(0.2)


@pytest.mark.parametrize("staleness, batch, honest", [(0, 4, 0), (2, 12, 1)])
def test_a_credential_that_holds_leases_it_never_fills_cannot_stall_the_trainer(
        tiny_model, tmp_path, staleness, batch, honest):
    """Issue 48, case 1: a lease is owed work, not a seat. The squatter asks every 0.2 s and
    never posts (at max_staleness 2 after one honest delivery, so that it is measured and counts
    as a supplier); before, each /quota renewed its lease, so at S = 0 the honest replica was
    leased B - 1 (3 of 4: 0 of 6 steps) and at S = 2, B = 12 the step waited for the squatter's
    share (11 of 12). Now asking again returns what it still owes, a lease that expires unfilled
    counts against its holder, and only recent deliveries make a supplier."""
    trainer, stats, records, workers = run(
        tmp_path, tiny_model,
        lambda url: [Replica(url, "honest", 0.05, toy_group), Squatter(url, "squatter", honest)], 6,
        proxy_flags=["--max-staleness", str(staleness), "--groups-per-step", str(batch)],
        trainer_flags=["--wait-timeout", "30"])
    assert trainer.returncode == 0, trainer.stdout[-2000:] + trainer.stderr[-3000:]
    print("squatter's answers:", workers["squatter"].answers, stats["leased"])
    assert [r["step"] for r in records] == list(range(1, 7))
    assert workers["squatter"].asked > 20, workers["squatter"].asked  # it kept asking
    assert stats["trained"].get("squatter", 0) <= honest, stats["trained"]
