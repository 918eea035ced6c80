"""FP8 (ModelOpt fake-quant on CPU): branch replay's error against the fp32 truth is
within 2x that of the naive computation under the same FP8 emulation."""

import pytest
import torch

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.integrations.fp8 import emulate_fp8
from megatron_branch.reference.agreement import grads
from megatron_branch.reference.naive import naive_rollout_logprobs
from megatron_branch.spec.builders import build_gpt, llama_config


def _rel(a, b):
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp(min=1e-30)).item() for n in b)


def test_fp8_emulated_branch_replay_matches_fp8_emulated_naive():
    config = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2)
    branch = build_gpt(config, 128, seed=0)
    stock, stock32 = build_gpt(config, 128, branch=False), build_gpt(config, 128, branch=False)
    stock.load_state_dict(branch.state_dict())
    stock32.load_state_dict(branch.state_dict())
    batch = branching_rollouts([48, 20], [2, 3], [6, 8], 128, seed=4)
    tree = mb.BranchTree.from_sequences(batch.sequences)
    emulate_fp8(stock, lambda m: naive_rollout_logprobs(m, batch.sequences))
    emulate_fp8(branch, lambda m: mb.rollout_logprobs(m, tree))
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    adv = torch.linspace(-1.0, 1.0, len(batch.sequences))

    def run(model, t=None):
        model.zero_grad(set_to_none=True)
        lp = mb.rollout_logprobs(model, t) if t is not None else naive_rollout_logprobs(model, batch.sequences)
        losses.ppo_policy_loss(lp, lp.detach(), adv, mask)[0].backward()
        return lp.detach(), grads(model)

    lp_ref, g_ref = run(stock32)
    lp_b, g_b = run(branch, tree)
    lp_n, g_n = run(stock)
    naive_err = (lp_n - lp_ref).abs().max().item()
    assert naive_err > 1e-4  # FP8 rounding really happens
    assert (lp_b - lp_ref).abs().max().item() <= 2 * naive_err
    assert _rel(g_b, g_ref) <= 2 * _rel(g_n, g_ref)
    assert (lp_b - lp_n).abs().max().item() < naive_err  # closer to each other than to fp32


def test_unknown_modelopt_config():
    with pytest.raises(ValueError, match="no quantisation config"):
        emulate_fp8(torch.nn.Linear(2, 2), lambda m: None, config="NOPE_CFG")


def _fp8_model():
    config = llama_config(num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=2, fp8="hybrid")
    return build_gpt(config, 128, seed=0)


def test_fp8_without_transformer_engine_linears_is_refused():
    """fp8 in the config of a local-spec model would run in full precision without a word."""
    model = _fp8_model()
    tree = mb.BranchTree.from_sequences([[1, 2, 3, 4], [1, 2, 5]])
    for run in (lambda: mb.rollout_logprobs(model, tree),
                lambda: mb.replay_step(model, tree, lambda lp, ids: lp.sum()),
                lambda: mb.replay_logprobs(model, tree)):
        with pytest.raises(ValueError, match="fp8: TransformerConfig.fp8='hybrid' but the model has no Transformer "
                                             "Engine linear layers"):
            run()


def test_our_loops_have_transformer_engine_recast_fp8_weights_every_step(monkeypatch):
    """Megatron's set_is_first_microbatch flags every module that caches FP8 weight casts
    (TE's ``is_first_microbatch``); rollout_logprobs and replay_step call it before their
    first forward, as Megatron's schedules do (whether TE then recasts is gpu_check's)."""
    from megatron_branch import model as handle
    from megatron_branch.replay import step
    from megatron_branch.scoring import logprobs

    model = _fp8_model()
    cache = model.decoder.layers[0].mlp.linear_fc1
    cache.is_first_microbatch = False  # the attribute TE's linears keep
    handle.refresh_fp8_weights(model)
    assert cache.is_first_microbatch is True
    calls = []
    for module in (logprobs, step):
        monkeypatch.setattr(module, "refresh_fp8_weights", calls.append)
        monkeypatch.setattr(module, "check_model", lambda m, t: [])  # no TE here: skip the refusal
    tree = mb.BranchTree.from_sequences([[1, 2, 3, 4], [1, 2, 5]])
    mb.rollout_logprobs(model, tree)
    mb.replay_step(model, tree, lambda lp, ids: lp.sum(), max_chunk_tokens=2)
    assert calls == [model, model]


@pytest.mark.parametrize("budgets, refused", [((None, None), False), ((12, 12), False), ((None, 12), True)])
def test_data_parallel_ranks_with_different_units_under_fp8_are_refused_not_hung(budgets, refused, tmp_path):
    """TE reduces FP8 amax over data x tensor x context parallel ranks after each forward:
    ranks whose trees split into different numbers of units would hang; both raise instead."""
    import dist_worker

    from megatron_branch.distributed import free_port

    errors = dist_worker.spawn_fp8_plan(budgets, str(tmp_path), free_port())
    assert all(("tp_only_amax_red" in e) == refused for e in errors), errors
