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

Below them, --old-logprobs learner (TRL's GRPOTrainer with vLLM): TRL 1.16's lines written out
(trl_importance_sampling_ratio, trl_get_off_policy_mask, trl_compute_loss, each line with its
number in trl/trainer/grpo_trainer.py), the weights by hand, the loss and gradient against TRL's
in every mode, and a whole trainer step on the tiny model. With trl importable (PYTHONPATH=<the
unpacked trl-1.16.0 wheel>/src), the written-out loss is also checked against TRL's own method.
"""

import math

import pytest
import torch

from grpo_loss import (IS_MODES, LOG_RATIO_MAX, LOSS_TYPES, all_finite, group_advantages,
                       importance_sampling_ratio, microbatch_weight, off_policy_mask,
                       offpolicy_stats, policy_loss, sampler_correction, token_logprobs)
from support.step_record import row_columns

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
    got = row_columns(offpolicy_stats(logprobs, old, mask), mask, epsilon=0.2)
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


# ---- Where the sampler's log-probs enter: TRL 1.16's GRPOTrainer with vLLM, written out.
# Each reference line is copied from trl==1.16.0's trl/trainer/grpo_trainer.py (the line number
# beside it), self.* replaced by an argument. trainer.py --old-logprobs learner must equal it.

def trl_importance_sampling_ratio(old_per_token_logps, sampling_per_token_logps, mask, mode,
                                  clip_min, clip_max):
    """grpo_trainer.py 2660-2705 (_generate_and_score_completions)."""
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask  # 2662
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)  # 2665
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]  # 2667
    if sequence_level_is:
        per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)  # 2669
        logps_diff = per_sequence_logps_diff
    else:
        logps_diff = per_token_logps_diff
    vllm_importance_sampling_ratio = torch.exp(logps_diff)  # 2674
    if mode in ["sequence_truncate", "token_truncate"]:  # 2680
        vllm_importance_sampling_ratio = torch.clamp(vllm_importance_sampling_ratio,
                                                     min=clip_min, max=clip_max)  # 2681-2685
    else:  # sequence_mask, token_mask
        min_val = clip_min if clip_min is not None else -math.inf  # 2687-2691
        max_val = clip_max if clip_max is not None else math.inf  # 2692-2696
        invalid_mis_mask = ((vllm_importance_sampling_ratio < min_val)
                            | (vllm_importance_sampling_ratio > max_val))  # 2698-2700
        vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(
            invalid_mis_mask, value=0.0)  # 2701-2703
    return vllm_importance_sampling_ratio


def trl_get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                            off_policy_threshold):
    """grpo_trainer.py 2945-2968 (a static method)."""
    kl_div = sampling_per_token_logps - per_token_logps.detach()  # 2957
    kl_div = torch.nan_to_num(kl_div, nan=0.0)  # 2961
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)  # 2963
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # 2964
    is_pos_adv = advantages >= 0  # 2966
    is_low_kl = avg_seq_kl <= off_policy_threshold  # 2967
    return (is_pos_adv | is_low_kl).to(dtype=mask.dtype)  # 2968


def trl_compute_loss(per_token_logps, old_per_token_logps, sampling_per_token_logps, advantages,
                     mask, importance_sampling_ratio, loss_type, epsilon_low=0.2,
                     epsilon_high=0.28, delta=None, beta=0.0, ref_per_token_logps=None,
                     off_policy_mask_threshold=None, max_completion_length=None):
    """grpo_trainer.py 3031-3173 (_compute_loss) for TRL's defaults importance_sampling_level
    "token", use_bias_correction_kl=True, top_entropy_quantile=1.0, one process, no gradient
    accumulation; vLLM on with vllm_importance_sampling_correction (None: off)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # 3061
    if off_policy_mask_threshold is not None:
        off_policy_mask = trl_get_off_policy_mask(advantages, per_token_logps,
                                                  sampling_per_token_logps, mask,
                                                  off_policy_mask_threshold)  # 3075-3081
    log_ratio = per_token_logps - old_per_token_logps  # 3083
    log_importance_weights = log_ratio  # 3085
    coef_1 = torch.exp(log_importance_weights)  # 3095
    if beta != 0.0:
        per_token_kl = (torch.exp(ref_per_token_logps - per_token_logps)
                        - (ref_per_token_logps - per_token_logps) - 1)  # 3100-3102
        per_token_kl = per_token_kl * coef_1  # 3105: use_bias_correction_kl
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)  # 3113
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)  # 3116
    per_token_loss1 = coef_1 * advantages  # 3118
    per_token_loss2 = coef_2 * advantages  # 3119
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)  # 3120
    if off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask  # 3141
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio  # 3147
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl  # 3150
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()  # 3154
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)  # 3159
    if loss_type == "dr_grpo":  # 3164
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    normalizer = mask.sum().clamp(min=1.0)  # 3170: num_items_in_batch, one process
    return (per_token_loss * mask).sum() / normalizer  # 3173


# The importance weights by hand. d = learner - sampler log-prob per token:
#   row 0: d = ln 4, 0, -ln 2      token ratios 4, 1, 0.5   sequence: e^(ln 2) = 2
#   row 1: d = ln 2, ln 2, (pad)   token ratios 2, 2        sequence: e^(ln 4) = 4
# with clip_min 0.6 and clip_max 3 (TRL's default max):
IS_D = torch.tensor([[math.log(4.0), 0.0, -math.log(2.0)], [math.log(2.0), math.log(2.0), 9.0]])
IS_MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
IS_BY_HAND = {  # mode -> (weights with clip_min 0.6, weights with clip_min None); padding: any
    "token_truncate": ([[3.0, 1.0, 0.6], [2.0, 2.0]], [[3.0, 1.0, 0.5], [2.0, 2.0]]),
    "token_mask": ([[0.0, 1.0, 0.0], [2.0, 2.0]], [[0.0, 1.0, 0.5], [2.0, 2.0]]),
    "sequence_truncate": ([[2.0], [3.0]], [[2.0], [3.0]]),
    "sequence_mask": ([[2.0], [0.0]], [[2.0], [0.0]]),
}


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("clip_min", [0.6, None])
def test_importance_sampling_ratio_by_hand_in_each_mode(mode, clip_min):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.1]])  # (2, 3) the learner's
    sampling = old - IS_D  # (2, 3) the sampler's: bigger and smaller than the learner's
    ratio, outside = importance_sampling_ratio(old, sampling, IS_MASK, mode, 3.0, clip_min)
    want = IS_BY_HAND[mode][clip_min is None]
    for r in range(2):
        got = ratio[r, :3 - r] if mode.startswith("token") else ratio[r]
        torch.testing.assert_close(got, torch.tensor(want[r]), atol=1e-6, rtol=1e-6)
    if mode.startswith("token"):  # 4 > 3 above; 0.5 < 0.6 below
        assert outside[IS_MASK.bool()].tolist() == [True, False, clip_min is not None, False, False]
    else:  # 4 > 3: the second sequence
        assert outside.squeeze(1).tolist() == [False, True]
    torch.testing.assert_close(  # TRL's lines give the same, padding excepted
        ratio * (IS_MASK if mode.startswith("token") else 1),
        trl_importance_sampling_ratio(old, sampling, IS_MASK, mode, clip_min, 3.0)
        * (IS_MASK if mode.startswith("token") else 1))


def test_off_policy_mask_by_hand():
    # mean(sampler - learner) per row: 0.5, 0.05, 0.5, 0.05; threshold 0.1
    # advantages -1, -1, +1, 0: row 0 only is dropped (negative advantage and far from the sampler)
    logprobs = torch.zeros(4, 2)  # (4, 2)
    sampling = torch.tensor([[0.4, 0.6], [0.1, 0.0], [0.5, 0.5], [0.1, 7.0]])  # (4, 2) pad 7.0
    mask = torch.tensor([[1.0, 1], [1, 1], [1, 1], [1, 0]])
    adv = torch.tensor([-1.0, -1.0, 1.0, 0.0])
    got = off_policy_mask(adv, logprobs, sampling, mask, 0.1)  # (4, 1)
    torch.testing.assert_close(got, torch.tensor([[0.0], [1.0], [1.0], [1.0]]))
    torch.testing.assert_close(got, trl_get_off_policy_mask(adv.unsqueeze(1), logprobs, sampling,
                                                            mask, 0.1))


def test_learner_gradient_by_hand_the_weight_times_the_on_policy_gradient():
    # --old-logprobs learner: old = logps.detach(), so the ratio is 1 and nothing is clipped; each
    # token's gradient is -A * w / N with w its weight (token_truncate, clip [0.6, 3]: IS_BY_HAND).
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.1]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    w = sampler_correction(logprobs, logprobs.detach() - IS_D, adv, IS_MASK, "learner",
                           vllm_importance_sampling_mode="token_truncate",
                           vllm_importance_sampling_clip_min=0.6)
    assert torch.equal(w["old_logprobs"], logprobs.detach()) and w["off_policy_mask"] is None
    loss, stats = policy_loss(logprobs, advantages=adv, mask=IS_MASK, loss_type="dapo", **w)
    loss.backward()
    weight = torch.tensor([[3.0, 1.0, 0.6], [2.0, 2.0, 0.0]])  # (2, 3) 0: padding
    torch.testing.assert_close(logprobs.grad, -adv.unsqueeze(1) * weight * IS_MASK / 5)
    assert loss.item() == pytest.approx((-(3 + 1 + 0.6) + 2 * (2 + 2)) / 5)
    assert stats["ratio_mean"] == 1.0 and stats["clip_low_frac"] == stats["clip_high_frac"] == 0


def test_sampler_mode_is_the_ratio_against_the_sampler_and_no_weight():
    logprobs, old = example()
    w = sampler_correction(logprobs, old, A, MASK)  # the default: "sampler"
    assert w == {"old_logprobs": old, "importance_sampling_ratio": None, "off_policy_mask": None}
    loss, _ = policy_loss(logprobs, advantages=A, mask=MASK, loss_type="bnpo", **w)
    assert loss.item() == pytest.approx(EXPECTED["bnpo"][0], abs=1e-6)  # the table at the top
    with pytest.raises(ValueError, match="old_logprobs must be one of"):
        sampler_correction(logprobs, old, A, MASK, "behaviour")
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of"):
        importance_sampling_ratio(old, old, MASK, "token")


def mismatch_batch(seed=0):
    """6 completions (2 groups of 3), up to 5 tokens, from parameters theta; the sampler's
    log-probs are the learner's -2 .. +2 nats off, so that weights pass both clip bounds, per
    token and per sequence."""
    torch.manual_seed(seed)
    B, T, V = 6, 5, 7
    theta = torch.randn(B, T, V, requires_grad=True)  # (B, T, V)
    ids = torch.randint(0, V, (B, T))  # (B, T)
    lengths = torch.tensor([5, 2, 4, 1, 5, 3])
    mask = (torch.arange(T) < lengths.unsqueeze(1)).float()  # (B, T)
    noise = torch.tensor([[1.5, -0.2, 0.1, 0.3, -0.1], [-1.8, 0.2, 0, 0, 0],
                          [0.8, -0.1, 0.1, -0.05, 0], [2.0, 0, 0, 0, 0],
                          [-0.4, -0.5, -0.3, -0.6, -0.2], [0.1, 0.2, -0.1, 0, 0]])  # (B, T)
    sampling = token_logprobs(theta.detach(), ids) - noise  # (B, T) the sampler's
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.5]), 3)  # (B,)
    return theta, ids, mask, sampling, adv


@pytest.mark.parametrize("clip_min,threshold", [(None, None), (0.5, 0.1)])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("mode", IS_MODES)
def test_learner_mode_equals_trl_grpo_trainer(mode, loss_type, beta, clip_min, threshold):
    """The loss and its gradient of --old-logprobs learner against TRL's lines above, given the
    same sampling_per_token_logps; TRL's old log-probs from a separate no-grad forward."""
    theta, ids, mask, sampling, adv = mismatch_batch()
    ref = token_logprobs(theta.detach() * 0.9, ids)  # (B, T) another policy as the reference
    kw = dict(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, delta=2.0, beta=beta,
              max_completion_length=5)
    knobs = dict(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=3.0,
                 vllm_importance_sampling_clip_min=clip_min, off_policy_mask_threshold=threshold)

    logps = token_logprobs(theta, ids)  # (B, T) ours: one forward
    w = sampler_correction(logps, sampling, adv, mask, "learner", **knobs)
    loss, _ = policy_loss(logps, advantages=adv, mask=mask, ref_logprobs=ref, **kw, **w)
    g_ours, = torch.autograd.grad(loss, theta)

    with torch.no_grad():  # TRL: old_per_token_logps from its own forward (2644), no gradient
        old = token_logprobs(theta, ids)  # (B, T)
    is_ratio = trl_importance_sampling_ratio(old, sampling, mask, mode, clip_min, 3.0)
    per_token_logps = token_logprobs(theta, ids)  # (B, T) TRL: _compute_loss's forward
    want = trl_compute_loss(per_token_logps, old, sampling, adv, mask, is_ratio, loss_type,
                            delta=2.0, beta=beta, ref_per_token_logps=ref,
                            off_policy_mask_threshold=threshold, max_completion_length=5)
    g_want, = torch.autograd.grad(want, theta)
    assert loss.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(g_ours, g_want, rtol=1e-5, atol=1e-7)

    # the test can fail: the weights left 1 on both sides, and the mask dropped a row
    _, outside = importance_sampling_ratio(old, sampling, mask, mode, 3.0, clip_min)
    weights = is_ratio.expand_as(mask)[mask.bool()]
    assert bool(outside.any()) and (weights > 1.5).any() and (weights < 0.9).any()
    if clip_min is not None:
        assert bool(((torch.exp(torch.where(mask.bool(), old - sampling, 0.0)) < clip_min)
                     & mask.bool()).any()), "no token below clip_min"
    if threshold is not None:
        assert 0 < int((w["off_policy_mask"] == 0).sum()) < 6
    no_weight, _ = policy_loss(logps, advantages=adv, mask=mask, ref_logprobs=ref, **kw,
                               old_logprobs=logps.detach())
    assert abs(no_weight.item() - loss.item()) > 1e-4, "the weight changed nothing"


def test_offpolicy_stats_sampling_columns_by_hand():
    # IS_D's rows: |learner - sampler| = ln 4, 0, ln 2 | ln 2, ln 2; weights as IS_BY_HAND
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.1]])  # (2, 3)
    sampling = old - IS_D  # (2, 3)
    ln2 = math.log(2.0)
    for mode, is_count, is_sum, is_min, is_max, is_outside in [
            ("token_mask", [3, 2], [1.0, 4.0], [0.0, 2.0], [1.0, 2.0], [2, 0]),
            ("sequence_truncate", [1, 1], [2.0, 3.0], [2.0, 3.0], [2.0, 3.0], [0, 1])]:
        got = row_columns(offpolicy_stats(old, sampling, IS_MASK, correction={
            "vllm_importance_sampling_mode": mode, "vllm_importance_sampling_clip_min": 0.6}),
            IS_MASK, off_policy_mask=torch.tensor([[0.0], [1.0]]))
        torch.testing.assert_close(got["logp_diff"], torch.tensor([3 * ln2, 2 * ln2]))
        torch.testing.assert_close(got["logp_diff_max"], torch.tensor([2 * ln2, ln2]))
        for key, want in [("is_count", is_count), ("is_sum", is_sum), ("is_min", is_min),
                          ("is_max", is_max), ("is_outside", is_outside)]:
            torch.testing.assert_close(got[key], torch.tensor(want, dtype=torch.float), msg=key)
        torch.testing.assert_close(got["off_policy_masked"], torch.tensor([1.0, 0.0]))


# ---- trainer.compute_loss_and_backward with --old-logprobs learner, on the tiny model's LoRA

def tiny_step(model):
    """3 groups of 4 from adapter versions 2, 1, 0 (the trainer at version 2: staleness 0, 1, 2),
    prompts and completions of different lengths, one group with equal rewards; the sampler's
    log-probs are the model's own (trainer.plain_logprobs) -1.5 .. +1.5 nats off."""
    import random

    import trainer

    rng = random.Random(3)
    groups = [{"prompt_ids": [rng.randrange(4, 100) for _ in range(rng.randint(3, 9))],
               "policy_version": 2 - k, "group_id": f"g{k}", "worker": "w",
               "completions": [{"ids": [rng.randrange(4, 100) for _ in range(rng.randint(1, 7))],
                                "logprobs": [], "finish_reason": "stop",
                                "reward": 1.0 if k == 2 else float((c + k) % 2)}
                               for c in range(4)]} for k in range(3)]
    seqs = trainer.flatten_groups(groups, 16)
    with torch.no_grad():
        lp = trainer.plain_logprobs(model, seqs, list(range(len(seqs))), 0.7)  # (B, C)
    gen = torch.Generator().manual_seed(0)
    for r, s in enumerate(seqs):
        noise = (3 * torch.rand(len(s["ids"]), generator=gen) - 1.5).tolist()
        s["logprobs"] = [min(a + b, 0.0) for a, b in zip(lp[r, :len(s["ids"])].tolist(), noise)]
    return seqs


@pytest.mark.parametrize("mode,beta", [("sequence_mask", 0.0), ("token_truncate", 0.04)])
def test_learner_mode_step_one_forward_per_microbatch_and_trls_gradient(lora_model, mode, beta,
                                                                       monkeypatch):
    import trainer
    from support import shared_prompt, trainer_state

    model = lora_model
    seqs = tiny_step(model)
    advantages = group_advantages(torch.tensor([s["reward"] for s in seqs]), 4)  # (B,)
    mbs = shared_prompt.make_microbatches(seqs, 40)
    assert len(mbs) == 3
    correction = {"old_logprobs": "learner", "vllm_importance_sampling_mode": mode,
                  "vllm_importance_sampling_clip_min": 0.5}
    calls = {"model": 0, "logprobs": 0}

    def count_forward(module, args, kwargs):
        calls["model"] += 1

    def counted(*args, **kwargs):
        calls["logprobs"] += 1
        return shared_prompt.plain_logprobs_fast(*args, **kwargs)

    monkeypatch.setattr(trainer, "plain_logprobs_fast", counted)
    hook = model.register_forward_pre_hook(count_forward, with_kwargs=True)
    try:
        runs = {}
        for old_logprobs in ("sampler", "learner"):
            calls.update(model=0, logprobs=0)
            model.zero_grad(set_to_none=True)
            stats = trainer.compute_loss_and_backward(
                model, seqs, advantages, mbs, epsilon_high=0.28, beta=beta, temperature=0.7,
                delta=2.0, version=2, correction=dict(correction, old_logprobs=old_logprobs))
            runs[old_logprobs] = (dict(calls), stats)
    finally:
        hook.remove()
    (sampler_calls, _), (learner_calls, stats) = runs["sampler"], runs["learner"]
    forwarded = len(mbs) - (beta == 0)  # beta 0: the equal-reward group's micro-batch is skipped
    assert learner_calls == sampler_calls, "the learner's old log-probs cost a forward"
    assert learner_calls["logprobs"] == forwarded * (2 if beta else 1)  # beta: + the reference
    assert stats["finite"]
    got = [p.grad.clone() for p in trainer_state.lora_parameters(model)]

    # TRL: the old log-probs from a no-grad forward, the weights, _compute_loss on the whole step
    model.zero_grad(set_to_none=True)
    every = list(range(len(seqs)))
    C = max(len(s["ids"]) for s in seqs)
    mask = torch.tensor([[1.0] * len(s["ids"]) + [0.0] * (C - len(s["ids"])) for s in seqs])
    sampling = torch.tensor([s["logprobs"] + [0.0] * (C - len(s["ids"])) for s in seqs])
    with torch.no_grad():
        old = trainer.plain_logprobs(model, seqs, every, 0.7)  # (B, C)
        ref = None
        if beta:
            with model.disable_adapter():
                ref = trainer.plain_logprobs(model, seqs, every, 0.7)  # (B, C)
    is_ratio = trl_importance_sampling_ratio(old, sampling, mask, mode, 0.5, 3.0)
    want = trl_compute_loss(trainer.plain_logprobs(model, seqs, every, 0.7), old, sampling,
                            advantages, mask, is_ratio, "dapo", delta=2.0, beta=beta,
                            ref_per_token_logps=ref)
    want.backward()
    assert stats["loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    for a, b in zip(got, [p.grad for p in trainer_state.lora_parameters(model)]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())

    # the record: TRL's metrics over the forwarded completions, and by staleness
    used = torch.tensor([beta > 0 or s["reward"] != 1.0 or s["group"] != 2 for s in seqs])
    stale = torch.tensor([2 - s["policy_version"] for s in seqs])  # (B,)
    diff = ((old - sampling).abs() * mask)  # (B, C)
    _, outside = importance_sampling_ratio(old, sampling, mask, mode, 3.0, 0.5)
    per_token = mode.startswith("token")
    assert set(stats["by_staleness"]) == ({"0", "1", "2"} if beta else {"0", "1"})
    for key, sel in [(None, used)] + [(str(k), used & (stale == k)) for k in (0, 1, 2)]:
        if key is not None and key not in stats["by_staleness"]:
            continue
        rec = stats if key is None else stats["by_staleness"][key]
        n = mask[sel].sum()
        assert rec["sampling/sampling_logp_difference/mean"] == pytest.approx(
            (diff[sel].sum() / n).item(), rel=1e-4)
        assert rec["sampling/sampling_logp_difference/max"] == pytest.approx(
            diff[sel].max().item(), rel=1e-4)
        w = is_ratio[sel][mask[sel].bool()] if per_token else is_ratio[sel].flatten()
        out = outside[sel][mask[sel].bool()] if per_token else outside[sel].flatten()
        assert rec["sampling/importance_sampling_ratio/mean"] == pytest.approx(
            w.mean().item(), rel=1e-4)
        assert rec["sampling/importance_sampling_ratio/min"] == pytest.approx(w.min().item(),
                                                                             rel=1e-4, abs=1e-7)
        assert rec["sampling/importance_sampling_ratio/max"] == pytest.approx(w.max().item(),
                                                                             rel=1e-4)
        assert rec["sampling/importance_sampling_ratio/outside_frac"] == pytest.approx(
            out.float().mean().item())
    assert 0 < stats["sampling/importance_sampling_ratio/outside_frac"] < 1
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["clip_low_frac"] == 0.0


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("loss_type,beta", [("dapo", 0.0), ("grpo", 0.04), ("bnpo", 0.04)])
def test_trl_reference_is_trls_own_compute_loss(mode, loss_type, beta):
    """The written-out _compute_loss above against TRL's own method, run on a stand-in trainer
    (only where trl 1.16 imports: e.g. PYTHONPATH=<the unpacked trl-1.16.0 wheel>)."""
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    from collections import defaultdict
    from types import SimpleNamespace

    theta, ids, mask, sampling, adv = mismatch_batch()
    ref = token_logprobs(theta.detach() * 0.9, ids)  # (B, T)
    with torch.no_grad():
        old = token_logprobs(theta, ids)  # (B, T)
    is_ratio = trl_importance_sampling_ratio(old, sampling, mask, mode, 0.5, 3.0)
    accelerator = SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, **k: x,
                                  sync_gradients=True)
    stub = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=0.1, importance_sampling_level="token",
        beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, use_vllm=True,
        vllm_importance_sampling_correction=True, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=5, accelerator=accelerator,
        aux_loss_enabled=False, _entropy_bonus_enabled=False, _metrics=defaultdict(
            lambda: defaultdict(list)),
        args=SimpleNamespace(use_bias_correction_kl=True, delta=2.0, steps_per_generation=1),
        get_off_policy_mask=grpo_trainer.GRPOTrainer.get_off_policy_mask,
        _get_per_token_logps_and_entropies=lambda *a, **k: (token_logprobs(theta, ids),
                                                            torch.zeros_like(mask), None))
    inputs = {"prompt_ids": torch.zeros(6, 1, dtype=torch.long), "prompt_mask": torch.ones(6, 1),
              "completion_ids": ids, "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "sampling_per_token_logps": sampling,
              "importance_sampling_ratio": is_ratio, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    trls = grpo_trainer.GRPOTrainer._compute_loss(stub, None, inputs)
    g_trl, = torch.autograd.grad(trls, theta)
    want = trl_compute_loss(token_logprobs(theta, ids), old, sampling, adv, mask, is_ratio,
                            loss_type, delta=2.0, beta=beta, ref_per_token_logps=ref,
                            off_policy_mask_threshold=0.1, max_completion_length=5)
    g_want, = torch.autograd.grad(want, theta)
    assert trls.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-8)
    torch.testing.assert_close(g_trl, g_want)
