"""bf16 (Megatron's Float16Module) branch replay: its error against the fp32 truth is
within 2x the error of the naive computation in the same precision."""

import torch

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.reference.agreement import grads
from megatron_branch.reference.naive import naive_rollout_logprobs
from megatron_branch.spec.builders import build_gpt, llama_config


def _pair(bf16):
    from megatron.core.transformer.module import Float16Module

    config = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          bf16=bf16, params_dtype=torch.float32)
    branch = build_gpt(config, 128, seed=0)
    stock = build_gpt(config, 128, branch=False)
    stock.load_state_dict(branch.state_dict())
    if bf16:
        branch, stock = Float16Module(config, branch), Float16Module(config, stock)
    return branch, stock


def _run(model, batch, tree=None):
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    adv = torch.linspace(-1.0, 1.0, len(batch.sequences))
    model.zero_grad(set_to_none=True)
    lp = mb.rollout_logprobs(model, tree) if tree is not None else naive_rollout_logprobs(model, batch.sequences)
    losses.ppo_policy_loss(lp, lp.detach(), adv, mask)[0].backward()
    g = {n.replace("module.", "", 1): t.float() for n, t in grads(model).items()}
    return lp.detach().float(), g


def _max_rel(a, b):
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp(min=1e-30)).item() for n in b)


def test_bf16_branch_error_within_twice_the_bf16_naive_error():
    batch = branching_rollouts([48, 20], [2, 3], [6, 8], 128, seed=4)
    tree = mb.BranchTree.from_sequences(batch.sequences)
    _, stock32 = _pair(False)
    lp_ref, g_ref = _run(stock32, batch)
    branch16, stock16 = _pair(True)
    lp_b, g_b = _run(branch16, batch, tree)
    lp_n, g_n = _run(stock16, batch)
    lp_naive_err = (lp_n - lp_ref).abs().max().item()
    lp_branch_err = (lp_b - lp_ref).abs().max().item()
    assert lp_naive_err > 1e-4  # bf16 really is in use
    assert lp_branch_err <= 2 * lp_naive_err, (lp_branch_err, lp_naive_err)
    assert _max_rel(g_b, g_ref) <= 2 * _max_rel(g_n, g_ref), (_max_rel(g_b, g_ref), _max_rel(g_n, g_ref))
