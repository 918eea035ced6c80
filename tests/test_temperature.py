"""Sampling temperature (issue 20): log-probs and entropies of ``softmax(logits / T)``,
one number or one per rollout, exact against the naive computation at the same
temperature (log-probs, entropy, every gradient), in one pass, streaming and through
Megatron's training step; bad temperatures are refused naming the rollout."""

import pytest
import torch
from conftest import make_pair

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.reference.agreement import compare_grads, grads
from megatron_branch.reference.naive import naive_rollout_logprobs

TOL = 1e-5


def batch():
    return branching_rollouts([20, 13], [2, 3], [5, 6], 128, seed=4, jitter=3)


def per_rollout_temps(n):
    # rollouts of one prompt share rows but not temperatures
    return torch.tensor([[0.6, 1.0, 1.3][i % 3] for i in range(n)])


def naive_entropy(model, seqs, temps):
    rows = []
    width = max(len(s) for s in seqs) - 1
    for s, t in zip(seqs, temps):
        n = len(s)
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
        logits = model(s[None], torch.arange(n)[None], attention_mask=mask)[0, :-1].float() / float(t)
        ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        rows.append(torch.nn.functional.pad(ent, (0, width - ent.numel())))
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["scalar", "per_rollout"])
def test_one_pass_matches_naive_at_the_same_temperature(kind):
    b = batch()
    seqs = b.sequences
    temps = torch.full((len(seqs),), 0.7) if kind == "scalar" else per_rollout_temps(len(seqs))
    temperature = 0.7 if kind == "scalar" else temps
    branch, stock = make_pair()
    tree = mb.BranchTree.from_sequences(seqs)
    weights = torch.linspace(-1.0, 1.0, len(seqs))
    lp, ent = mb.rollout_logprobs(branch, tree, temperature=temperature, entropy=True)
    (lp.sum(1) * weights).sum().backward()
    lp_ref = naive_rollout_logprobs(stock, seqs, temperature=temperature)
    (lp_ref.sum(1) * weights).sum().backward()
    assert (lp.detach() - lp_ref.detach()).abs().max() < TOL
    diffs = compare_grads(grads(branch), grads(stock))
    assert max(diffs.values()) < TOL, max(diffs, key=diffs.get)
    with torch.no_grad():
        valid = tree.rows[:, 1:] >= 0
        ent_ref = naive_entropy(stock, seqs, temps)
        assert (torch.where(valid, ent - ent_ref, torch.zeros(())).abs().max()) < TOL
    # and the temperature matters: at T = 1 the log-probs differ
    with torch.no_grad():
        assert (mb.rollout_logprobs(branch, tree) - lp.detach()).abs().max() > 1e-3


def test_streaming_with_per_rollout_temperatures_equals_the_one_pass():
    b = batch()
    branch, _ = make_pair()
    tree = mb.BranchTree.from_sequences(b.sequences)
    temps = per_rollout_temps(tree.num_rollouts)
    mask = losses.response_mask(b.lengths, b.prompt_lengths)
    adv = torch.linspace(-1.0, 1.0, tree.num_rollouts)

    def loss_fn(lp, ids):
        return losses.ppo_policy_loss(lp, lp.detach(), adv[ids], mask[ids], global_tokens=mask.sum())[0]

    one = mb.replay_step(branch, tree, loss_fn, temperature=temps)
    g_one = grads(branch)
    branch.zero_grad(set_to_none=True)
    chunked = mb.replay_step(branch, tree, loss_fn, max_chunk_tokens=9, temperature=temps, recompute_stem=True)
    assert chunked.num_stems > 1 and abs(chunked.loss - one.loss) < 1e-5
    assert max(compare_grads(grads(branch), g_one).values()) < TOL
    with torch.no_grad():
        lp = mb.rollout_logprobs(branch, tree, temperature=temps)
    assert (mb.replay_logprobs(branch, tree, max_chunk_tokens=9, temperature=temps) - lp).abs().max() < TOL


@pytest.mark.parametrize("streaming", [False, True])
def test_megatron_training_step_at_a_temperature_equals_the_naive_step(streaming):
    from megatron_branch._megatron import OptimizerConfig
    from megatron_branch.reference.naive import make_naive_forward_step
    from megatron_branch.spec.builders import build_gpt, llama_config
    from megatron_branch.training import get_optimizer, plan_data_parallel, train_step, wrap_ddp

    b = batch()
    seqs = b.sequences
    temps = per_rollout_temps(len(seqs))
    mask = losses.response_mask(b.lengths, b.prompt_lengths)
    plan = plan_data_parallel(seqs, b.group, 1, micro_batch_tokens=80)
    assert len(plan.ranks[0]) > 1

    def loss_fn(lp, ids):
        m = mask[ids][:, : lp.shape[1]]
        return (lp * m).sum(), m.sum()

    found = []
    for naive in (False, True):
        cfg = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                           calculate_per_token_loss=True)
        model = build_gpt(cfg, 128, seed=0, branch=not naive)
        ddp = wrap_ddp(model)
        opt = get_optimizer(OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0), [ddp])
        step = (dict(forward_step_func=make_naive_forward_step(loss_fn, seqs, temperature=temps)) if naive
                else dict(max_chunk_tokens=16 if streaming else None))
        train_step([ddp], opt, plan.ranks[0], loss_fn, temperature=temps, **step)
        found.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
    diffs = compare_grads(*found)
    assert max(diffs.values()) < TOL, max(diffs, key=diffs.get)


def test_bad_temperatures_are_refused_naming_the_rollout():
    branch, _ = make_pair()
    tree = mb.BranchTree.from_sequences(batch().sequences)
    n = tree.num_rollouts
    with pytest.raises(ValueError, match="temperature: must be a finite number > 0, got 0"):
        mb.rollout_logprobs(branch, tree, temperature=0)
    with pytest.raises(ValueError, match="temperature: must be a finite number > 0, got -1.0"):
        mb.replay_logprobs(branch, tree, temperature=-1.0)
    bad = torch.ones(n)
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="rollout 3: temperature must be a finite number > 0, got nan"):
        mb.rollout_logprobs(branch, tree, temperature=bad)
    with pytest.raises(ValueError, match=f"temperature: {n - 1} values for {n} rollouts"):
        mb.replay_step(branch, tree, lambda lp, ids: lp.sum(), temperature=torch.ones(n - 1))
    with pytest.raises(ValueError, match="temperature: must be a finite number > 0, got inf"):
        mb.rollout_logprobs(branch, tree, temperature=float("inf"))
