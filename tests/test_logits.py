"""Logits only where a loss reads them: the output layer sees only the scored tokens'
parents, and the scored log-probs and every gradient are unchanged."""

import pytest
import torch
from conftest import VOCAB, make_pair

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.reference.agreement import compare_grads, grads
from megatron_branch.reference.naive import naive_rollout_logprobs


def rows_seen(model):
    """Rows of logits the output layer produces, per call (a forward hook on Megatron's layer)."""
    seen = []
    handle = model.output_layer.register_forward_hook(lambda m, args, out: seen.append(out[0].shape[0]))
    return seen, handle


@pytest.fixture
def batch():
    return branching_rollouts([60, 45], [2, 3], [5, 7], VOCAB, seed=4, jitter=2)


def test_scored_logprobs_and_gradients_are_unchanged(batch):
    branch, stock = make_pair()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    seen, handle = rows_seen(branch)
    lp = mb.rollout_logprobs(branch, tree, score_mask=mask)
    handle.remove()
    # the response tokens' parents only: the prompts' rows are never projected
    parents = tree.parents[tree.rows[:, 1:][(mask > 0) & (tree.rows[:, 1:] >= 0)]].unique()
    assert seen == [parents.numel()] and parents.numel() < tree.unique_positions / 2
    full = mb.rollout_logprobs(branch, tree).detach()
    assert torch.equal(lp.detach() == 0, (mask == 0) | (full == 0))
    assert (lp.detach() - full * mask).abs().max() < 1e-6
    loss = losses.sft_loss(lp, mask)
    loss.backward()
    naive = losses.sft_loss(naive_rollout_logprobs(stock, batch.sequences), mask)
    naive.backward()
    assert abs(loss.item() - naive.item()) < 1e-6
    diffs = compare_grads(grads(branch), grads(stock))
    assert max(diffs.values()) < 1e-5, max(diffs, key=diffs.get)


@pytest.mark.parametrize("recompute_stem", [False, True])
def test_streaming_with_a_score_mask_is_exact_and_skips_prompt_logits(batch, recompute_stem):
    branch, stock = make_pair()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    tokens = mask.sum()

    def loss_fn(lp, ids):
        return losses.sft_loss(lp, mask[ids], global_tokens=tokens)

    naive = losses.sft_loss(naive_rollout_logprobs(stock, batch.sequences), mask, global_tokens=tokens)
    naive.backward()
    seen, handle = rows_seen(branch)
    stats = mb.replay_step(branch, tree, loss_fn, max_chunk_tokens=20, score_mask=mask,
                           recompute_stem=recompute_stem)
    handle.remove()
    assert stats.num_stems >= 4 and min(seen) <= 1  # prompt stems project at most their last row
    assert abs(stats.loss - naive.item()) < 1e-6
    diffs = compare_grads(grads(branch), grads(stock))
    assert max(diffs.values()) < 1e-5, max(diffs, key=diffs.get)
    old = mb.replay_logprobs(branch, tree, max_chunk_tokens=20, score_mask=mask)
    assert (old - mb.rollout_logprobs(branch, tree, score_mask=mask).detach()).abs().max() < 1e-5


def test_bad_score_mask(batch):
    branch, _ = make_pair()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    with pytest.raises(ValueError, match=r"score_mask: expected shape \[12, "):
        mb.rollout_logprobs(branch, tree, score_mask=torch.ones(12, 3))
