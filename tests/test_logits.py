"""Logits only where a loss reads them: the output layer sees only the scored tokens'
parents, and the scored log-probs and every gradient are unchanged."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from conftest import VOCAB, make_pair

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.reference.agreement import compare_grads, grads
from megatron_branch.reference.naive import naive_rollout_logprobs
from megatron_branch.scoring.vocab import child_logprobs


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
    # one row per scored token, at its parent: the prompts' rows are never projected, and a
    # branch point's row comes once per child (so no logits row is copied for a second child)
    scored = tree.rows[:, 1:][(mask > 0) & (tree.rows[:, 1:] >= 0)].unique()
    parents = tree.parents[scored].unique()
    assert seen == [scored.numel()] and parents.numel() < scored.numel()
    assert parents.numel() < tree.unique_positions / 2
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


def _direct_logprobs(logits, rows, targets, temperatures):
    """The formulation child_logprobs avoids: every child gathers its parent's row."""
    picked = logits[rows].float()
    lps = [torch.log_softmax(picked / t, -1).gather(1, targets[:, None])[:, 0] for t in temperatures]
    ents = []
    for t in temperatures:
        logp = torch.log_softmax(picked / t, -1)
        ents.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(lps, 1), torch.stack(ents, 1)


@pytest.mark.parametrize("temperatures", [None, [1.0, 0.7]])
@pytest.mark.parametrize("childless", [False, True])
def test_child_logprobs_match_the_gathered_rows(temperatures, childless):
    gen = torch.Generator().manual_seed(0)
    n, vocab = 9, 40
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64).float().requires_grad_()
    # rows 2 and 5 are branch points (3 and 2 children); with ``childless`` rows 7 and 8 have none
    rows = torch.tensor([0, 1, 2, 2, 3, 4, 5, 2, 6, 5] + ([] if childless else [7, 8]))
    rows = rows[torch.randperm(rows.numel(), generator=gen)]
    targets = torch.randint(0, vocab, (rows.numel(),), generator=gen)
    temps = None if temperatures is None else torch.tensor(temperatures)
    before = logits.detach().clone()
    lp, ent = child_logprobs(logits, rows, targets, entropy=True, temperatures=temps)
    assert torch.equal(logits.detach(), before)  # not consumed: the caller's logits are intact
    ref_lp, ref_ent = _direct_logprobs(logits, rows, targets, temperatures or [1.0])
    assert lp.shape == ref_lp.shape and (lp - ref_lp).abs().max() < 1e-5
    assert (ent - ref_ent).abs().max() < 1e-5
    w = torch.randn(lp.shape, generator=gen)
    (g,) = torch.autograd.grad((lp * w).sum() + (ent * w).sum(), logits)
    (ref_g,) = torch.autograd.grad((ref_lp * w).sum() + (ref_ent * w).sum(), logits)
    assert (g - ref_g).abs().max() < 1e-5
    if childless:
        assert g[7:].abs().max() == 0  # a row no child reads moves nothing


class _BigLive(TorchDispatchMode):
    """The most tensor storages of at least ``size`` bytes alive at once."""

    def __init__(self, size):
        super().__init__()
        self.size, self.live, self.most = size, set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.size:
                key = t.untyped_storage().data_ptr()
                if key not in self.live:
                    self.live.add(key)
                    self.most = max(self.most, len(self.live))
                    weakref.finalize(t.untyped_storage(), self.live.discard, key)
        return out


def test_the_logits_exist_once_through_the_loss_and_its_backward(batch):
    # Megatron's cross-entropy works in place; the scored path hands it the model's own
    # logits (one row per scored token), so forward and backward never hold a second
    # [m, V] tensor: no gather of shared rows, no scatter-add, no copy by a select.
    vocab = 4096
    branch, stock = make_pair(vocab=vocab)
    seqs = [s % vocab for s in batch.sequences]
    tree = mb.BranchTree.from_sequences(seqs)
    rows = tree.unique_positions - tree.num_rollouts  # every token with a parent scored
    meter = _BigLive(rows * vocab * 4 // 2)
    with meter:
        lp = mb.rollout_logprobs(branch, tree)
        lp.sum().backward()
    assert meter.most == 1, meter.most
    naive = naive_rollout_logprobs(stock, seqs)
    assert (lp.detach() - naive.detach()).abs().max() < 1e-5
