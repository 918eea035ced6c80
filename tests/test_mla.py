"""Multi-latent attention (DeepSeek-V3 style) under branch replay vs the naive computation.

The naive truth is Megatron's stock local MLA spec (``MLASelfAttention`` with Megatron's
local ``DotProductAttention``, :mod:`megatron_branch.spec.stock_mla`), each rollout run
alone; the branch model is ``get_branch_layer_spec(multi_latent_attention=True)`` with the
same weights. Query/key heads (``qk_head_dim + qk_pos_emb_head_dim`` = 24) and value heads
(``v_head_dim`` = 12) differ in width, so every kernel's unequal-head path runs.
"""

import dist_worker
import pytest
import torch
from conftest import VOCAB
from test_exactness import TREES, grpo_loss_fn, logprobs_at_packed_index
from test_replay import Loss, multi_level_forest, naive_truth, one_prompt_tails

import megatron_branch as mb
from megatron_branch._megatron import mla_unbuildable_reason
from megatron_branch.attention.kernels import KERNELS
from megatron_branch.distributed import free_port
from megatron_branch.reference.agreement import check_against_naive, compare_grads, grads
from megatron_branch.reference.naive import batched_rollout_logprobs, naive_rollout_logprobs
from megatron_branch.replay import replay_logprobs, replay_step
from megatron_branch.spec.builders import build_gpt, mla_config

pytestmark = pytest.mark.skipif(mla_unbuildable_reason() is not None, reason=str(mla_unbuildable_reason()))

TOL = 1e-5


def mla_pair(backend="cascade", chunk_size=None, kernel=None, seed=0, **cfg):
    """(branch MLA model, stock MLA model) with identical weights."""
    cfg.setdefault("qk_layernorm", True)
    config = mla_config(**cfg)
    branch = build_gpt(config, VOCAB, seed=seed,
                       spec_kwargs={"backend": backend, "chunk_size": chunk_size, "kernel": kernel})
    stock = build_gpt(config, VOCAB, branch=False)
    stock.load_state_dict(branch.state_dict())
    return branch, stock


def assert_exact(report):
    assert report.max_abs_logprob_diff < TOL
    assert report.loss_rel_diff < TOL
    assert report.max_rel_grad_diff < TOL, (report.worst_param, report.max_rel_grad_diff)


@pytest.mark.parametrize("tree_name", ["multi_level", "forest_3_prompts", "identical_and_prefix"])
@pytest.mark.parametrize("rope_type", ["rope", "yarn"])
@pytest.mark.parametrize("backend", ["cascade", "dense", "repeat_kv"])
def test_logprobs_loss_and_every_gradient_match_stock_mla(tree_name, rope_type, backend):
    batch = TREES[tree_name]()
    branch, stock = mla_pair(backend=backend, rope_type=rope_type)
    report = check_against_naive(branch, stock, batch.sequences, grpo_loss_fn(batch))
    assert_exact(report)
    assert len(report.grad_rel_diffs) == len(list(stock.parameters()))


@pytest.mark.parametrize("chunk_size, kernel", [(5, "flash_cpu"), (7, "math"), (None, "math"), (None, "flash_varlen")])
def test_kernels_and_tiles_with_unequal_head_sizes(chunk_size, kernel):
    batch = TREES["multi_level"]()
    branch, stock = mla_pair(chunk_size=chunk_size, kernel=kernel, rope_type="yarn")
    assert_exact(check_against_naive(branch, stock, batch.sequences, grpo_loss_fn(batch)))


def test_without_q_lora_and_without_latent_norms():
    # q_lora_rank=None: the query comes from linear_q_proj (DeepSeek-V2-Lite style)
    batch = TREES["forest_3_prompts"]()
    branch, stock = mla_pair(q_lora_rank=None, qk_layernorm=False, seed=3)
    assert_exact(check_against_naive(branch, stock, batch.sequences, grpo_loss_fn(batch)))


@pytest.mark.parametrize("batch_fn", [multi_level_forest, one_prompt_tails])
@pytest.mark.parametrize("budget, recompute_stem", [(12, False), (12, True), (3, False), (16, False)])
def test_streaming_replay_matches_naive(batch_fn, budget, recompute_stem):
    batch = batch_fn()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, stock = mla_pair(rope_type="yarn")
    loss = Loss(batch)
    ref_loss, ref_grads = naive_truth(stock, batch, loss)
    stats = replay_step(branch, tree, loss, max_chunk_tokens=budget, recompute_stem=recompute_stem)
    assert stats.num_chunks > 1 and stats.num_stems >= 1
    assert abs(stats.loss - ref_loss) <= TOL * max(1.0, abs(ref_loss))
    assert max(compare_grads(grads(branch), ref_grads).values()) < TOL
    with torch.no_grad():
        lp = replay_logprobs(branch, tree, max_chunk_tokens=budget)
        ref = naive_rollout_logprobs(stock, batch.sequences)
    assert (lp - ref).abs().max() < TOL


def test_megatron_activation_recompute_of_the_up_projections():
    batch = multi_level_forest()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    branch, stock = mla_pair(recompute_granularity="selective", recompute_modules=["mla_up_proj", "core_attn"])
    loss = Loss(batch)
    _, ref_grads = naive_truth(stock, batch, loss)
    replay_step(branch, tree, loss, max_chunk_tokens=12)
    assert max(compare_grads(grads(branch), ref_grads).values()) < TOL


def test_branch_spec_without_a_tree_is_the_stock_mla():
    batch = TREES["forest_3_prompts"]()
    branch, stock = mla_pair(rope_type="yarn")
    with torch.no_grad():
        got = batched_rollout_logprobs(branch, batch.sequences, fused_causal=True)
        ref = naive_rollout_logprobs(stock, batch.sequences)
    assert (got - ref).abs().max() < TOL


def test_positions_matter():
    # Guard: MLA's rotary table at the packed index instead of the tree depth differs.
    batch = TREES["one_prompt_8_rollouts"]()
    branch, stock = mla_pair(init_method_std=0.1)  # larger weights: RoPE moves the scores visibly
    tree = mb.BranchTree.from_sequences(batch.sequences)
    wrong = logprobs_at_packed_index(branch, tree)
    with torch.no_grad():
        ref = naive_rollout_logprobs(stock, batch.sequences)
        right = mb.rollout_logprobs(branch, tree)
    assert (right - ref).abs().max() < TOL
    assert (wrong - ref).abs().max() > 100 * TOL


def test_the_rotary_module_is_restored_after_each_call():
    branch, _ = mla_pair()
    attn = branch.decoder.layers[0].self_attention
    stock_rotary = attn.rotary_pos_emb
    mb.rollout_logprobs(branch, mb.BranchTree.from_sequences([[1, 2, 3, 4], [1, 2, 5]]))
    assert attn.rotary_pos_emb is stock_rotary and "rotary_pos_emb" not in attn.__dict__


@pytest.mark.parametrize("dv", [12, 40])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_kernel_with_unequal_value_heads_equals_math(dv, causal):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 9, 3, 24, generator=gen) for _ in range(2))
    v = torch.randn(2, 9, 3, dv, generator=gen)
    dout = torch.randn(2, 9, 3, dv, generator=gen)
    (f_fwd, f_bwd), (m_fwd, m_bwd) = KERNELS["flash_cpu"], KERNELS["math"]
    out, lse = f_fwd(q, k, v, causal, 0.2)
    ref, ref_lse = m_fwd(q, k, v, causal, 0.2)
    assert out.shape == (2, 9, 3, dv)
    assert (out - ref).abs().max() < 1e-5 and (lse - ref_lse).abs().max() < 1e-5
    for got, want in zip(f_bwd(dout, q, k, v, out, lse, causal, 0.2), m_bwd(dout, q, k, v, ref, ref_lse, causal, 0.2)):
        assert got.shape == want.shape and (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("option, value", [("apply_rope_fusion", True), ("cache_mla_latents", True),
                                           ("qk_clip", True)])
def test_options_without_an_exact_tree_path_are_refused(option, value):
    config = mla_config()
    setattr(config, option, value)  # set after validation: the refusal is the spec's, not the config's
    with pytest.raises(ValueError, match=option):
        build_gpt(config, VOCAB)


# ------------------------------------------------------------------ TP / CP (gloo)
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Weights file and single-process results of the MLA model for every case."""
    path = tmp_path_factory.mktemp("mla") / "full.pt"
    return path, dist_worker.single_process_reference(str(path), mla=True)


@pytest.mark.parametrize("layout, cases", [
    ({"tp": 1, "cp": 2, "pp": 1}, [("multi_level", None, "p2p"), ("forest", 12, "allgather"),
                                   ("multi_level", 12, "p2p")]),
    ({"tp": 1, "cp": 4, "pp": 1}, [("forest", None, "p2p"), ("multi_level", 12, "allgather")]),
], ids=["cp2", "cp4"])
def test_context_parallel_trees_match_single_process(layout, cases, reference, tmp_path):
    path, ref = reference
    ranks = dist_worker.spawn(dict(layout, mla=True), cases, str(path), str(tmp_path), free_port())
    for rank, res in enumerate(ranks):
        for name, chunk, comm in cases:
            got = res[f"{name}/{chunk}/{comm}"]
            diffs = compare_grads(got["grads"], ref[name]["grads"])
            assert max(diffs.values()) < TOL, (rank, name, chunk, comm, max(diffs, key=diffs.get))
            assert (got["lp"] - ref[name]["lp"]).abs().max() < TOL, (rank, name, chunk, comm)


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_on_the_local_mla_spec_is_refused(sp, tmp_path):
    # megatron-core's own MLA is not exact under TP with a column-parallel kv down
    # projection (the local spec): refused by name rather than silently different.
    messages = dist_worker.spawn_build_error({"tp": 2, "cp": 1, "pp": 1, "sp": sp, "mla": True}, str(tmp_path),
                                             free_port())
    assert all("tensor_model_parallel_size" in m and "sequence_parallel" in m for m in messages), messages
