"""Rollout routing replay (R3) under branch replay vs the naive batch with the same replayed routing.

The routing is random (distinct experts per token and layer, one per unique token so the
rollouts agree on shared tokens): it differs from what the routers would choose, so the
agreement proves the replay reaches every unit. The naive truth is a stock-spec MoE model
with the same weights, every rollout one sequence of a right-padded batch, each router
replaying the batch's experts through Megatron's own ``RouterReplay``
(:func:`megatron_branch.reference.naive.replayed_batch_routing`), forward and backward.
fp32: log-probs and every parameter gradient within 1e-5 (relative), aux and z losses on.
Runs on megatron-core 0.16.1 and 0.19.2 (both ship ``RouterReplay``); on a release without it
only the refusal is tested.
"""

import os

import dist_worker
import pytest
import torch
import torch.distributed as dist
from test_moe import loss_fn_for, ragged  # the MoE suite's forest (2 prompts, 12 rollouts) and additive loss

import megatron_branch as mb
from megatron_branch._megatron import MoEAuxLossAutoScaler, RouterReplay, clear_moe_logged_metrics
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.distributed import free_port
from megatron_branch.full_state import full_state
from megatron_branch.reference.agreement import compare_grads, grads
from megatron_branch.reference.naive import naive_moe_logprobs, replayed_batch_routing
from megatron_branch.spec import moe
from megatron_branch.spec.builders import build_gpt, llama_config

HAVE_REPLAY = RouterReplay is not None
needs_replay = pytest.mark.skipif(not HAVE_REPLAY, reason="this megatron-core has no RouterReplay "
                                  "(moe_enable_routing_replay); 0.16.1 and 0.19.2 have it")

VOCAB = 128
TOL = 1e-5
EXPERTS, TOPK, LAYERS = 4, 2, 2
SPEC = dict(num_experts=EXPERTS, moe_grouped_gemm=False)


def moe_config(**overrides):
    kwargs = dict(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=96,
                  moe_token_dispatcher_type="allgather", moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                  moe_aux_loss_coeff=[0.01, 0.02], moe_z_loss_coeff=1e-3, moe_enable_routing_replay=True)
    kwargs.update(overrides)
    return llama_config(**kwargs)


def make_pair(stock_overrides=None, **overrides):
    """(branch model, stock model) with identical weights; ``stock_overrides`` for the naive's config only."""
    branch = build_gpt(moe_config(**overrides), VOCAB, seed=0, spec_kwargs=SPEC)
    stock = build_gpt(moe_config(**{**overrides, **(stock_overrides or {})}), VOCAB, branch=False, spec_kwargs=SPEC)
    stock.load_state_dict(branch.state_dict())
    return branch, stock


def random_routing(tree: mb.BranchTree, seed: int = 0, layers: int = LAYERS, topk: int = TOPK):
    """Per rollout ``[len_r, layers, topk]`` random distinct experts, one draw per unique
    token (rollouts sharing a token agree), each row in a random order."""
    g = torch.Generator().manual_seed(seed)
    unique = torch.rand(tree.unique_positions, layers, EXPERTS, generator=g).argsort(-1)[..., :topk]
    return [unique[tree.rows[r, : int(tree.lengths[r])]] for r in range(tree.num_rollouts)]


@pytest.fixture(autouse=True)
def _fresh_scale_and_logs():
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # a schedule leaves a [1]-shaped scale
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    clear_moe_logged_metrics()
    yield


def run_naive(stock, seqs, routing, loss_fn):
    """The naive step with every router replaying ``routing`` (forward and backward, so
    Megatron's activation recompute replays it too)."""
    width = max(len(s) for s in seqs)
    with replayed_batch_routing(stock, routing, width):
        lp = naive_moe_logprobs(stock, seqs)
        loss_fn(lp).backward()
    return lp.detach()


def check(branch, stock, seqs, run_branch, routing=None, **naive):
    """Branch step vs naive step under the same replayed routing; returns (lp diff, grad diff)."""
    tree = mb.BranchTree.from_sequences(seqs)
    routing = routing or random_routing(tree)
    loss_fn = loss_fn_for(seqs)
    for m in (branch, stock):
        m.zero_grad(set_to_none=True)
    moe.tokens_per_expert(branch, reset=True)
    lp = run_branch(branch, tree, loss_fn, routing)
    counts = moe.tokens_per_expert(branch, reset=True)
    lp_ref = run_naive(stock, seqs, routing, loss_fn)
    diffs = compare_grads(grads(branch), grads(stock))
    grad_diff = max(diffs.values())
    assert grad_diff < TOL, (max(diffs, key=diffs.get), grad_diff)
    assert all(g.abs().max() > 0 for k, g in grads(branch).items() if "router" in k)
    # the replay reached every layer: the expert counts are those of the given routing
    layers = routing[0].shape[1]
    want = torch.zeros(layers, EXPERTS, dtype=torch.float64)
    for x in routing:
        for layer in range(layers):
            want[layer] += torch.bincount(x[:, layer].reshape(-1), minlength=EXPERTS).double()
    assert torch.equal(counts, want)
    lp_diff = 0.0
    if lp is not None:
        lp_diff = float((lp.detach() - lp_ref).abs().max())
        assert lp_diff < TOL
    return lp_diff, grad_diff


def one_pass(model, tree, loss_fn, routing):
    lp = mb.rollout_logprobs(model, tree, routing=routing)
    loss_fn(lp).backward()
    return lp


@needs_replay
def test_one_pass_matches_naive_with_the_same_routing():
    seqs = ragged()
    branch, stock = make_pair()
    tree = mb.BranchTree.from_sequences(seqs)
    routing = random_routing(tree)
    lp_diff, grad_diff = check(branch, stock, seqs, one_pass, routing)
    print(f"one pass: max |lp - naive| {lp_diff:.2e}, max grad rel diff {grad_diff:.2e}")
    # the replayed routing is not the routers' own: the log-probs move
    with torch.no_grad():
        free = mb.rollout_logprobs(branch, tree)
        replayed = mb.rollout_logprobs(branch, tree, routing=routing)
    assert (free - replayed).abs().max() > 1e-3


@needs_replay
def test_dense_layers_take_no_column():
    """A block with a dense first layer (``moe_layer_freq``): the routing holds the MoE
    layers only, in layer order (decoder layers 2 and 3 -> columns 0 and 1)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_branch._megatron import GPTModel
    from megatron_branch.spec import apply_branch_attention

    # no router losses: Megatron's loss logging is sized by the first model's layer count
    config = moe_config(num_layers=3, moe_layer_freq=[0, 1, 1], moe_router_load_balancing_type="none",
                        moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    stock_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    torch.manual_seed(0)
    kwargs = dict(position_embedding_type="rope", share_embeddings_and_output_weights=False)
    branch = GPTModel(config, moe.apply_branch_moe(apply_branch_attention(stock_spec)), VOCAB, 4096, **kwargs)
    stock = GPTModel(config, stock_spec, VOCAB, 4096, **kwargs)
    stock.load_state_dict(branch.state_dict())
    assert [r.layer_number for r in moe.routers(branch)] == [2, 3]
    seqs = ragged()
    check(branch, stock, seqs, one_pass, random_routing(mb.BranchTree.from_sequences(seqs), seed=4))


@needs_replay
@pytest.mark.parametrize("budget, recompute_stem", [(10, False), (10, True), (24, False)])
def test_streaming_matches_naive_with_the_same_routing(budget, recompute_stem):
    seqs = ragged()
    branch, stock = make_pair()

    def stream(model, tree, loss_fn, routing):
        stats = mb.replay_step(model, tree, loss_fn, max_chunk_tokens=budget, recompute_stem=recompute_stem,
                               routing=routing)
        assert stats.num_chunks + stats.num_stems > 2
        assert (stats.positions_recomputed > 0) == recompute_stem
        return mb.replay_logprobs(model, tree, max_chunk_tokens=budget, routing=routing)

    lp_diff, grad_diff = check(branch, stock, seqs, stream)
    print(f"streaming budget {budget} recompute_stem {recompute_stem}: max |lp - naive| {lp_diff:.2e}, "
          f"max grad rel diff {grad_diff:.2e}")


@needs_replay
@pytest.mark.parametrize("recompute", ["full", "moe"])
def test_activation_recompute_replays_the_same_routing(recompute):
    extra = (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
             if recompute == "full" else dict(recompute_granularity="selective", recompute_modules=["moe"]))
    branch, stock = make_pair(stock_overrides=dict(recompute_granularity=None, recompute_method=None,
                                                   recompute_num_layers=None, recompute_modules=None), **extra)

    def stream(model, tree, loss_fn, routing):
        mb.replay_step(model, tree, loss_fn, max_chunk_tokens=12, routing=routing)

    check(branch, stock, ragged(), stream)


@needs_replay
def test_packed_logprobs_take_routing_in_the_batch_layout():
    seqs = ragged()
    branch, _ = make_pair()
    tree = mb.BranchTree.from_sequences(seqs)
    routing = random_routing(tree, seed=5)
    tokens = torch.cat([torch.as_tensor(s) for s in seqs])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    with torch.no_grad():
        want = mb.rollout_logprobs(branch, tree, routing=routing)
        got = mb.packed_logprobs(branch, tokens, cu, routing=torch.cat(routing))
    for r, s in enumerate(seqs):
        start = int(cu[r])
        assert torch.equal(got[start: start + len(s) - 1], want[r, : len(s) - 1])
    with pytest.raises(ValueError, match=r"routing: expected tokens' shape"):
        mb.packed_logprobs(branch, tokens, cu, routing=torch.cat(routing)[:-1])


@needs_replay
def test_routing_as_one_padded_uint8_tensor():
    """verl-style data: one right-padded ``[R, S, moe_layers, topk]`` tensor of small ints."""
    branch, _ = make_pair()
    tree = mb.BranchTree.from_sequences(ragged())
    routing = random_routing(tree, seed=2)
    padded = torch.full((tree.num_rollouts, tree.max_len + 3, LAYERS, TOPK), 255, dtype=torch.uint8)
    for r, x in enumerate(routing):
        padded[r, : x.shape[0]] = x.to(torch.uint8)
    with torch.no_grad():
        assert torch.equal(mb.rollout_logprobs(branch, tree, routing=padded),
                           mb.rollout_logprobs(branch, tree, routing=routing))


@needs_replay
def test_disagreeing_routing_of_a_shared_token_names_rollouts_position_and_layer():
    seqs = ragged()
    branch, _ = make_pair()
    tree = mb.BranchTree.from_sequences(seqs)
    routing = [x.clone() for x in random_routing(tree)]
    # rollouts 0 and 1 share their prompt: rollout 1 routes its token 4 differently in MoE layer 1
    assert int(tree.rows[0, 4]) == int(tree.rows[1, 4])
    routing[1][4, 1] = torch.tensor([e for e in range(EXPERTS) if e not in routing[0][4, 1].tolist()][:TOPK])
    with pytest.raises(ValueError, match=r"rollouts 0 and 1 share the token at position 4 .* MoE layer 1 "):
        mb.rollout_logprobs(branch, tree, routing=routing)
    # the order of a token's experts does not matter (a set)
    same = [x.clone() for x in random_routing(tree)]
    same[1][4, 1] = same[1][4, 1].flip(0)
    with torch.no_grad():
        assert torch.equal(mb.rollout_logprobs(branch, tree, routing=same),
                           mb.rollout_logprobs(branch, tree, routing=random_routing(tree)))


@needs_replay
@pytest.mark.parametrize("case, match", [
    ("count", r"routing: expected one \[len_r, moe_layers, topk\] tensor per rollout \(12\), got 11 entries"),
    ("float", r"rollout 3: routing must be an integer tensor of expert ids, got dtype torch.float32"),
    ("short", r"rollout 3: routing has shape \(\d+, 2, 2\), expected \[len_r, moe_layers, topk\]"),
    ("layers", r"rollout 3: routing has shape \(\d+, 1, 2\), expected"),
    ("topk", r"rollout 3: routing has 3 experts per token, the model routes each token to moe_router_topk=2"),
    ("range", r"rollout 3: routing position 2, MoE layer 0 \(decoder layer 1\) names expert 4, outside "
              r"\[0, num_moe_experts=4\)"),
    ("negative", r"rollout 3: routing position 0, MoE layer 1 \(decoder layer 2\) names expert -1"),
    ("twice", r"rollout 3: routing position 1, MoE layer 0 \(decoder layer 1\) names expert \d twice"),
])
def test_bad_routing_is_refused_before_any_work(case, match):
    branch, _ = make_pair()
    tree = mb.BranchTree.from_sequences(ragged())
    routing = random_routing(tree)
    r = 3

    def edit(fn):
        out = [x.clone() for x in routing]
        out[r] = fn(out[r])
        return out

    def put(pos, layer, value):
        def fn(x):
            x[pos, layer, 0] = value
            return x
        return fn

    bad = {
        "count": lambda: routing[:-1],
        "float": lambda: edit(lambda x: x.float()),
        "short": lambda: edit(lambda x: x[:-1]),
        "layers": lambda: edit(lambda x: x[:, :1]),
        "topk": lambda: edit(lambda x: torch.cat([x, x[..., :1]], -1)),
        "range": lambda: edit(put(2, 0, EXPERTS)),
        "negative": lambda: edit(put(0, 1, -1)),
        "twice": lambda: edit(lambda x: (x.__setitem__((1, 0, 1), x[1, 0, 0]), x)[1]),
    }[case]()
    branch.zero_grad(set_to_none=True)
    for run in (lambda: mb.rollout_logprobs(branch, tree, routing=bad),
                lambda: mb.replay_step(branch, tree, loss_fn_for(ragged()), max_chunk_tokens=10, routing=bad),
                lambda: mb.replay_logprobs(branch, tree, max_chunk_tokens=10, routing=bad)):
        with pytest.raises(ValueError, match=match):
            run()
    assert all(p.grad is None for p in branch.parameters())  # refused before any forward


@needs_replay
def test_routing_to_a_model_that_cannot_replay_is_refused():
    seqs = ragged()
    tree = mb.BranchTree.from_sequences(seqs)
    routing = random_routing(tree)
    off = build_gpt(moe_config(moe_enable_routing_replay=False), VOCAB, seed=0, spec_kwargs=SPEC)
    with pytest.raises(ValueError, match=r"routing: moe_enable_routing_replay is off"):
        mb.rollout_logprobs(off, tree, routing=routing)
    dense = build_gpt(llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2),
                      VOCAB, seed=0)
    with pytest.raises(ValueError, match=r"routing: the model has no MoE layers"):
        mb.rollout_logprobs(dense, tree, routing=routing)


@needs_replay
def test_routers_holding_another_router_replay_class_are_refused():
    """A trainer that patched its own RouterReplay class in process-wide (verl's R3 patch)
    compares its own action enum, so Megatron's REPLAY_FORWARD would route natively:
    refused, naming the class, not silently unreplayed."""
    from megatron_branch.spec.moe import routers

    class PatchedRouterReplay:  # what such a patch puts in the router: not Megatron's class
        router_replay_action = None

    tree = mb.BranchTree.from_sequences(ragged())
    model = build_gpt(moe_config(), VOCAB, seed=0, spec_kwargs=SPEC)
    for router in routers(model):
        router.router_replay = PatchedRouterReplay()
    with pytest.raises(ValueError, match=r"routing: the model's routers hold .*PatchedRouterReplay, not Megatron"):
        mb.rollout_logprobs(model, tree, routing=random_routing(tree))


def test_routing_without_router_replay_in_megatron_core_is_refused(monkeypatch):
    """A release without ``megatron/core/transformer/moe/router_replay.py`` (the adapter's
    import gives ``None``): refused with the release named, before any work."""
    from megatron_branch import _megatron

    config = llama_config(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=96,
                          moe_token_dispatcher_type="allgather")
    model = build_gpt(config, VOCAB, seed=0, spec_kwargs=SPEC)
    tree = mb.BranchTree.from_sequences(ragged())
    monkeypatch.setattr(_megatron, "RouterReplay", None)
    with pytest.raises(ValueError, match=r"routing: megatron-core \d+\.\d+ has no RouterReplay"):
        mb.rollout_logprobs(model, tree, routing=random_routing(tree))


# ---------------------------------------------------------------- training step (Megatron DDP)
@needs_replay
@pytest.mark.parametrize("budget", [None, 10])
def test_training_step_replays_each_micro_batchs_routing(budget):
    """forward_backward_step: the global batch's routing, split over micro-batches (one pass
    through Megatron's schedule, or streaming), gives replay_step's gradients."""
    from megatron_branch.training import forward_backward_step, plan_data_parallel, wrap_ddp

    seqs = ragged()
    tree = mb.BranchTree.from_sequences(seqs)
    routing = random_routing(tree, seed=7)
    weights = torch.linspace(-1.0, 1.0, len(seqs))

    def loss_fn(lp, ids):  # Megatron divides by the global count: one per rollout
        return (lp.sum(1) * weights[ids]).sum(), len(ids)

    # no router losses: their per-token scaling under calculate_per_token_loss is test_moe's subject
    plain = dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    branch, _ = make_pair(calculate_per_token_loss=True, **plain)
    reference, _ = make_pair(**plain)
    reference.load_state_dict(branch.state_dict())
    reference.zero_grad(set_to_none=True)
    mb.replay_step(reference, tree, lambda lp, ids: loss_fn(lp, ids)[0] / len(seqs), routing=routing)
    model = wrap_ddp(branch)
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # Megatron's schedule sets a [1]-shaped 1.0
    plan = plan_data_parallel(seqs, [0] * 6 + [1] * 6, 1, micro_batch_tokens=70)
    assert len(plan.ranks[0]) == 2  # one prompt's group per micro-batch
    forward_backward_step(model, plan.ranks[0], loss_fn, max_chunk_tokens=budget, routing=routing)
    got = {k: v for k, v in full_state(model, "grad").items()}
    diffs = compare_grads(got, grads(reference))
    assert max(diffs.values()) < TOL, (max(diffs, key=diffs.get), max(diffs.values()))
    bad = [x.clone() for x in routing]
    bad[7] = bad[7][:-1]
    with pytest.raises(ValueError, match=r"rollout 7: routing has shape"):
        forward_backward_step(model, plan.ranks[0], loss_fn, max_chunk_tokens=budget, routing=bad)


# ---------------------------------------------------------------- expert parallelism (gloo)
TREES = {"a": ([24], [2, 2, 3], [6, 5, 7], 2), "b": ([30, 17], [3], [9], 3)}


def tree_of(name):
    prompts, branches, tails, seed = TREES[name]
    seqs = branching_rollouts(prompts, branches, tails, VOCAB, seed=seed, jitter=3).sequences
    tree = mb.BranchTree.from_sequences(seqs)
    return seqs, tree, random_routing(tree, seed=seed)


def build_ep(ep=1, tp=1, sp=False):
    return build_gpt(moe_config(moe_token_dispatcher_type="alltoall", expert_model_parallel_size=ep,
                                expert_tensor_parallel_size=1, tensor_model_parallel_size=tp, sequence_parallel=sp),
                     VOCAB, seed=0, spec_kwargs=SPEC)


def run_ep_case(model, name, chunk, recompute_stem=False):
    """One replay step with routing on a Megatron-DDP model, reduced by ``finalize_model_grads``."""
    from megatron_branch._megatron import finalize_model_grads
    from megatron_branch.cpu import cuda_factories_on_cpu

    seqs, tree, routing = tree_of(name)
    model.zero_grad_buffer()
    mb.replay_step(model, tree, loss_fn_for(seqs), max_chunk_tokens=chunk, recompute_stem=recompute_stem,
                   routing=routing)
    with torch.no_grad():
        lp = mb.rollout_logprobs(model, tree, routing=routing)
    with cuda_factories_on_cpu():
        finalize_model_grads([model])
    return {"grads": full_state(model, "grad"), "lp": lp}


def ep_worker(rank, world, port, layout, cases, weights, out_dir):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_branch._megatron import parallel_state
    from megatron_branch.full_state import load_full_state
    from megatron_branch.training import wrap_ddp

    mb.enable_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout["tp"],
                                                 expert_model_parallel_size=world, expert_tensor_parallel_size=1)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        model = build_ep(world, layout["tp"], layout["sp"])
        dp_rank = parallel_state.get_data_parallel_rank()
        assert len(model.decoder.layers[0].mlp.experts.local_experts) == EXPERTS // world  # experts split
        load_full_state(model, torch.load(weights))
        model = wrap_ddp(model)
        results = [run_ep_case(model, names[dp_rank], chunk, recompute) for names, chunk, recompute in cases]
        torch.save(results, os.path.join(out_dir, f"ep{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# (tree of each data-parallel rank, streaming budget, recompute_stem); streaming needs equal plans on the EP ranks
EP_LAYOUTS = {
    # EP=2 across two data-parallel ranks, each its own tree: gradients = the mean of the trees' steps
    "ep2-dp2": (dict(tp=1, sp=False), [(("a", "b"), None, False), (("a", "a"), 10, False), (("b", "b"), 12, True)]),
    # EP=2 across the two tensor-parallel ranks (sequence parallel: each router sees half the tokens)
    "ep2-tp2-sp": (dict(tp=2, sp=True), [(("a",), None, False), (("b",), 7, False), (("a",), 12, True)]),
}


@needs_replay
@pytest.mark.parametrize("layout_name", list(EP_LAYOUTS))
def test_expert_parallel_matches_single_process(layout_name, tmp_path):
    from megatron_branch.training import wrap_ddp

    model = build_ep()
    weights = str(tmp_path / "full.pt")
    torch.save(full_state(model, "param"), weights)
    model = wrap_ddp(model)
    ref = {name: run_ep_case(model, name, None) for name in TREES}
    layout, cases = EP_LAYOUTS[layout_name]
    dist_worker.start(ep_worker, (2, free_port(), layout, cases, weights, str(tmp_path)), 2)
    worst_lp = worst_grad = 0.0
    for rank in range(2):
        res = torch.load(os.path.join(tmp_path, f"ep{rank}.pt"))
        for (names, chunk, _), got in zip(cases, res):
            want = {k: sum(ref[n]["grads"][k] for n in names) / len(names) for k in ref["a"]["grads"]}
            diffs = compare_grads(got["grads"], want)
            lp_diff = float((got["lp"] - ref[names[rank % len(names)]]["lp"]).abs().max())
            assert max(diffs.values()) < TOL, (rank, names, chunk, max(diffs, key=diffs.get), max(diffs.values()))
            assert lp_diff < TOL, (rank, names, chunk, lp_diff)
            worst_lp, worst_grad = max(worst_lp, lp_diff), max(worst_grad, max(diffs.values()))
    print(f"{layout_name}: max |lp - single process| {worst_lp:.2e}, max grad rel diff {worst_grad:.2e}")


# ---------------------------------------------------------------- pipeline parallelism (gloo)
PLAIN = dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
             calculate_per_token_loss=True, pipeline_dtype=torch.float32)


def run_pp_case(model, name, replay=True):
    """One iteration through Megatron's schedule (one micro-batch per tree) with routing."""
    from megatron_branch._megatron import finalize_model_grads
    from megatron_branch.cpu import cuda_factories_on_cpu
    from megatron_branch.training.schedule import forward_backward

    seqs, tree, routing = tree_of(name)
    weights = torch.linspace(-1.0, 1.0, len(seqs))
    model.zero_grad_buffer()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # Megatron's schedule sets a [1]-shaped 1.0
    forward_backward(model, [tree], lambda lp, ids: ((lp.sum(1) * weights[ids]).sum(), len(ids)),
                     routing=routing if replay else None)
    with cuda_factories_on_cpu():
        finalize_model_grads([model])
    return full_state(model, "grad")


def pp_worker(rank, world, port, weights, out_dir):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_branch._megatron import parallel_state
    from megatron_branch.full_state import load_full_state
    from megatron_branch.training import wrap_ddp

    mb.enable_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
        model = build_gpt(moe_config(pipeline_model_parallel_size=world, **PLAIN), VOCAB, seed=0, spec_kwargs=SPEC,
                          pre_process=parallel_state.is_pipeline_first_stage(),
                          post_process=parallel_state.is_pipeline_last_stage())
        assert len(moe.routers(model)) == LAYERS // world  # each stage holds one MoE layer
        load_full_state(model, torch.load(weights))
        model = wrap_ddp(model)
        torch.save({name: run_pp_case(model, name) for name in TREES}, os.path.join(out_dir, f"pp{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@needs_replay
def test_pipeline_stages_replay_their_layers_columns(tmp_path):
    """PP=2: each stage's router replays its own column of the routing (the MoE layer
    numbers gathered over the stages before the schedule)."""
    from megatron_branch.training import wrap_ddp

    model = build_gpt(moe_config(**PLAIN), VOCAB, seed=0, spec_kwargs=SPEC)
    weights = str(tmp_path / "full.pt")
    torch.save(full_state(model, "param"), weights)
    model = wrap_ddp(model)
    ref = {name: run_pp_case(model, name) for name in TREES}
    free = run_pp_case(model, "a", replay=False)  # the routers' own choice: other gradients
    assert max(compare_grads(free, ref["a"]).values()) > 1e-3
    dist_worker.start(pp_worker, (2, free_port(), weights, str(tmp_path)), 2)
    worst = 0.0
    for rank in range(2):
        res = torch.load(os.path.join(tmp_path, f"pp{rank}.pt"))
        for name in TREES:
            got = res[name]
            diffs = compare_grads(got, {k: ref[name][k] for k in got})
            assert max(diffs.values()) < TOL, (rank, name, max(diffs, key=diffs.get), max(diffs.values()))
            assert any("router" in k for k in got)
            worst = max(worst, max(diffs.values()))
    print(f"pp2: max grad rel diff {worst:.2e}")
