"""Branch replay on Megatron's training machinery, in one process: DDP's ``main_grad`` and
held bucket reduction, Megatron optimizers on CPU, whole-tree DP plans, micro-batches."""

import pytest
import torch

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch._megatron import OptimizerConfig, finalize_model_grads
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.cpu import cuda_factories_on_cpu
from megatron_branch.reference.agreement import compare_grads
from megatron_branch.reference.naive import naive_rollout_logprobs
from megatron_branch.scoring.unit import linear_weight
from megatron_branch.spec.builders import build_gpt, llama_config
from megatron_branch.training import (
    forward_backward_step,
    get_optimizer,
    plan_data_parallel,
    train_step,
    wrap_ddp,
)
from megatron_branch.training.batching import TreeMicroBatch

VOCAB = 128
TOL = 1e-5


def config(**overrides):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                calculate_per_token_loss=True)
    base.update(overrides)
    return llama_config(**base)


def models(**overrides):
    """(branch model, stock model) with the same weights."""
    cfg = config(**overrides)
    branch = build_gpt(cfg, VOCAB, seed=0)
    stock = build_gpt(cfg, VOCAB, branch=False)
    stock.load_state_dict(branch.state_dict())
    return branch, stock


def batch_and_loss(seed=5, prompts=(24, 17)):
    batch = branching_rollouts(list(prompts), [2, 3], [5, 6], VOCAB, seed=seed, jitter=3)
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    adv = torch.linspace(-1.0, 1.0, len(batch.sequences))
    old = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))

    def loss_fn(lp, ids):  # (loss_sum, num_tokens), Megatron's per-token convention
        m = mask[ids][:, : lp.shape[1]]
        w = lp.shape[1]
        return losses.ppo_policy_loss(lp, old[ids][:, :w], adv[ids], m, global_tokens=1.0)[0], m.sum()

    return batch, loss_fn, mask


def naive_grads(stock, batch, loss_fn):
    stock.zero_grad(set_to_none=True)
    lp = naive_rollout_logprobs(stock, batch.sequences)
    loss, count = loss_fn(lp, torch.arange(len(batch.sequences)))
    (loss / count).backward()
    return {n: p.grad.detach().clone() for n, p in stock.named_parameters()}


def main_grads(ddp):
    return {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}


class SyncCounter:
    """Counts each DDP bucket group's ``start_grad_sync`` calls (instruments the real method)."""

    def __init__(self, ddp):
        self.calls = {}
        for i, bg in enumerate(ddp.bucket_groups):
            original = bg.start_grad_sync

            def counted(*a, _i=i, _f=original, **k):
                self.calls[_i] = self.calls.get(_i, 0) + 1
                return _f(*a, **k)

            bg.start_grad_sync = counted
        self.groups = len(ddp.bucket_groups)

    def reset(self):
        self.calls = {}


@pytest.mark.parametrize("fp32_reduce", [True, False], ids=["fp32-reduce", "param-dtype-reduce"])
@pytest.mark.parametrize("replay", [
    dict(),
    dict(max_chunk_tokens=7),
    dict(max_chunk_tokens=7, recompute_stem=True),
], ids=["single-pass", "streaming", "streaming-recompute"])
def test_ddp_main_grad_equals_naive(replay, fp32_reduce):
    batch, loss_fn, mask = batch_and_loss()
    branch, stock = models()
    ref = naive_grads(stock, batch, loss_fn)
    ddp = wrap_ddp(branch, grad_reduce_in_fp32=fp32_reduce, overlap_grad_reduce=True, bucket_size=5000)
    counter = SyncCounter(ddp)
    tree = mb.BranchTree.from_sequences(batch.sequences)
    for step in range(2):  # the first step records Megatron's golden per-bucket counts
        ddp.zero_grad_buffer()
        counter.reset()
        stats = mb.replay_step(ddp, tree, loss_fn, **replay)
        if step == 1:
            # every bucket was dispatched once, during the final backward of the step
            assert counter.groups > 1 and counter.calls == {i: 1 for i in range(counter.groups)}
        with cuda_factories_on_cpu():
            finalize_model_grads([ddp], torch.tensor(int(stats.num_tokens), dtype=torch.int))
        if step == 1:
            assert counter.calls == {i: 1 for i in range(counter.groups)}
    assert stats.num_tokens == float(mask.sum())
    diffs = compare_grads(main_grads(ddp), ref)
    assert max(diffs.values()) < TOL, max(diffs, key=diffs.get)
    assert all(p.grad is None for p in ddp.module.parameters())


def test_replay_inside_callers_no_sync_holds_every_bucket():
    batch, loss_fn, _ = batch_and_loss()
    branch, _ = models()
    ddp = wrap_ddp(branch, overlap_grad_reduce=True, bucket_size=5000)
    counter = SyncCounter(ddp)
    tree = mb.BranchTree.from_sequences(batch.sequences)
    with ddp.no_sync():
        mb.replay_step(ddp, tree, loss_fn, max_chunk_tokens=9)
        assert not any(bg.is_last_microbatch for bg in ddp.bucket_groups)
    assert counter.calls == {}
    assert all(bg.is_last_microbatch for bg in ddp.bucket_groups)


def test_tail_only_and_bias_under_ddp():
    batch, loss_fn, _ = batch_and_loss()
    plain, _ = models()
    ddp = wrap_ddp(models()[0], overlap_grad_reduce=True, bucket_size=5000)
    ddp.module.load_state_dict(plain.state_dict())
    tree = mb.BranchTree.from_sequences(batch.sequences)
    mb.replay_step(plain, tree, loss_fn, max_chunk_tokens=9, prefix_grad="detached")
    ddp.zero_grad_buffer()
    mb.replay_step(ddp, tree, loss_fn, max_chunk_tokens=9, prefix_grad="detached")
    diffs = compare_grads(main_grads(ddp), {n: p.grad for n, p in plain.named_parameters()})
    assert max(diffs.values()) < TOL
    kept = main_grads(ddp)
    bias = mb.prefix_grad_bias(ddp, tree, loss_fn, max_chunk_tokens=9)
    assert 0.0 < bias["cosine"] < 0.9999
    assert all(torch.equal(kept[n], p.main_grad) for n, p in ddp.module.named_parameters())


def test_model_chunk_lists_and_refused_wrappers():
    batch, loss_fn, _ = batch_and_loss()
    branch, _ = models()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    ddp = wrap_ddp(branch)
    ref = mb.rollout_logprobs(branch, tree)
    assert torch.equal(mb.rollout_logprobs([ddp], tree), ref)
    assert torch.equal(mb.replay_logprobs([ddp], tree, max_chunk_tokens=9),
                       mb.replay_logprobs(branch, tree, max_chunk_tokens=9))
    with pytest.raises(ValueError, match="one model chunk, got 2"):
        mb.rollout_logprobs([ddp, ddp], tree)
    torch_ddp = torch.nn.parallel.DistributedDataParallel(models()[0])
    with pytest.raises(ValueError, match="torch.nn.parallel.DistributedDataParallel"):
        mb.replay_step(torch_ddp, tree, loss_fn)
    with pytest.raises(ValueError, match="Megatron's optimizers need chunks wrapped"):
        get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [branch])


@pytest.mark.parametrize("kind", ["fp32", "distributed", "bf16"])
def test_megatron_optimizers_step_on_cpu(kind):
    bf16 = kind == "bf16"
    cfg = config(bf16=bf16)
    model = build_gpt(cfg, VOCAB, seed=0)
    ddp = wrap_ddp(model, bf16=bf16, use_distributed_optimizer=kind == "distributed")
    opt = get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=bf16,
                                        use_distributed_optimizer=kind == "distributed"), [ddp])
    batch, loss_fn, _ = batch_and_loss()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    main = [m for o in opt.chained_optimizers for g in getattr(o, "fp32_from_float16_groups", []) for m in g]
    main_before = [m.detach().clone() for m in main]
    result = train_step([ddp], opt, [tree], loss_fn)
    assert result.update_successful and result.grad_norm > 0
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach().float(), before[n])}
    # bf16 norm weights start at 1.0, where an update of lr=1e-3 is below bf16's resolution
    assert moved == {n for n in before if not (bf16 and "norm" in n)}
    assert len(main) == (len(before) if bf16 else 0)
    assert all(not torch.equal(m, b) for m, b in zip(main, main_before))


def test_training_refuses_what_would_be_silently_different():
    batch, loss_fn, _ = batch_and_loss()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    ddp = wrap_ddp(build_gpt(config(), VOCAB, seed=0))
    opt = get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [ddp])
    with pytest.raises(ValueError, match="not a Megatron optimizer"):
        train_step([ddp], torch.optim.AdamW(ddp.parameters()), [tree], loss_fn)
    with pytest.raises(ValueError, match=r"must return \(loss_sum, num_tokens\)"):
        train_step([ddp], opt, [tree], lambda lp, ids: loss_fn(lp, ids)[0])
    with pytest.raises(ValueError, match=r"must return \(loss_sum, num_tokens\)"):
        train_step([ddp], opt, [tree], lambda lp, ids: loss_fn(lp, ids)[0], max_chunk_tokens=9)
    mean_cfg = wrap_ddp(build_gpt(config(calculate_per_token_loss=False), VOCAB, seed=0))
    mean_opt = get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [mean_cfg])
    with pytest.raises(ValueError, match="calculate_per_token_loss"):
        train_step([mean_cfg], mean_opt, [tree], loss_fn)
    with pytest.raises(ValueError, match="wrapped in Megatron's DistributedDataParallel"):
        forward_backward_step([build_gpt(config(), VOCAB, seed=0)], [tree], loss_fn)


@pytest.mark.parametrize("streaming", [None, 11], ids=["schedule", "streaming"])
def test_micro_batches_give_the_gradient_of_one_batch(streaming):
    batch, loss_fn, _ = batch_and_loss(prompts=(24, 17, 30, 9))
    branch, stock = models()
    ref = naive_grads(stock, batch, loss_fn)
    ddp = wrap_ddp(branch, overlap_grad_reduce=True, bucket_size=5000)
    for budget in (None, 100):
        plan = plan_data_parallel(batch.sequences, batch.group, 1, micro_batch_tokens=budget,
                                  streaming=streaming is not None)
        items = plan.ranks[0]
        assert len(items) == 1 if budget is None else len(items) >= 3
        loss_sum, tokens = forward_backward_step([ddp], items, loss_fn, max_chunk_tokens=streaming)
        assert tokens == sum(int(loss_fn(torch.zeros(len(it.rollouts), it.width), it.rollouts)[1])
                             for it in items)
        diffs = compare_grads(main_grads(ddp), ref)
        assert max(diffs.values()) < TOL, (budget, max(diffs, key=diffs.get))


def test_plan_keeps_groups_whole_and_balances_work():
    batch = branching_rollouts([48, 32, 40, 24, 56, 16, 36, 28], [2, 4], [8, 12], VOCAB, seed=0, jitter=4)
    weight = linear_weight(config())
    for dp in (2, 4):
        plan = plan_data_parallel(batch.sequences, batch.group, dp, micro_batch_tokens=200, linear_weight=weight)
        assert plan.imbalance <= 1.10, plan.report()
        seen = []
        for rank in plan.ranks:
            for item in rank:
                assert isinstance(item, TreeMicroBatch) and item.tree.unique_positions <= 200
                groups = {batch.group[int(r)] for r in item.rollouts}
                for g in groups:  # a group is never cut
                    assert sorted(int(r) for r in item.rollouts if batch.group[int(r)] == g) == \
                        [r for r, gg in enumerate(batch.group) if gg == g]
                seen += [int(r) for r in item.rollouts]
                for j, r in enumerate(item.rollouts):
                    assert torch.equal(item.tree.sequence(j), batch.sequences[int(r)])
        assert sorted(seen) == list(range(len(batch.sequences)))
    assert "max/mean work over DP ranks" in plan.report()


def test_plan_bad_inputs():
    batch = branching_rollouts([48, 32], [2], [8], VOCAB, seed=0)
    with pytest.raises(ValueError, match="2 groups cannot feed 4 data-parallel ranks"):
        plan_data_parallel(batch.sequences, batch.group, 4)
    with pytest.raises(ValueError, match="group_ids: 3 entries for 4 rollouts"):
        plan_data_parallel(batch.sequences, [0, 0, 1], 1)
    with pytest.raises(ValueError, match="group 0 has 64 unique tokens, more than the budget of 50"):
        plan_data_parallel(batch.sequences, batch.group, 1, micro_batch_tokens=50)
    plan = plan_data_parallel(batch.sequences, batch.group, 1, micro_batch_tokens=50, streaming=True)
    assert len(plan.ranks[0]) == 2
    with pytest.raises(ValueError, match="micro_batch_tokens: must be a positive"):
        plan_data_parallel(batch.sequences, batch.group, 1, micro_batch_tokens=0)


def test_pipeline_forward_step_refuses_megatrons_mean():
    batch, loss_fn, _ = batch_and_loss()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    from megatron_branch.training.schedule import forward_backward

    model = build_gpt(config(calculate_per_token_loss=False), VOCAB, seed=0)
    with pytest.raises(ValueError, match="calculate_per_token_loss"):
        forward_backward(model, [tree], loss_fn)
    out = forward_backward(model, [tree], lambda lp, ids: lp.sum(), forward_only=True)
    assert len(out) == 1 and float(out[0]["lm loss"][0]) < 0
