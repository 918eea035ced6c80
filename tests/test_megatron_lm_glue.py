"""The Megatron-LM glue that runs without a Megatron-LM checkout: the branch spec from
parsed arguments, the Megatron-RL trajectory helpers, the patch tool's ``--apply`` and
the shipped patch folder."""

import argparse
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import make_pair
from megatron.core.transformer.enums import AttnBackend

from megatron_branch.integrations.megatron_lm import branch_spec_from_args
from megatron_branch.integrations.megatron_rl import (
    replay_trajectory_logprobs,
    trajectory_lengths,
    trajectory_logprobs,
    trajectory_tree,
)
from megatron_branch.integrations.megatron_rl import validate_args as validate_rl_args
from megatron_branch.reference.naive import naive_rollout_logprobs
from megatron_branch.spec.builders import llama_config
from megatron_branch.spec.core_attention import BranchCoreAttention
from megatron_branch.spec.self_attention import BranchSelfAttention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "apply_patches.py")


# ----------------------------------------------------------------------------- branch spec
def lm_args(**overrides):
    """The fields of Megatron-LM's parsed arguments that the branch spec reads."""
    fields = dict(normalization="RMSNorm", qk_layernorm=False, transformer_impl="local", num_experts=None,
                  moe_grouped_gemm=False, attention_dropout=0.0, multi_latent_attention=False,
                  experimental_attention_variant=None, qk_l2_norm=False, heterogeneous_layers_config_path=None,
                  mtp_num_layers=None)
    fields.update(overrides)
    return argparse.Namespace(**fields)


def gpt(spec, config):
    """A tiny GPTModel on ``spec`` (a layer or block spec)."""
    from megatron.core.models.gpt import GPTModel

    from megatron_branch.cpu import cuda_factories_on_cpu

    with cuda_factories_on_cpu():
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=64,
                        position_embedding_type="rope", share_embeddings_and_output_weights=False)


def shapes(model):
    return {n: tuple(p.shape) for n, p in model.state_dict().items() if not n.endswith("_extra_state")}


def attention_kinds(model):
    return {type(layer.self_attention.core_attention) for layer in model.decoder.layers}


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_branch_spec_from_args_is_the_local_spec_with_tree_attention(qk_layernorm):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = llama_config(num_layers=2, hidden_size=64, qk_layernorm=qk_layernorm)
    branch = gpt(branch_spec_from_args(lm_args(qk_layernorm=qk_layernorm)), config)
    stock = gpt(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm), config)
    assert shapes(branch) == shapes(stock)  # stock checkpoints load as they are
    assert any("q_layernorm" in n for n in shapes(branch)) == qk_layernorm
    assert attention_kinds(branch) == {BranchCoreAttention}
    assert all(isinstance(layer.self_attention, BranchSelfAttention) for layer in branch.decoder.layers)


def test_branch_spec_from_args_moe_layer_pattern():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    config = llama_config(num_layers=2, hidden_size=64, num_moe_experts=4, moe_layer_freq=[0, 1],
                          moe_router_topk=2, moe_ffn_hidden_size=64, moe_token_dispatcher_type="allgather")
    branch = gpt(branch_spec_from_args(lm_args(num_experts=4), config=config), config)
    stock = gpt(get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm"), config)
    assert shapes(branch) == shapes(stock)
    assert attention_kinds(branch) == {BranchCoreAttention}
    assert [isinstance(layer.mlp, MoELayer) for layer in branch.decoder.layers] == [False, True]


def test_branch_spec_from_args_multi_latent_attention():
    from megatron_branch._megatron import mla_unbuildable_reason
    from megatron_branch.spec.builders import mla_config
    from megatron_branch.spec.mla_attention import BranchMLASelfAttention
    from megatron_branch.spec.stock_mla import get_stock_mla_layer_spec

    if mla_unbuildable_reason():
        pytest.skip(mla_unbuildable_reason())
    config = mla_config(qk_layernorm=True)
    branch = gpt(branch_spec_from_args(lm_args(multi_latent_attention=True, qk_layernorm=True)), config)
    stock = gpt(get_stock_mla_layer_spec(normalization="RMSNorm", qk_layernorm=True), config)
    assert shapes(branch) == shapes(stock)
    assert attention_kinds(branch) == {BranchCoreAttention}
    assert all(isinstance(layer.self_attention, BranchMLASelfAttention) for layer in branch.decoder.layers)


def test_branch_spec_from_args_gated_delta_net_hybrid():
    from megatron_branch._megatron import gdn_unavailable_reason
    from megatron_branch.spec.builders import hybrid_config
    from megatron_branch.spec.gdn import BranchGatedDeltaNet
    from megatron_branch.spec.stock_hybrid import get_local_hybrid_block_spec

    if gdn_unavailable_reason():
        pytest.skip(gdn_unavailable_reason())
    config = hybrid_config(num_layers=4, linear_attention_freq=2)
    args = lm_args(experimental_attention_variant="gated_delta_net")
    branch = gpt(branch_spec_from_args(args, config=config), config)
    stock = gpt(get_local_hybrid_block_spec(config, normalization="RMSNorm"), config)
    assert shapes(branch) == shapes(stock)
    kinds = [type(layer.self_attention) for layer in branch.decoder.layers]
    assert kinds[0] is BranchGatedDeltaNet and kinds[2] is BranchGatedDeltaNet
    assert isinstance(branch.decoder.layers[1].self_attention, BranchSelfAttention)


@pytest.mark.parametrize("overrides, flag", [
    (dict(mla_down_proj_fusion=True), "--mla-down-proj-fusion"),
    (dict(experimental_attention_variant="dsa"), "--experimental-attention-variant dsa"),
    (dict(qk_l2_norm=True), "--qk-l2-norm"),
    (dict(heterogeneous_layers_config_path="layers.json"), "--heterogeneous-layers-config-path"),
    (dict(mtp_num_layers=1), "--mtp-num-layers"),
    (dict(attention_dropout=0.1), "--attention-dropout"),
    (dict(transformer_impl="inference_optimized"), "--transformer-impl inference_optimized"),
    (dict(attention_backend=AttnBackend.local), "--attention-backend local"),
])
def test_branch_spec_from_args_refusals(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        branch_spec_from_args(lm_args(**overrides))


def test_branch_spec_from_args_transformer_engine_needs_te():
    from megatron_branch._deps import HAVE_TE

    if HAVE_TE:
        pytest.skip("Transformer Engine is installed")
    with pytest.raises(ValueError, match="--transformer-impl transformer_engine"):
        branch_spec_from_args(lm_args(transformer_impl="transformer_engine"))


def core_kernels(spec):
    """The ``kernel`` every tree-attention slot of a layer spec is built with."""
    return {spec.submodules.self_attention.submodules.core_attention.params["kernel"]}


def test_branch_spec_kernel_from_the_environment(monkeypatch, caplog):
    import logging

    from megatron_branch.integrations import options

    monkeypatch.setattr(options, "_logged", set())
    monkeypatch.delenv("MEGATRON_BRANCH_KERNEL", raising=False)
    with caplog.at_level(logging.INFO, logger=options.__name__):
        assert core_kernels(branch_spec_from_args(lm_args())) == {None}  # default by device and dtype
        monkeypatch.setenv("MEGATRON_BRANCH_KERNEL", "math")
        spec = branch_spec_from_args(lm_args())
        branch_spec_from_args(lm_args())  # logged once
    assert core_kernels(spec) == {"math"}
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ["megatron_branch: tree-attention kernel default by device and dtype: flash_cpu on CPU; on "
                      "CUDA flash_varlen for bf16/fp16, efficient_varlen for float32 ($MEGATRON_BRANCH_KERNEL unset)",
                      "megatron_branch: tree-attention kernel math ($MEGATRON_BRANCH_KERNEL)"]
    # the model runs with it
    model = gpt(spec, llama_config(num_layers=2, hidden_size=64))
    assert {layer.self_attention.core_attention.kernel for layer in model.decoder.layers} == {"math"}
    # an explicit kernel (a model provider's) agrees with the variable or is refused
    assert core_kernels(branch_spec_from_args(lm_args(), kernel="math")) == {"math"}
    with pytest.raises(ValueError, match="MEGATRON_BRANCH_KERNEL=math"):
        branch_spec_from_args(lm_args(), kernel="flash_cpu")


@pytest.mark.parametrize("value", ["flash", "flash-varlen", "auto"])
def test_branch_spec_refuses_an_unknown_kernel_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("MEGATRON_BRANCH_KERNEL", value)
    with pytest.raises(ValueError, match=f"^MEGATRON_BRANCH_KERNEL={value}: .* is not a tree-attention kernel"):
        branch_spec_from_args(lm_args())
    with pytest.raises(ValueError, match=f"^MEGATRON_BRANCH_KERNEL={value}: "):
        validate_rl_args(rl_args())  # Megatron-RL fails at argument time


# ----------------------------------------------------------------------------- Megatron-RL helpers
PAD, EOD = 126, 127


def padded(seqs, width, pad=PAD):
    out = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(s)
    return out


def test_trajectory_lengths_strip_padding_keep_eod():
    tokens = padded([[5, 6, EOD], [5, 7, 8, 9, EOD], [1, 2, 3, 4, 5, 6]], 6)
    assert trajectory_lengths(tokens, PAD, EOD).tolist() == [3, 5, 6]
    same = padded([[5, 6, EOD], [5, PAD, 8, EOD], [1, 2, 3, 4, 5, 6]], 6, pad=EOD)  # pad id == eod id
    assert trajectory_lengths(same, EOD, EOD).tolist() == [3, 4, 6]
    with pytest.raises(ValueError, match="tokens"):
        trajectory_lengths(tokens.float(), PAD, EOD)


def test_trajectory_logprobs_match_naive_per_row_and_pad_with_zeros():
    branch, stock = make_pair(seed=1)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 100, (9,), generator=gen).tolist()
    seqs = [prompt + torch.randint(0, 100, (n,), generator=gen).tolist() + [EOD] for n in (4, 6, 3)]
    seqs.append(seqs[0][:11] + [7, EOD])  # shares a response stem with rollout 0
    tokens = padded(seqs, 24)
    assert trajectory_tree(tokens, PAD, EOD).unique_positions < sum(map(len, seqs))
    want = naive_rollout_logprobs(stock, seqs)  # [4, 16]
    for lp in (trajectory_logprobs(branch, tokens, PAD, EOD),
               replay_trajectory_logprobs(branch, tokens, PAD, EOD, max_chunk_tokens=5)):
        assert lp.shape == (4, 23) and lp.dtype == torch.float32
        torch.testing.assert_close(lp[:, : want.shape[1]], want, atol=1e-5, rtol=0)
        assert (lp[:, want.shape[1]:] == 0).all()
    lp = trajectory_logprobs(branch, tokens, PAD, EOD)
    lp.sum().backward()
    assert all(p.grad is not None for p in branch.parameters())


# ----------------------------------------------------------------------------- patch tool
def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env=dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                            GIT_COMMITTER_EMAIL="t@t"))


def _tool(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True)


@pytest.fixture
def upstream(tmp_path):
    """A git repo tagged v1.0 and a patch folder for it (``up-v1.0``, UPSTREAM tag v1.0)."""
    repo = tmp_path / "up"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "commit", "-qm", "init")
    _git(repo, "tag", "v1.0")
    folder = tmp_path / "patches" / "up-v1.0"
    folder.mkdir(parents=True)
    (folder / "UPSTREAM").write_text("repository: https://example.invalid/up\ntag: v1.0\n")
    (folder / "0001-x.patch").write_text("--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n")
    return repo, tmp_path / "patches"


def test_apply_patches_applies_the_folder_of_the_checkouts_tag(upstream):
    repo, patches = upstream
    args = ["--checkout", str(repo), "--patches", str(patches), "--upstream", "up"]
    check = _tool(*args)
    assert check.returncode == 0 and "ok   up-v1.0/0001-x.patch" in check.stdout
    assert (repo / "a.py").read_text() == "x = 1\n"  # check-only changes nothing
    applied = _tool(*args, "--apply")
    assert applied.returncode == 0 and "applied 1 patch(es)" in applied.stdout
    assert (repo / "a.py").read_text() == "x = 2\n"
    again = _tool(*args, "--apply")  # idempotent
    assert again.returncode == 0 and "already applied" in again.stdout and "applied 0 patch(es)" in again.stdout
    assert (repo / "a.py").read_text() == "x = 2\n"


def test_apply_patches_refuses_a_checkout_at_another_tag(upstream):
    repo, patches = upstream
    (repo / "b.py").write_text("y = 1\n")
    _git(repo, "add", "b.py")
    _git(repo, "commit", "-qm", "next")
    _git(repo, "tag", "v2.0")
    res = _tool("--checkout", str(repo), "--patches", str(patches), "--upstream", "up", "--apply")
    assert res.returncode == 1 and "v2.0" in res.stderr and "v1.0" in res.stderr
    assert (repo / "a.py").read_text() == "x = 1\n"
    other = _tool("--checkout", str(repo), "--patches", str(patches), "--upstream", "other")
    assert other.returncode == 0 and "no patches" in other.stdout


def test_apply_patches_applies_nothing_when_one_fails(upstream):
    repo, patches = upstream
    (patches / "up-v1.0" / "0002-bad.patch").write_text("--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-y = 1\n+y = 2\n")
    res = _tool("--checkout", str(repo), "--patches", str(patches), "--upstream", "up", "--apply")
    assert res.returncode == 1 and "FAIL up-v1.0/0002-bad.patch" in res.stdout
    assert (repo / "a.py").read_text() == "x = 1\n"


def _load_tool():
    spec = importlib.util.spec_from_file_location("apply_patches", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_apply_patches_picks_a_branch_folder_by_its_commit(upstream):
    repo, patches = upstream
    (repo / "a.py").write_text("x = 3\n")
    _git(repo, "commit", "-qam", "main moves on")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    folder = patches / f"up-main-{head[:10]}"
    folder.mkdir()
    (folder / "UPSTREAM").write_text(f"repository: https://example.invalid/up\ncommit: {head}\n")
    (folder / "0001-x.patch").write_text("--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 3\n+x = 4\n")
    res = _tool("--checkout", str(repo), "--patches", str(patches), "--upstream", "up", "--apply")
    assert res.returncode == 0 and f"up-main-{head[:10]}/0001-x.patch" in res.stdout, res.stdout + res.stderr
    assert (repo / "a.py").read_text() == "x = 4\n"
    tool = _load_tool()
    assert tool.folder_for(str(repo), "up", str(patches)) == str(folder)
    _git(repo, "commit", "-qam", "one more")  # a later main has no patch: named, with what exists
    res = _tool("--checkout", str(repo), "--patches", str(patches), "--upstream", "up")
    assert res.returncode == 1 and "no up patch fits" in res.stderr
    assert "v1.0" in res.stderr and f"commit {head[:10]}" in res.stderr


def test_patch_folder_names_give_their_upstream():
    tool = _load_tool()
    for name in ("megatron-lm-core_v0.16.1", "megatron-lm-core_v0.19.0", "megatron-lm-main-d98e8a64dd"):
        assert tool.folder_upstream(name) == "megatron-lm", name
    assert tool.folder_upstream("up-v1.0") == "up"


SHIPPED = sorted(glob.glob(os.path.join(ROOT, "patches", "megatron-lm-*")))


def test_shipped_megatron_lm_patch_folders_cover_the_releases():
    tool = _load_tool()
    versions = {tool.describe(tool.read_upstream(f)) for f in SHIPPED}
    assert {"core_v0.16.1", "core_v0.19.0", "commit d98e8a64dd"} <= versions


@pytest.mark.parametrize("folder", SHIPPED, ids=os.path.basename)
def test_shipped_megatron_lm_patch_folder(folder):
    upstream = _load_tool().read_upstream(folder)
    assert upstream["repository"] == "https://github.com/NVIDIA/Megatron-LM"
    assert len(upstream["commit"]) == 40
    patch = open(os.path.join(folder, "0001-branch-replay.patch"), encoding="utf-8").read()
    for path in ("train_rl.py", "megatron/rl/rl_utils.py", "megatron/training/arguments.py"):
        assert f"+++ b/{path}" in patch
    assert "--rl-branch-replay" in patch and "megatron_rl.validate_args(args)" in patch
    # megatron_branch is imported only inside the branch-replay code paths, never at module level
    imports = [line for line in patch.splitlines() if line.startswith("+") and "megatron_branch" in line
               and "import" in line]
    assert imports and all(line[1:].startswith(" ") for line in imports), imports


# ----------------------------------------------------------------------------- --rl-branch-replay validation
def rl_args(**overrides):
    """The fields of Megatron-LM's parsed arguments that the validation reads."""
    fields = dict(rl_use_sequence_packing=False, pipeline_model_parallel_size=1, context_parallel_size=1,
                  reset_position_ids=False, reset_attention_mask=False, attention_dropout=0.0, hidden_dropout=0.0,
                  cuda_graph_impl="none", batch_invariant_mode=False, hybrid_layer_pattern=None,
                  data_parallel_size=2, grpo_prompts_per_step=4, micro_batch_size=8, grpo_group_size=4,
                  rl_branch_replay_max_chunk_tokens=None)
    fields.update(overrides)
    return argparse.Namespace(**fields)


@pytest.mark.parametrize("overrides, flag", [
    (dict(rl_use_sequence_packing=True), "--rl-use-sequence-packing"),
    (dict(pipeline_model_parallel_size=2), "--pipeline-model-parallel-size"),
    (dict(context_parallel_size=2), "--context-parallel-size"),
    (dict(reset_attention_mask=True), "--reset-attention-mask"),
    (dict(hidden_dropout=0.1), "--hidden-dropout"),
    (dict(cuda_graph_impl="transformer_engine"), "--cuda-graph-impl"),
    (dict(batch_invariant_mode=True), "--batch-invariant-mode"),
    (dict(hybrid_layer_pattern="M*M*"), "--hybrid-layer-pattern"),
    (dict(grpo_prompts_per_step=3), "--grpo-prompts-per-step"),
    (dict(micro_batch_size=6), "--micro-batch-size"),
    (dict(rl_branch_replay_max_chunk_tokens=0), "--rl-branch-replay-max-chunk-tokens"),
])
def test_rl_branch_replay_validation_names_the_flag(overrides, flag):
    validate_rl_args(rl_args())  # the defaults pass
    with pytest.raises(ValueError, match=re.escape(flag)):
        validate_rl_args(rl_args(**overrides))


def test_rl_branch_replay_budget_is_logged_once(monkeypatch, caplog):
    import logging

    from megatron_branch.integrations import options

    monkeypatch.setattr(options, "_logged", set())
    monkeypatch.delenv("MEGATRON_BRANCH_KERNEL", raising=False)
    with caplog.at_level(logging.INFO, logger=options.__name__):
        validate_rl_args(rl_args(rl_branch_replay_max_chunk_tokens=4096))
        validate_rl_args(rl_args(rl_branch_replay_max_chunk_tokens=4096))
    assert [r.getMessage() for r in caplog.records] == [
        "megatron_branch: Megatron-RL old/reference log-probs by branch replay, at most 4096 tokens per forward "
        "(--rl-branch-replay-max-chunk-tokens)"]


def test_rl_branch_replay_validation_skips_options_a_release_lacks():
    args = rl_args()
    for name in ("cuda_graph_impl", "batch_invariant_mode", "hybrid_layer_pattern"):  # not in core_v0.16.1
        delattr(args, name)
    validate_rl_args(args)


def test_filler_rows_are_scored_whole_as_the_stock_path_does():
    """core_v0.19.0 pads the trajectories with rows of padding only; they are scored as S pad tokens
    (as the stock forward does), all on one shared path, and the rest is unchanged."""
    branch, stock = make_pair(seed=1)
    seqs = [[3, 4, 5, EOD], [3, 4, 9, 10, EOD]]
    tokens = torch.cat([padded(seqs, 8), torch.full((2, 8), PAD)])
    tree = trajectory_tree(tokens, PAD, EOD)
    assert tree.unique_positions == 2 + 2 + 3 + 8  # shared [3, 4], two answers, one filler path
    want = naive_rollout_logprobs(stock, seqs + [[PAD] * 8] * 2)
    lp = trajectory_logprobs(branch, tokens, PAD, EOD)
    torch.testing.assert_close(lp[2:], want[2:], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp[:2, :4], want[:2, :4], atol=1e-5, rtol=0)
    assert (lp[0, 3:] == 0).all() and (lp[1, 4:] == 0).all()
