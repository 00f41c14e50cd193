"""trainer.py: micro-batching, resume state, and whole runs over real processes.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_trainer.py -q

1. The gradient of a batch split into micro-batches (whole groups) equals the gradient of the batch
   in one pass, for every loss_type but bnpo (with and without KL), on the tiny model with a real
   PEFT LoRA. (tests/test_shared_prompt.py checks the shared-prompt forward against TRL's formulas.)
2. A real run: an in-process proxy.serve + one `rollout.py --engine hf --task toy` replica +
   `trainer.py` on a directory bucket. The toy reward rises, every version is published, the
   replica hot-loads several of them, and the groups used came from more than one policy version.
3. SIGKILL the trainer mid-run and start it again with the same command: it says it resumed,
   step and version continue from the saved state, and no version number is published twice.
   Below it: saved state round-trips exactly, and the version-numbering rule.
4. A real replica that reads another bucket: it says so, and the trainer stops with a clear error
   naming the bucket. Also: a wrong token / a missing S3 bucket is one clear line.
"""

import http.server
import importlib.util
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import proxy
import grpo_loss
from support import buckets, cli, group_checks, proxy_client, proxy_service, shared_prompt, step_record, trainer_state
import sync
import trainer
from conftest import ROOT

G = 4
TOKEN = "test-token"
# The toy task on the tiny model: reward ~0.05 at start; at lr 1e-3 it nears 1.0 in ~25 steps with
# one replica (at 3e-3 it is solved by step ~20 and every group then has equal rewards).
CONTRACT = dict(num_generations=8, groups_per_step=4, max_staleness=2, max_new_tokens=6)  # the proxy's settings
TRAIN_ARGS = ["--learning-rate", "1e-3", "--lora-r", "8", "--lora-alpha", "16", "--micro-batch-tokens", "256",
              "--seed", "0"]


def fake_groups(model, n_groups, seed):
    """Groups in the proxy's JSON form: prompts and completions of different lengths; the sampler's
    log-probs are the model's own plus noise, so that some ratios fall outside the clip range."""
    rng = random.Random(seed)
    groups = []
    for gi in range(n_groups):
        prompt = [rng.randrange(4, 100) for _ in range(rng.randint(3, 12))]
        comps = []
        for ci in range(G):
            ids = [rng.randrange(4, 100) for _ in range(rng.randint(1, 9))]
            if ci % 2:
                ids.append(3)  # ends on the EOS, as a completion that stopped does
            comps.append({"ids": ids, "logprobs": [0.0] * len(ids), "reward": float((ci + gi) % 3 == 0),
                          "text": "", "finish_reason": "stop" if ci % 2 else "length"})
        groups.append({"group_id": f"g{gi}", "policy_version": 0, "worker": "w", "prompt": "",
                       "prompt_ids": prompt, "completions": comps})
    seqs = trainer.flatten_groups(groups, 64)
    with torch.no_grad():
        lp = shared_prompt.plain_logprobs_fast(model, seqs, list(range(len(seqs))), grpo_loss.token_logprobs)  # (B, C)
    gen = torch.Generator().manual_seed(seed)
    for r, s in enumerate(seqs):
        n = len(s["ids"])
        noise = (torch.rand(n, generator=gen) - 0.5).tolist()  # +-0.5 nats: ratios 0.6 .. 1.65
        g, c = divmod(r, G)
        groups[g]["completions"][c]["logprobs"] = [a + b for a, b in zip(lp[r, :n].tolist(), noise)]
    return groups


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])  # bnpo: per micro-batch, as TRL (by design)
def test_microbatched_gradient_equals_full_batch(lora_model, loss_type, beta):
    model = lora_model
    seqs = trainer.flatten_groups(fake_groups(model, 3, seed=7), 64)
    rewards = torch.tensor([s["reward"] for s in seqs])  # (B,)
    advantages = grpo_loss.group_advantages(rewards, G)  # (B,)
    params = trainer_state.lora_parameters(model)

    def grads(budget):
        mbs = shared_prompt.make_microbatches(seqs, budget)
        model.zero_grad(set_to_none=True)
        stats = trainer.compute_loss_and_backward(model, seqs, advantages, mbs, loss_type=loss_type, beta=beta,
                                                  epsilon=0.2, epsilon_high=0.28, max_completion_length=16)
        return mbs, stats, [p.grad.clone() for p in params]

    full_mbs, full_stats, full = grads(10**9)
    micro_mbs, micro_stats, micro = grads(60)
    assert len(full_mbs) == 1 and len(micro_mbs) >= 3
    assert full_stats["clip_low_frac"] + full_stats["clip_high_frac"] > 0, "no clipping: the test is too easy"
    assert sum(g.abs().sum() for g in full) > 0
    assert micro_stats["loss"] == pytest.approx(full_stats["loss"], rel=1e-4, abs=1e-7)  # fp32 sums in another order
    assert micro_stats["ratio_mean"] == pytest.approx(full_stats["ratio_mean"], rel=1e-5)
    if beta:
        assert full_stats["kl"] > 0 and micro_stats["kl"] == pytest.approx(full_stats["kl"], rel=1e-4)
    for a, b in zip(micro, full):  # fp32: alone, a group's prompt is forwarded as a common prefix + its last token
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_a_step_split_into_shares_sums_to_the_whole_step(lora_model, loss_type):
    """What data parallel relies on (support/data_parallel.py's share_of_step): compute_loss_and_backward given the
    step's micro-batches with the others emptied ([]) computes its share with the whole step's normalisers, so the
    shares' losses and gradients sum to the step's, at every loss_type (bnpo too: the split is the same)."""
    model, params = lora_model, trainer_state.lora_parameters(lora_model)
    seqs = trainer.flatten_groups(fake_groups(model, 4, seed=5), 64)
    advantages = grpo_loss.group_advantages(torch.tensor([s["reward"] for s in seqs]), G)  # (B,)
    mbs = shared_prompt.make_microbatches(seqs, 60)

    def step(microbatches):
        model.zero_grad(set_to_none=True)
        stats = trainer.compute_loss_and_backward(model, seqs, advantages, microbatches, loss_type=loss_type,
                                                  max_completion_length=16)
        return stats["loss"], [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]

    whole_loss, whole = step(mbs)
    (loss0, share0), (loss1, share1) = [step([mb if k % 2 == r else [] for k, mb in enumerate(mbs)]) for r in (0, 1)]
    assert len(mbs) >= 3 and sum(g.abs().sum() for g in share0) > 0 and sum(g.abs().sum() for g in share1) > 0
    assert loss0 + loss1 == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
    for a, b, w in zip(share0, share1, whole):
        torch.testing.assert_close(a + b, w, rtol=1e-4, atol=1e-6)


def test_state_round_trip_restores_weights_optimizer_and_rng(tiny_model, tmp_path):
    """What a resume loads is what was saved: LoRA weights, AdamW moments, RNG streams."""
    bucket = str(tmp_path / "bucket")
    model = trainer_state.build_model(tiny_model, lora_r=8, lora_alpha=16, seed=0)
    params = trainer_state.lora_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    seqs = trainer.flatten_groups(fake_groups(model, 2, seed=3), 64)
    adv = grpo_loss.group_advantages(torch.tensor([s["reward"] for s in seqs]), G)  # (B,)
    for _ in range(2):
        opt.zero_grad()
        trainer.compute_loss_and_backward(model, seqs, adv, shared_prompt.make_microbatches(seqs, 100))
        opt.step()
    trainer.publish(model, buckets.open_bucket(bucket), 1, 4, tiny_model, 2, {"step": 2, "version": 1}, opt)
    want_next = (random.random(), torch.rand(3))

    fresh = trainer_state.build_model(tiny_model, lora_r=8, lora_alpha=16, seed=5)
    fresh_opt = torch.optim.AdamW(trainer_state.lora_parameters(fresh), lr=1e-2, weight_decay=0.0)
    d = buckets.load_trainer_state(bucket, str(tmp_path / "state"))
    state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
    assert (state["step"], state["version"]) == (2, 1)
    trainer_state.restore_state(fresh, fresh_opt, d, state)
    for a, b in zip(params, trainer_state.lora_parameters(fresh)):
        assert torch.equal(a, b)
    assert any(p.abs().sum() > 0 for n, p in fresh.named_parameters() if "lora_B" in n)
    for sa, sb in zip(opt.state_dict()["state"].values(), fresh_opt.state_dict()["state"].values()):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    got_next = (random.random(), torch.rand(3))  # the streams continue where the saved run left them
    assert got_next[0] == want_next[0] and torch.equal(got_next[1], want_next[1])


def test_make_microbatches_respects_the_token_budget():
    """Whole groups per micro-batch; each group's prompt counted once: k prompts + n completions, padded."""
    rng = random.Random(0)
    prompts = [[1] * rng.randint(1, 20) for _ in range(10)]
    seqs = [{"prompt_ids": prompts[i // 4], "ids": [1] * rng.randint(1, 30), "group": i // 4} for i in range(40)]
    mbs = shared_prompt.make_microbatches(seqs, 200)
    assert sorted(i for m in mbs for i in m) == list(range(40)) and len(mbs) > 1
    for m in mbs:
        groups = {seqs[i]["group"] for i in m}
        assert all(sum(seqs[i]["group"] == g for i in m) == 4 for g in groups), "a group was split"
        cost = len(groups) * max(len(seqs[i]["prompt_ids"]) for i in m) + len(m) * max(len(seqs[i]["ids"]) for i in m)
        assert cost <= 200 or len(groups) == 1
    assert shared_prompt.make_microbatches([{"prompt_ids": [1] * 50, "ids": [1] * 300, "group": 0}], 100) == [[0]]


def test_starting_version_never_reuses_a_number():
    assert trainer_state.starting_version(None, None) == (0, True)  # a new run: publish v0
    assert trainer_state.starting_version(None, 7) == (8, True)  # a bucket used before, no state
    saved = {"step": 10, "version": 5, "published_step": 10}
    assert trainer_state.starting_version(saved, 5) == (5, False)  # LATEST holds exactly the saved weights
    assert trainer_state.starting_version(saved, 9) == (10, True)  # published after the save, then killed
    assert trainer_state.starting_version(dict(saved, published_step=8), 5) == (6, True)  # stepped past v5
    assert trainer_state.starting_version(saved, 5, seen=[4, 5, 6]) == (7, True)  # v6 torn: killed before LATEST


def test_with_the_state_key_the_trainer_follows_its_own_versions_not_a_planted_latest(tmp_path, capfd):
    """TRAINER_STATE_KEY: the trainer's versions go on after the newest one it tagged itself (and
    the folders right after it, publishes a kill cut short). LATEST = 2^31 - 1 and a folder
    planted near the limit are named on stderr and passed over; its own LATEST is trusted. Without
    the key the numbers are taken as they are, and one leaving no room is an error naming it."""
    b, a = buckets.open_bucket(str(tmp_path / "bucket")), tmp_path / "a"
    a.mkdir()
    (a / "adapter_model.safetensors").write_bytes(b"weights")
    for v in range(4):  # the trainer's v0..v3, its state saved with each
        sync.publish_adapter(b, str(a), v, trainer_key="t", step=v, state_step=v - 1 if v else None)
    state = {"step": 3, "version": 3, "published_step": 3}
    assert trainer_state.starting_version(state, *trainer_state.numbers_to_follow(b, "t", state)[:2]) \
        == (3, False)  # LATEST is its own v3: resumed as it is
    b.write("adapters/v000004/adapter_model.safetensors", b"torn")  # a publish cut short
    b.write("adapters/LATEST", b'{"version": 2147483647}')
    b.write("adapters/v2147483646/manifest.json", b"{}")
    latest, seen, own = trainer_state.numbers_to_follow(b, "t", state)
    assert (latest, seen, sorted(own)) == (None, {0, 1, 2, 3, 4}, [0, 1, 2, 3])
    assert trainer_state.starting_version(state, latest, seen) == (5, True)
    assert "passed over: adapters/LATEST (v2147483647), adapters/v2147483646/" in capfd.readouterr().err
    latest, seen, own = trainer_state.numbers_to_follow(b, None, state)  # no key: as they are
    assert (latest, max(seen), own) == (2147483647, 2147483646, {})
    version = trainer_state.starting_version(state, latest, seen)[0]
    error = trainer_state.no_room(b.url, version, 100, latest, seen, state)
    assert "adapters/LATEST (v2147483647) leaves no room below 2^31" in error and "delete it" in error


# ----------------------------------------------------------------------------- real processes

@pytest.fixture
def proxy_url():
    server, _ = proxy.serve(port=0, token=TOKEN, log_every=3600, **CONTRACT)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def child_env(**extra):
    return {**os.environ, "PROXY_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", **extra}


def start_replica(tiny_model, bucket, url, log_path):
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "rollout.py", "--engine", "hf", "--task", "toy", "--model", tiny_model,
             "--bucket", bucket, "--proxy", url, "--seed", "0"],
            cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture
def cluster(tiny_model, tmp_path, proxy_url):
    """The in-process proxy, one hf-engine toy replica, and a directory bucket."""
    bucket, log_path = str(tmp_path / "bucket"), tmp_path / "replica.log"
    replica = start_replica(tiny_model, bucket, proxy_url, log_path)
    c = SimpleNamespace(bucket=bucket, url=proxy_url, replica_log=log_path, tmp=tmp_path, replica=replica,
                        cmd=lambda steps, *extra: [sys.executable, "trainer.py", "--model", tiny_model, "--bucket",
                                                   bucket, "--proxy", proxy_url, *TRAIN_ARGS, "--max-steps",
                                                   str(steps), *extra])
    yield c
    replica.kill()
    replica.wait()
    c.replica_rc = replica.returncode


def published(stdout):
    return [int(v) for v in re.findall(r"^published v(\d+) at step \d+$", stdout, re.M)]


def test_truncated_means_ended_without_eos_as_trl_counts_it():
    """TRL's completions/clipped_ratio counts the completions whose last token is not EOS: here the
    replica's finish_reason says so ("stop": EOS, "length": the limit); a completion longer than
    max_completion_length (cut by the trainer) is truncated whatever it claims."""
    comp = {"ids": [5, 6, 3], "logprobs": [-1.0] * 3, "reward": 1.0, "text": ""}
    reasons = ["stop", "length", "stop", None]  # None: no finish_reason at all (not the proxy's JSON)
    group = {"group_id": "g", "policy_version": 0, "worker": "w", "prompt_ids": [4],
             "completions": [dict(comp, finish_reason=r) for r in reasons if r] + [comp]}
    cut = dict(comp, ids=[5] * 5, logprobs=[-1.0] * 5, finish_reason="stop")  # 5 tokens > the limit 4
    seqs = trainer.flatten_groups([group, {**group, "completions": [cut] * 4}], 4)
    assert [s["truncated"] for s in seqs] == [False, True, False, True] + [True] * 4
    a = cli.trainer_args(["--model", "m", "--bucket", "b", "--proxy", "p"])
    assert a.use_bias_correction_kl and not a.mask_truncated_completions  # TRL 1.16's defaults
    a = cli.trainer_args(["--model", "m", "--bucket", "b", "--proxy", "p",
                            "--no-use-bias-correction-kl", "--mask-truncated-completions"])
    assert not a.use_bias_correction_kl and a.mask_truncated_completions


def test_run_learns_the_toy_task(cluster, tiny_model):
    """The three roles as processes on the tiny model, from an empty bucket: the trainer starts
    fresh and publishes v0, then one version per step (24), the toy reward rises, the replica
    hot-loads several versions and exits by itself; the last adapter loads with peft."""
    r = subprocess.run(cluster.cmd(24, "--save-every", "10"), cwd=ROOT, env=child_env(), capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    recs = buckets.read_metrics(cluster.bucket)
    assert [m["step"] for m in recs] == list(range(1, 25))
    first = sum(m["reward_mean"] for m in recs[:5]) / 5
    last = sum(m["reward_mean"] for m in recs[-5:]) / 5
    print(f"toy reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.3 and last > first + 0.4, f"reward {first:.3f} -> {last:.3f}: no learning"
    versions = published(r.stdout)
    assert versions == list(range(25)), "one version per optimizer step"
    assert sync.latest_version(cluster.bucket) == versions[-1]
    used = set().union(*(m["policy_versions"] for m in recs))
    assert len(used) >= 5 and max(m["staleness_max"] for m in recs) >= 1, f"versions used: {sorted(used)}"
    loaded = {int(v) for v in re.findall(r"adapter v(\d+) loaded", cluster.replica_log.read_text())}
    assert len(loaded) >= 5, "the replica should have hot-loaded several published versions"
    assert all(k in recs[-1] for k in ("loss", "ratio_mean", "clip_low_frac", "grad_norm", "wait_s", "tokens_per_s",
                                       "approx_kl", "clip_frac", "by_staleness"))
    n = CONTRACT["groups_per_step"] * CONTRACT["num_generations"]  # completions per step
    assert all(0 <= m["truncated"] <= n and m["clipped_ratio"] == m["truncated"] / n for m in recs)
    lr = [1e-3 * (1 - i / 24) for i in range(24)]  # --lr-scheduler-type linear (the default): 1e-3 down to 0
    assert [m["learning_rate"] for m in recs] == pytest.approx(lr)
    assert cluster.replica.wait(timeout=60) == 0, "the replica exits by itself once the trainer is done"
    assert "the trainer is done" in cluster.replica_log.read_text()

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = sync.pull_adapter(cluster.bucket, versions[-1], str(cluster.tmp / "pulled"))  # standard PEFT files
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), path)
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


def test_sigkill_and_restart_resumes(cluster):
    cmd = cluster.cmd(16, "--save-every", "4")
    with open(cluster.tmp / "run1.err", "w") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=err, text=True)
        watchdog = threading.Timer(180, p.kill)
        watchdog.start()
        run1 = ""
        for line in p.stdout:  # kill it three steps after the state saved at step 4
            run1 += line
            if line.startswith("step 7 "):
                p.send_signal(signal.SIGKILL)
                break
        p.wait()
        watchdog.cancel()
    assert p.returncode == -signal.SIGKILL, run1 + (cluster.tmp / "run1.err").read_text()[-2000:]
    assert "saved state at step 4 (version 4)" in run1

    r = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.splitlines()[0].startswith("resumed from step 4, version 4"), r.stdout[:500]
    steps2 = [int(s) for s in re.findall(r"^step (\d+) ", r.stdout, re.M)]
    assert steps2 == list(range(5, 17)), "the restart must continue at the step after the saved one"
    v1, v2 = published(run1), published(r.stdout)
    assert v1[:5] == [0, 1, 2, 3, 4] and len(v1) >= 7
    assert v2[0] > max(v1), "the restart republishes the saved weights under a new number"
    assert v1 + v2 == sorted(set(v1 + v2)), f"a version was published twice: {v1} then {v2}"
    assert sync.latest_version(cluster.bucket) == v2[-1]
    recs = buckets.read_metrics(cluster.bucket)
    assert {m["step"] for m in recs} == set(range(1, 17))
    resumed = [m for m in recs if m["version"] >= v2[0]]
    assert [m["step"] for m in resumed] == list(range(5, 17))  # steps 5..7 of run 1 were redone
    assert [m["learning_rate"] for m in resumed] == pytest.approx([1e-3 * (1 - i / 16) for i in range(4, 16)])
    last = json.loads(open(os.path.join(cluster.bucket, "adapters", f"v{v2[-1]:06d}", "manifest.json")).read())
    assert last["step"] == 16


def test_user_errors_are_one_clear_line(tiny_model, tmp_path, proxy_url, s3_server):
    bucket = str(tmp_path / "bucket")
    base = [sys.executable, "trainer.py", "--model", tiny_model, "--proxy", proxy_url, "--max-steps", "1"]
    r = subprocess.run(base + ["--bucket", bucket], cwd=ROOT, env=child_env(PROXY_TOKEN="wrong"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("trainer.py: error:") and "PROXY_TOKEN" in r.stderr
    assert sync.latest_version(bucket) is None, "nothing may be published before the proxy answered"
    if importlib.util.find_spec("wandb") is None:
        r = subprocess.run(base + ["--bucket", bucket, "--report-to", "wandb"], cwd=ROOT, env=child_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "Traceback" not in r.stderr and "pip install wandb" in r.stderr
    r = subprocess.run(base + ["--bucket", "s3://no-such-bucket/run"], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "trainer.py: error:" in r.stderr and "does not exist" in r.stderr


def test_a_replica_that_reads_another_bucket_is_diagnosed(tiny_model, tmp_path, proxy_url):
    """The replica follows a bucket that only ever holds v0: it says so, the trainer starves on clear terms."""
    wrong, bucket = str(tmp_path / "wrong"), str(tmp_path / "bucket")
    model = trainer_state.build_model(tiny_model, lora_r=8, lora_alpha=16)
    model.save_pretrained(str(tmp_path / "v0"))
    sync.publish_adapter(wrong, str(tmp_path / "v0"), 0)
    replica = start_replica(tiny_model, wrong, proxy_url, tmp_path / "replica.log")
    try:
        r = subprocess.run([sys.executable, "trainer.py", "--model", tiny_model, "--bucket", bucket, "--proxy",
                            proxy_url, *TRAIN_ARGS, "--max-steps", "20", "--wait-timeout", "6"],
                           cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    finally:
        replica.kill()
        replica.wait()
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    steps = re.findall(r"^step (\d+) v(\d+) ", r.stdout, re.M)
    assert [(int(s), int(v)) for s, v in steps] == [(1, 0), (2, 1), (3, 2)]  # v0 groups are usable up to v2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("trainer.py: error: no groups for") and f"--bucket {bucket}" in last, last
    log = (tmp_path / "replica.log").read_text()
    assert f"{wrong} shows only v0" in log, log[-2000:]


def test_a_group_with_token_ids_outside_the_vocabulary_is_dropped(capfd):
    """A replica (broken or hostile) can send any id below 2^31: the trainer must not index its embedding with it."""
    server, _ = proxy.serve(port=0, num_generations=2, max_new_tokens=4)
    try:
        client = proxy_client.ProxyClient(f"http://127.0.0.1:{server.server_address[1]}")
        client.set_version(0)

        def group(gid, token):
            comps = [{"ids": [token, 3], "logprobs": [-1.0, -1.0], "reward": float(r), "text": "", "finish_reason":
                      "stop"} for r in (0, 1)]
            return {"group_id": gid, "policy_version": 0, "worker": "w", "prompt": "", "prompt_ids": [5, 6],
                    "temperature": 1.0, "max_new_tokens": 4, "completions": comps}

        client.post_rollouts([group("a", 7), group("bad", 10**6), group("b", 8)])
        got = trainer.gather_groups(client, 2, 10, "B", group_checks.UsableGroups(client, 100))
        assert [g["group_id"] for g in got] == ["a", "b"]
        assert "dropped group bad from w: a token id >= the vocabulary size 100" in capfd.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


# ----------------------------------------------------------------------------- hostile groups

def crafted(model, group, shift=-19.9):
    """The group with every sampler log-prob set to the current policy's + shift: what a replica that
    holds the current adapter can send (ratio e^19.9 ~ 4.4e8, just under grpo_loss.LOG_RATIO_MAX)."""
    seqs = trainer.flatten_groups([group], 64)
    with torch.no_grad():
        lp = shared_prompt.plain_logprobs_fast(model, seqs, list(range(len(seqs))), grpo_loss.token_logprobs)  # (G, C)
    for r, c in enumerate(group["completions"]):
        c["logprobs"] = [x + shift for x in lp[r, :len(c["ids"])].tolist()]
    return group


def test_one_crafted_group_cannot_steer_the_step_by_default(lora_model):
    """1 crafted group among 15 honest ones: with the trainer's default --delta the step's gradient
    points where the honest groups' does (cosine >= 0.9), and the crafted group is named."""
    model, args = lora_model, cli.trainer_args(["--model", "m", "--bucket", "b", "--proxy", "p"])
    groups = fake_groups(model, 16, seed=11)
    groups[15] = crafted(model, groups[15])  # rewards (ci + 15) % 3 == 0: two negative advantages

    def gradient(gs):
        seqs = trainer.flatten_groups(gs, 64)
        adv = grpo_loss.group_advantages(torch.tensor([s["reward"] for s in seqs]), G)  # (B,)
        model.zero_grad(set_to_none=True)
        stats = trainer.compute_loss_and_backward(model, seqs, adv, shared_prompt.make_microbatches(seqs, 10**9),
                                                  delta=args.delta, epsilon_high=args.epsilon_high)
        return torch.cat([p.grad.flatten() for p in trainer_state.lora_parameters(model)]), stats

    honest, _ = gradient(groups[:15])
    step, stats = gradient(groups)
    cosine = torch.nn.functional.cosine_similarity(step, honest, dim=0).item()
    print(f"delta {args.delta}: cosine with the honest groups {cosine:.4f}, |step| {step.norm():.3g} "
          f"|honest| {honest.norm():.3g}")
    assert cosine >= 0.9 and step.norm() < 2 * honest.norm()
    assert list(stats["absurd_ratio"]) == [15] and stats["absurd_ratio"][15] > step_record.ABSURD_RATIO


def good_group(gid, worker="honest", n=4, prompt=(5, 6, 7)):
    return {"group_id": gid, "policy_version": 0, "worker": worker, "prompt": "", "prompt_ids": list(prompt),
            "temperature": 1.0, "max_new_tokens": 4,
            "completions": [{"ids": [8 + j, 3], "logprobs": [-1.0, -0.5], "reward": float(j % 2), "text": "",
                             "finish_reason": "stop"} for j in range(n)]}


def unusable_groups():
    """One group per reason the trainer drops (kind, group): each would crash or poison the step."""
    def bad(gid, edit):
        g = good_group(gid, worker="evil")
        edit(g)
        return g

    def comp(j, **kw):
        return lambda g: g["completions"][j].update(kw)
    return [("empty_prompt", bad("no-prompt", lambda g: g.update(prompt_ids=[]))),
            ("empty_completion", bad("no-ids", lambda g: [c.update(ids=[], logprobs=[]) for c in g["completions"]])),
            ("too_long", bad("long", lambda g: g.update(prompt_ids=[5] * 2100))),
            ("token_id", bad("vocab", comp(1, ids=[10**6, 3]))),
            ("token_id", bad("negative", comp(1, ids=[-1, 3]))),
            ("logprobs", bad("lengths", comp(2, logprobs=[-1.0]))),
            ("reward", bad("huge-reward", comp(0, reward=1e20))),
            ("reward", bad("nan-reward", comp(0, reward=float("nan")))),
            ("num_completions", bad("three", lambda g: g["completions"].pop())),
            ("malformed", bad("no-version", lambda g: g.pop("policy_version")))]


def test_group_problem_names_each_unusable_group():
    limits = {"num_generations": 4, "context": 2048, "reward_range": [0, 1]}
    assert group_checks.group_problem(good_group("ok"), 100, **limits) is None
    for kind, g in unusable_groups():
        assert group_checks.group_problem(g, 100, **limits)[0] == kind, g["group_id"]
    huge = good_group("huge")  # no reward_range served: no bound but finiteness
    huge["completions"][0]["reward"] = 1e20
    assert group_checks.group_problem(huge, 100, 4, 2048) is None


class PassThroughProxy(http.server.BaseHTTPRequestHandler):
    """A proxy that hands the trainer whatever it was given, unchecked (an older or compromised
    proxy.py): what the trainer must survive on its own. Serves GET /config, /batch, /stats and
    POST /version, /done, as proxy.py does for the trainer."""
    contract, queue = {}, []

    def do_GET(self):
        path, _, query = self.path.partition("?")
        n = int(dict(q.split("=") for q in query.split("&")).get("groups", 0)) if query else 0
        if path == "/batch":
            batch, self.queue[:n] = self.queue[:n], []
            answer = {"groups": batch} if batch else (time.sleep(0.2), {"groups": []})[1]
        else:
            answer = self.contract if path == "/config" else {
                "buffered": len(self.queue), "leased": {}, "dropped_stale": 0, "dropped_zero_variance": 0}
        self.reply(answer)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.reply({"ok": True})

    def reply(self, answer):
        body = json.dumps(answer).encode()  # NaN goes out as NaN: json.loads on the other side takes it
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_the_trainer_drops_and_reports_groups_it_cannot_use(tiny_model, tmp_path):
    """A real trainer.py behind a proxy that checks nothing: every unusable group is dropped with a line
    naming its worker and why, counted in the step's groups_dropped; the step still has its 2 groups;
    the crafted one among them (ratio ~4e8) is named and, under the default delta, inert."""
    model = trainer_state.build_model(tiny_model, lora_r=8, lora_alpha=16, seed=0)  # the trainer's v0 (B = 0)
    model.eval()
    bad = unusable_groups()
    handler = type("Handler", (PassThroughProxy,), {
        "contract": {"num_generations": 4, "groups_per_step": 2, "max_staleness": 2, "temperature": 1.0,
                     "max_new_tokens": 4, "reward_range": [0, 1]},
        "queue": [g for _, g in bad] + [good_group("ok"), crafted(model, good_group("crafted", worker="evil"))]})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    bucket = str(tmp_path / "bucket")
    try:
        r = subprocess.run([sys.executable, "trainer.py", "--model", tiny_model, "--bucket", bucket, "--proxy",
                            f"http://127.0.0.1:{server.server_address[1]}", *TRAIN_ARGS, "--max-steps", "1",
                            "--wait-timeout", "30"], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                           timeout=180)
    finally:
        server.shutdown()
        server.server_close()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for kind, g in bad:
        assert f"dropped group {g['group_id']} from evil: " in r.stderr, (g["group_id"], r.stderr[-3000:])
    assert re.search(r"group crafted from evil: importance ratio \S+ > 1000", r.stderr), r.stderr[-2000:]
    (rec,) = buckets.read_metrics(bucket)
    want = {}
    for kind, _ in bad:
        want[kind] = want.get(kind, 0) + 1
    assert rec["groups"] == 2 and rec["groups_dropped"] == want and rec["groups_absurd_ratio"] == 1
    assert not rec["skipped_non_finite"] and math.isfinite(rec["grad_norm"])


def test_a_group_the_trainer_drops_goes_back_to_the_quota_so_it_never_waits_on_it(capfd):
    """Issue 39, item 2, against a proxy that cannot check ids (the trainer's vocabulary not
    announced): a replica's whole step of out-of-vocabulary groups is delivered and dropped. The
    trainer reports the drops (POST /reject): the proxy gives them back to the step's quota and
    bans their worker, so the honest replica is leased them at once; before, the proxy counted
    them as taken, leased nobody anything, and the trainer waited until --wait-timeout."""
    R = "replica-secret"
    server, _ = proxy.serve(port=0, num_generations=2, max_new_tokens=4, groups_per_step=2,
                            max_staleness=0, token=TOKEN, rollout_token=R)
    url, stop = f"http://127.0.0.1:{server.server_address[1]}", threading.Event()

    def client(worker):
        return proxy_client.ProxyClient(url, token=proxy_service.replica_token(R, worker))

    def group(gid, worker, token):
        comps = [{"ids": [token, 3], "logprobs": [-1.0, -1.0], "reward": float(r), "text": "",
                  "finish_reason": "stop"} for r in (0, 1)]
        return {"group_id": gid, "policy_version": 0, "worker": worker, "prompt": "",
                "prompt_ids": [5, 6], "temperature": 1.0, "max_new_tokens": 4, "completions": comps}

    def honest():
        c, made = client("honest"), 0
        while not stop.is_set():
            if n := c.quota("honest", 0, 100, timeout=1.0)["groups"]:
                c.post_rollouts([group(f"ok-{made + i}", "honest", 7) for i in range(n)])
                made += n
    try:
        trainer_client = proxy_client.ProxyClient(url, token=TOKEN)
        trainer_client.set_version(0)
        oov = client("oov")
        assert oov.quota("oov", 0, 100, timeout=0)["groups"] == 2  # alone: the whole step
        oov.post_rollouts([group(f"bad-{i}", "oov", 100000) for i in range(2)])
        threading.Thread(target=honest, daemon=True).start()
        t0, usable = time.monotonic(), group_checks.UsableGroups(trainer_client, 101)
        got = trainer.gather_groups(trainer_client, 2, 20, "B", usable)
        dropped = usable.lap()
        waited = time.monotonic() - t0
        s = trainer_client.stats()
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
    assert [g["worker"] for g in got] == ["honest", "honest"] and waited < 5, waited
    assert dropped == {"token_id": 2} and "dropped group bad-0 from oov" in capfd.readouterr().err
    assert (s["dropped_by_trainer"], s["trainer_drops"], list(s["banned"])) == (2, {"oov": 2},
                                                                               ["oov"])
