"""Losses: values by hand, chunk-additivity under global normalisation, bad shapes."""

import math

import pytest
import torch

from megatron_branch import losses


def _data(R=4, T=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(R, T, generator=gen) * 3
    old = lp + 0.3 * torch.randn(R, T, generator=gen)
    adv = torch.randn(R, generator=gen)
    mask = (torch.rand(R, T, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    return lp.requires_grad_(), old, adv, mask


def test_ppo_clip_by_hand():
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))
    old = torch.zeros(1, 3)
    adv = torch.tensor([2.0])
    mask = torch.ones(1, 3)
    loss, m = losses.ppo_policy_loss(lp, old, adv, mask, clip_ratio=0.2)
    # ratio 1.5 -> min(3.0, 2.4) = 2.4; ratio 0.5 -> min(1.0, 1.6) = 1.0; ratio 1 -> 2.0
    assert math.isclose(loss.item(), -(2.4 + 1.0 + 2.0) / 3, rel_tol=1e-6)
    assert math.isclose(m["clip_frac"].item(), 1 / 3, rel_tol=1e-6)


def test_dual_clip_caps_negative_advantages():
    lp = torch.log(torch.tensor([[10.0]]))
    loss, _ = losses.ppo_policy_loss(lp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1),
                                     dual_clip=3.0)
    assert math.isclose(loss.item(), 3.0, rel_tol=1e-6)  # instead of 10.0


def test_dapo_clip_higher_is_asymmetric():
    lp = torch.log(torch.tensor([[1.25, 0.75]]))
    loss, _ = losses.dapo_policy_loss(lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
    # ratio 1.25 < 1.28 unclipped; ratio 0.75 -> min(0.75, 0.8) = 0.75
    assert math.isclose(loss.item(), -(1.25 + 0.75) / 2, rel_tol=1e-6)


def test_kl_k3_is_zero_at_equality_and_positive_elsewhere():
    lp = torch.tensor([[-1.0, -2.0]])
    assert losses.kl_penalty(lp, lp).abs().max() == 0
    assert (losses.kl_penalty(lp, lp + torch.tensor([[0.5, -0.5]])) > 0).all()


def test_grpo_advantages():
    adv = losses.grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0, 5.0]), 2)
    assert torch.allclose(adv[:2], torch.tensor([0.7071, -0.7071]), atol=1e-3)
    assert torch.allclose(adv[4:], torch.zeros(2))
    with pytest.raises(ValueError, match="group_size"):
        losses.grpo_advantages(torch.ones(5), 2)


@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_aggregation_is_additive_over_chunks_with_global_counts(agg):
    lp, old, adv, mask = _data(R=6)
    full, _ = losses.ppo_policy_loss(lp, old, adv, mask, agg=agg)
    g_tokens, g_seqs = mask.sum(), 6
    parts = [
        losses.ppo_policy_loss(lp[s], old[s], adv[s], mask[s], agg=agg, global_tokens=g_tokens,
                               global_seqs=g_seqs)[0]
        for s in (slice(0, 1), slice(1, 4), slice(4, 6))
    ]
    assert torch.allclose(sum(parts), full, atol=1e-6)
    g_full = torch.autograd.grad(full, lp)[0]
    g_parts = torch.autograd.grad(sum(parts), lp)[0]
    assert torch.allclose(g_full, g_parts, atol=1e-7)


def test_seq_mean_token_mean_by_hand():
    loss = torch.tensor([[1.0, 3.0, 100.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert losses.agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 2.0) / 2)
    assert losses.agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((4.0 + 2.0) / 2)
    assert losses.agg_loss(loss, mask, "token-mean").item() == pytest.approx(6.0 / 3)


def test_dpo_and_sft():
    c, r = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    loss, m = losses.dpo_loss(c, r, torch.zeros(2), torch.zeros(2), beta=0.5)
    expected = -(torch.nn.functional.logsigmoid(torch.tensor(1.0)) + torch.nn.functional.logsigmoid(torch.tensor(-0.5))) / 2
    assert loss.item() == pytest.approx(expected.item())
    assert m["reward_accuracy"].item() == 0.5
    lp = torch.tensor([[-1.0, -2.0], [-4.0, 0.0]])
    assert losses.sft_loss(lp, torch.tensor([[1.0, 1.0], [1.0, 0.0]])).item() == pytest.approx(7 / 3)


def test_response_mask_and_sequence_logprobs():
    mask = losses.response_mask([4, 3], [2, 1])
    assert mask.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    assert losses.sequence_logprobs(torch.ones(2, 3), mask).tolist() == [2.0, 2.0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"advantages": torch.zeros(3)}, r"advantages: shape \(3,\) does not match logprobs \(4, 6\)"),
        ({"advantages": torch.zeros(4, 5)}, "advantages: shape"),
        ({"mask": torch.ones(4, 5)}, r"mask: shape \(4, 5\) does not match logprobs \(4, 6\)"),
        ({"old_logprobs": torch.zeros(3, 6)}, "old_logprobs: shape"),
        ({"ref_logprobs": torch.zeros(4, 7), "kl_coef": 0.1}, "ref_logprobs: shape"),
        ({"kl_coef": 0.1}, "ref_logprobs: required"),
        ({"agg": "mean"}, "mode: 'mean' is not one of"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"logprobs": torch.zeros(4)}, r"logprobs: expected shape \[R, T\]"),
    ],
)
def test_bad_shapes_raise_naming_the_field(kwargs, match):
    lp, old, adv, mask = _data()
    args = {"logprobs": lp, "old_logprobs": old, "advantages": adv, "mask": mask}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        losses.ppo_policy_loss(args.pop("logprobs"), args.pop("old_logprobs"), args.pop("advantages"),
                               args.pop("mask"), **args)


def test_bad_dpo_and_mask_inputs():
    with pytest.raises(ValueError, match="rejected_logprobs: shape"):
        losses.dpo_loss(torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="rollout 1: prompt_lengths 3 must be in"):
        losses.response_mask([4, 3], [2, 3])
    with pytest.raises(ValueError, match="prompt_lengths: 1 entries for 2 rollouts"):
        losses.response_mask([4, 3], [2])
    with pytest.raises(ValueError, match="policy loss"):
        losses.get_policy_loss("nope")
    assert set(losses.POLICY_LOSSES) >= {"ppo", "grpo", "dapo"}
