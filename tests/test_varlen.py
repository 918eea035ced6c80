"""The varlen kernel contract (``attention/varlen.py``) and the varlen cascade
(``attention/varlen_cascade.py``): the CUDA default's conventions, run on the CPU side of
the same contract against a float64 reference. What only a GPU can settle (the CUDA
kernels against these conventions) is in ``tools/gpu_check.py``."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_branch import BranchTree
from megatron_branch.attention import dense_tree_attention, plan_pieces
from megatron_branch.attention.kernels import default_kernel
from megatron_branch.attention.pieces import AttentionPiece
from megatron_branch.attention.varlen import (
    VarlenCall,
    check_kernel,
    varlen_backward,
    varlen_forward,
)
from megatron_branch.attention.varlen_cascade import plan_calls, spans, varlen_calls, varlen_cascade_attention

# sequences with more queries than keys, fewer, none of either, and a square
SPANS = [(0, 5, 0, 3), (5, 7, 3, 3), (7, 7, 3, 6), (7, 10, 6, 12), (10, 14, 12, 14)]


def _reference(q, k, v, spans_, causal, scale):
    """Bottom-right causal attention per sequence in float64; rows without keys: zero
    output, lse +inf."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    outs, lses = [], []
    for q_lo, q_hi, k_lo, k_hi in spans_:
        lq, lk = q_hi - q_lo, k_hi - k_lo
        s = torch.einsum("qhd,khd->hqk", q[q_lo:q_hi].double(), k[k_lo:k_hi]) * scale
        if causal:
            hidden = torch.arange(lk)[None, :] > lk - lq + torch.arange(lq)[:, None]
            s = s.masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(s, -1) if lk else torch.full((q.shape[1], lq), float("-inf"), dtype=torch.float64)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", p, v[k_lo:k_hi]))
        lses.append(lse)
    lse = torch.cat(lses, dim=1)
    return torch.cat(outs), lse.masked_fill(torch.isneginf(lse), float("inf"))


def _qkv(tq, tk, h, hk, d, dv=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, h, d, generator=gen, dtype=dtype)
    k = torch.randn(tk, hk, d, generator=gen, dtype=dtype)
    v = torch.randn(tk, hk, dv or d, generator=gen, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, kv_heads, dv", [(4, 4, 8), (4, 2, 8), (6, 1, 8), (4, 2, 12)])
def test_contract_forward_and_backward_against_float64(causal, heads, kv_heads, dv):
    q, k, v = _qkv(14, 14, heads, kv_heads, 8, dv)
    call = VarlenCall.from_spans(SPANS, causal, 14, 14)
    out, lse = varlen_forward("flash_varlen", q, k, v, call, 0.3)
    ref, ref_lse = _reference(q, k, v, SPANS, causal, 0.3)
    assert out.shape == (14, heads, dv) and lse.shape == (heads, 14) and lse.dtype == torch.float32
    assert (out.double() - ref).abs().max() < 1e-5
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isposinf(lse), empty) and empty[:, 5:7].all()  # the keyless rows: +inf
    assert (lse.double() - ref_lse)[~empty].abs().max() < 1e-5 and out[5:7].abs().max() == 0
    # the backward of the reference (autograd in float64) given the same out / lse
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(ref)
    grads_ref = torch.autograd.grad(_reference(qr, kr, vr, SPANS, causal, 0.3)[0], (qr, kr, vr), dout)
    grads = varlen_backward("flash_varlen", dout.float(), q, k, v, out, lse, call, 0.3)
    for got, want in zip(grads, grads_ref):
        assert got.shape == want.shape and (got.double() - want).abs().max() < 1e-5
    assert grads[0][5:7].abs().max() == 0  # rows without keys move nothing
    assert grads[1][3:6].abs().max() == 0 and grads[2][3:6].abs().max() == 0  # keys without queries get nothing


def test_backward_takes_the_merged_output_and_lse():
    """Two calls splitting every row's keys, merged by log-sum-exp, and each call's
    backward given the merged (out, lse): their sum is full attention's gradient."""
    q, k, v = _qkv(6, 10, 2, 1, 8)
    first = VarlenCall.from_spans([(0, 6, 0, 4), (6, 6, 4, 10)], False, 6, 10)
    second = VarlenCall.from_spans([(0, 0, 0, 4), (0, 6, 4, 10)], False, 6, 10)
    (o1, l1), (o2, l2) = (varlen_forward("flash_varlen", q, k, v, c, 0.4) for c in (first, second))
    lse = torch.logaddexp(l1, l2)
    out = (o1 * torch.exp(l1 - lse).T[..., None] + o2 * torch.exp(l2 - lse).T[..., None])
    ref, _ = _reference(q, k, v, [(0, 6, 0, 10)], False, 0.4)
    assert (out.double() - ref).abs().max() < 1e-5
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    dout = torch.randn(ref.shape, dtype=torch.float64)
    want = torch.autograd.grad(_reference(qr, kr, vr, [(0, 6, 0, 10)], False, 0.4)[0], (qr, kr, vr), dout)
    parts = [varlen_backward("flash_varlen", dout.float(), q, k, v, out, lse, c, 0.4) for c in (first, second)]
    for i in range(3):
        assert ((parts[0][i] + parts[1][i]).double() - want[i]).abs().max() < 1e-5


def _tree():
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8, 9], [1, 2, 3, 10], [1, 2, 3, 10, 11, 12], [20, 21], [20, 22, 23]]
    return BranchTree.from_sequences(seqs)


def test_a_tree_is_one_causal_call_and_one_call_per_depth():
    tree = _tree()
    pieces = plan_pieces(tree.segments)
    calls = plan_calls(pieces, tree.unique_positions, tree.unique_positions)
    depth = max(_depth(tree, i) for i in range(len(tree.segments)))
    assert len(calls) == 1 + depth and all(p.causal for p in calls[0])
    assert not any(p.causal for c in calls[1:] for p in c)
    assert sum(len(c) for c in calls) == len(pieces)
    for call in calls:  # sequences consecutive over every row and key, pieces as they are
        seqs = spans(call, tree.unique_positions, tree.unique_positions)
        assert seqs[0][0] == 0 and seqs[0][2] == 0 and seqs[-1][1] == seqs[-1][3] == tree.unique_positions
        assert all(a[1] == b[0] and a[3] == b[2] for a, b in zip(seqs, seqs[1:]))
        assert {(p.q_lo, p.q_hi, p.k_lo, p.k_hi) for p in call} <= set(seqs)


def _depth(tree, i):
    d = 0
    while tree.segments[i].parent >= 0:
        i, d = tree.segments[i].parent, d + 1
    return d


def test_top_left_fused_pieces_are_refused():
    with pytest.raises(ValueError, match="not square"):
        plan_calls([AttentionPiece(0, 6, 0, 3, True)], 6, 6)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])
def test_varlen_cascade_with_a_cached_path_matches_float64(heads, kv_heads):
    tree = _tree()
    U, P, d = tree.unique_positions, 5, 16
    q, k, v = (x.requires_grad_() for x in _qkv(U, U, heads, kv_heads, d))
    pk, pv = (x.requires_grad_() for x in _qkv(P, P, kv_heads, kv_heads, d, seed=1)[1:])
    scale = d**-0.5
    calls = varlen_calls(plan_pieces(tree.segments), U, U)
    rep = heads // kv_heads
    keys = torch.cat([pk, k]).repeat_interleave(rep, 1).double()
    values = torch.cat([pv, v]).repeat_interleave(rep, 1).double()
    visible = torch.cat([torch.ones(U, P, dtype=torch.bool), tree.visibility_mask()], dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    ref = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, float("-inf")).softmax(-1), values)
    dout = torch.randn(ref.shape, dtype=torch.float64)
    want = torch.autograd.grad(ref, (q, k, v, pk, pv), dout)
    out = varlen_cascade_attention(q, k, v, calls, scale, "flash_varlen", prefix=(pk, pv))
    got = torch.autograd.grad(out, (q, k, v, pk, pv), dout.float())
    assert (out.double() - ref).abs().max() < 1e-5
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max() < 1e-5
    # and without the path, against the dense reference backend
    dense = dense_tree_attention(q, k, v, tree.last, scale)
    assert (varlen_cascade_attention(q, k, v, calls, scale, "flash_varlen") - dense).abs().max() < 1e-5


def test_causal_sequences_with_more_queries_than_keys_get_a_keyless_part():
    """The rows before a causal sequence's first key are a sequence of their own without
    keys (the memory-efficient kernel masks such rows wrongly; the result is the same)."""
    call = VarlenCall.from_spans(SPANS, True, 14, 14)
    assert call.spans == [(0, 2, 0, 0), (2, 5, 0, 3), (5, 7, 3, 3), (7, 7, 3, 6), (7, 10, 6, 12), (10, 12, 12, 12),
                          (12, 14, 12, 14)]
    assert VarlenCall.from_spans(SPANS, False, 14, 14).spans == SPANS


def test_kernel_choice_and_refusals():
    assert default_kernel(torch.device("cpu"), torch.bfloat16) == "flash_cpu"
    assert default_kernel(torch.device("cuda"), torch.bfloat16) == "flash_varlen"
    assert default_kernel(torch.device("cuda"), torch.float16) == "flash_varlen"
    assert default_kernel(torch.device("cuda"), torch.float32) == "efficient_varlen"
    check_kernel("flash_varlen", "cuda", torch.bfloat16, 256, 32, 8)
    check_kernel("efficient_varlen", "cuda", torch.float32, 512, 32, 8)
    check_kernel("flash_varlen", "cpu", torch.float32, 512, 4, 2)  # the CPU side runs what the CPU kernel runs
    for args, match in [(("flash_varlen", "cuda", torch.float32, 128, 4, 2), "dtype: .*efficient_varlen"),
                        (("flash_varlen", "cuda", torch.bfloat16, 320, 4, 2), "head_dim: .*at most 256"),
                        (("flash_vrlen", "cpu", torch.float32, 64, 4, 2), "kernel: 'flash_vrlen'"),
                        (("flash_varlen", "cpu", torch.float32, 64, 6, 4), "heads: 6")]:
        with pytest.raises(ValueError, match=match):
            check_kernel(*args)


class _HostSyncs(TorchDispatchMode):
    """Counts the ops that read a tensor's values on the host (a device sync on a GPU)."""

    SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "item", "equal", "is_nonzero"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.SYNCS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_no_host_sync_per_layer(megatron_world):
    """One training step's host syncs do not grow with the layers: tree data is planned on
    the host and copied once per unit, nothing in a layer reads a device value."""
    from conftest import make_pair

    import megatron_branch as mb

    tree = _tree()
    counts = []
    for layers in (1, 3):
        model, _ = make_pair(num_layers=layers, kernel="flash_varlen")
        mb.rollout_logprobs(model, tree).sum().backward()  # warm (kernel probes run once per process)
        with _HostSyncs() as mode:
            mb.rollout_logprobs(model, tree).sum().backward()
        counts.append(mode.count)
    assert counts[0] == counts[1], counts
    assert counts[0] <= 8, counts  # per unit: a few (3 on megatron-core 0.16.1), not per layer or piece


def test_thd_batches_are_one_varlen_call_planned_once_per_batch():
    """Megatron-RL's THD batches through the varlen kernel: the stock per-sequence result,
    cu_seqlens read on the host by the first layer only (a sync per batch, not per layer)."""
    import gc

    from conftest import make_pair

    from megatron_branch._megatron import PackedSeqParams
    from megatron_branch.attention import plain

    varlen, _ = make_pair(kernel="flash_varlen", num_layers=3)
    flash, _ = make_pair(kernel="flash_cpu", num_layers=3)
    flash.load_state_dict(varlen.state_dict())
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8, max_seqlen_kv=8)
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(5), torch.arange(7), torch.arange(8)])[None]
    before = len(plain._THD_CALLS)
    out = varlen(ids, pos, attention_mask=None, packed_seq_params=params)
    assert len(plain._THD_CALLS) == before + 1  # three layers, one plan
    assert (out - flash(ids, pos, attention_mask=None, packed_seq_params=params)).abs().max() < 1e-5
    del params
    gc.collect()
    assert len(plain._THD_CALLS) == before
