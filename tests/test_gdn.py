"""Gated DeltaNet (Qwen3-Next / Qwen3.5 hybrid) under branch replay vs the naive computation.

The naive truth is Megatron's ``GatedDeltaNet`` on local modules
(:mod:`megatron_branch.spec.stock_hybrid`), each rollout run alone; the branch model has
the same weights with the tree recurrence (:mod:`megatron_branch.spec.gdn`).

Two tolerances, because Megatron's torch kernel works in float32 chunks of 64 steps:

* float64 models with a step-by-step kernel (:mod:`megatron_branch.reference.recurrent`)
  in both — the algorithm: log-probs within 1e-6, every gradient within 1e-5 of the
  model's gradient scale (measured: ~1e-7, up to 2e-6 for the decay parameters; the
  scoring rounds the float64 logits to float32);
* float32 with Megatron's chunk kernel in both — log-probs within 1e-5, every gradient
  within 1e-5 relative of the stock one; for the two decay parameters (``A_log``,
  ``dt_bias``, whose gradients are sums with cancellation, so float32 chunking moves
  them by ~1e-5 in the stock model itself), the branch gradient's distance to the exact
  (float64, step-by-step) gradient is at most twice the stock float32 gradient's.
"""

import dist_worker
import pytest
import torch
from conftest import VOCAB
from test_exactness import TREES, grpo_loss_fn
from test_replay import Loss, multi_level_forest, naive_truth, one_prompt_tails

import megatron_branch as mb
from megatron_branch._megatron import gdn_unavailable_reason
from megatron_branch.attention.recurrent_path import RecurrentPath
from megatron_branch.distributed import free_port
from megatron_branch.reference.agreement import check_against_naive, compare_grads, grads
from megatron_branch.reference.naive import batched_rollout_logprobs, naive_rollout_logprobs
from megatron_branch.reference.recurrent import recurrent_gated_delta_rule
from megatron_branch.replay import replay_logprobs, replay_step
from megatron_branch.replay.plan import plan_replay
from megatron_branch.spec import gdn as gdn_module
from megatron_branch.spec.builders import build_gpt, hybrid_config

pytestmark = pytest.mark.skipif(gdn_unavailable_reason() is not None, reason=str(gdn_unavailable_reason()))

TOL = 1e-5
DECAY = ("A_log", "dt_bias")
# float32 decay gradients under TP, relative to the gradient scale: sums with cancellation, moved by
# the other float32 order of TP's partial sums (1.8e-5 in isolated runs, 3.1e-4 once in a full CI
# suite run); float64 tests above hold them exact, and a wrong path or split moves them by O(1)
DECAY_TP_TOL = 1e-3
LAYOUTS = {"hybrid": dict(num_layers=4, linear_attention_freq=2),  # GDN, attention, GDN, attention
           "pure_gdn": dict(num_layers=2, linear_attention_freq=[1, 1])}


def gdn_pair(layout="hybrid", seed=0, kernel="math", **cfg):
    config = hybrid_config(**LAYOUTS[layout], **cfg)
    branch = build_gpt(config, VOCAB, seed=seed, spec_kwargs={"kernel": kernel})
    stock = build_gpt(config, VOCAB, branch=False)
    stock.load_state_dict(branch.state_dict())
    return branch, stock


def scaled_diffs(got, ref):
    """Per parameter ``max|g - g_ref| / max(max|g_ref|, 1e-4 * the largest gradient entry)``.

    The decay parameters' gradients can vanish (strongly decaying heads: ``|g| ~ 1e-10``
    where other gradients are ``~1e-3``); relative to themselves, float rounding of 1e-14
    would look like 1e-4. The floor measures them against the model's gradient scale.
    """
    top = max(r.abs().max().item() for r in ref.values())
    return {n: (got[n] - r).abs().max().item() / max(r.abs().max().item(), 1e-4 * top) for n, r in ref.items()}


def gdn_layers(model):
    return [layer.self_attention for layer in model.decoder.layers if hasattr(layer.self_attention, "gated_delta_rule")]


def use_kernel(model, kernel):
    for layer in gdn_layers(model):
        layer.gated_delta_rule = kernel


@pytest.mark.parametrize("tree_name", ["multi_level", "forest_3_prompts", "identical_and_prefix",
                                       "one_prompt_8_rollouts"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tree_recurrence_is_exact_in_float64(tree_name, layout):
    batch = TREES[tree_name]()
    branch, stock = (m.double() for m in gdn_pair(layout))
    for m in (branch, stock):
        use_kernel(m, recurrent_gated_delta_rule)
    report = check_against_naive(branch, stock, batch.sequences, grpo_loss_fn(batch))
    assert report.max_abs_logprob_diff < 1e-6
    diffs = scaled_diffs(grads(branch), grads(stock))
    assert max(diffs.values()) < TOL, max(diffs, key=diffs.get)
    assert len(diffs) == len(list(stock.parameters()))


def float64_truth(stock, batch, loss_fn):
    """Every parameter's gradient from a float64 copy of the stock model with the
    step-by-step kernel: the exact result both float32 runs are measured against."""
    truth = build_gpt(stock.config, VOCAB, branch=False)
    truth.load_state_dict(stock.state_dict())
    truth = truth.double()
    use_kernel(truth, recurrent_gated_delta_rule)
    truth.zero_grad(set_to_none=True)
    loss_fn(naive_rollout_logprobs(truth, batch.sequences)).backward()
    return grads(truth)


@pytest.mark.parametrize("tree_name", ["multi_level", "forest_3_prompts", "identical_and_prefix"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tree_recurrence_matches_megatrons_float32_kernel(tree_name, layout):
    batch = TREES[tree_name]()
    branch, stock = gdn_pair(layout, seed=1)
    loss_fn = grpo_loss_fn(batch)
    report = check_against_naive(branch, stock, batch.sequences, loss_fn)
    assert report.max_abs_logprob_diff < TOL
    assert report.loss_rel_diff < TOL
    truth = float64_truth(stock, batch, loss_fn)
    ours, theirs = compare_grads(grads(branch), truth), compare_grads(grads(stock), truth)
    for name, diff in report.grad_rel_diffs.items():
        if name.endswith(DECAY):
            # no further from the exact gradient than twice the stock float32 error
            assert ours[name] < max(TOL, 2 * theirs[name]), (name, ours[name], theirs[name])
        else:
            assert diff < TOL, (name, diff)


def test_branch_spec_without_a_tree_is_the_stock_layer():
    batch = TREES["forest_3_prompts"]()
    branch, stock = gdn_pair()
    with torch.no_grad():
        got = batched_rollout_logprobs(branch, batch.sequences, fused_causal=True)
        ref = naive_rollout_logprobs(stock, batch.sequences)
    assert (got - ref).abs().max() < TOL


def test_parameters_and_names_are_the_stock_layers():
    branch, stock = gdn_pair()
    assert {n: p.shape for n, p in branch.named_parameters()} == {n: p.shape for n, p in stock.named_parameters()}
    assert all(isinstance(m, gdn_module.BranchGatedDeltaNet) for m in gdn_layers(branch))


@pytest.mark.parametrize("wrong", ["zero_state", "no_conv_window"])
def test_guard_a_branch_without_its_parents_state_differs(wrong, monkeypatch):
    # Guard against a test that cannot fail: branches that start from a zero recurrent
    # state, or whose convolution sees zeros instead of the parent's last inputs.
    batch = TREES["one_prompt_8_rollouts"]()
    branch, stock = gdn_pair("pure_gdn", seed=2, init_method_std=0.1)  # larger weights: visible effects
    build = gdn_module.TreeRecurrencePlan.build

    def broken(*args, **kwargs):
        plan = build(*args, **kwargs)
        if wrong == "zero_state":
            for level in plan.levels:
                level.parents[:] = [-1] * len(level.parents)
        else:
            starts = {s for lv in plan.levels for s in lv.index[:, 0].tolist()}
            for t in starts:
                plan.ancestors[t] = plan.num_tokens
        return plan

    monkeypatch.setattr(gdn_module.TreeRecurrencePlan, "build", broken)
    with torch.no_grad():
        got = mb.rollout_logprobs(branch, mb.BranchTree.from_sequences(batch.sequences))
        ref = naive_rollout_logprobs(stock, batch.sequences)
    assert (got - ref).abs().max() > 100 * TOL


@pytest.mark.parametrize("batch_fn", [multi_level_forest, one_prompt_tails])
@pytest.mark.parametrize("budget, recompute_stem, kernel", [(12, False, "math"), (12, True, "math"),
                                                            (3, False, "math"), (2, True, "math"),
                                                            (3, True, "flash_varlen")])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_streaming_replay_matches_naive_in_float64(batch_fn, budget, recompute_stem, kernel, layout):
    # small budgets split stems shorter than the convolution window: the path tail then
    # spans several stems, and the state passes through a chain of stems; flash_varlen:
    # the CUDA default's contract (its CPU side)
    batch = batch_fn()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, stock = (m.double() for m in gdn_pair(layout, kernel=kernel))
    for m in (branch, stock):
        use_kernel(m, recurrent_gated_delta_rule)
    loss = Loss(batch)
    ref_loss, ref_grads = naive_truth(stock, batch, loss)
    stats = replay_step(branch, tree, loss, max_chunk_tokens=budget, recompute_stem=recompute_stem)
    assert stats.num_chunks > 1 and stats.num_stems >= 1
    assert abs(stats.loss - ref_loss) <= 1e-6 * max(1.0, abs(ref_loss))
    diffs = scaled_diffs(grads(branch), ref_grads)
    assert max(diffs.values()) < TOL, max(diffs, key=diffs.get)
    with torch.no_grad():
        lp = replay_logprobs(branch, tree, max_chunk_tokens=budget)
        ref = naive_rollout_logprobs(stock, batch.sequences)
    assert (lp - ref).abs().max() < 1e-6


def test_a_stem_with_complete_subtrees_caches_its_chains_state_in_float64():
    # budget 16: stems also run complete subtrees below them; the units below read the
    # recurrent state and convolution rows at the chain's end, not the unit's
    batch = multi_level_forest()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    assert any(op.path_end is not None for op in plan_replay(tree, 16, attach_subtrees=True))
    branch, stock = (m.double() for m in gdn_pair())
    for m in (branch, stock):
        use_kernel(m, recurrent_gated_delta_rule)
    loss = Loss(batch)
    ref_loss, ref_grads = naive_truth(stock, batch, loss)
    stats = replay_step(branch, tree, loss, max_chunk_tokens=16)
    assert stats.num_chunks == sum(op.kind == "chunk" for op in plan_replay(tree, 16, attach_subtrees=True))
    assert abs(stats.loss - ref_loss) <= 1e-6 * max(1.0, abs(ref_loss))
    diffs = scaled_diffs(grads(branch), ref_grads)
    assert max(diffs.values()) < TOL, max(diffs, key=diffs.get)


def test_streaming_replay_with_megatrons_kernel_matches_one_pass():
    batch = multi_level_forest()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, _ = gdn_pair()
    loss = Loss(batch)
    replay_step(branch, tree, loss)
    one_pass = grads(branch)
    branch.zero_grad(set_to_none=True)
    replay_step(branch, tree, loss, max_chunk_tokens=12)
    diffs = compare_grads(grads(branch), one_pass)
    assert max(v for k, v in diffs.items() if not k.endswith(DECAY)) < TOL


def test_streaming_guard_a_unit_that_ignores_the_path_differs(monkeypatch):
    batch = one_prompt_tails()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, stock = gdn_pair("pure_gdn", seed=2, init_method_std=0.1)
    monkeypatch.setattr(RecurrentPath, "path_state", lambda self, layer: None)
    with torch.no_grad():
        lp = replay_logprobs(branch, tree, max_chunk_tokens=12)
        ref = naive_rollout_logprobs(stock, batch.sequences)
    assert (lp - ref).abs().max() > 100 * TOL


def test_a_stock_gdn_layer_in_a_tree_model_is_refused():
    # apply_branch_attention on attention layers only would leave a stock GDN layer that
    # runs the packed tree as one sequence: the model check names it.
    branch, stock = gdn_pair()
    branch.decoder.layers[0].self_attention = stock.decoder.layers[0].self_attention
    with pytest.raises(ValueError, match="decoder.layers.0.self_attention: GatedDeltaNet is a stock recurrent layer"):
        mb.rollout_logprobs(branch, mb.BranchTree.from_sequences([[1, 2, 3], [1, 2, 4]]))


# ------------------------------------------------------------------ TP (gloo); CP refused
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Weights file and single-process results of the hybrid GDN model for every case."""
    path = tmp_path_factory.mktemp("gdn") / "full.pt"
    return path, dist_worker.single_process_reference(str(path), gdn=True)


@pytest.mark.parametrize("layout, cases", [
    ({"tp": 2, "cp": 1, "pp": 1, "sp": True}, [("multi_level", None, "allgather"), ("forest", None, "allgather"),
                                               ("tiny", None, "allgather")]),
], ids=["tp2-sp"])
def test_tensor_parallel_trees_match_single_process(layout, cases, reference, tmp_path):
    # GDN heads split over TP ranks, one pass as the single-process reference: the same
    # segments, so the same float32 chunks (streaming's other chunking moves the decay
    # gradients at float32 rounding: covered in float64 above). Decay parameters are
    # compared against the model's gradient scale (their gradients can vanish).
    path, ref = reference
    ranks = dist_worker.spawn(dict(layout, gdn=True), cases, str(path), str(tmp_path), free_port())
    for rank, res in enumerate(ranks):
        for name, chunk, comm in cases:
            got = res[f"{name}/{chunk}/{comm}"]
            diffs = scaled_diffs(got["grads"], ref[name]["grads"])
            # TP sums out_proj's partial products in another float32 order; the decay
            # gradients (sums with cancellation) move by up to ~3e-4 of the gradient scale
            # (DECAY_TP_TOL), everything else stays within TOL
            for param, diff in diffs.items():
                assert diff < (DECAY_TP_TOL if param.endswith(DECAY) else TOL), (rank, name, param, diff)
            assert (got["lp"] - ref[name]["lp"]).abs().max() < TOL, (rank, name, chunk)


def test_context_parallel_is_refused_by_name(tmp_path):
    messages = dist_worker.spawn_run_error({"tp": 1, "cp": 2, "pp": 1, "gdn": True}, str(tmp_path), free_port())
    assert all("context_parallel_size: layer 1 (GatedDeltaNet)" in m for m in messages), messages


def test_tensor_parallel_without_sequence_parallel_is_refused(tmp_path):
    messages = dist_worker.spawn_build_error({"tp": 2, "cp": 1, "pp": 1, "gdn": True}, str(tmp_path), free_port())
    assert all("sequence_parallel: layer 1 (GatedDeltaNet)" in m for m in messages), messages


# ------------------------------------------------------------------ Megatron's HybridModel
def hybrid_model_pair(pattern="G-*-G-", seed=0):
    from megatron_branch.spec.builders import build_hybrid

    config = hybrid_config(num_layers=len(pattern))
    branch = build_hybrid(config, VOCAB, pattern, seed=seed, spec_kwargs={"kernel": "math"})
    stock = build_hybrid(config, VOCAB, pattern, branch=False)
    stock.load_state_dict(branch.state_dict())
    return branch, stock


@pytest.mark.parametrize("budget", [None, 3])
def test_megatrons_hybrid_model_is_exact_in_float64(budget):
    # HybridModel with Megatron's layer symbols: GDN, MLP, attention, MLP, GDN, MLP
    batch = one_prompt_tails()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, stock = (m.double() for m in hybrid_model_pair())
    for m in (branch, stock):
        use_kernel(m, recurrent_gated_delta_rule)
    loss = Loss(batch)
    ref_loss, ref_grads = naive_truth(stock, batch, loss)
    stats = replay_step(branch, tree, loss, max_chunk_tokens=budget)
    assert abs(stats.loss - ref_loss) <= 1e-6 * max(1.0, abs(ref_loss))
    diffs = scaled_diffs(grads(branch), ref_grads)
    assert max(diffs.values()) < TOL, max(diffs, key=diffs.get)


def test_megatrons_hybrid_model_matches_in_float32():
    batch = TREES["forest_3_prompts"]()
    branch, stock = hybrid_model_pair(seed=3)
    report = check_against_naive(branch, stock, batch.sequences, grpo_loss_fn(batch))
    assert report.max_abs_logprob_diff < TOL
    assert all(d < TOL for n, d in report.grad_rel_diffs.items() if not n.endswith(DECAY)), report.worst_param


def test_a_mamba_layer_in_the_pattern_is_refused_by_name():
    from megatron_branch.spec.builders import build_hybrid

    with pytest.raises(ValueError, match=r"hybrid_layer_pattern: Mamba layers \('M'\) are not supported"):
        build_hybrid(hybrid_config(num_layers=2), VOCAB, "M-")
