"""``mb.packed_logprobs``: THD, padded THD and [B, S] batches of whole sequences, exact
against each sequence run alone through the stock spec (log-probs, gradients), in the
batch's own layout; malformed layouts refused naming the sequence or field."""

import pytest
import torch
from conftest import make_pair

import megatron_branch as mb
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.reference.agreement import compare_grads, grads
from megatron_branch.reference.naive import naive_rollout_logprobs

TOL = 1e-5


def sequences():
    return branching_rollouts([18, 11], [2, 2], [4, 5], 128, seed=6, jitter=2).sequences


def thd(seqs, multiple=None):
    if multiple is None:
        cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
        return torch.cat(seqs), cu, None
    padded = [-(-len(s) // multiple) * multiple for s in seqs]
    cup = torch.tensor([0] + padded).cumsum(0)
    flat = torch.zeros(int(cup[-1]), dtype=torch.long)
    for s, start in zip(seqs, cup[:-1]):
        flat[int(start): int(start) + len(s)] = s
    return flat, torch.tensor([0] + [len(s) for s in seqs]).cumsum(0), cup


def expected_flat(lp_ref, seqs, starts, total):
    out = torch.zeros(total)
    for r, (s, start) in enumerate(zip(seqs, starts)):
        out[int(start): int(start) + len(s) - 1] = lp_ref[r, : len(s) - 1]
    return out


@pytest.mark.parametrize("layout", ["thd", "thd_padded", "bs"])
def test_packed_batches_match_each_sequence_alone(layout):
    seqs = sequences()
    branch, stock = make_pair()
    temps = torch.tensor([0.8, 1.0, 1.2, 0.8, 1.0, 1.2, 0.9, 1.1][: len(seqs)])
    if layout == "bs":
        width = max(len(s) for s in seqs) + 3
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = s
        lengths = torch.tensor([len(s) for s in seqs])
        lp = mb.packed_logprobs(branch, tokens, lengths=lengths, temperature=temps)
        starts, total = torch.arange(len(seqs)) * width, tokens.numel()
    else:
        tokens, cu, cup = thd(seqs, 8 if layout == "thd_padded" else None)
        lp = mb.packed_logprobs(branch, tokens, cu, cu_seqlens_padded=cup, pad_multiple=8 if cup is not None else None,
                                temperature=temps)
        starts, total = (cup if cup is not None else cu)[:-1], tokens.numel()
    assert lp.shape == tokens.shape
    weights = torch.randn(lp.shape, generator=torch.Generator().manual_seed(0))
    (lp * weights).sum().backward()
    lp_ref = naive_rollout_logprobs(stock, seqs, temperature=temps)
    ref = expected_flat(lp_ref, seqs, starts, total).reshape(tokens.shape)
    (ref * weights).sum().backward()
    assert (lp.detach() - ref.detach()).abs().max() < TOL
    diffs = compare_grads(grads(branch), grads(stock))
    assert max(diffs.values()) < TOL, max(diffs, key=diffs.get)
    # the sharing is real: fewer unique positions than tokens
    tree = mb.BranchTree.from_sequences(seqs)
    assert tree.unique_positions < tree.naive_positions


def test_score_mask_and_entropy_in_the_batch_layout():
    seqs = sequences()
    branch, _ = make_pair()
    tokens, cu, _ = thd(seqs)
    mask = torch.zeros(tokens.shape, dtype=torch.bool)
    mask[int(cu[1]) - 4: int(cu[1]) - 1] = True  # the last three predictions of sequence 0
    with torch.no_grad():
        full, ent = mb.packed_logprobs(branch, tokens, cu, entropy=True)
        part = mb.packed_logprobs(branch, tokens, cu, score_mask=mask)
    assert torch.equal(part != 0, mask & (full != 0))
    assert (part - torch.where(mask, full, torch.zeros(()))).abs().max() < TOL
    assert ent.shape == tokens.shape and bool((ent[: int(cu[1]) - 1] > 0).all())
    assert float(full[int(cu[1]) - 1]) == 0.0  # a sequence's last token predicts nothing


def test_malformed_layouts_are_refused_naming_the_sequence():
    seqs = sequences()
    branch, _ = make_pair()
    tokens, cu, _ = thd(seqs)
    with pytest.raises(ValueError, match="cu_seqlens: must start at 0"):
        mb.packed_logprobs(branch, tokens, cu + 1)
    bad = cu.clone()
    bad[2] = bad[1]
    with pytest.raises(ValueError, match="sequence 1: cu_seqlens must increase"):
        mb.packed_logprobs(branch, tokens, bad)
    with pytest.raises(ValueError, match="already split for context parallelism"):
        mb.packed_logprobs(branch, tokens[: len(tokens) // 2], cu)
    flat, cu, cup = thd(seqs, 8)
    with pytest.raises(ValueError, match="not a multiple of pad_multiple=16"):
        mb.packed_logprobs(branch, flat, cu, cu_seqlens_padded=cup, pad_multiple=16)
    short = cup.clone()
    short[1] = 2
    with pytest.raises(ValueError, match="sequence 0: padded to 2 tokens, shorter than"):
        mb.packed_logprobs(branch, flat, cu, cu_seqlens_padded=short)
    with pytest.raises(ValueError, match="score_mask: shape"):
        mb.packed_logprobs(branch, tokens, thd(seqs)[1], score_mask=torch.ones(3))
    with pytest.raises(ValueError, match=r"sequence 1: lengths 0 must be in \[1, 5\]"):
        mb.packed_logprobs(branch, torch.zeros(2, 5, dtype=torch.long), lengths=[3, 0])
    with pytest.raises(ValueError, match="lengths: a padded"):
        mb.packed_logprobs(branch, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="rollout 0: tokens contains id 999"):
        mb.packed_logprobs(branch, torch.tensor([1, 999, 2]), torch.tensor([0, 3]))
