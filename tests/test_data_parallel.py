"""trainer.py as 2 processes of one job (torchrun, gloo on the CPU): support/data_parallel.py.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_data_parallel.py -q

1. The update of a 2-rank step (trainer.grpo_update spread over the ranks by Ranks.spread; data
   parallel, and FSDP2: --fsdp, each rank half of the model, the plain forward) equals the
   1-process update on the same groups and micro-batches: the LoRA gradient, the weights after
   AdamW and the step's statistics, for every loss_type at beta 0 and 0.04, with --old-logprobs
   learner and the masks, and with a rank that forwards nothing; both ranks end with the same
   weights. One torchrun of this file (its __main__ is the worker) computes every case; each
   is a test.
2. A 2-rank trainer against a real proxy and replica learns the toy task; a SIGKILL of rank 1
   ends rank 0 through torchrun's agent, which names the rank; one plain process resumes from
   the bucket, is killed in turn, and the 2-rank command resumes from its state (N changes).
   --fsdp (FSDP2): 2 ranks resume a plain process's state, publish adapters of the whole LoRA
   and save a state that a plain process restores.
3. Without torchrun's agent (two plain processes with its variables), a rank whose peer dies
   while it waits on it ends with one clear line, in seconds.
4. jobs.sh: TRAINER_GPUS (by default the trainer flavour's GPUs) ranks, started by torchrun.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import ROOT, free_port
from test_jobs_hf import dry_run_commands, gateway, run_jobs  # noqa: F401 (a fixture)
from test_trainer import G, child_env, cluster, proxy_url, published  # noqa: F401 (fixtures)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
CASES = [f"{t}-beta{b}" for t in LOSS_TYPES for b in (0.0, 0.04)] + ["dapo-learner", "dapo-flat"]
FLAGS = {"dapo-learner": ["--old-logprobs", "learner", "--off-policy-mask-threshold", "0.05",
                          "--mask-truncated-completions"]}


# ----------------------------------------------------------------------------- 1. the update

def worker(tiny_model, out, mode):
    """Run by each rank of `torchrun ... tests/test_data_parallel.py worker MODEL OUT MODE`: every
    case as a 2-rank step (MODE dp: data parallel, fsdp: FSDP2, the model sharded), and on rank 0
    as one process from the same weights; rank 0 saves both."""
    import trainer
    from support import cli, data_parallel, fsdp, trainer_state
    from conftest import make_lora_model
    from test_trainer import fake_groups

    def lora_model():  # the same weights on every rank, and in every call
        return make_lora_model(tiny_model)

    def full(t):  # a tensor, or a DTensor (--fsdp: this rank's shard) gathered whole
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()

    ranks = data_parallel.join_ranks(60, 0, fsdp=mode == "fsdp")
    model = lora_model()
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    one_model = lora_model() if ranks.fsdp and ranks.rank == 0 else model  # unsharded, 1 process
    if ranks.fsdp:
        fsdp.shard_model(model)
    local = sum(p.to_local().numel() if ranks.fsdp else p.numel()
                for p in trainer_state.lora_parameters(model))
    groups = ranks.same_groups(fake_groups(one_model, 4, seed=7) if ranks.rank == 0 else None)
    results = {}
    for case in CASES:  # (a test of its own each)
        loss_type, beta = case.split("-")[0], float(case.split("beta")[-1] if "beta" in case else 0)
        args = cli.trainer_args(["--model", "m", "--bucket", "b", "--proxy", "p", "--loss-type",
                                 loss_type, "--beta", str(beta), "--epsilon-high", "0.28",
                                 "--micro-batch-tokens", "60", "--learning-rate", "1e-3",
                                 "--max-steps", "10", *FLAGS.get(case, [])])
        vars(args).update(num_generations=G, max_completion_length=16, temperature=1.0)
        batch = groups
        if case == "dapo-flat":  # one group with a signal: one rank forwards nothing
            batch = [dict(g, completions=[dict(c, reward=1.0) for c in g["completions"]])
                     if k else g for k, g in enumerate(groups)]

        def update(r, m):
            params = trainer_state.lora_parameters(m)
            if r.fsdp:  # rank 0's start weights into every rank's shard
                fsdp.load_full_state(m, None, start if r.rank == 0 else {}, None, resumed=False)
            else:
                for n, p in m.named_parameters():
                    if p.requires_grad:
                        p.data.copy_(start[n])
            for p in params:
                p.grad = None  # a fresh trainer's first step
            opt = trainer_state.make_optimizer(params, args)
            step = r.spread(trainer.grpo_update, trainer.compute_loss_and_backward,
                            trainer.plain_logprobs)  # ONE_PROCESS: grpo_update itself
            _, mbs, stats, norm, finite = step(m, opt, batch, args, 3, 5)
            return {"grads": [full(p.grad) for p in params], "mbs": mbs, "stats": stats,
                    "weights": [full(p) for p in params], "grad_norm": norm, "finite": finite}

        dp = update(ranks, model)
        theirs = [None, None]
        torch.distributed.all_gather_object(theirs, dp["weights"])
        if ranks.rank == 0:
            one = update(data_parallel.ONE_PROCESS, one_model)
            same = all(torch.equal(a, b) for a, b in zip(*theirs))
            results[case] = {"dp": dp, "one": one, "ranks_equal": same, "local": local,
                             "whole": sum(p.numel() for p in start.values())}
    if ranks.fsdp:  # a resume and a save: rank 0's full LoRA and AdamW state into the shards
        # and back, as one process's state_dict()
        opt = trainer_state.make_optimizer(trainer_state.lora_parameters(model), args)
        lora, adamw = {}, None
        if ranks.rank == 0:  # after a step of one process: AdamW's moments are not zeros
            ref = trainer_state.make_optimizer(trainer_state.lora_parameters(one_model), args)
            trainer.grpo_update(one_model, ref, groups, args, 3, 5)
            lora = {n: p.detach().clone() for n, p in one_model.named_parameters()
                    if p.requires_grad}
            adamw = ref.state_dict()
        fsdp.load_full_state(model, opt, lora, adamw, resumed=True)
        back = fsdp.gather_full_state(model, opt)
        if ranks.rank == 0:
            results["round trip"] = {"lora": (lora, back[0]), "adamw": (adamw, back[1])}
    if ranks.rank == 0:
        torch.save(results, out)
    ranks.leave()


@pytest.fixture(scope="module", params=["dp", "fsdp"])
def updates(tiny_model, tmp_path_factory, request):
    out = str(tmp_path_factory.mktemp("dp") / "updates.pt")
    r = subprocess.run([*TORCHRUN, __file__, "worker", tiny_model, out, request.param], cwd=ROOT,
                       env=child_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return request.param, torch.load(out, weights_only=False)


@pytest.mark.parametrize("case", CASES)
def test_a_2_rank_update_equals_the_1_process_update(updates, case):
    """dp: each rank the whole model; fsdp: each rank half of it (FSDP2), the plain forward."""
    mode, updates = updates
    dp, one = updates[case]["dp"], updates[case]["one"]
    assert dp["mbs"] == one["mbs"] and len(dp["mbs"]) >= 3, "the same micro-batches, >= 2 ranks'"
    assert dp["finite"] and one["finite"] and updates[case]["ranks_equal"], "ranks diverged"
    if mode == "fsdp":  # each rank holds about half of the LoRA
        assert updates[case]["local"] <= 0.6 * updates[case]["whole"], updates[case]
    assert sum(g.abs().sum() for g in one["grads"]) > 0
    for a, b in zip(dp["grads"], one["grads"]):  # test_grpo_loss's tolerance
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # AdamW's first step moves each weight by lr * g / (|g| + 1e-8): where |g| is near 1e-8 a
    # rounding of g (summed in another order) moves it by up to lr. Elsewhere: the tolerance.
    tame = [g.abs() > 1e-6 for g in one["grads"]]
    assert sum(int((~t).sum()) for t in tame) < 0.01 * sum(t.numel() for t in tame)
    for a, b, t in zip(dp["weights"], one["weights"], tame):
        torch.testing.assert_close(a[t], b[t], atol=1e-6, rtol=1e-5)
    assert dp["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    s, t = dp["stats"], one["stats"]
    assert s.keys() == t.keys() and s["groups_forwarded"] == t["groups_forwarded"]
    assert s["by_staleness"].keys() == t["by_staleness"].keys()
    for k, v in t.items():
        if isinstance(v, float):
            assert s[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    if case == "dapo-flat":
        assert t["groups_forwarded"] == 1
    if "beta0.04" in case:
        assert t["kl"] > 0
    if case == "dapo-learner":
        assert t["sampling/off_policy_mask/masked_frac"] > 0, "the mask left nothing out"


def test_fsdp_the_full_state_goes_into_the_shards_and_back_as_it_was(updates):
    """--fsdp's resume and save (support/fsdp.py): a trained LoRA and AdamW state of one process,
    loaded into the 2 ranks' shards (load_full_state) and gathered back (gather_full_state), is
    the same state, in one process's format (AdamW's settings included: state_problem checks)."""
    mode, updates = updates
    if mode != "fsdp":
        pytest.skip("data parallel holds whole tensors: nothing to shard")
    (lora, lora_back), (adamw, adamw_back) = updates["round trip"].values()
    assert lora.keys() == lora_back.keys() and len(lora) > 0
    for n in lora:
        assert torch.equal(lora[n], lora_back[n]), n
    assert adamw["param_groups"] == adamw_back["param_groups"]
    assert adamw["state"].keys() == adamw_back["state"].keys() and len(adamw["state"]) == len(lora)
    for i, s in adamw["state"].items():
        assert s.keys() == adamw_back["state"][i].keys()
        assert s["exp_avg"].abs().sum() > 0
        for k, v in s.items():
            assert torch.equal(v, adamw_back["state"][i][k]), (i, k)


def test_make_microbatches_gives_each_rank_a_share_of_whole_groups():
    from support.shared_prompt import by_group, make_microbatches

    seqs = [{"prompt_ids": [1] * (3 + g), "ids": [1] * (1 + i), "group": g}
            for g in range(5) for i in range(4)]
    assert len(make_microbatches(seqs, 10**6)) == 1
    for n in (2, 3, 5, 8):
        mbs = make_microbatches(seqs, 10**6, at_least=n)
        assert len(mbs) >= min(n, 5) and sorted(i for m in mbs for i in m) == list(range(20))
        assert all(len(g) == 4 for m in mbs for g in by_group(seqs, m)), "a group was split"
    assert make_microbatches(seqs, 60, at_least=2) == make_microbatches(seqs, 60)


# ----------------------------------------------------------------------------- 2. a real run

def rank_pid(parent, rank):
    """The pid of torchrun `parent`'s worker with RANK=rank (its children: the agent's workers)."""
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and open(f"/proc/{pid}/stat").read().split(") ")[1].split()[1] \
                    == str(parent):
                if f"RANK={rank}".encode() in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                    return int(pid)
        except OSError:
            continue
    return None


def run_until(cmd, tmp, name, step, kill):
    """Start cmd, read its stdout until the line "step {step} ", then kill(process); its stdout and
    stderr (tmp/name.err) after it ended, and the time of the kill."""
    with open(tmp / f"{name}.err", "w") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=err,
                             text=True)
        watchdog = threading.Timer(240, p.kill)
        watchdog.start()
        out, killed = "", None
        for line in p.stdout:
            out += line
            if line.startswith(f"step {step} "):
                kill(p)
                killed = time.time()
                break
        out += p.stdout.read()
        p.wait()
        watchdog.cancel()
    return p, out, (tmp / f"{name}.err").read_text(), killed


def test_a_2_rank_run_learns_and_resumes_after_a_kill_as_1_process_then_as_2(cluster):
    """The resume state is the full LoRA and AdamW state whatever N: 2 ranks (rank 1 killed at step
    7, state saved at 4) -> one plain process from step 4 (killed at step 11, state saved at 8)
    -> 2 ranks again from step 8, to the end; the toy reward rises across the three."""
    one = cluster.cmd(24, "--save-every", "4")  # python trainer.py ...
    cmd = TORCHRUN + one[1:]
    p, run1, log, killed = run_until(cmd, cluster.tmp, "run1", 7,
                                     lambda p: os.kill(rank_pid(p.pid, 1), signal.SIGKILL))
    assert killed and p.returncode != 0, run1[-2000:] + log[-2000:]
    assert time.time() - killed < 60, "torchrun ends the other rank"
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", log) and "Signal 9" in log, log[-2000:]
    assert "saved state at step 4 (version 4)" in run1

    p, run2, log, killed = run_until(one, cluster.tmp, "run2", 11, lambda p: p.kill())
    assert killed and p.returncode == -signal.SIGKILL, run2[-2000:] + log[-2000:]
    assert run2.splitlines()[0].startswith("resumed from step 4, version 4"), run2[:500]
    assert [int(s) for s in re.findall(r"^step (\d+) ", run2, re.M)] == list(range(5, 12))
    assert re.search(r"^saved state at step 8 \(version \d+\)$", run2, re.M), run2[-2000:]

    r = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.splitlines()[0].startswith("resumed from step 8, version "), r.stdout[:500]
    assert [int(s) for s in re.findall(r"^step (\d+) ", r.stdout, re.M)] == list(range(9, 25))
    v1, v2, v3 = published(run1), published(run2), published(r.stdout)
    assert v1 + v2 + v3 == sorted(set(v1 + v2 + v3)), f"a version published twice: {v1, v2, v3}"
    assert len(re.findall(r"^step 9 ", r.stdout, re.M)) == 1, "one rank logs"

    from support import buckets

    recs = buckets.read_metrics(cluster.bucket)  # a step redone after a resume: its new record
    by_step = {m["step"]: m for m in recs}
    assert sorted(by_step) == list(range(1, 25))
    # the schedule goes on across the resumes: --lr-scheduler-type linear over the 24 steps
    assert [by_step[s]["learning_rate"] for s in range(1, 25)] == \
        pytest.approx([1e-3 * (1 - i / 24) for i in range(24)])
    first = sum(by_step[s]["reward_mean"] for s in range(1, 6)) / 5
    last = sum(by_step[s]["reward_mean"] for s in range(20, 25)) / 5
    print(f"toy reward, 2 ranks, 1, then 2: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.3 and last > first + 0.4, f"reward {first:.3f} -> {last:.3f}: no learning"
    two = [by_step[s] for s in (*range(1, 5), *range(9, 25))]  # the steps the 2-rank runs kept
    assert all(m["micro_batches"] >= 2 for m in two), "each rank takes a share"


def test_an_fsdp_run_resumes_a_1_process_state_publishes_whole_adapters_and_saves_one(cluster,
                                                                                  tiny_model):
    """--fsdp: one plain process killed at step 7 (state saved at 4); 2 ranks, each holding half
    of the model (FSDP2), resume from its state and finish the 8 steps against the real proxy
    and replica, the restored weights published first under a new number. Every version they
    publish is a PEFT adapter of the whole LoRA, and the state
    they save is one process's: a plain trainer restores it, the weights of the last adapter."""
    one = cluster.cmd(8, "--save-every", "4")
    p, run1, log, killed = run_until(one, cluster.tmp, "run1", 7, lambda p: p.kill())
    assert killed and "saved state at step 4 (version 4)" in run1, run1[-2000:] + log[-2000:]
    r = subprocess.run(TORCHRUN + one[1:] + ["--fsdp"], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.splitlines()[0].startswith("resumed from step 4, version 4"), r.stdout[:500]
    assert [int(s) for s in re.findall(r"^step (\d+) ", r.stdout, re.M)] == list(range(5, 9))
    v1, v2 = published(run1), published(r.stdout)
    assert v1 + v2 == sorted(set(v1 + v2)) and len(v2) == 1 + 4, f"{v1} then {v2}"
    assert "saved state at step 8" in r.stdout

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import sync
    from support import buckets, cli, trainer_state

    model = trainer_state.build_model(tiny_model, lora_r=8, lora_alpha=16, seed=3)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    args = cli.trainer_args(["--model", tiny_model, "--bucket", "b", "--proxy", "p"])
    opt = trainer_state.make_optimizer(trainer_state.lora_parameters(model), args)
    where = str(cluster.tmp / "state")
    state_dir = buckets.load_trainer_state(buckets.open_bucket(cluster.bucket), where)
    state = trainer_state.load_state(state_dir, None, cluster.bucket)
    assert state["step"] == 8 and trainer_state.state_problem(state, opt) is None
    trainer_state.restore_state(model, opt, state_dir, state)  # a plain trainer's resume
    assert len(opt.state_dict()["state"]) == len(names), "AdamW's state of every LoRA tensor"
    pulled = sync.pull_adapter(cluster.bucket, v2[-1], str(cluster.tmp / "pulled"))
    last = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), pulled)
    theirs = dict(last.named_parameters())
    for n, p in model.named_parameters():
        if p.requires_grad:  # the whole tensor, the same in the adapter and in the state
            torch.testing.assert_close(theirs[n], p, atol=0, rtol=0)
    assert any(p.abs().sum() > 0 for n, p in theirs.items() if "lora_B" in n), "it learned"


# ----------------------------------------------------------------------------- 3. no agent

def test_without_torchrun_a_rank_whose_peer_dies_ends_with_a_clear_line(tiny_model, tmp_path,
                                                                          proxy_url):
    """Rank 0 waits for groups (no replica), rank 1 waits for them in a broadcast: rank 0 is
    killed, rank 1 ends in seconds with one line saying what happened and what to do."""
    port = free_port()
    cmd = [sys.executable, "trainer.py", "--model", tiny_model, "--bucket", str(tmp_path / "b"),
           "--proxy", proxy_url, "--max-steps", "3", "--lora-r", "8", "--lora-alpha", "16"]
    procs = []
    for rank in (0, 1):
        env = child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        for line in procs[0].stdout:
            if line.startswith("published v0"):  # past the start: both ranks in the loop
                break
        time.sleep(1)
        procs[0].kill()
        t = time.time()
        _, err = procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    print(f"rank 1 ended {time.time() - t:.1f} s after rank 0 was killed")
    last = err.strip().splitlines()[-1]
    assert procs[1].returncode == 1 and "Traceback" not in err, err[-3000:]
    assert last.startswith("trainer.py: error: rank 1 of 2: the step's groups did not come") \
        and "resumes" in last, last


# ----------------------------------------------------------------------------- 4. the launch

@pytest.mark.parametrize("env, ranks", [({}, None), ({"TRAINER_FLAVOR": "h200x2"}, "2"),
                                        ({"TRAINER_FLAVOR": "h200x4", "TRAINER_GPUS": "3"}, "3"),
                                        ({"TRAINER_FLAVOR": "h200x2", "TRAINER_FSDP": "1"}, "2")])
def test_jobs_sh_starts_one_trainer_rank_per_gpu_of_its_flavor(tmp_path, hf_run_name, gateway,
                                                                env, ranks):
    """TRAINER_GPUS, by default the flavour's "xN": the trainer job's command is torchrun's;
    TRAINER_FSDP=1 adds --fsdp, and needs 2 or more."""

    res, _ = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="me/b", DRY_RUN="1", **env)
    assert res.returncode == 0, res.stderr
    trainer = dry_run_commands(res)[-1][-1]  # its `bash -c` text
    start = " python3 trainer.py " if ranks is None else \
        f" python3 -m torch.distributed.run --standalone --nproc-per-node {ranks} trainer.py "
    assert start in trainer, trainer
    assert (" --fsdp" in trainer) == ("TRAINER_FSDP" in env), trainer
    res, _ = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="me/b", DRY_RUN="1", TRAINER_GPUS="0")
    assert res.returncode != 0 and "TRAINER_GPUS='0'" in res.stderr
    res, _ = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="me/b", DRY_RUN="1", TRAINER_FSDP="1",
                      TRAINER_GPUS="1")
    assert res.returncode != 0 and "TRAINER_FSDP=1" in res.stderr and ">= 2" in res.stderr


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:  # torchrun's ranks, for test 1
    worker(*sys.argv[2:5])
