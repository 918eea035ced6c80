"""The branch spec on batches without tree data equals Megatron's stock local spec.

Masks (padding, arbitrary, fully masked rows), every mask type, a query block after
cached keys (bottom-right causality), and THD packing (which the stock local attention
refuses: compared with each sequence run alone) — fp32, 1e-5, values and gradients.
"""

import pytest
import torch
from conftest import make_pair, rand_seq

from megatron_branch._megatron import AttnMaskType, PackedSeqParams
from megatron_branch.spec.builders import llama_config
from megatron_branch.spec.core_attention import BranchCoreAttention

TOL = 1e-5


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_both(branch, stock, ids, pos, **kwargs):
    """Forward + backward of a fixed random projection of the logits on both models."""
    out = []
    for m in (branch, stock):
        m.zero_grad(set_to_none=True)
        logits = m(ids, pos, **kwargs)
        weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
        (logits * weight).sum().backward()
        out.append((logits.detach(), _grads(m)))
    return out


def assert_same(results):
    (lb, gb), (ls, gs) = results
    assert (lb - ls).abs().max() < TOL * max(1.0, ls.abs().max())
    assert set(gb) == set(gs)
    for n in gs:
        assert (gb[n] - gs[n]).abs().max() <= TOL * max(gs[n].abs().max(), 1e-12), n


def left_padded(lengths, width, gen):
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    pos = torch.zeros(len(lengths), width, dtype=torch.long)
    keep = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = rand_seq(gen, n)
        pos[i, width - n:] = torch.arange(n)
        keep[i, width - n:] = True
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    # True = masked out: padding keys, and the future
    mask = ~(causal[None] & keep[:, None, :])
    return ids, pos, mask[:, None]


def test_left_padded_batch_with_padding_mask_equals_stock():
    branch, stock = make_pair()
    gen = torch.Generator().manual_seed(1)
    ids, pos, mask = left_padded([13, 9, 5], 13, gen)
    assert mask.all(-1).any()  # the padding queries have no visible key: stock's uniform rows
    results = run_both(branch, stock, ids, pos, attention_mask=mask)
    assert_same(results)
    with torch.no_grad():  # the guard: the mask matters here (ignoring it differs a lot)
        assert (branch(ids, pos, attention_mask=None) - results[0][0]).abs().max() > 1e-1


def test_arbitrary_mask_broadcast_over_the_batch_equals_stock():
    branch, stock = make_pair()
    gen = torch.Generator().manual_seed(2)
    ids = torch.stack([rand_seq(gen, 11) for _ in range(2)])
    pos = torch.arange(11).expand(2, -1)
    mask = torch.rand(1, 1, 11, 11, generator=gen) < 0.4
    mask[..., 3, :] = True  # a fully masked row
    assert_same(run_both(branch, stock, ids, pos, attention_mask=mask))


def test_causal_without_mask_equals_stock_default_mask():
    branch, stock = make_pair()
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([rand_seq(gen, 10) for _ in range(3)])
    pos = torch.arange(10).expand(3, -1)
    assert_same(run_both(branch, stock, ids, pos, attention_mask=None))


def core_pair(mask_type, heads=4, groups=2):
    config = llama_config(num_layers=1, hidden_size=32, num_attention_heads=heads, num_query_groups=groups)
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    ours = BranchCoreAttention(config, 1, mask_type)
    stock = DotProductAttention(config, 1, mask_type, "self")
    return ours, stock


def qkv(sq, sk, b=2, heads=4, groups=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, heads, d, generator=gen).requires_grad_()
    k = torch.randn(sk, b, groups, d, generator=gen).requires_grad_()
    v = torch.randn(sk, b, groups, d, generator=gen).requires_grad_()
    return q, k, v


def compare_core(ours, stock, q, k, v, ours_mask, stock_mask, **kwargs):
    results = []
    for module, mask in ((ours, ours_mask), (stock, stock_mask)):
        out = module(q, k, v, mask, **kwargs)
        g = torch.autograd.grad(out.square().sum(), (q, k, v))
        results.append((out.detach(), g))
    (o1, g1), (o2, g2) = results
    assert (o1 - o2).abs().max() < TOL
    for a, b in zip(g1, g2):
        assert (a - b).abs().max() < TOL * max(1.0, b.abs().max())


@pytest.mark.parametrize("sq, sk", [(1, 9), (4, 9), (9, 9)])
def test_query_block_after_cached_keys_is_bottom_right_causal(sq, sk):
    ours, stock = core_pair(AttnMaskType.causal)
    q, k, v = qkv(sq, sk)
    # the stock local attention needs this mask spelled out for sq != sk (it asserts otherwise)
    bottom_right = ~torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)[None, None]
    compare_core(ours, stock, q, k, v, None, bottom_right if sq > 1 else None)


@pytest.mark.parametrize("mask_type", [AttnMaskType.padding, AttnMaskType.no_mask, AttnMaskType.arbitrary])
def test_unmasked_types_attend_to_every_key_like_stock(mask_type):
    ours, stock = core_pair(mask_type)
    q, k, v = qkv(6, 6)
    compare_core(ours, stock, q, k, v, None, None)
    # the per-call type overrides the constructor's (as Transformer Engine's attention does)
    causal = ~torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    compare_core(ours, stock, q, k, v, None, causal, attn_mask_type=AttnMaskType.causal)


def test_bad_masks_and_types_are_refused():
    ours, _ = core_pair(AttnMaskType.causal)
    q, k, v = qkv(5, 5)
    with pytest.raises(ValueError, match=r"attention_mask: shape \(2, 1, 5, 4\) does not broadcast"):
        ours(q, k, v, torch.zeros(2, 1, 5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask: must be a bool tensor"):
        ours(q, k, v, torch.zeros(2, 1, 5, 5))
    with pytest.raises(ValueError, match="padding_causal needs the padding mask"):
        ours(q, k, v, None, attn_mask_type=AttnMaskType.padding_causal)
    q2, k2, v2 = qkv(6, 5)
    with pytest.raises(ValueError, match="6 queries but only 5 keys"):
        ours(q2, k2, v2, None)


def thd_params(lengths, **kwargs):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    fields = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                  max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    fields.update(kwargs)
    return PackedSeqParams(**fields)


def test_thd_packing_equals_each_sequence_alone():
    """Megatron-RL's bins: sequences, then the bin's padding as a sequence, then zero-length
    ghost sequences; RoPE restarts per sequence."""
    branch, stock = make_pair()
    gen = torch.Generator().manual_seed(4)
    seqs = [rand_seq(gen, n) for n in (7, 12, 3, 9)]
    lengths = [7, 12, 3, 9]
    ids = torch.cat(seqs).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    params = thd_params(lengths)
    params.cu_seqlens_q = params.cu_seqlens_kv = torch.cat([params.cu_seqlens_q, torch.tensor([31, 31], dtype=torch.int32)])
    weight = torch.randn(1, 31, 128, generator=gen)
    branch.zero_grad(set_to_none=True)
    logits = branch(ids, pos, attention_mask=None, packed_seq_params=params)
    (logits * weight).sum().backward()
    stock.zero_grad(set_to_none=True)
    ref, start = [], 0
    for s in seqs:
        n = s.numel()
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
        out = stock(s.unsqueeze(0), torch.arange(n).unsqueeze(0), attention_mask=mask)
        (out * weight[:, start:start + n]).sum().backward()
        ref.append(out.detach())
        start += n
    assert (logits.detach() - torch.cat(ref, 1)).abs().max() < TOL
    with torch.no_grad():  # the guard: one causal sequence over the whole pack differs
        assert (branch(ids, pos, attention_mask=None) - logits).abs().max() > 1e-1
    gs = _grads(stock)
    for n, p in branch.named_parameters():
        assert (p.grad - gs[n]).abs().max() <= TOL * max(gs[n].abs().max(), 1e-12), n


def test_thd_bidirectional_types_and_bad_cu_seqlens():
    ours, stock = core_pair(AttnMaskType.no_mask)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(10, 4, 8, generator=gen)
    k, v = torch.randn(10, 2, 8, generator=gen), torch.randn(10, 2, 8, generator=gen)
    out = ours(q, k, v, None, packed_seq_params=thd_params([4, 6]))
    for lo, hi in ((0, 4), (4, 10)):  # each sequence attends to all of itself
        ref = stock(q[lo:hi, None], k[lo:hi, None], v[lo:hi, None], None)
        assert (out[lo:hi] - ref[:, 0]).abs().max() < TOL
    with pytest.raises(ValueError, match="cu_seqlens_q: ends at 9 but the packed batch has 10 tokens"):
        ours(q, k, v, None, packed_seq_params=thd_params([4, 5]))
    with pytest.raises(ValueError, match="needs cu_seqlens_q"):
        ours(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(ValueError, match="cu_seqlens_q_padded: padded THD layouts"):
        ours(q, k, v, None, packed_seq_params=thd_params(
            [4, 6], cu_seqlens_q_padded=torch.tensor([0, 5, 10], dtype=torch.int32)))
    with pytest.raises(ValueError, match="must start at 0 and never decrease"):
        ours(q, k, v, None, packed_seq_params=thd_params([4, 6], cu_seqlens_q=torch.tensor([0, 6, 4, 10]),
                                                         cu_seqlens_kv=None))
    with pytest.raises(ValueError, match="THD packing takes no mask"):
        ours(q, k, v, torch.zeros(1, 1, 10, 10, dtype=torch.bool), packed_seq_params=thd_params([4, 6]))
