"""TRL's trajectory replayed by trainer.py's update (issue 50): the same batches, the same weights.

tests/data/trl_replay.pt holds a real TRL 1.16 GRPOTrainer run on the tiny model, step by step
(bench/record_trl_replay.py wrote it: the batches, TRL's gradient norms and its LoRA weights after
each of 5 optimizer steps of a 10-step linear schedule; its docstring has the config). Here
trainer.grpo_update, with trainer.py's own flags (support/cli.trainer_args, only the run's
settings given) and AdamW (trainer_state.make_optimizer), takes the same batches from TRL's initial
LoRA, as the trainer's loop does (the replica's log-probs: the policy's own, on-policy); after
every step our LoRA must be TRL's within TOLERANCE of TRL's update so far, and our gradient norm
TRL's. The schedule, AdamW's state, clipping, accumulation over micro-batches and equal-reward
groups are all in that path.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q tests/test_trl_replay.py
"""

import os

import pytest
import torch

import trainer
from support import cli, trainer_state

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "trl_replay.pt")
# |ours - TRL's| / |TRL's update so far|, the LoRA weights' global norms: 4x the most this replay
# measures (3.5e-5 to 9.7e-5 with the sampler's log-probs, to 2.3e-4 with the learner's, whose
# weights are 1 only to float precision; the float noise of gradients that cancel over a group,
# which Adam's first steps, g / (|g| + eps), blow up)
TOLERANCE = 1e-3


def load():
    return torch.load(DATA, weights_only=True)


def replay(tiny_model, data, flags=(), optimizer=None):
    """trainer.grpo_update on TRL's batches. Returns one row per step: (relative difference,
    largest |ours - TRL's| of a weight, our gradient norm, TRL's)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    cfg = data["config"]
    G = cfg["num_generations"]
    args = cli.trainer_args([
        "--model", tiny_model, "--bucket", "unused", "--proxy", "http://127.0.0.1:9",
        "--num-generations", str(G), "--groups-per-step", str(cfg["groups"]),
        "--max-staleness", "0", "--temperature", str(cfg["temperature"]),
        "--max-completion-length", str(cfg["max_completion_length"]),
        "--learning-rate", str(cfg["learning_rate"]), "--max-steps", str(cfg["max_steps"]),
        "--lora-r", str(cfg["lora_r"]), "--lora-alpha", str(cfg["lora_alpha"]),
        "--max-grad-norm", str(cfg["max_grad_norm"]), "--epsilon", str(cfg["epsilon"]),
        "--beta", str(cfg["beta"]), "--loss-type", cfg["loss_type"], *flags])
    model = trainer_state.build_model(tiny_model, args.lora_r, args.lora_alpha, "all-linear")
    fingerprint = data["base_fingerprint"]
    ws = [p.detach().double() for n, p in model.named_parameters() if "lora_" not in n]
    assert [float(sum(w.sum() for w in ws)), float(sum((w * w).sum() for w in ws))] == \
        pytest.approx(fingerprint, rel=1e-9), "not the tiny model TRL trained: re-record it"
    start = {k: torch.zeros_like(v) for k, v in get_peft_model_state_dict(model).items()}
    assert sorted(start) == data["lora_keys"]
    start.update(data["initial_A"])  # TRL's B starts at 0, as ours
    set_peft_model_state_dict(model, start)
    optimizer = (optimizer or trainer_state.make_optimizer)(
        trainer_state.lora_parameters(model), args)
    rows = []
    for step, (batch, trl_after) in enumerate(zip(data["batches"], data["after"])):
        seqs = [{"prompt_ids": r["prompt_ids"], "ids": r["ids"]} for r in batch]
        with torch.no_grad():  # the replica's log-probs: the policy's own (staleness 0)
            now = trainer.plain_logprobs(model, seqs, range(len(seqs)), args.temperature)
        completions = [{"ids": r["ids"], "logprobs": now[i, :len(r["ids"])].tolist(),
                        "reward": r["reward"],  # TRL's EOS: the tiny tokenizer's <|im_end|>
                        "finish_reason": "stop" if r["ids"][-1] == cfg["eos_token_id"]
                        else "length"}
                       for i, r in enumerate(batch)]
        groups = [{"prompt_ids": batch[k]["prompt_ids"], "policy_version": step,
                   "completions": completions[k:k + G]} for k in range(0, len(batch), G)]
        _, _, _, grad_norm, finite = trainer.grpo_update(model, optimizer, groups, args, step, step)
        assert finite
        ours = get_peft_model_state_dict(model)
        diff = torch.sqrt(sum(((ours[k] - trl_after[k]) ** 2).sum() for k in ours))
        moved = torch.sqrt(sum(((trl_after[k] - start[k]) ** 2).sum() for k in ours))
        largest = max((ours[k] - trl_after[k]).abs().max().item() for k in ours)
        rows.append(((diff / moved).item(), largest, grad_norm, data["grad_norm"][step]))
    return rows


def test_the_recorded_batches_have_trls_advantages():
    """The file's batches as trainer.py reads them: TRL's advantages are grpo_loss's of the
    rewards (the replay below does not take them from the file), equal-reward groups included."""
    import grpo_loss

    data = load()
    G = data["config"]["num_generations"]
    assert len(data["batches"]) == len(data["after"]) == len(data["grad_norm"]) >= 4
    flat = [r for b in data["batches"] for r in b]
    ours = grpo_loss.group_advantages(torch.tensor([r["reward"] for r in flat]), G, "group")
    assert ours.tolist() == pytest.approx([r["advantage"] for r in flat], abs=1e-6)
    equal = sum(len({r["reward"] for r in b[k:k + G]}) == 1
                for b in data["batches"] for k in range(0, len(b), G))
    assert 0 < equal < len(flat) // G  # both kinds of group are in the replay


@pytest.mark.parametrize("flags", [
    [],  # trainer.py's defaults: one micro-batch here, the sampler's log-probs as the old policy
    ["--micro-batch-tokens", "1"],  # a group a micro-batch: the gradient accumulated
    ["--old-logprobs", "learner"],  # jobs.sh's GPU default (sequence_mask): weights 1 on-policy
], ids=["defaults", "a-group-a-micro-batch", "old-logprobs-learner"])
def test_trainer_update_follows_trls_trajectory(tiny_model, flags):
    rows = replay(tiny_model, load(), flags)
    for step, (rel, largest, ours_norm, trl_norm) in enumerate(rows, 1):
        print(f"step {step}: |ours - TRL's| = {rel:.1e} of TRL's update, largest {largest:.1e}; "
              f"gradient norm {ours_norm:.5f} (TRL {trl_norm:.5f})")
    assert all(rel < TOLERANCE for rel, *_ in rows), rows
    assert [r[2] for r in rows] == pytest.approx([r[3] for r in rows], rel=1e-5)


def adamw_eps(eps):
    return lambda params, args: torch.optim.AdamW(params, lr=args.learning_rate, eps=eps,
                                                  weight_decay=0.0)


@pytest.mark.parametrize("flags, optimizer", [
    (["--max-steps", "11"], None),  # the linear schedule over one step more than TRL's
    (["--max-grad-norm", "1.0"], None),  # no clip (TRL's norms are 0.74-0.82)
    ([], adamw_eps(1e-7)),  # AdamW's eps 1e-7, not torch's and TRL's 1e-8
], ids=["schedule-11-steps", "no-clip", "adamw-eps-1e-7"])
def test_the_replay_sees_a_different_update(tiny_model, flags, optimizer):
    """The replay can fail: each of these changes parts from TRL's weights by more than five
    times the tolerance within the 5 steps (measured: 2.3e-2, 9.9e-3, 2.4e-2 of the update)."""
    rows = replay(tiny_model, load(), flags, optimizer)
    assert max(rel for rel, *_ in rows) > 5 * TOLERANCE, rows


def test_a_first_step_of_equal_rewards_steps_adamw_as_trls_does(tiny_model):
    """TRL backpropagates its loss even when every group's rewards are equal (advantages 0): AdamW
    then steps on zero gradients, its count goes to 1, and the next step's bias correction is
    that of step 2. trainer.py forwards nothing for such groups; make_optimizer's zero gradients
    make AdamW step all the same (with None gradients it skipped the step, and after the next
    step the weights were 0.34 of TRL's update away from TRL's: `bench_vs_trl.py --check-update
    2 --steps 2` on the tiny model, whose first batch earns 0 everywhere)."""
    batch, G = load()["batches"][0], load()["config"]["num_generations"]
    args = cli.trainer_args(["--model", tiny_model, "--bucket", "unused", "--proxy",
                             "http://127.0.0.1:9", "--num-generations", str(G),
                             "--groups-per-step", str(len(batch) // G), "--max-steps", "10"])
    model = trainer_state.build_model(tiny_model, args.lora_r, args.lora_alpha, "all-linear")
    params = list(trainer_state.lora_parameters(model))
    optimizer = trainer_state.make_optimizer(params, args)
    before = [p.detach().clone() for p in params]
    groups = [{"prompt_ids": batch[k]["prompt_ids"], "policy_version": 0, "completions": [
        {"ids": r["ids"], "logprobs": [0.0] * len(r["ids"]), "reward": 0.0,
         "finish_reason": "length"} for r in batch[k:k + G]]} for k in range(0, len(batch), G)]
    *_, grad_norm, finite = trainer.grpo_update(model, optimizer, groups, args, 0, 0)
    assert finite and grad_norm == 0.0
    assert [int(optimizer.state[p]["step"]) for p in params] == [1] * len(params)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
