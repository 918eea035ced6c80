"""Cascade tree attention vs the dense-mask reference, and its memory bound."""

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_branch import BranchTree
from megatron_branch.attention import cascade_attention, dense_tree_attention, kernels, plan_pieces


def _tree(seed=0, vocab=50):
    rng = random.Random(seed)
    base = [rng.randrange(vocab) for _ in range(40)]
    seqs = []
    for _ in range(8):
        k = rng.choice([10, 20, 25, 40])
        seqs.append(base[:k] + [rng.randrange(vocab) for _ in range(rng.randint(1, 15))])
    seqs += [[99, 98, 97], base[:30], base[:30]]
    return BranchTree.from_sequences(seqs)


def _qkv(U, h, hk, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda n: torch.randn(U, n, d, generator=gen, dtype=dtype).requires_grad_()  # noqa: E731
    return mk(h), mk(hk), mk(hk)


def _masked_reference(q, k, v, tree, scale):
    """Per-query loop over its ancestors in float64: independent of both backends."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    out = []
    for i in range(q.shape[0]):
        keys = []
        j = i
        while j >= 0:
            keys.append(j)
            j = int(tree.parents[j])
        idx = torch.tensor(keys)
        s = torch.einsum("hd,khd->hk", q[i].double(), k[idx]) * scale
        out.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), v[idx]))
    return torch.stack(out)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_dense_matches_per_query_reference(heads, kv_heads):
    tree = _tree()
    q, k, v = _qkv(tree.unique_positions, heads, kv_heads, 16)
    ref = _masked_reference(q, k, v, tree, 0.25)
    out = dense_tree_attention(q, k, v, tree.last, 0.25)
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])
def test_repeated_kv_matches_dense(heads, kv_heads):
    from megatron_branch.attention.repeat_kv import repeated_kv_attention

    tree = _tree(5)
    q, k, v = _qkv(tree.unique_positions, heads, kv_heads, 16)
    ref = dense_tree_attention(q, k, v, tree.last, 0.25)
    out = repeated_kv_attention(q, k, v, tree.segments, 0.25)
    g = torch.randn_like(ref)
    assert (out - ref).abs().max() < 1e-5
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert (a - b).abs().max() < 1e-5


@pytest.mark.parametrize("kernel", ["flash_cpu", "math"])
@pytest.mark.parametrize("q_block, k_block", [(None, None), (7, 5), (3, None), (1, 1), (40, 40)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])
@pytest.mark.parametrize("fuse", [False, True])
def test_cascade_matches_dense_forward_and_backward(kernel, q_block, k_block, heads, kv_heads, fuse):
    tree = _tree(1)
    q, k, v = _qkv(tree.unique_positions, heads, kv_heads, 16)
    scale = 16**-0.5
    ref = dense_tree_attention(q, k, v, tree.last, scale)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    pieces = plan_pieces(tree.segments, q_block, k_block, fuse)
    if fuse and q_block is None:  # a segment with descendants is one taller-than-wide causal piece
        assert any(p.causal and p.q_hi - p.q_lo > p.k_hi - p.k_lo for p in pieces)
    out = cascade_attention(q, k, v, pieces, scale, kernel)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert (out - ref).abs().max() < 1e-5
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() < 1e-5


@pytest.mark.parametrize("kernel", ["flash_cpu", "math"])
@pytest.mark.parametrize("q_block, k_block", [(None, None), (7, 5), (1000, 1000), (3, None)])
@pytest.mark.parametrize("fuse", [False, True])
def test_cascade_with_cached_path_matches_dense_forward_and_backward(kernel, q_block, k_block, fuse):
    """Streaming replay's prefix piece (every query sees every cached key): as one tile
    (the kernel's result as is) and tiled (merged by log-sum-exp), against float64."""
    tree = _tree(4)
    U, P, h, hk, d = tree.unique_positions, 9, 4, 2, 16
    q, k, v = _qkv(U, h, hk, d, seed=1)
    pk, pv = (x[:P].detach().clone().requires_grad_() for x in _qkv(P, hk, hk, d, seed=2)[1:])
    scale = d**-0.5
    # reference: the path's keys in front of the unit's, visible to every query
    keys = torch.cat([pk, k]).repeat_interleave(h // hk, 1).double()
    values = torch.cat([pv, v]).repeat_interleave(h // hk, 1).double()
    visible = torch.cat([torch.ones(U, P, dtype=torch.bool), tree.visibility_mask()], dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    ref = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, float("-inf")).softmax(-1), values)
    grad_out = torch.randn(ref.shape, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, (q, k, v, pk, pv), grad_out)
    out = cascade_attention(q, k, v, plan_pieces(tree.segments, q_block, k_block, fuse), scale, kernel,
                            prefix=(pk, pv), q_block=q_block, k_block=k_block)
    grads = torch.autograd.grad(out, (q, k, v, pk, pv), grad_out.float())
    assert (out.double() - ref).abs().max() < 1e-5
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max() < 1e-5


def test_cascade_is_not_trivially_equal_to_causal_attention():
    # Guard: the tree mask matters, so packed causal attention must differ.
    tree = _tree(2)
    q, k, v = _qkv(tree.unique_positions, 4, 2, 16)
    out = cascade_attention(q, k, v, plan_pieces(tree.segments), 0.25)
    causal = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1), is_causal=True, scale=0.25,
    ).transpose(0, 1)
    assert (out - causal).abs().max() > 1e-2


def test_bf16_cascade_error_within_twice_the_dense_bf16_error():
    tree = _tree(3)
    q, k, v = _qkv(tree.unique_positions, 4, 2, 32)
    ref = dense_tree_attention(q, k, v, tree.last, 32**-0.5)
    qb, kb, vb = (x.detach().bfloat16().requires_grad_() for x in (q, k, v))
    dense_err = (dense_tree_attention(qb, kb, vb, tree.last, 32**-0.5).float() - ref).abs().max()
    casc_err = (cascade_attention(qb, kb, vb, plan_pieces(tree.segments), 32**-0.5).float() - ref).abs().max()
    assert casc_err <= 2 * dense_err + 1e-6


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _prompt_tails_tree(prompt=1536, tails=16, tail_len=64):
    gen = torch.Generator().manual_seed(0)
    p = torch.randint(0, 100, (prompt,), generator=gen)
    seqs = []
    for i in range(tails):
        t = torch.randint(0, 100, (tail_len,), generator=gen)
        t[0] = 100 + i
        seqs.append(torch.cat([p, t]))
    return BranchTree.from_sequences(seqs)


@pytest.mark.parametrize("chunk", [None, 256])
def test_cascade_never_allocates_a_u_by_u_tensor(chunk):
    tree = _prompt_tails_tree()
    U = tree.unique_positions  # 2560: U*U = 6.5M elements
    q, k, v = _qkv(U, 2, 1, 8)
    with _LargestTensor() as probe:
        out = cascade_attention(q, k, v, plan_pieces(tree.segments, chunk), 8**-0.5)
        out.sum().backward()
    assert probe.largest < U * U // 16, probe.largest


def test_allocation_probe_catches_the_dense_backend():
    # The probe above can fail: the dense backend does build U x U scores.
    tree = _prompt_tails_tree(prompt=512, tails=4)
    U = tree.unique_positions
    q, k, v = _qkv(U, 2, 1, 8)
    with _LargestTensor() as probe:
        dense_tree_attention(q, k, v, tree.last, 8**-0.5).sum().backward()
    assert probe.largest >= U * U


@pytest.mark.parametrize("fuse", [False, True])
def test_pieces_cover_every_visible_pair_once(fuse):
    tree = _tree(4)
    U = tree.unique_positions
    for qb, kb in [(None, None), (5, 3), (40, 40)]:
        cover = torch.zeros(U, U, dtype=torch.long)
        for p in plan_pieces(tree.segments, qb, kb, fuse):
            block = torch.ones(p.q_hi - p.q_lo, p.k_hi - p.k_lo, dtype=torch.long)
            cover[p.q_lo : p.q_hi, p.k_lo : p.k_hi] += block.tril() if p.causal else block
        assert torch.equal(cover, tree.visibility_mask().long())


def test_math_kernel_tiles_by_default_and_stays_exact(monkeypatch):
    """The GPU fallback kernel materialises float32 scores; without a chunk size its pieces
    are tiled to MATH_TILE x MATH_TILE, so no score block grows with the stem."""
    from conftest import make_pair

    import megatron_branch as mb
    from megatron_branch.spec import core_attention

    tree = _prompt_tails_tree(prompt=700, tails=3, tail_len=20)
    branch, _ = make_pair(kernel="math")
    flash, _ = make_pair(kernel="flash_cpu")
    heads = branch.config.num_attention_heads
    largest = {}
    for tile in (4096, 128):
        monkeypatch.setattr(core_attention, "MATH_TILE", tile)
        with torch.no_grad(), _LargestTensor() as probe:
            lp = mb.rollout_logprobs(branch, tree)
        largest[tile] = probe.largest
        with torch.no_grad():
            assert (lp - mb.rollout_logprobs(flash, tree)).abs().max() < 1e-5
    assert largest[4096] >= heads * 700 * 700  # untiled: the stem's whole score square
    assert largest[128] < heads * 700 * 700 // 4, largest


def test_fp8_pads_units_and_cp_shards_to_16_invisibly(monkeypatch):
    from conftest import make_pair

    import megatron_branch as mb
    from megatron_branch.scoring.unit import unit_multiple
    from megatron_branch.spec.builders import llama_config
    from megatron_branch.spec.packed_seq import BranchPackedSeqParams

    assert unit_multiple(llama_config(fp8="hybrid")) == 16
    assert unit_multiple(llama_config(fp8="hybrid", tensor_model_parallel_size=2, sequence_parallel=True)) == 32
    assert unit_multiple(llama_config()) == 1
    tree = _prompt_tails_tree(prompt=37, tails=3, tail_len=5)  # 52 tokens
    params = BranchPackedSeqParams.for_unit(tree, 0, tree.unique_positions, multiple=16)
    assert params.total == 64 and params.num_real == 52
    # a unit padded to 16 (as FP8's TE GEMMs need; a local-spec model with fp8 set is refused,
    # tests/test_fp8_emulation.py) gives the unpadded log-probs
    from megatron_branch.scoring import unit

    plain, _ = make_pair()
    with torch.no_grad():
        want = mb.rollout_logprobs(plain, tree)
    monkeypatch.setattr(unit, "unit_multiple", lambda config: 16)
    seen = []
    plain.embedding.register_forward_hook(lambda m, a, out: seen.append(out.shape[0]))
    with torch.no_grad():
        assert torch.equal(mb.rollout_logprobs(plain, tree), want)
    assert seen == [64]


@pytest.mark.parametrize("fuse", [False, True])
def test_batches_cover_every_visible_pair_once_and_few_calls_suffice(fuse):
    """Pieces of equal (bucketed) shape share one kernel call; padded rows see nothing real."""
    from megatron_branch.attention.pieces import bucket, plan_batches
    from megatron_branch.commands.synthetic import branching_rollouts

    assert [bucket(n) for n in (1, 16, 17, 31, 100, 1000)] == [1, 16, 18, 32, 104, 1024]
    forest = branching_rollouts([40, 33, 51], [3, 3, 3], [5, 4, 6], 100, seed=0, jitter=2)
    tree = BranchTree.from_sequences(forest.sequences)
    U = tree.unique_positions
    pieces = plan_pieces(tree.segments, fuse=fuse)
    batches = plan_batches(pieces)
    assert len(pieces) > 100 and len(batches) < len(pieces) / 4
    assert any(b.causal and b.k_index.shape[1] < b.q_index.shape[1] for b in batches) == fuse
    cover = torch.zeros(U, U, dtype=torch.long)
    for b in batches:
        for qi, ki, valid in zip(b.q_index, b.k_index, b.valid):
            block = torch.ones(len(qi), len(ki), dtype=torch.long)
            if b.causal:
                block = block.tril()
            block = block * valid[:, None]  # padded query rows are dropped
            if b.causal:  # a square's padded keys come after every real query (a fused piece pads none)
                block = block * (torch.arange(len(ki))[None, :] < valid.sum())
            cover.index_put_((qi[:, None].expand_as(block), ki[None, :].expand_as(block)), block, accumulate=True)
    assert torch.equal(cover, tree.visibility_mask().long())
    q, k, v = _qkv(U, 4, 2, 16)
    ref = dense_tree_attention(q, k, v, tree.last, 0.25)
    out = cascade_attention(q, k, v, batches, 0.25)
    g = torch.randn_like(ref)
    assert (out - ref).abs().max() < 1e-5
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert (a - b).abs().max() < 1e-5


@pytest.mark.parametrize("kernel", ["flash_cpu", "math"])
@pytest.mark.parametrize("sequences", [
    [[1, 2, 3, 4] + [10 + i, 20 + i, 30 + i] for i in range(6)],  # a prompt and equal answers
    [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9, 10], [1, 2, 3, 4, 11, 12]],  # leaves across subtrees
    [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8]],  # a forest: the leaves' run reaches past the first tree
])
def test_fused_pieces_merge_run_by_run_exactly(kernel, sequences, monkeypatch):
    """With fused pieces every batch of these trees is a run of consecutive rows: the
    merge is elementwise (the scatter merge never runs) and exact."""
    from megatron_branch.attention import cascade

    def no_scatter(*args):
        raise AssertionError("the scatter merge ran")

    tree = BranchTree.from_sequences([torch.tensor(s) for s in sequences])
    q, k, v = _qkv(tree.unique_positions, 4, 2, 16, seed=3)
    ref = dense_tree_attention(q, k, v, tree.last, 0.25)
    g = torch.randn_like(ref)
    monkeypatch.setattr(cascade, "_merge", no_scatter)
    out = cascade_attention(q, k, v, plan_pieces(tree.segments, fuse=True), 0.25, kernel)
    assert (out - ref).abs().max() < 1e-5
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert (a - b).abs().max() < 1e-5


def _flash_cpu_pieces(batch, nq, nk):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, n, h, 16, generator=gen) for n, h in ((nq, 4), (nk, 2), (nk, 2)))
    return q, k, v


@pytest.mark.parametrize("nk", [8, 63, 64])
def test_flash_cpu_few_keys_run_on_one_thread_bitwise_as_on_many(nk):
    """A flash_cpu call on pieces of fewer than FLASH_CPU_SERIAL_KEYS keys runs on one
    intra-op thread (it is slower on two); the values must not depend on the thread count,
    forward and backward, or the gate would change results."""
    seen = []
    real = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    q, k, v = _flash_cpu_pieces(12, 40, nk)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out2, lse2 = real(*(kernels._bhsd(x) for x in (q, k, v)), 0.0, True, scale=0.25)  # ungated, two threads
        dout = torch.randn(out2.shape, generator=torch.Generator().manual_seed(1))
        grads2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, *(kernels._bhsd(x) for x in (q, k, v)), out2, lse2, 0.0, True, scale=0.25)
        with kernels.serial_if_few_keys(nk):
            seen.append(torch.get_num_threads())
        out, lse = kernels.flash_cpu_forward(q, k, v, True, 0.25)
        grads = kernels.flash_cpu_backward(kernels._back(dout, True), q, k, v, out, lse, True, 0.25)
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(threads)
    assert seen == [1 if nk < kernels.FLASH_CPU_SERIAL_KEYS else 2]
    assert torch.equal(out, kernels._back(out2, True)) and torch.equal(lse, lse2)
    for got, want in zip(grads, grads2):
        assert torch.equal(got, kernels._back(want, True))
