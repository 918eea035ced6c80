import random

import numpy as np
import pytest
import torch

from megatron_branch import BranchTree


def _trie_size(seqs):
    root, count = {}, 0
    for s in seqs:
        node = root
        for t in s:
            if t not in node:
                node[t] = {}
                count += 1
            node = node[t]
    return count


def _check(seqs):
    tree = BranchTree.from_sequences(seqs)
    U = tree.unique_positions
    assert tree.num_rollouts == len(seqs)
    assert tree.naive_positions == sum(len(s) for s in seqs)
    assert U == _trie_size([list(map(int, s)) for s in seqs])
    for r, s in enumerate(seqs):
        rows = tree.rows[r, : len(s)]
        assert tree.sequence(r).tolist() == list(map(int, s))
        assert tree.positions[rows].tolist() == list(range(len(s)))
        assert int(tree.parents[rows[0]]) == -1
        assert torch.equal(tree.parents[rows[1:]], rows[:-1])
        assert (tree.rows[r, len(s):] == -1).all()
    # Visibility from the parent pointers alone vs the j <= i <= last[j] rule.
    anc = torch.zeros(U, U, dtype=torch.bool)
    for i in range(U):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = int(tree.parents[j])
    assert torch.equal(anc, tree.visibility_mask())
    assert tree.attention_pairs() == int(anc.sum())
    covered = torch.zeros(U, dtype=torch.long)
    for seg in tree.segments:
        covered[seg.start : seg.end] += 1
        assert (tree.last[seg.start : seg.end] == seg.subtree_end - 1).all()
        assert all(int(tree.parents[i]) == i - 1 for i in range(seg.start + 1, seg.end))
    assert (covered == 1).all()
    return tree


def test_random_forests_match_a_reference_trie():
    rng = random.Random(0)
    for _ in range(200):
        base = [rng.randint(0, 3) for _ in range(rng.randint(1, 6))]
        seqs = []
        for _ in range(rng.randint(1, 9)):
            k = rng.randint(0, len(base))
            seqs.append(base[:k] + [rng.randint(0, 3) for _ in range(rng.randint(0 if k else 1, 5))])
        _check(seqs)


@pytest.mark.parametrize(
    "seqs",
    [
        [[1, 2, 3]],  # a single rollout
        [[7]],  # a single-token rollout
        [[1, 2, 3], [1, 2, 3]],  # identical rollouts
        [[1, 2], [1, 2, 3, 4], [1]],  # prefixes of another
        [[5], [6], [5]],  # single-token rollouts, a forest
        [[1, 2, 3, 4], [1, 2, 9, 9], [1, 2, 3, 5], [8, 8]],  # multi-level + forest
    ],
)
def test_edge_cases(seqs):
    _check(seqs)


def test_identical_and_prefix_share_everything():
    tree = _check([[1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 3, 4]])
    assert tree.unique_positions == 4
    assert len(tree.segments) == 1  # a chain extended by prefixes is one segment


def test_inputs_as_tensors_arrays_and_a_2d_batch():
    a = _check([torch.tensor([1, 2, 3]), np.array([1, 2, 4]), [1, 5]])
    b = BranchTree.from_sequences(torch.tensor([[1, 2, 3], [1, 2, 4]]))
    assert a.unique_positions == 5 and b.unique_positions == 4


def test_large_tree_shape():
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (6000,), generator=gen)
    tails = [torch.randint(0, 1000, (2192,), generator=gen) for _ in range(64)]
    for i, tail in enumerate(tails):
        tail[0] = i  # distinct first tokens: the tails share nothing
    seqs = [torch.cat([prompt, tail]) for tail in tails]
    tree = BranchTree.from_sequences(seqs)
    assert tree.naive_positions == 64 * 8192
    assert tree.unique_positions == 6000 + 64 * 2192
    assert len(tree.segments) == 65
    assert torch.equal(tree.sequence(17), seqs[17])


@pytest.mark.parametrize(
    "seqs, match",
    [
        ([], "no rollouts"),
        ([[1, 2], []], "rollout 1: tokens is empty"),
        ([[1, 2], [1.5, 2.0]], "rollout 1: tokens must be integers"),
        ([torch.tensor([1.0, 2.0])], "rollout 0: tokens must be integers"),
        ([[1, 2], [[1, 2]]], "rollout 1: tokens must be 1-D"),
        ([[1, 2], [3, -4]], "rollout 1: tokens contains negative token id -4"),
        ([[1, 2], [1, [2, 3]]], "rollout 1"),
        # a batch of integer tensors is checked at once, but the error still names the rollout
        ([torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, -6])],
         "rollout 2: tokens contains negative token id -6"),
        ([torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)], "rollout 1: tokens is empty"),
        ([torch.tensor([1, 2]), torch.tensor([[1, 2]])], "rollout 1: tokens must be 1-D"),
        ([torch.tensor([1, 2]), torch.tensor([True, False])], "rollout 1: tokens must be integers"),
    ],
)
def test_bad_rollouts_raise_naming_the_rollout(seqs, match):
    with pytest.raises(ValueError, match=match):
        BranchTree.from_sequences(seqs)


def test_tensor_batches_build_the_same_tree_as_lists():
    """The one-go conversion of integer tensors (mixed dtypes included) and the
    rollout-by-rollout path of lists give the same tree."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 50, (12,), generator=gen)
    seqs = [torch.cat([prompt[: 4 + r % 9], torch.randint(0, 50, (1 + r % 5,), generator=gen)]) for r in range(40)]
    seqs[3] = seqs[3].to(torch.int32)
    seqs[7] = seqs[7].to(torch.uint8)
    from_tensors = BranchTree.from_sequences(seqs)
    from_lists = BranchTree.from_sequences([s.tolist() for s in seqs])
    for name in ("tokens", "positions", "parents", "last", "rows", "lengths"):
        assert torch.equal(getattr(from_tensors, name), getattr(from_lists, name)), name
    assert from_tensors.segments == from_lists.segments
    for r, s in enumerate(seqs):
        assert from_tensors.sequence(r).tolist() == s.tolist()


def test_token_outside_vocabulary_names_the_rollout():
    with pytest.raises(ValueError, match="rollout 2: tokens contains id 50 outside the vocabulary of size 50"):
        BranchTree.from_sequences([[1, 2], [3], [4, 50]], vocab_size=50)


def test_share_limit():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5]]
    assert BranchTree.from_sequences(seqs).unique_positions == 5
    assert BranchTree.from_sequences(seqs, share_limit=0).unique_positions == 12
    prompt_only = BranchTree.from_sequences(seqs, share_limit=[2, 2, 2])
    assert prompt_only.unique_positions == 2 + 3 * 2
    for r, s in enumerate(seqs):
        assert prompt_only.sequence(r).tolist() == s
    with pytest.raises(ValueError, match="share_limit"):
        BranchTree.from_sequences(seqs, share_limit=[1, 2])


def test_rollout_order_is_lexicographic_with_prefixes_first():
    # the packed order the tree is built in: the padded matrix's np.lexsort (-1 padding
    # sorts a prefix before its extensions), ids past one byte and ties kept stable
    from megatron_branch.tree import _lexicographic_order

    rng = np.random.default_rng(0)
    for _ in range(100):
        base = rng.integers(0, 70000, size=rng.integers(1, 8))
        arrays = []
        for _ in range(rng.integers(1, 10)):
            keep = int(rng.integers(0, base.size + 1))
            tail = rng.choice([1, 255, 256, 65535, 65536, 2**40], size=rng.integers(0 if keep else 1, 4))
            arrays.append(np.concatenate([base[:keep], tail]).astype(np.int64))
        mat = np.full((len(arrays), max(a.size for a in arrays)), -1, dtype=np.int64)
        for i, a in enumerate(arrays):
            mat[i, : a.size] = a
        assert _lexicographic_order(arrays, np.concatenate(arrays)).tolist() == np.lexsort(mat.T[::-1]).tolist()
