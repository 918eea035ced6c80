"""Streaming replay at any length: 64K-token prompts with 32-token chunks, trees a thousand
levels deep, one prefix piece however many stems are cached."""

import time

import pytest
import torch

import megatron_branch as mb
from megatron_branch.attention import kernels
from megatron_branch.replay.plan import path_capacity, plan_replay
from megatron_branch.spec.builders import build_gpt, llama_config

VOCAB = 32


def tiny(max_len):
    cfg = llama_config(num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1, ffn_hidden_size=32)
    return build_gpt(cfg, VOCAB, seed=0, max_sequence_length=max_len)


def long_prompt_tree(prompt_len, tails=3, tail_len=8):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    seqs = [torch.cat([prompt, torch.randint(0, VOCAB, (tail_len,), generator=gen)]) for _ in range(tails)]
    return mb.BranchTree.from_sequences(seqs)


def test_plan_of_a_128k_prompt_is_iterative_and_sized():
    tree = long_prompt_tree(131072, tails=16, tail_len=64)
    start = time.time()
    ops = plan_replay(tree, 32)
    assert time.time() - start < 10
    stems = sum(op.kind == "stem" for op in ops)
    assert stems >= 131072 // 32 - 1
    assert path_capacity(ops) >= 131072 - 32 and path_capacity(ops) <= tree.unique_positions


def test_64k_prompt_in_32_token_chunks_equals_the_single_pass():
    tree = long_prompt_tree(65536)
    model = tiny(65536 + 16)
    with torch.no_grad():
        ref = mb.rollout_logprobs(model, tree)
    got = mb.replay_logprobs(model, tree, max_chunk_tokens=32)
    assert (got - ref).abs().max() < 1e-5


@pytest.mark.parametrize("recompute_stem", [False, True])
def test_long_prompt_streaming_gradients_equal_the_single_pass(recompute_stem):
    tree = long_prompt_tree(3000, tails=4, tail_len=6)
    model = tiny(3100)
    mask = (torch.arange(tree.max_len - 1)[None, :] >= 2990).float().expand(tree.num_rollouts, -1)

    def loss_fn(lp, ids):
        return -(lp * mask[ids]).sum() / 40

    model.zero_grad(set_to_none=True)
    loss_fn(mb.rollout_logprobs(model, tree), torch.arange(tree.num_rollouts)).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    stats = mb.replay_step(model, tree, loss_fn, max_chunk_tokens=32, recompute_stem=recompute_stem)
    assert stats.num_stems >= 90
    for n, p in model.named_parameters():
        assert (p.grad - ref[n]).abs().max() <= 1e-5 * ref[n].abs().max(), n


def comb(depth):
    """Rollout ``i`` = the first ``i`` tokens of a base sequence plus a distinct token: a
    tree that branches at every depth (``depth`` nested segments)."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, VOCAB - 1, (depth,), generator=gen)
    return mb.BranchTree.from_sequences([torch.cat([base[:i], torch.tensor([VOCAB - 1])])
                                         for i in range(1, depth + 1)])


def test_a_thousand_levels_deep_tree_replays_exactly():
    deep = comb(1200)
    assert len(deep.segments) >= 2 * 1200 - 1
    model = tiny(1300)
    with torch.no_grad():
        ref_lp = mb.rollout_logprobs(model, deep)
    assert (mb.replay_logprobs(model, deep, max_chunk_tokens=3) - ref_lp).abs().max() < 1e-5
    tree = comb(300)

    def loss_fn(lp, ids):
        return lp.sum() / 1000

    model.zero_grad(set_to_none=True)
    loss_fn(mb.rollout_logprobs(model, tree), torch.arange(tree.num_rollouts)).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    stats = mb.replay_step(model, tree, loss_fn, max_chunk_tokens=3)
    assert stats.num_stems >= 290
    for n, p in model.named_parameters():
        assert (p.grad - ref[n]).abs().max() <= 1e-5 * ref[n].abs().max(), n


def test_one_prefix_piece_per_unit_whatever_the_number_of_stems(monkeypatch):
    """A unit below many cached stems attends to all of them in one kernel call per layer."""
    tree = long_prompt_tree(640, tails=1, tail_len=8)
    model = tiny(700)
    calls = []
    fwd, bwd = kernels.KERNELS["flash_cpu"]

    def counted(q, k, v, causal, scale):
        calls.append((q.shape[0], k.shape[0], causal))
        return fwd(q, k, v, causal, scale)

    monkeypatch.setitem(kernels.KERNELS, "flash_cpu", (counted, bwd))
    mb.replay_logprobs(model, tree, max_chunk_tokens=32)
    # one chain: every piece of a unit is causal except its one prefix piece
    prefix_calls = [c for c in calls if not c[2]]
    # one prefix call per unit below the first stem (19 stems + the last chunk), none per stem
    assert len(prefix_calls) == 20
    assert [c[1] for c in prefix_calls] == list(range(32, 641, 32))
