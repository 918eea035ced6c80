"""Streaming branch replay vs the naive computation and vs the single pass."""

import pytest
import torch
from conftest import VOCAB, make_pair

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.reference.agreement import compare_grads, grads
from megatron_branch.reference.bias import prefix_grad_bias
from megatron_branch.reference.naive import naive_rollout_logprobs
from megatron_branch.replay import plan_replay, replay_logprobs, replay_step
from megatron_branch.replay.plan import last_token

TOL = 1e-5


def multi_level_forest():
    batch = branching_rollouts([24, 11], [2, 2, 3], [6, 5, 7], VOCAB, seed=2, jitter=3)
    # a rollout that ends inside a shared stem
    batch.sequences.append(batch.sequences[0][:30].clone())
    batch.prompt_lengths.append(24)
    batch.group.append(0)
    return batch


def one_prompt_tails():
    return branching_rollouts([40], [6], [9], VOCAB, seed=5, jitter=4)


class Loss:
    """A PPO loss normalised by global token counts, usable whole or per chunk."""

    def __init__(self, batch):
        self.mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
        num = len(batch.sequences)
        self.adv = torch.linspace(-1.0, 1.0, num)
        self.old = -torch.rand(self.mask.shape, generator=torch.Generator().manual_seed(3))
        self.tokens = self.mask.sum()
        self.calls = []

    def full(self, lp):
        return losses.ppo_policy_loss(lp, self.old, self.adv, self.mask, global_tokens=self.tokens)[0]

    def __call__(self, lp, ids):
        self.calls.append(ids.tolist())
        return losses.ppo_policy_loss(
            lp, self.old[ids], self.adv[ids], self.mask[ids], global_tokens=self.tokens
        )[0]


def naive_truth(stock, batch, loss):
    stock.zero_grad(set_to_none=True)
    value = loss.full(naive_rollout_logprobs(stock, batch.sequences))
    value.backward()
    return value.item(), grads(stock)


def leaf_subtree_size(tree):
    return max(s.subtree_end - s.start for s in tree.segments if s.subtree_end == s.end)


@pytest.mark.parametrize("batch_fn", [multi_level_forest, one_prompt_tails])
@pytest.mark.parametrize("chunk", ["all", "one_rollout", "several", 3, 1])
@pytest.mark.parametrize("recompute_stem", [False, True])
def test_exact_replay_matches_naive_and_single_pass(batch_fn, chunk, recompute_stem, kernel=None):
    batch = batch_fn()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    budget = {
        "all": None,
        "one_rollout": leaf_subtree_size(tree),
        "several": 3 * leaf_subtree_size(tree),
    }.get(chunk, chunk)
    branch, stock = make_pair(kernel=kernel)
    loss = Loss(batch)
    ref_loss, ref_grads = naive_truth(stock, batch, loss)

    branch.zero_grad(set_to_none=True)
    stats = replay_step(branch, tree, loss, max_chunk_tokens=budget, recompute_stem=recompute_stem)
    streamed = grads(branch)
    assert abs(stats.loss - ref_loss) <= TOL * max(1.0, abs(ref_loss))
    assert max(compare_grads(streamed, ref_grads).values()) < TOL
    if budget is not None:  # it streams (a stem may run complete subtrees with it: one chunk then suffices)
        assert stats.num_chunks + stats.num_stems > 1 and stats.num_stems >= 1
    if chunk == "one_rollout" and batch_fn is one_prompt_tails:
        assert [len(ids) for ids in loss.calls] == [1] * tree.num_rollouts

    branch.zero_grad(set_to_none=True)
    replay_step(branch, tree, loss)  # single pass
    assert max(compare_grads(streamed, grads(branch)).values()) < TOL

    assert stats.positions_forwarded == tree.unique_positions + stats.positions_recomputed
    assert (stats.positions_recomputed > 0) == (recompute_stem and stats.num_stems > 0)


@pytest.mark.parametrize("batch_fn", [multi_level_forest, one_prompt_tails])
@pytest.mark.parametrize("chunk, recompute_stem", [("all", False), ("several", True), (3, False), (1, True)])
def test_exact_replay_with_the_varlen_kernel(batch_fn, chunk, recompute_stem):
    """The CUDA default's contract (flash_varlen, its CPU side): streaming's stems, chunks
    and cached path through varlen calls."""
    test_exact_replay_matches_naive_and_single_pass(batch_fn, chunk, recompute_stem, kernel="flash_varlen")


@pytest.mark.parametrize(
    "granularity, extra",
    [
        ("full", {"recompute_method": "uniform", "recompute_num_layers": 1}),
        ("selective", {"recompute_modules": ["core_attn"]}),
    ],
)
@pytest.mark.parametrize("recompute_stem", [False, True])
def test_exact_replay_with_megatron_activation_recompute(granularity, extra, recompute_stem):
    batch = multi_level_forest()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, stock = make_pair(recompute_granularity=granularity, **extra)
    loss = Loss(batch)
    _, ref_grads = naive_truth(stock, batch, loss)
    replay_step(branch, tree, loss, max_chunk_tokens=12, recompute_stem=recompute_stem)
    assert max(compare_grads(grads(branch), ref_grads).values()) < TOL


def test_gradients_accumulate_like_backward():
    batch = one_prompt_tails()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, stock = make_pair()
    loss = Loss(batch)
    _, ref_grads = naive_truth(stock, batch, loss)
    branch.zero_grad(set_to_none=True)
    replay_step(branch, tree, loss, max_chunk_tokens=20)
    replay_step(branch, tree, loss, max_chunk_tokens=7)
    doubled = {n: 2 * g for n, g in ref_grads.items()}
    assert max(compare_grads(grads(branch), doubled).values()) < TOL


def _detached_reference(stock, batch, loss, stem_tokens):
    """Each rollout alone through the stock model, its first ``stem_tokens[r]`` positions'
    K/V (every layer) and logits detached: the tail-only gradient, computed without any
    branch-replay code."""
    state = {"n": 0}

    def detach_prefix(module, args, kwargs):
        query, key, value = args[:3]
        n = state["n"]
        key = torch.cat([key[:n].detach(), key[n:]])
        value = torch.cat([value[:n].detach(), value[n:]])
        return (query, key, value) + tuple(args[3:]), kwargs

    handles = [
        layer.self_attention.core_attention.register_forward_pre_hook(detach_prefix, with_kwargs=True)
        for layer in stock.decoder.layers
    ]
    width = max(batch.lengths) - 1
    rows = []
    try:
        for r, seq in enumerate(batch.sequences):
            n = seq.numel()
            state["n"] = stem_tokens[r]
            mask = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
            logits = stock(seq[None], torch.arange(n)[None], attention_mask=mask)[0, :-1].float()
            logits = torch.cat([logits[: stem_tokens[r]].detach(), logits[stem_tokens[r]:]])
            lp = torch.log_softmax(logits, -1).gather(-1, seq[1:, None])[:, 0]
            rows.append(torch.nn.functional.pad(lp, (0, width - lp.numel())))
    finally:
        for h in handles:
            h.remove()
    stock.zero_grad(set_to_none=True)
    loss.full(torch.stack(rows)).backward()
    return grads(stock)


def _stem_tokens_per_rollout(tree, budget):
    in_stem = torch.zeros(tree.unique_positions, dtype=torch.bool)
    for op in plan_replay(tree, budget):
        if op.kind == "stem":
            in_stem[op.start : op.end] = True
    return [int(in_stem[tree.rows[r, : int(tree.lengths[r])]].sum()) for r in range(tree.num_rollouts)]


@pytest.mark.parametrize("batch_fn, budget", [(one_prompt_tails, 20), (multi_level_forest, 12)])
def test_detached_mode_matches_an_independent_tail_only_reference(batch_fn, budget):
    batch = batch_fn()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, stock = make_pair()
    loss = Loss(batch)
    stem_tokens = _stem_tokens_per_rollout(tree, budget)
    assert any(stem_tokens)
    ref = _detached_reference(stock, batch, loss, stem_tokens)

    branch.zero_grad(set_to_none=True)
    stats = replay_step(branch, tree, loss, max_chunk_tokens=budget, prefix_grad="detached")
    detached = grads(branch)
    assert stats.prefix_grad == "detached" and stats.positions_recomputed == 0
    assert max(compare_grads(detached, ref).values()) < TOL

    _, exact = naive_truth(stock, batch, loss)
    assert max(compare_grads(detached, exact).values()) > 1e-2  # the modes are told apart


def test_prefix_grad_bias_reports_and_restores_grads():
    batch = one_prompt_tails()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, _ = make_pair()
    branch.zero_grad(set_to_none=True)
    bias = prefix_grad_bias(branch, tree, Loss(batch), max_chunk_tokens=20)
    assert -1.0 <= bias["cosine"] < 0.999
    assert bias["rel_error"] > 1e-3 and bias["rel_norm"] > 0
    assert all(p.grad is None for p in branch.parameters())


def test_forward_only_logprobs_with_the_same_chunking():
    batch = multi_level_forest()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, stock = make_pair()
    with torch.no_grad():
        ref = naive_rollout_logprobs(stock, batch.sequences)
        for budget in (None, 12, 1):
            got = replay_logprobs(branch, tree, max_chunk_tokens=budget)
            assert (got - ref).abs().max() < TOL
    assert all(p.grad is None for p in branch.parameters())


def test_no_grad_replay_step_backpropagates_nothing():
    batch = one_prompt_tails()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, _ = make_pair()
    branch.zero_grad(set_to_none=True)
    with torch.no_grad():
        stats = replay_step(branch, tree, Loss(batch), max_chunk_tokens=20)
    assert stats.loss != 0.0
    assert all(p.grad is None for p in branch.parameters())


def test_group_ids_keep_pairs_in_one_loss_call():
    # DPO-style: 3 prompts x (chosen, rejected)
    batch = branching_rollouts([30, 25, 20], [2], [8], VOCAB, seed=9)
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, _ = make_pair()
    pairs = [r // 2 for r in range(tree.num_rollouts)]
    loss = Loss(batch)
    replay_step(branch, tree, loss, max_chunk_tokens=40, group_ids=pairs)
    for call in loss.calls:
        assert all(r ^ 1 in call for r in call)  # both rollouts of every pair
    assert len(loss.calls) > 1
    with pytest.raises(ValueError, match="max_chunk_tokens must be at least 16"):
        replay_step(branch, tree, loss, max_chunk_tokens=10, group_ids=pairs)


def test_peak_memory_is_bounded_by_the_chunk_not_the_group_size():
    batch = branching_rollouts([256], [32], [48], VOCAB, seed=11)
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, _ = make_pair(hidden_size=64, ffn_hidden_size=256)
    loss = Loss(batch)
    single = replay_step(branch, tree, loss, measure_memory=True)
    chunked = replay_step(branch, tree, loss, max_chunk_tokens=256, measure_memory=True, recompute_stem=True)
    assert chunked.num_chunks > 4
    assert chunked.peak_memory_bytes < 0.5 * single.peak_memory_bytes, (
        chunked.peak_memory_bytes, single.peak_memory_bytes)


def test_bad_inputs():
    batch = one_prompt_tails()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, stock = make_pair()
    with pytest.raises(ValueError, match="loss_fn: must return a scalar tensor.*got \\(2,\\)"):
        replay_step(branch, tree, lambda lp, ids: lp.sum(-1)[:2], max_chunk_tokens=20)
    with pytest.raises(ValueError, match="loss_fn: must return a scalar tensor.*got float"):
        replay_step(branch, tree, lambda lp, ids: 1.0)
    with pytest.raises(ValueError, match="get_branch_layer_spec"):
        replay_step(stock, tree, Loss(batch))
    with pytest.raises(ValueError, match="prefix_grad: 'tail'"):
        replay_step(branch, tree, Loss(batch), prefix_grad="tail")
    with pytest.raises(ValueError, match="max_chunk_tokens: must be a positive"):
        replay_step(branch, tree, Loss(batch), max_chunk_tokens=0)
    with pytest.raises(ValueError, match="group_ids: 2 entries for 6 rollouts"):
        replay_step(branch, tree, Loss(batch), max_chunk_tokens=20, group_ids=[0, 1])


def _units(ops):
    return [(op.start, op.end) for op in ops if op.kind != "pop"]


def test_a_stem_runs_complete_subtrees_below_it_where_that_saves_a_unit():
    batch = multi_level_forest()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    plain, attached = plan_replay(tree, 16), plan_replay(tree, 16, attach_subtrees=True)
    assert len(_units(attached)) < len(_units(plain))
    with_subtrees = [op for op in attached if op.kind == "stem" and op.path_end is not None]
    assert with_subtrees
    for op in with_subtrees:
        assert op.start < op.path_end < op.end and op.end - op.start <= 16
        # the cached part is one chain; every segment after it ends its subtree inside the unit
        assert sum(op.start <= s.start < op.path_end for s in tree.segments) <= 1
        assert all(s.subtree_end <= op.end for s in tree.segments if op.path_end <= s.start < op.end)
    units = sorted(_units(attached))
    assert units[0][0] == 0 and units[-1][1] == tree.unique_positions
    assert all(a[1] == b[0] for a, b in zip(units, units[1:]))

    branch, stock = make_pair()
    loss = Loss(batch)
    ref_loss, ref_grads = naive_truth(stock, batch, loss)
    stats = replay_step(branch, tree, loss, max_chunk_tokens=16)
    assert stats.num_chunks == sum(op.kind == "chunk" for op in attached)  # the step ran the attached plan
    assert abs(stats.loss - ref_loss) <= TOL * max(1.0, abs(ref_loss))
    assert max(compare_grads(grads(branch), ref_grads).values()) < TOL
    # recomputed stems (their graph rebuilt at the pop) and constant stems (tail-only) keep the chains alone
    for kwargs in ({"recompute_stem": True}, {"prefix_grad": "detached"}):
        branch.zero_grad(set_to_none=True)
        other = replay_step(branch, tree, loss, max_chunk_tokens=16, **kwargs)
        assert other.num_chunks == sum(op.kind == "chunk" for op in plain), kwargs


def test_budget_below_the_longest_segment_splits_it():
    batch = one_prompt_tails()  # a 40-token prompt segment
    tree = mb.BranchTree.from_sequences(batch.sequences)
    ops = plan_replay(tree, 16)
    stems = [op for op in ops if op.kind == "stem"]
    assert [(op.start, op.end) for op in stems[:3]] == [(0, 16), (16, 32), (32, 40)]
    assert all(op.end - op.start <= 16 for op in ops if op.kind != "pop")
    covered = sorted((op.start, op.end) for op in ops if op.kind != "pop")
    assert covered[0][0] == 0 and covered[-1][1] == tree.unique_positions
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    assert set(last_token(tree)) <= set(range(tree.unique_positions))


@pytest.mark.parametrize("backend, budget", [("cascade", None), ("dense", None), ("repeat_kv", None),
                                             ("dense", 12), ("cascade", 12)])
def test_replay_with_every_backend(backend, budget):
    batch = multi_level_forest()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, stock = make_pair(backend=backend)
    loss = Loss(batch)
    _, ref_grads = naive_truth(stock, batch, loss)
    replay_step(branch, tree, loss, max_chunk_tokens=budget)
    assert max(compare_grads(grads(branch), ref_grads).values()) < TOL


def test_repeat_kv_backend_refuses_streaming():
    batch = one_prompt_tails()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, _ = make_pair(backend="repeat_kv")
    with pytest.raises(ValueError, match="repeat_kv"):
        replay_step(branch, tree, Loss(batch), max_chunk_tokens=20)


@pytest.mark.parametrize("agg, arg", [("token-mean", "global_tokens"), ("seq-mean-token-mean", "global_seqs")])
def test_a_per_chunk_normaliser_is_refused_not_silently_used(agg, arg):
    """Issue 21: a ``mb.losses`` call inside a chunk that would normalise by the chunk's own
    counts raises, naming the argument; with the global count it equals the one-pass loss."""
    batch = one_prompt_tails()
    branch, _ = make_pair()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    adv = torch.linspace(-1.0, 1.0, len(batch.sequences))

    def per_call(lp, ids):
        return losses.ppo_policy_loss(lp, lp.detach(), adv[ids], mask[ids], agg=agg)[0]

    with pytest.raises(ValueError, match=f"{arg}: not given.*holds 1 of the batch's 6 rollouts"):
        replay_step(branch, tree, per_call, max_chunk_tokens=12)
    whole = replay_step(branch, tree, per_call)  # one pass: the call holds the whole batch
    counts = {"global_tokens": mask.sum(), "global_seqs": float(len(batch.sequences))}

    def global_norm(lp, ids):
        return losses.ppo_policy_loss(lp, lp.detach(), adv[ids], mask[ids], agg=agg, **{arg: counts[arg]})[0]

    chunked = replay_step(branch, tree, global_norm, max_chunk_tokens=12)
    assert chunked.num_chunks > 1 and abs(chunked.loss - whole.loss) < 1e-5 * max(1.0, abs(whole.loss))


def test_dpo_pairs_without_global_pairs_are_refused_in_chunks():
    batch = one_prompt_tails()
    branch, _ = make_pair()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    groups = [i // 2 for i in range(len(batch.sequences))]
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)

    def dpo(lp, ids):
        seq = losses.sequence_logprobs(lp, mask[ids])
        return losses.dpo_loss(seq[0::2], seq[1::2], seq[0::2].detach(), seq[1::2].detach())[0]

    with pytest.raises(ValueError, match="global_pairs: not given"):
        replay_step(branch, tree, dpo, max_chunk_tokens=50, group_ids=groups)
