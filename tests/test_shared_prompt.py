"""The shared-prompt training forward against the plain one, on the tiny model with a real PEFT LoRA.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_shared_prompt.py -q

support/shared_prompt.py's plain_logprobs_fast (what trainer.py's step runs) sends each group's prompt through the model once and forwards the G
completions on top of its KV cache. The reference here is the plain path it replaced
(`trainer.plain_logprobs`: every row [left-padded prompt | completion] forwarded whole), and TRL's loss
formulas written out below, independently of grpo_loss.py. The data: groups whose prompts have
different lengths (left padding inside one micro-batch), completions of different lengths (right
padding), temperature 0.7, sampler log-probs off by up to +-0.5 nats (so that ratios leave the clip
range), policy versions 0..2 (staleness), and one group whose rewards are all equal (advantage 0:
trainer.py does not forward it when beta == 0, and the gradient must not change).
"""

import random

import pytest
import torch

import grpo_loss
import trainer
from support import shared_prompt, trainer_state

G, T, EPS, EPS_HIGH, MAX_LEN = 4, 0.7, 0.2, 0.28, 16
PROMPT_LENGTHS = [3, 11, 6, 14, 5]  # after a common prefix of PREFIX tokens, as a chat template's system prompt
PREFIX = 4
EQUAL_GROUP = 3  # its rewards are all equal
BUDGET = 108  # --micro-batch-tokens: 3 micro-batches, the equal-reward group sharing one


def make_groups(model, seed=0, prefix=PREFIX):
    """Groups in the proxy's JSON form; sampler log-probs = the model's own (plain path) + noise."""
    rng = random.Random(seed)
    shared = [rng.randrange(4, 100) for _ in range(prefix)]
    groups = []
    for k, P in enumerate(PROMPT_LENGTHS):
        comps = []
        for c in range(G):
            ids = [rng.randrange(4, 100) for _ in range(rng.randint(1, 9))]
            reward = 1.0 if k == EQUAL_GROUP else float((c + k) % 3 == 0)
            comps.append({"ids": ids, "logprobs": [0.0] * len(ids), "reward": reward,
                          "finish_reason": "length" if (c + k) % 4 == 1 else "stop"})  # 1 in 4: no EOS
        groups.append({"prompt_ids": shared + [rng.randrange(4, 100) for _ in range(P)], "completions": comps,
                       "policy_version": k % 3, "group_id": f"g{k}", "worker": "w"})
    seqs = trainer.flatten_groups(groups, MAX_LEN)
    with torch.no_grad():
        lp = trainer.plain_logprobs(model, seqs, list(range(len(seqs))), T)  # (B, C)
    gen = torch.Generator().manual_seed(seed)
    for r, s in enumerate(seqs):
        noise = (torch.rand(len(s["ids"]), generator=gen) - 0.5).tolist()  # ratios 0.6 .. 1.65
        s["logprobs"] = [a + b for a, b in zip(lp[r, :len(s["ids"])].tolist(), noise)]
    return seqs


def padded(seqs, key):
    C = max(len(s["ids"]) for s in seqs)
    return torch.tensor([list(s[key]) + [0] * (C - len(s["ids"])) for s in seqs], dtype=torch.float)  # (B, C)


def trl_loss(logps, seqs, advantages, loss_type, microbatches, ref=None, beta=0.0, delta=None,
             mask_truncated=False):
    """TRL 1.16's _compute_loss on the whole step, written out (bnpo: per micro-batch, / their
    number), with its defaults use_bias_correction_kl=True and mask_truncated_completions=False."""
    old, mask = padded(seqs, "logprobs"), (padded(seqs, "ids") != 0).float()  # (B, C); ids are never 0
    if mask_truncated:  # TRL: completion_mask = completion_mask * (~is_truncated).unsqueeze(1).int()
        mask = mask * torch.tensor([not s["truncated"] for s in seqs]).unsqueeze(1)  # (B, C)
    coef_1 = torch.exp(logps - old)  # (B, C)
    coef_2 = torch.clamp(coef_1, 1 - EPS, 1 + EPS_HIGH)  # (B, C)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    adv = advantages.unsqueeze(1)  # (B, 1)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)  # (B, C)
    if beta:
        kl = torch.exp(ref - logps) - (ref - logps) - 1  # (B, C)
        kl = kl * torch.exp(logps - old)  # (B, C) use_bias_correction_kl: times coef_1, before delta
        per_token_loss = per_token_loss + beta * kl
    masked = per_token_loss * mask  # (B, C)
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return masked.sum() / (len(seqs) * MAX_LEN)
    if loss_type == "dapo":
        return masked.sum() / mask.sum()
    mb_means = [masked[mb].sum() / mask[mb].sum().clamp(min=1.0) for mb in microbatches]
    return sum(mb_means) / len(microbatches)  # bnpo


@pytest.fixture(scope="module")
def seqs(lora_model):
    return make_groups(lora_model)


def lora_grads(model):
    return [p.grad.clone() for p in trainer_state.lora_parameters(model)]


def test_logprobs_equal_the_plain_forward(lora_model, seqs):
    """plain_logprobs_fast gives trainer.plain_logprobs' log-probs, whatever the prompts share: a
    common prefix, none, one prompt inside another."""
    # a common prefix (seqs), none (prompts that differ from their first token), one prompt inside another
    unshared = make_groups(lora_model, seed=1, prefix=0)
    nested = [dict(s, prompt_ids=seqs[G]["prompt_ids"][:PREFIX + 1]) if s["group"] == 0 else s for s in seqs]
    adv, every = torch.zeros(len(seqs)), list(range(len(seqs)))
    cases = [(seqs, every, PREFIX), (unshared, every, 0),
             (nested, list(range(2 * G)), PREFIX),  # group 0's prompt is the start of group 1's: capped
             (seqs, [7], PREFIX + PROMPT_LENGTHS[1] - 1),  # one prompt: all of it but its last token
             *[(seqs, idx, None) for idx in shared_prompt.make_microbatches(seqs, BUDGET) + [[5, 0, 17, 6]]]]  # any rows
    with torch.no_grad():
        for data, idx, prefix in cases:
            mb = shared_prompt.collate(data, idx, "cpu")
            assert prefix is None or mb["prefix_ids"].shape[1] == prefix
            got = shared_prompt.plain_logprobs_fast(lora_model, data, idx, grpo_loss.token_logprobs, T)  # (n, C)
            want = trainer.plain_logprobs(lora_model, data, idx, T)  # (n, C)
            torch.testing.assert_close(got * mb["mask"], want * mb["mask"], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("beta,delta,mask_truncated", [(0.0, None, False), (0.04, 1.5, False),
                                                        (0.0, None, True), (0.04, 1.5, True)])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_and_lora_gradients_equal_trl_on_the_plain_forward(lora_model, seqs, loss_type, beta, delta,
                                                               mask_truncated):
    model = lora_model
    assert 0 < sum(s["truncated"] for s in seqs) < len(seqs), "completions with and without EOS"

    rewards = torch.tensor([s["reward"] for s in seqs])  # (B,)
    advantages = grpo_loss.group_advantages(rewards, G)  # (B,)
    assert torch.all(advantages[EQUAL_GROUP * G:(EQUAL_GROUP + 1) * G] == 0)
    mbs = shared_prompt.make_microbatches(seqs, BUDGET)
    assert len(mbs) >= 3, "the test needs several micro-batches"
    assert max(len(m) for m in mbs) > G, "a micro-batch must hold prompts of different lengths"
    together = next(m for m in mbs if EQUAL_GROUP * G in m)
    assert len(together) > G, "the equal-reward group must share a micro-batch (bnpo counts its tokens)"

    model.zero_grad(set_to_none=True)
    stats = trainer.compute_loss_and_backward(model, seqs, advantages, mbs, loss_type=loss_type, epsilon=EPS,
                                              epsilon_high=EPS_HIGH, beta=beta, max_completion_length=MAX_LEN,
                                              temperature=T, delta=delta, version=2,
                                              mask_truncated_completions=mask_truncated)
    got = lora_grads(model)
    assert stats["finite"] and stats["groups_forwarded"] == len(PROMPT_LENGTHS) - (beta == 0)

    model.zero_grad(set_to_none=True)
    everything = list(range(len(seqs)))
    ref = None
    if beta:
        with torch.no_grad(), model.disable_adapter():
            ref = trainer.plain_logprobs(model, seqs, everything, T)  # (B, C)
    want_loss = trl_loss(trainer.plain_logprobs(model, seqs, everything, T), seqs, advantages, loss_type, mbs, ref, beta,
                         delta, mask_truncated)
    want_loss.backward()
    want = lora_grads(model)

    assert stats["loss"] == pytest.approx(want_loss.item(), rel=1e-5, abs=1e-7)
    assert stats["clip_low_frac"] + stats["clip_high_frac"] > 0, "no clipping: the test is too easy"
    assert sum(g.abs().sum() for g in want) > 0
    if delta is not None:
        assert stats["ratio_max"] > delta, "no ratio above delta: delta is not tested"
    for a, b in zip(got, want):  # fp32: entries near 0 get an absolute tolerance on the tensor's scale
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())


def test_asynchrony_stats_overall_and_by_staleness(lora_model, seqs):
    model = lora_model
    advantages = grpo_loss.group_advantages(torch.tensor([s["reward"] for s in seqs]), G)  # (B,)
    model.zero_grad(set_to_none=True)
    stats = trainer.compute_loss_and_backward(model, seqs, advantages, shared_prompt.make_microbatches(seqs, BUDGET),
                                              epsilon=EPS, epsilon_high=EPS_HIGH, temperature=T, version=3)
    with torch.no_grad():
        lp = trainer.plain_logprobs(model, seqs, list(range(len(seqs))), T)  # (B, C)
    old, mask = padded(seqs, "logprobs"), (padded(seqs, "ids") != 0).float()  # (B, C)
    log_r = (lp - old) * mask  # (B, C)
    r = log_r.exp()  # (B, C)
    k3 = ((r - 1) - log_r) * mask  # (B, C)  CleanRL's approx_kl per token
    outside = ((r < 1 - EPS) | (r > 1 + EPS_HIGH)).float() * mask  # (B, C)
    used = torch.tensor([s["group"] != EQUAL_GROUP for s in seqs])  # (B,) the equal-reward group is not forwarded
    stale = torch.tensor([3 - s["policy_version"] for s in seqs])  # (B,)
    assert set(stats["by_staleness"]) == {"1", "2", "3"}
    for key, sel in [(None, used)] + [(str(s), used & (stale == s)) for s in (1, 2, 3)]:
        got = stats if key is None else stats["by_staleness"][key]
        n = mask[sel].sum()
        assert got["approx_kl"] == pytest.approx((k3[sel].sum() / n).item(), rel=1e-4)
        assert got["clip_frac"] == pytest.approx((outside[sel].sum() / n).item(), abs=1e-6)
        if key is not None:
            assert got["tokens"] == int(n)
    assert stats["approx_kl"] > 0 and 0 < stats["clip_frac"] < 1
    assert stats["ratio_max"] == pytest.approx((r * mask)[used].max().item(), rel=1e-4)


def test_poisoned_sampler_logprobs_never_reach_the_weights_unseen(lora_model, seqs):
    """An extreme sampler log-prob gives a finite gradient (the log-ratio is bounded); a NaN one
    makes the step say it is not finite, so the trainer skips optimizer.step()."""
    model = lora_model
    advantages = grpo_loss.group_advantages(torch.tensor([s["reward"] for s in seqs]), G)  # (B,)
    mbs = shared_prompt.make_microbatches(seqs, BUDGET)
    row = int(torch.nonzero(advantages < 0)[0])  # a negative-advantage completion: -r * A grows with r
    for value, finite in [(-1e29, True), (float("nan"), False)]:
        poisoned = [dict(s) for s in seqs]
        poisoned[row] = dict(seqs[row], logprobs=[value] + seqs[row]["logprobs"][1:])
        model.zero_grad(set_to_none=True)
        stats = trainer.compute_loss_and_backward(model, poisoned, advantages, mbs, temperature=T, version=2)
        assert stats["finite"] is finite
        if finite:
            assert grpo_loss.all_finite(p.grad for p in trainer_state.lora_parameters(model))
            assert stats["ratio_max"] == pytest.approx(torch.exp(torch.tensor(grpo_loss.LOG_RATIO_MAX)).item())


def test_microbatches_hold_whole_groups_and_count_each_prompt_once(seqs):
    for budget in (1, 60, 90, 200, 10**6):
        mbs = shared_prompt.make_microbatches(seqs, budget)
        assert sorted(i for m in mbs for i in m) == list(range(len(seqs)))
        for m in mbs:
            groups = shared_prompt.by_group(seqs, m)
            assert all(len(g) == G for g in groups), "a group was split across micro-batches"
            cost = (len(groups) * max(len(seqs[i]["prompt_ids"]) for i in m)
                    + len(m) * max(len(seqs[i]["ids"]) for i in m))
            assert cost <= budget or len(groups) == 1
    assert len(shared_prompt.make_microbatches(seqs, 10**6)) == 1
    assert len(shared_prompt.make_microbatches(seqs, 1)) == len(PROMPT_LENGTHS)


def test_a_step_of_equal_reward_groups_forwards_nothing(lora_model, seqs):
    equal = [dict(s, reward=1.0) for s in seqs]
    advantages = grpo_loss.group_advantages(torch.tensor([s["reward"] for s in equal]), G)  # (B,) all 0
    lora_model.zero_grad(set_to_none=True)
    stats = trainer.compute_loss_and_backward(lora_model, equal, advantages, shared_prompt.make_microbatches(equal, BUDGET))
    assert stats["groups_forwarded"] == 0 and stats["loss"] == 0.0 and stats["finite"]
    assert stats["ratio_mean"] is None and stats["ratio_max"] is None and stats["by_staleness"] == {}
    assert all(p.grad is None for p in trainer_state.lora_parameters(lora_model))
