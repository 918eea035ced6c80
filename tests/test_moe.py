"""MoE branch replay vs the naive MoE batch (stock local MoE spec, every rollout in one batch).

fp32; log-probs within 1e-5 and every parameter gradient (router included) within 1e-5
relative, with the load-balancing and z losses on; Megatron's logged router losses and
the per-expert token counts equal too. The naive batch is :func:`megatron_branch.spec.naive_moe_logprobs`
(right-padded, Megatron's MoE padding mask, so padding is not counted).
"""

import dist_worker
import pytest
import torch

import megatron_branch as mb
from megatron_branch._megatron import (
    GPTModel,
    ModuleSpec,
    MoEAuxLossAutoScaler,
    TopKRouter,
    clear_moe_logged_metrics,
    moe_logged_metrics,
)
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.distributed import free_port
from megatron_branch.full_state import full_state
from megatron_branch.reference.agreement import compare_grads, grads
from megatron_branch.reference.bias import token_dropping_bias
from megatron_branch.reference.naive import naive_moe_logprobs
from megatron_branch.replay.plan import plan_replay
from megatron_branch.replay.routing import needs_routing_statistics, routed_before_backward
from megatron_branch.scoring.unit import forward_unit
from megatron_branch.spec import apply_branch_attention, moe
from megatron_branch.spec.builders import build_gpt, llama_config

VOCAB = 128
TOL = 1e-5
SPEC = dict(num_experts=4, moe_grouped_gemm=False)


def moe_config(**overrides):
    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, num_moe_experts=4,
                  moe_router_topk=2, moe_ffn_hidden_size=96, moe_token_dispatcher_type="allgather",
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    kwargs.update(overrides)
    return llama_config(**kwargs)


def make_pair(seed=0, kernel=None, **overrides):
    """(branch model, stock model) with identical weights."""
    config = moe_config(**overrides)
    branch = build_gpt(config, VOCAB, seed=seed, spec_kwargs=dict(SPEC, kernel=kernel))
    stock = build_gpt(config, VOCAB, branch=False, spec_kwargs=SPEC)
    stock.load_state_dict(branch.state_dict())
    return branch, stock


def equal_lengths():
    return branching_rollouts([24], [2, 3], [6, 5], VOCAB, seed=2).sequences  # 6 rollouts of 35


def ragged():
    return branching_rollouts([20, 13], [2, 3], [6, 5], VOCAB, seed=3, jitter=3).sequences  # 2 prompts


def loss_fn_for(seqs):
    weights = torch.linspace(-1.0, 1.0, len(seqs))

    def loss_fn(lp, ids=None):  # additive over rollouts: any chunking sums to the same loss
        ids = torch.arange(len(seqs)) if ids is None else ids
        return (lp.sum(1) * weights[ids]).sum() / 100

    return loss_fn


@pytest.fixture(autouse=True)
def _fresh_scale_and_logs():
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))  # another test may have run a schedule
    clear_moe_logged_metrics()
    yield


def run_naive(stock, seqs, loss_fn):
    """Naive step; returns (log-probs, logged router losses, per-expert counts of each layer)."""
    clear_moe_logged_metrics()
    counts = []
    lengths = torch.tensor([len(s) for s in seqs])
    valid = (torch.arange(int(lengths.max()))[:, None] < lengths[None, :]).reshape(-1)  # [s * b], s-major
    hooks = [m.register_forward_hook(lambda mod, a, out: counts.append(out[1][valid].sum(0).double()))
             for m in stock.modules() if isinstance(m, TopKRouter)]
    try:
        lp = naive_moe_logprobs(stock, seqs)
    finally:
        for h in hooks:
            h.remove()
    loss_fn(lp).backward()
    logged = {k: v.clone() for k, v in moe_logged_metrics().items() if v.abs().sum() > 0}
    return lp.detach(), logged, torch.stack(counts)


def check(branch, stock, seqs, run_branch, tree=None):
    loss_fn = loss_fn_for(seqs)
    for m in (branch, stock):
        m.zero_grad(set_to_none=True)
    moe.tokens_per_expert(branch, reset=True)
    clear_moe_logged_metrics()
    lp = run_branch(branch, tree or mb.BranchTree.from_sequences(seqs), loss_fn)
    logged = {k: v.clone() for k, v in moe_logged_metrics().items() if v.abs().sum() > 0}
    counts = moe.tokens_per_expert(branch, reset=True)
    lp_ref, logged_ref, counts_ref = run_naive(stock, seqs, loss_fn)
    diffs = compare_grads(grads(branch), grads(stock))
    assert max(diffs.values()) < TOL, (max(diffs, key=diffs.get), max(diffs.values()))
    assert all(g.abs().max() > 0 for k, g in grads(branch).items() if "router" in k)
    if lp is not None:
        assert (lp.detach() - lp_ref).abs().max() < TOL
    assert set(logged) == set(logged_ref) and logged_ref
    for name in logged_ref:
        torch.testing.assert_close(logged[name], logged_ref[name], rtol=1e-5, atol=1e-7, msg=name)
    assert torch.equal(counts, counts_ref)
    return diffs


def one_pass(model, tree, loss_fn):
    lp = mb.rollout_logprobs(model, tree)
    loss_fn(lp).backward()
    return lp


LOSSES = {
    "aux_loss": dict(),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss"),
    "global_aux_loss": dict(moe_router_load_balancing_type="global_aux_loss"),
    "all_three": dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
                      moe_aux_loss_coeff=[0.01, 0.02, 0.03]),
}


@pytest.mark.parametrize("batch", ["equal_lengths", "ragged"])
@pytest.mark.parametrize("losses", list(LOSSES))
def test_one_pass_matches_naive_batch(losses, batch):
    seqs = {"equal_lengths": equal_lengths, "ragged": ragged}[batch]()
    branch, stock = make_pair(**LOSSES[losses])
    check(branch, stock, seqs, one_pass)


@pytest.mark.parametrize("recompute_stem, kernel", [(False, None), (True, None), (True, "flash_varlen")])
def test_streaming_replay_matches_naive_batch(recompute_stem, kernel):
    seqs = ragged()
    branch, stock = make_pair(kernel=kernel, **LOSSES["all_three"])

    def stream(model, tree, loss_fn):
        stats = mb.replay_step(model, tree, loss_fn, max_chunk_tokens=10, recompute_stem=recompute_stem)
        assert stats.num_stems > 1 and stats.num_chunks > 1
        return None

    check(branch, stock, seqs, stream)


IN_STEP = {
    "all_three": dict(LOSSES["all_three"]),
    "per_token_loss": dict(LOSSES["all_three"], calculate_per_token_loss=True),
    # Megatron recomputes the MoE layer in the backward: it routes tokens already counted
    "recompute_moe": dict(LOSSES["all_three"], recompute_granularity="selective", recompute_modules=["moe"]),
    "recompute_stem": dict(LOSSES["all_three"]),
}


@pytest.mark.parametrize("case", list(IN_STEP))
def test_statistics_from_the_steps_own_forwards(case):
    """A plan whose backwards all follow its last forward (a stem, then one chunk) counts the
    tree in its own forwards: no statistics pass, and still the naive batch's gradients,
    logged losses and counts."""
    seqs = equal_lengths()  # 24-token prompt, then 42 tokens of branches: stem + one chunk at 42
    tree = mb.BranchTree.from_sequences(seqs)
    assert [op.kind for op in plan_replay(tree, 42, attach_subtrees=True)] == ["stem", "chunk", "pop"]
    assert routed_before_backward(plan_replay(tree, 42)) and not routed_before_backward(plan_replay(tree, 30))
    branch, stock = make_pair(**IN_STEP[case])
    forwards = []
    hook = branch.register_forward_hook(lambda *_: forwards.append(1))

    def stream(model, tree, loss_fn):
        stats = mb.replay_step(model, tree, loss_fn, max_chunk_tokens=42, recompute_stem=case == "recompute_stem")
        assert (stats.num_stems, stats.num_chunks) == (1, 1)

    try:
        check(branch, stock, seqs, stream, tree)
    finally:
        hook.remove()
    assert len(forwards) == 2 + (case == "recompute_stem")  # stem, chunk (, the stem's recompute at its pop)


@pytest.mark.parametrize("recompute", ["full", "moe"])
def test_activation_recompute_replays_the_same_statistics(recompute):
    # "moe": Megatron recomputes the MoE layer in the backward, after other units ran
    extra = (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
             if recompute == "full" else dict(recompute_granularity="selective", recompute_modules=["moe"]))
    seqs = equal_lengths()
    branch, stock = make_pair(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                              moe_aux_loss_coeff=[0.01, 0.02], **extra)

    def stream(model, tree, loss_fn):
        mb.replay_step(model, tree, loss_fn, max_chunk_tokens=12)

    check(branch, stock, seqs, stream)


def test_statistics_collected_with_the_old_logprobs_are_reused():
    seqs = ragged()
    branch, stock = make_pair(moe_router_load_balancing_type="seq_aux_loss")
    tree = mb.BranchTree.from_sequences(seqs)
    stats, old_lp = mb.replay.collect_routing_statistics(branch, tree, max_chunk_tokens=10)
    assert torch.allclose(old_lp, mb.replay_logprobs(branch, tree), atol=1e-6)

    def stream(model, tree, loss_fn):
        mb.replay_step(model, tree, loss_fn, max_chunk_tokens=10, routing_statistics=stats)

    check(branch, stock, seqs, stream, tree)


def test_partial_forwards_without_statistics_are_refused():
    branch, _ = make_pair()
    tree = mb.BranchTree.from_sequences(equal_lengths())
    # a forward of part of the tree with an aux loss, outside replay_step (which collects them)
    with pytest.raises(ValueError, match="streaming replay.*megatron_branch.replay_step"):
        forward_unit(branch, tree, 0, tree.unique_positions // 2)
    other = mb.BranchTree.from_sequences(ragged())
    stats, _ = mb.replay.collect_routing_statistics(branch, other, max_chunk_tokens=10)
    with pytest.raises(ValueError, match="another tree"):
        mb.replay_step(branch, tree, loss_fn_for(equal_lengths()), max_chunk_tokens=10, routing_statistics=stats)
    # z-loss and counts need no statistics; forward-only replay needs none
    branch, _ = make_pair(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    mb.replay_step(branch, tree, loss_fn_for(equal_lengths()), max_chunk_tokens=10)
    assert not needs_routing_statistics(branch, plan_replay(tree, 10))


def test_expert_bias_counts_for_aux_loss_free_balancing():
    # equal lengths: Megatron's own expert-bias count fails with a padding mask
    # (``routing_map & ~padding_mask`` broadcasts [tokens] against [tokens, experts])
    seqs = equal_lengths()
    branch, stock = make_pair(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                              moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                              moe_router_bias_update_rate=1e-3)
    for router in moe.routers(branch):
        router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))  # routing uses the bias too
    for router in [m for m in stock.modules() if isinstance(m, TopKRouter)]:
        router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))

    def stream(model, tree, loss_fn):
        mb.replay_step(model, tree, loss_fn, max_chunk_tokens=10, recompute_stem=True)

    check(branch, stock, seqs, stream)
    got = torch.stack([r.local_tokens_per_expert for r in moe.routers(branch)])
    ref = torch.stack([m.local_tokens_per_expert for m in stock.modules() if isinstance(m, TopKRouter)])
    assert torch.equal(got, ref) and got.sum() == 2 * 2 * sum(len(s) for s in seqs)


def test_per_token_loss_scaling_matches_naive():
    seqs = ragged()
    branch, stock = make_pair(calculate_per_token_loss=True, **LOSSES["all_three"])

    def stream(model, tree, loss_fn):
        mb.replay_step(model, tree, loss_fn, max_chunk_tokens=10)

    check(branch, stock, seqs, stream)


def test_unweighted_statistics_fail():
    # Guard: Megatron's router on the tree computes its statistics over unique tokens.
    seqs = equal_lengths()
    spec = mb.get_branch_layer_spec(normalization="RMSNorm", **SPEC)
    mlp = spec.submodules.mlp
    (mlp.submodules if isinstance(mlp, ModuleSpec) else mlp.keywords["submodules"]).router = TopKRouter
    config = moe_config()
    torch.manual_seed(0)
    plain = GPTModel(config, spec, VOCAB, 4096, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    _, stock = make_pair()
    stock.load_state_dict(plain.state_dict())
    loss_fn = loss_fn_for(seqs)
    lp = one_pass(plain, mb.BranchTree.from_sequences(seqs), loss_fn)
    lp_ref, _, _ = run_naive(stock, seqs, loss_fn)
    assert (lp.detach() - lp_ref).abs().max() < TOL  # routing itself is per token
    diffs = compare_grads(grads(plain), grads(stock))
    assert max(v for k, v in diffs.items() if "router" in k) > 1e-2


def test_tree_sums_by_brute_force():
    tree = mb.BranchTree.from_sequences(ragged())
    gen = torch.Generator().manual_seed(0)
    values = torch.rand(tree.unique_positions, 3, generator=gen, dtype=torch.float64)
    index = torch.arange(tree.unique_positions)
    sums = moe.rollout_sums(values, index, tree)
    for r in range(tree.num_rollouts):
        torch.testing.assert_close(sums[r], values[tree.rows[r, : tree.lengths[r]]].sum(0))
    # a part of the tree, with padding
    part = torch.cat([torch.arange(5, 30), torch.full((3,), -1)])
    per_rollout = torch.rand(tree.num_rollouts, 3, generator=gen, dtype=torch.float64)
    sub = moe.subtree_rollout_sums(per_rollout, part, tree)
    for i, u in enumerate(part.tolist()):
        holders = [r for r in range(tree.num_rollouts) if u >= 0 and (tree.rows[r] == u).any()]
        want = per_rollout[holders].sum(0) if holders else torch.zeros(3, dtype=torch.float64)
        torch.testing.assert_close(sub[i], want)
    torch.testing.assert_close(moe.subtree_rollout_sums(torch.ones(tree.num_rollouts, 1), index, tree)[:, 0],
                               tree.multiplicity.double())


def test_token_dropping_is_refused_unless_approximate():
    with pytest.raises(ValueError, match="token dropping cannot be exact.*capacity"):
        make_pair(moe_expert_capacity_factor=1.0)
    with pytest.raises(ValueError, match="moe_token_dropping"):
        mb.get_branch_layer_spec(moe_token_dropping="sometimes", **SPEC)
    config = moe_config(moe_expert_capacity_factor=1.0, moe_aux_loss_coeff=0.0,
                        moe_router_load_balancing_type="none")
    branch = build_gpt(config, VOCAB, seed=0, spec_kwargs=dict(SPEC, moe_token_dropping="approximate"))
    stock = build_gpt(config, VOCAB, branch=False, spec_kwargs=SPEC)
    stock.load_state_dict(branch.state_dict())
    seqs = equal_lengths()
    report = token_dropping_bias(branch, stock, seqs, loss_fn_for(seqs))
    assert set(report) == {"max_abs_logprob_diff", "loss_rel_diff", "grad_cosine", "grad_rel_error",
                           "dropped_tree", "dropped_naive"}
    assert report["dropped_naive"] > 0 and report["max_abs_logprob_diff"] > 1e-4  # the bias is real
    assert -1.0 <= report["grad_cosine"] <= 1.0


@pytest.mark.parametrize("bad, match", [
    (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0), "sinkhorn"),
    (dict(moe_input_jitter_eps=0.01), "moe_input_jitter_eps"),
])
def test_batch_dependent_routing_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        build_gpt(moe_config(**bad), VOCAB, spec_kwargs=SPEC)


def test_plain_batches_keep_stock_statistics():
    # Without tree data the branch MoE layer is Megatron's (pretraining / eval batches).
    seqs = ragged()
    branch, stock = make_pair(**LOSSES["all_three"])
    loss_fn = loss_fn_for(seqs)
    loss_fn(naive_moe_logprobs(branch, seqs)).backward()
    logged = {k: v.clone() for k, v in moe_logged_metrics().items() if v.abs().sum() > 0}
    _, logged_ref, _ = run_naive(stock, seqs, loss_fn)
    assert max(compare_grads(grads(branch), grads(stock)).values()) < TOL
    for name in logged_ref:
        torch.testing.assert_close(logged[name], logged_ref[name])


# ---------------------------------------------------------------- expert parallelism (gloo)
@pytest.fixture(scope="module")
def ep_reference(tmp_path_factory):
    """Weights and the single-process results of each tree's step (alltoall dispatcher)."""
    path = tmp_path_factory.mktemp("moe") / "full.pt"
    from megatron_branch.training import wrap_ddp

    model = dist_worker.build_moe()
    torch.save(full_state(model, "param"), path)
    model = wrap_ddp(model)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    return path, {name: dist_worker.run_moe_case(model, name, None) for name in dist_worker.MOE_TREES}


# (tree of each data-parallel rank, streaming budget)
EP_LAYOUTS = {
    # EP=2 across two data-parallel ranks: each its own tree; gradients = the mean of the trees' steps.
    # Streaming needs equal replay plans on the EP ranks (every MoE forward is an all-to-all).
    # Different trees streamed give different plans: refused (not a hang).
    # At 100 the plan is a stem (with attached subtrees) and one chunk: the step's own forwards
    # count the routing (no statistics pass), summed over the groups after the last forward.
    "ep2-dp2": (dict(tp=1, ep=2), [(("a", "b"), None), (("a", "a"), 10), (("a", "b"), 10), (("a", "a"), 100)]),
    # EP=2 across the two tensor-parallel ranks (sequence parallel): one tree.
    "ep2-tp2-sp": (dict(tp=2, ep=2, sp=True), [(("a",), None), (("b",), 7), (("a",), 140)]),
}


@pytest.mark.parametrize("layout_name", list(EP_LAYOUTS))
def test_expert_parallel_matches_single_process(layout_name, ep_reference, tmp_path):
    layout, cases = EP_LAYOUTS[layout_name]
    path, ref = ep_reference
    ranks = dist_worker.spawn_moe(layout, cases, str(path), str(tmp_path), free_port())
    for rank, res in enumerate(ranks):
        assert len(res) == len(cases)
        for i, (names, chunk) in enumerate(cases):
            got, want = res[i], ref[names[rank % len(names)]]
            if len(set(names)) > 1 and chunk is not None:
                assert "different replay plans" in got.get("error", ""), (rank, i)
                continue
            want_grads = {k: sum(ref[n]["grads"][k] for n in names) / len(names) for k in want["grads"]}
            diffs = compare_grads(got["grads"], want_grads)
            assert max(diffs.values()) < TOL, (rank, i, max(diffs, key=diffs.get), max(diffs.values()))
            assert (got["lp"] - want["lp"]).abs().max() < TOL, (rank, i)
            assert torch.equal(got["counts"], want["counts"]), (rank, i)
            assert set(got["logged"]) == set(want["logged"])
            for metric in want["logged"]:
                torch.testing.assert_close(got["logged"][metric], want["logged"][metric], rtol=1e-5, atol=1e-7)


def test_block_spec_with_dense_and_moe_layers():
    """apply_branch_moe on Megatron's decoder block spec (moe_layer_freq pattern): the MoE
    layers get the branch pieces, the dense ones stay as they are; exact as a whole."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = moe_config(moe_layer_freq=[0, 1])
    stock_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    spec = moe.apply_branch_moe(apply_branch_attention(stock_spec))
    torch.manual_seed(0)
    kwargs = dict(position_embedding_type="rope", share_embeddings_and_output_weights=False)
    branch = GPTModel(config, spec, VOCAB, 4096, **kwargs)
    stock = GPTModel(config, stock_spec, VOCAB, 4096, **kwargs)
    stock.load_state_dict(branch.state_dict())
    layers = branch.decoder.layers
    assert not isinstance(layers[0].mlp, moe.BranchMoELayer) and isinstance(layers[1].mlp, moe.BranchMoELayer)
    assert isinstance(layers[1], moe.BranchMoETransformerLayer)
    check(branch, stock, ragged(), one_pass)


def test_stock_moe_layers_under_tree_attention_are_refused():
    """apply_branch_attention alone on a MoE spec leaves Megatron's MoELayer, whose router
    statistics would count shared tokens once: tree data through it is a clear error."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = moe_config(moe_layer_freq=[0, 1])
    spec = apply_branch_attention(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                             normalization="RMSNorm"))
    model = GPTModel(config, spec, VOCAB, 4096, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    with pytest.raises(ValueError, match="stock MoELayer.*apply_branch_moe"):
        mb.rollout_logprobs(model, mb.BranchTree.from_sequences(ragged()))


def test_streaming_moe_through_megatron_training_equals_the_naive_step():
    """Issue 19: ``training.train_step`` at a chunk budget (streaming replay) on an MoE model
    with the three aux losses and the z-loss collects the router statistics itself, and its
    update equals the naive step's through the same Megatron machinery (per-token loss,
    ``finalize_model_grads``, a Megatron optimizer step). ``mb.replay_step`` at a budget is covered by
    ``test_streaming_replay_matches_naive_batch``."""
    from megatron_branch._megatron import OptimizerConfig
    from megatron_branch.reference.naive import make_naive_forward_step
    from megatron_branch.training import get_optimizer, train_step, wrap_ddp

    seqs = equal_lengths()  # the naive forward step pads without a router padding mask
    branch, stock = make_pair(calculate_per_token_loss=True, **LOSSES["all_three"])
    tree = mb.BranchTree.from_sequences(seqs)
    weights = torch.linspace(-1.0, 1.0, len(seqs))

    def loss_fn(lp, ids):  # (loss_sum, num_tokens): Megatron's per-token convention
        return (lp.sum(1) * weights[ids]).sum() / 100, torch.tensor(float(len(ids)))

    deltas = []
    for model, step in ((branch, dict(max_chunk_tokens=10)),
                        (stock, dict(forward_step_func=make_naive_forward_step(loss_fn, seqs)))):
        ddp = wrap_ddp(model)
        opt = get_optimizer(OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0), [ddp])
        MoEAuxLossAutoScaler.main_loss_backward_scale = None  # Megatron's schedule sets a [1]-shaped 1.0
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
        result = train_step([ddp], opt, [tree], loss_fn, **step)
        assert result.num_tokens == len(seqs)
        deltas.append({n: p.main_grad.clone() for n, p in model.named_parameters()})  # the step's gradient
    diffs = compare_grads(*deltas)
    assert max(diffs.values()) < TOL, (max(diffs, key=diffs.get), max(diffs.values()))
    assert all(deltas[1][n].abs().max() > 0 for n in deltas[1] if "router" in n)


def test_router_behaviour_is_an_explicit_table_of_releases():
    """Issue 21: the installed release's router-loss scaling comes from a table of releases
    (0.16 .. 0.19, read from each release's router source), not a search of the source."""
    from megatron_branch._megatron import MOE_ROUTER_BEHAVIOUR, megatron_core_version, moe_router_behaviour

    installed = megatron_core_version()
    assert installed in MOE_ROUTER_BEHAVIOUR  # the suite runs on 0.16.1 and 0.19.2
    old, new = moe_router_behaviour((0, 16)), moe_router_behaviour((0, 19))
    assert not old.per_token_scale_times_tp_cp and new.per_token_scale_times_tp_cp
    assert old.global_aux_log_flag == {"reduce_group_has_dp": True}
    assert moe_router_behaviour((0, 18)).global_aux_log_flag == {"needs_dp_avg": False}
    with pytest.raises(ValueError, match=r"megatron-core 0\.99: its MoE router loss scaling is not in"):
        moe_router_behaviour((0, 99))
    # the flag the table names is the keyword the installed router takes
    import inspect

    params = inspect.signature(TopKRouter.attach_and_log_load_balancing_loss).parameters
    assert set(moe_router_behaviour().global_aux_log_flag) <= set(params)
