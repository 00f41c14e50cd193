"""grpo_loss.py against numbers worked out by hand.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_grpo_loss.py -q

The loss example: 2 groups of 2 completions, 3 token positions, epsilon = 0.2 (clip to [0.8, 1.2]).

    row  A     ratio per token     mask     -min(r*A, clip(r)*A)        why
    0   +1.0   1.0  1.5  0.5       1 1 1    -1.0  -1.2  -0.5           t1 clipped high (no gradient)
    1   -1.0   0.5  1.5  (9.9)     1 1 0    +0.8  +1.5   -             t0 clipped low (no gradient)
    2   +0.5   1.1  (..) (..)      1 0 0    -0.55  -     -
    3   -0.5   1.0  0.9  1.3       1 1 1    +0.5  +0.45 +0.65          t2: r > 1.2 but A < 0: unclipped

    per-row sums: -2.7, 2.3, -0.55, 1.6 -> total 0.65 over 9 tokens; per-row means -0.9, 1.15,
    -0.55, 0.5333...
    grpo    = (-0.9 + 1.15 - 0.55 + 1.6/3) / 4 = 0.058333...
    bnpo    = 0.65 / 9 = 0.072222...
    dr_grpo = 0.65 / (4 rows * max_completion_length 3) = 0.0541666...
    dapo    = 0.65 / 9 (num_tokens defaults to the mask sum), = 0.65 / 13 = 0.05 with num_tokens=13
    d loss / d logprob = -A * r on unclipped tokens (d r / d logprob = r), 0 where clipped or
    masked, times the same normaliser.
"""

import math

import pytest
import torch

from grpo_loss import (LOG_RATIO_MAX, all_finite, group_advantages, microbatch_weight, offpolicy_stats, policy_loss,
                       token_logprobs)

A = torch.tensor([1.0, -1.0, 0.5, -0.5])  # (B,)
RATIO = torch.tensor([[1.0, 1.5, 0.5], [0.5, 1.5, 9.9], [1.1, 7.0, 7.0], [1.0, 0.9, 1.3]])  # (B, T)
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])  # (B, T)
# d(-min(r*A, clip(r)*A)) / d logprob, by hand: -A*r where unclipped, 0 where clipped or masked.
UNNORMALISED_GRAD = torch.tensor([[-1.0, 0.0, -0.5], [0.0, 1.5, 0.0], [-0.55, 0.0, 0.0], [0.5, 0.45, 0.65]])
ROW_TOKENS = torch.tensor([3.0, 2.0, 1.0, 3.0])
EXPECTED = {  # loss_type -> (loss, the normaliser each token's gradient is divided by)
    "grpo": ((-0.9 + 1.15 - 0.55 + 1.6 / 3) / 4, (4 * ROW_TOKENS).unsqueeze(1)),
    "bnpo": (0.65 / 9, 9.0),
    "dr_grpo": (0.65 / 12, 12.0),
    "dapo": (0.65 / 9, 9.0),
}


def example():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -2.0], [-0.7, -1.0, -4.0], [-2.5, -0.2, -1.1]])  # (B, T)
    logprobs = (old + RATIO.log()).requires_grad_()  # (B, T)
    return logprobs, old


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_types_match_hand_computed_values_and_gradients(loss_type):
    logprobs, old = example()
    loss, stats = policy_loss(logprobs, old, A, MASK, epsilon=0.2, loss_type=loss_type, max_completion_length=3)
    want_loss, norm = EXPECTED[loss_type]
    assert loss.item() == pytest.approx(want_loss, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, UNNORMALISED_GRAD / norm, atol=1e-6, rtol=1e-5)
    assert stats["ratio_mean"] == pytest.approx(9.3 / 9, abs=1e-6)  # (1+1.5+.5+.5+1.5+1.1+1+.9+1.3) / 9
    assert stats["clip_low_frac"] == pytest.approx(1 / 9)  # row 1, t0
    assert stats["clip_high_frac"] == pytest.approx(1 / 9)  # row 0, t1
    assert "kl" not in stats
    assert all(type(v) is float for v in stats.values())


def test_dapo_divides_by_the_whole_batch_token_count():
    logprobs, old = example()
    loss, _ = policy_loss(logprobs, old, A, MASK, loss_type="dapo", num_tokens=13)
    assert loss.item() == pytest.approx(0.05, abs=1e-7)


def test_clipping_stops_gradient_exactly_where_it_should():
    # One token each side of each clip edge, for A > 0 and A < 0; epsilon 0.2, epsilon_high 0.28.
    ratio = torch.tensor([[0.7, 0.9, 1.1, 1.25, 1.3]])  # (1, 5)
    for adv, clipped in [(1.0, [False, False, False, False, True]),  # A > 0: only r > 1.28 clipped
                         (-1.0, [True, False, False, False, False])]:  # A < 0: only r < 0.8 clipped
        old = torch.zeros(1, 5)  # (1, 5)
        logprobs = ratio.log().requires_grad_()  # (1, 5)
        loss, stats = policy_loss(logprobs, old, torch.tensor([adv]), torch.ones(1, 5), epsilon=0.2,
                                  epsilon_high=0.28, loss_type="bnpo")
        loss.backward()
        want = torch.where(torch.tensor(clipped), 0.0, -adv * ratio / 5)  # (1, 5)
        torch.testing.assert_close(logprobs.grad, want)
        assert stats["clip_high_frac" if adv > 0 else "clip_low_frac"] == pytest.approx(0.2)
        assert stats["clip_low_frac" if adv > 0 else "clip_high_frac"] == 0.0


def test_masked_positions_get_no_gradient_even_with_garbage():
    logprobs, old = example()
    old = old.clone()
    old[MASK == 0] = float("-inf")  # padding holding -inf would make exp(logp - old) = inf
    ref = logprobs.detach().clone()  # (B, T) equal to the policy: its KL gradient is 0 ...
    ref[MASK == 0] = float("nan")  # ... except on padding, which holds NaN
    loss, stats = policy_loss(logprobs, old, A, MASK, loss_type="dapo", ref_logprobs=ref, beta=0.1)
    loss.backward()
    assert loss.item() == pytest.approx(0.65 / 9, abs=1e-6)
    assert all(math.isfinite(v) for v in stats.values())
    assert torch.all(logprobs.grad[MASK == 0] == 0)
    torch.testing.assert_close(logprobs.grad, UNNORMALISED_GRAD / 9, atol=1e-6, rtol=1e-5)


KL_D = torch.tensor([[math.log(2.0), 0.0, 0.0], [0.0, -math.log(2.0), 5.0], [0.0, 5.0, 5.0],
                     [0.0, 0.0, math.log(2.0)]])  # (B, T) ref - logp; the 5.0 entries are masked


@pytest.mark.parametrize("use_bias_correction_kl", [True, False])
def test_k3_kl_term_with_beta(use_bias_correction_kl):
    logprobs, old = example()
    ln2 = math.log(2.0)
    ref = logprobs.detach() + KL_D  # (B, T); the 5.0 entries are masked and must not count
    loss, stats = policy_loss(logprobs, old, A, MASK, loss_type="dapo", ref_logprobs=ref, beta=0.1,
                              use_bias_correction_kl=use_bias_correction_kl)
    # k3 = e^d - d - 1: d = ln 2 -> 1 - ln 2 = 0.306853; d = -ln 2 -> ln 2 - 0.5 = 0.193147
    # TRL 1.16 (use_bias_correction_kl=True): each times its token's ratio, 1.0, 1.5 and 1.3
    if use_bias_correction_kl:
        kl_sum = 1.0 * (1 - ln2) + 1.5 * (ln2 - 0.5) + 1.3 * (1 - ln2)  # 0.995463
    else:
        kl_sum = 2 * (1 - ln2) + (ln2 - 0.5)  # 0.806853
    assert stats["kl"] == pytest.approx(kl_sum / 9, abs=1e-6)  # TRL logs the corrected term too
    assert loss.item() == pytest.approx((0.65 + 0.1 * kl_sum) / 9, abs=1e-6)


@pytest.mark.parametrize("use_bias_correction_kl", [True, False])
def test_kl_gradient_with_and_without_the_bias_correction(use_bias_correction_kl):
    # Advantages 0: only the KL term has a gradient. d = ref - logp, r = e^(logp - old):
    #   d(k3)/d logp = 1 - e^d;   d(r * k3)/d logp = r * k3 + r * (1 - e^d) = -r * d
    # so the correction changes the gradient even where r = 1 (row 0, t0: -ln 2 instead of -1).
    logprobs, old = example()
    ref = logprobs.detach() + KL_D  # (B, T)
    loss, _ = policy_loss(logprobs, old, torch.zeros(4), MASK, loss_type="dapo", ref_logprobs=ref,
                          beta=0.1, use_bias_correction_kl=use_bias_correction_kl)
    loss.backward()
    per_token = -RATIO * KL_D if use_bias_correction_kl else 1 - KL_D.exp()  # (B, T)
    torch.testing.assert_close(logprobs.grad, 0.1 * per_token * MASK / 9, atol=1e-6, rtol=1e-5)
    at_ratio_1 = -math.log(2) if use_bias_correction_kl else -1.0
    assert logprobs.grad[0, 0].item() == pytest.approx(0.1 * at_ratio_1 / 9)


def test_policy_loss_rejects_bad_arguments():
    logprobs, old = example()
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logprobs, old, A, MASK, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(logprobs, old, A, MASK, loss_type="ppo")
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old, A, MASK, beta=0.04)


# Rewards: group 1 = (3, 0, 0): mean 1, deviations (2, -1, -1), Bessel std sqrt(6/2) = sqrt(3);
#          group 2 = (1, 2, 3): mean 2, deviations (-1, 0, 1), std 1.
# Batch std of (3, 0, 0, 1, 2, 3): mean 1.5, squared deviations sum 9.5, std sqrt(9.5 / 5).
REWARDS = torch.tensor([3.0, 0.0, 0.0, 1.0, 2.0, 3.0])
DEVIATIONS = [2.0, -1.0, -1.0, -1.0, 0.0, 1.0]
S3, SB = math.sqrt(3.0) + 1e-4, math.sqrt(9.5 / 5) + 1e-4


@pytest.mark.parametrize("mode,want", [
    ("group", [2 / S3, -1 / S3, -1 / S3, -1 / 1.0001, 0.0, 1 / 1.0001]),
    ("batch", [x / SB for x in DEVIATIONS]),
    ("none", DEVIATIONS),
])
def test_group_advantages_by_hand(mode, want):
    got = group_advantages(REWARDS, 3, scale_rewards=mode)  # (6,)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
def test_zero_variance_groups_give_zero_advantage(mode):
    got = group_advantages(torch.tensor([5.0, 5.0, 5.0, 1.0, 0.0, 0.0]), 3, scale_rewards=mode)  # (6,)
    assert torch.all(got[:3] == 0)
    assert got[3] > 0 and got[4] < 0
    assert torch.all(group_advantages(torch.ones(4), 2, mode) == 0)


def test_group_advantages_rejects_bad_layout():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.zeros(4), 2, "std")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_equals_log_softmax_gather(dtype):
    torch.manual_seed(0)
    logits = (3 * torch.randn(5, 4, 11)).to(dtype).requires_grad_()  # (B, T, V)
    ids = torch.randint(0, 11, (5, 4))  # (B, T)
    want = logits.float().div(0.7).log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (B, T)
    got = token_logprobs(logits, ids, temperature=0.7, chunk_rows=2)  # (B, T), 3 chunks
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    weights = torch.randn(5, 4)  # (B, T)
    g_got, = torch.autograd.grad((got * weights).sum(), logits)
    g_want, = torch.autograd.grad((want * weights).sum(), logits)
    torch.testing.assert_close(g_got, g_want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(logits, ids, temperature=0.7), want.detach())


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_microbatches_weighted_sum_equals_trl_loss(loss_type):
    """grpo, dr_grpo, dapo: the weighted sum over micro-batches is the whole batch's loss. bnpo: it
    is TRL's, the mean over the micro-batches of each one's token mean (not the whole batch's)."""
    torch.manual_seed(1)
    B, T = 6, 4
    theta = torch.randn(B, T, 5, requires_grad=True)  # (B, T, V) parameters the log-probs come from
    ids = torch.randint(0, 5, (B, T))  # (B, T)
    old = token_logprobs(theta.detach(), ids) + 0.3 * torch.randn(B, T)  # (B, T) stale behaviour
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), 2)  # (B,)
    lengths = torch.tensor([4, 1, 2, 4, 3, 1])  # very uneven micro-batches in tokens
    mask = (torch.arange(T) < lengths.unsqueeze(1)).float()  # (B, T)
    kw = dict(loss_type=loss_type, max_completion_length=T, epsilon_high=0.28)
    total_tokens = mask.sum()
    splits = (slice(0, 1), slice(1, 4), slice(4, 6))  # 1, 3 and 2 sequences; 4, 7 and 4 tokens

    if loss_type == "bnpo":  # TRL: each micro-batch (l * m).sum() / m.sum(), / gradient_accumulation_steps
        want = sum(policy_loss(token_logprobs(theta[mb], ids[mb]), old[mb], adv[mb], mask[mb], **kw)[0]
                   for mb in splits) / 3
        full, _ = policy_loss(token_logprobs(theta, ids), old, adv, mask, **kw)
        assert abs(want.item() - full.item()) > 1e-3, "bnpo should differ from the whole-batch token mean here"
    else:
        want, _ = policy_loss(token_logprobs(theta, ids), old, adv, mask, **kw)
    g_want, = torch.autograd.grad(want, theta)

    def split_loss(weight_of):
        total = 0.0
        for mb in splits:
            loss, _ = policy_loss(token_logprobs(theta[mb], ids[mb]), old[mb], adv[mb], mask[mb],
                                  num_tokens=total_tokens if loss_type == "dapo" else None, **kw)
            total = total + weight_of(mask[mb]) * loss
        return total

    summed = split_loss(lambda m: microbatch_weight(loss_type, m, B, len(splits)))
    g_summed, = torch.autograd.grad(summed, theta)
    assert summed.item() == pytest.approx(want.item(), abs=1e-6)
    torch.testing.assert_close(g_summed, g_want, atol=1e-6, rtol=1e-5)
    if loss_type in ("grpo", "dr_grpo"):  # the test can fail: averaging over micro-batches (1/3 each) is wrong here
        naive = split_loss(lambda m: 1 / 3)
        assert abs(naive.item() - want.item()) > 1e-3


def test_bnpo_num_tokens_counts_rows_left_out_of_the_forward():
    logprobs, old = example()
    loss, _ = policy_loss(logprobs, old, A, MASK, loss_type="bnpo", num_tokens=13)  # 4 more tokens, advantage 0
    assert loss.item() == pytest.approx(0.05, abs=1e-7)


def test_delta_caps_the_ratio_of_negative_advantages():
    # delta 1.5, clip [0.8, 1.28]. A < 0: r = 2.0 -> loss 1.5 (capped, no gradient); r = 1.3 -> 1.3,
    # gradient -A * r = 1.3. A > 0: r = 2.0 -> clipped at 1.28 as without delta.
    ratio = torch.tensor([[2.0, 1.3], [2.0, 1.0]])  # (2, 2)
    adv = torch.tensor([-1.0, 1.0])  # (2,)
    logprobs = ratio.log().requires_grad_()  # (2, 2)
    loss, stats = policy_loss(logprobs, torch.zeros(2, 2), adv, torch.ones(2, 2), epsilon_high=0.28,
                              loss_type="bnpo", delta=1.5)
    assert loss.item() == pytest.approx((1.5 + 1.3 - 1.28 - 1.0) / 4, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 1.3], [0.0, -1.0]]) / 4)
    assert stats["ratio_mean"] == pytest.approx(6.3 / 4)  # the ratio before delta caps it
    without, _ = policy_loss(ratio.log(), torch.zeros(2, 2), adv, torch.ones(2, 2), epsilon_high=0.28,
                             loss_type="bnpo")
    assert without.item() == pytest.approx((2.0 + 1.3 - 1.28 - 1.0) / 4, abs=1e-6)
    with pytest.raises(ValueError, match="delta must be >= 1 \\+ epsilon_high"):
        policy_loss(logprobs, torch.zeros(2, 2), adv, torch.ones(2, 2), epsilon_high=0.28, delta=1.2)


def test_extreme_sampler_logprob_gives_finite_loss_and_gradient():
    # One token with a sampler log-prob of -1e29: exp(logp - old) would be inf, and its gradient NaN
    # (inf * 0 in the clipped branch). The log-ratio is held at LOG_RATIO_MAX: no gradient there.
    for adv, want_token_loss in [(1.0, -1.2), (-1.0, math.exp(LOG_RATIO_MAX))]:
        logprobs = torch.full((1, 3), -1.0, requires_grad=True)  # (1, 3)
        old = torch.tensor([[-1e29, -1.0, -1.0]])  # (1, 3) ratios: huge, 1, 1
        loss, stats = policy_loss(logprobs, old, torch.tensor([adv]), torch.ones(1, 3), loss_type="bnpo")
        loss.backward()
        assert math.isfinite(loss.item()) and all_finite([logprobs.grad])
        assert loss.item() == pytest.approx((want_token_loss - 2 * adv) / 3, rel=1e-5)
        torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -adv / 3, -adv / 3]]))


def test_offpolicy_stats_by_hand():
    # Row 0: ratios 1, 2, 0.5 -> k3 = (r - 1) - log r: 0, 1 - ln 2, ln 2 - 0.5; outside [0.8, 1.2]: 2.
    # Row 1: ratio 1.1 on its one token; the padding (9.9) does not count.
    ln2 = math.log(2.0)
    old = torch.zeros(2, 3)  # (2, 3)
    logprobs = torch.tensor([[0.0, ln2, -ln2], [math.log(1.1), 5.0, 5.0]])  # (2, 3)
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])  # (2, 3)
    got = offpolicy_stats(logprobs, old, mask, epsilon=0.2)
    torch.testing.assert_close(got["tokens"], torch.tensor([3.0, 1.0]))
    torch.testing.assert_close(got["approx_kl"], torch.tensor([0.5, 0.1 - math.log(1.1)]))  # 1 - ln2 + ln2 - 0.5
    torch.testing.assert_close(got["clipped"], torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(got["ratio_max"], torch.tensor([2.0, 1.1]))


def test_all_finite():
    assert all_finite([torch.ones(3), None, torch.zeros(2, 2)]) and all_finite([])
    assert not all_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert not all_finite([torch.tensor([float("-inf")])])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: a CPU-only torch has one device")
def test_all_finite_mixes_devices():
    """The trainer checks a CPU loss with CUDA gradients: each device's flags are reduced on it."""
    assert all_finite([torch.tensor(1.0), torch.ones(3, device="cuda"), torch.zeros(2)])
    assert not all_finite([torch.tensor(1.0), torch.tensor([float("nan")], device="cuda")])
