"""HF <-> Megatron conversion, checked against ``transformers`` itself."""

import json
import os

import dist_worker
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import megatron_branch as mb
from megatron_branch._megatron import mla_unbuildable_reason
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.distributed import free_port
from megatron_branch.hf.convert import export_hf, import_hf, load_megatron
from megatron_branch.hf.mapping import TensorError, hf_to_megatron, megatron_args_from_hf, megatron_to_hf

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    # Mixture of Experts: softmax -> top-k (Qwen3-MoE, no renormalisation) and renormalised top-k (Mixtral)
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
# DeepSeek-V3 multi-latent attention, dense layers (first_k_dense_replace = all layers). Larger
# weights (initializer_range 0.1) so RoPE pairing and scales move the log-probs visibly: a flipped
# rope_interleave changes them by ~1, YaRN's mscale_all_dim 0.6 -> 0.9 by ~0.07.
DEEPSEEK = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=12, first_k_dense_replace=2, initializer_range=0.1)
# YaRN with mscale != mscale_all_dim, so both the cos/sin factor and the softmax factor differ from 1
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.6}
MLA_ARCHS = {
    "deepseek_v3": DEEPSEEK,
    "deepseek_v3_yarn": dict(DEEPSEEK, rope_scaling=YARN),
    # RoPE on halves instead of interleaved pairs: the RoPE rows are permuted on import and export
    "deepseek_v3_rotate_half": dict(DEEPSEEK, rope_scaling=YARN, rope_interleave=False),
}
ARCHS.update({name: (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, extra)
              for name, extra in MLA_ARCHS.items()})
needs_mla = pytest.mark.skipif(mla_unbuildable_reason() is not None, reason=str(mla_unbuildable_reason()))


def arch_params(names):
    """``names`` for parametrize, the multi-latent attention ones skipped where megatron-core cannot build MLA."""
    return [pytest.param(name, marks=needs_mla) if name in MLA_ARCHS else name for name in names]


def make_hf(tmp_path, arch):
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**COMMON, **extra})).float().eval()
    with torch.no_grad():  # non-trivial biases and norms, so a wrong mapping shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
            elif name.endswith("mlp.gate.weight"):  # MoE router: well-separated top-k choices
                p.normal_(0.0, 1.0)
    path = tmp_path / f"hf-{arch}"
    model.save_pretrained(path)
    return model, str(path)


def hf_logprobs(model, sequences):
    width = max(len(s) for s in sequences) - 1
    rows = []
    with torch.no_grad():
        for s in sequences:
            logits = model(s[None]).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, s[1:, None])[:, 0]
            rows.append(torch.nn.functional.pad(lp, (0, width - lp.numel())))
    return torch.stack(rows)


BATCH = branching_rollouts([20, 9], [2, 3], [5, 6], 128, seed=1)


@pytest.mark.parametrize("arch", arch_params(ARCHS))
def test_imported_model_matches_transformers_on_a_branching_tree(arch, tmp_path):
    hf, hf_dir = make_hf(tmp_path, arch)
    import_hf(hf_dir, str(tmp_path / "mg"))
    model, _ = load_megatron(str(tmp_path / "mg"))
    assert bool(getattr(model.config, "multi_latent_attention", False)) == (arch in MLA_ARCHS)
    with torch.no_grad():
        lp = mb.rollout_logprobs(model, mb.BranchTree.from_sequences(BATCH.sequences))
    assert (lp - hf_logprobs(hf, BATCH.sequences)).abs().max() < 1e-5


@pytest.mark.parametrize("arch", arch_params(["llama", "qwen2", "qwen3", "llama_tied", "qwen3_moe", "mixtral",
                                              *MLA_ARCHS]))
def test_round_trip_is_bit_exact_and_loads_in_transformers(arch, tmp_path):
    hf, hf_dir = make_hf(tmp_path, arch)
    import_hf(hf_dir, str(tmp_path / "mg"))
    export_hf(str(tmp_path / "mg"), str(tmp_path / "back"), max_shard_bytes=20_000)  # forces sharding
    assert os.path.isfile(tmp_path / "back" / "model.safetensors.index.json")
    original = {k: v for f in os.listdir(hf_dir) if f.endswith(".safetensors") for k, v in load_file(os.path.join(hf_dir, f)).items()}
    back = {k: v for f in os.listdir(tmp_path / "back") if f.endswith(".safetensors")
            for k, v in load_file(str(tmp_path / "back" / f)).items()}
    assert set(back) == set(original)
    for name, t in original.items():
        assert torch.equal(back[name], t), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).float().eval()
    assert torch.equal(hf_logprobs(reloaded, BATCH.sequences), hf_logprobs(hf, BATCH.sequences))


def test_import_at_tp1_load_at_tp2(tmp_path):
    hf, hf_dir = make_hf(tmp_path, "qwen2")
    import_hf(hf_dir, str(tmp_path / "mg"))
    dist_worker.start(dist_worker.hf_worker, (2, free_port(), str(tmp_path / "mg"), BATCH.sequences, str(tmp_path)), 2)
    ref = hf_logprobs(hf, BATCH.sequences)
    for rank in range(2):
        assert (torch.load(tmp_path / f"hf{rank}.pt")["lp"] - ref).abs().max() < 1e-5


def _edit_weights(hf_dir, fn):
    path = os.path.join(hf_dir, "model.safetensors")
    state = load_file(path)
    fn(state)
    save_file(state, path, metadata={"format": "pt"})


def test_bad_inputs_raise_clearly(tmp_path):
    _, hf_dir = make_hf(tmp_path, "llama")
    with pytest.raises(ValueError, match="has no config.json"):
        import_hf(str(tmp_path), str(tmp_path / "x"))
    with pytest.raises(ValueError, match="--dtype"):
        import_hf(hf_dir, str(tmp_path / "x"), dtype="fp16")
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        megatron_args_from_hf(dict(cfg, architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        megatron_args_from_hf(dict(cfg, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="low_freq_factor"):
        megatron_args_from_hf(dict(cfg, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}))
    args, model_args = megatron_args_from_hf(dict(cfg, rope_scaling={"rope_type": "llama3", "factor": 32.0}))
    assert model_args["rope_scaling"] and model_args["rope_scaling_factor"] == 32.0

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not empty"):
        import_hf(hf_dir, str(tmp_path / "busy"))
    assert (tmp_path / "busy" / "file").read_text() == "keep me"

    _edit_weights(hf_dir, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        import_hf(hf_dir, str(tmp_path / "x"))
    _, hf_dir = make_hf(tmp_path / "2", "llama")
    _edit_weights(hf_dir, lambda s: s.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected tensors"):
        import_hf(hf_dir, str(tmp_path / "x"))
    _, hf_dir = make_hf(tmp_path / "3", "llama")
    _edit_weights(hf_dir, lambda s: s.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 32)}))
    with pytest.raises(ValueError, match=r"o_proj.weight' has shape \[64, 32\], config.json implies \[64, 64\]"):
        import_hf(hf_dir, str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_pickle_checkpoints_are_refused(tmp_path):
    _, hf_dir = make_hf(tmp_path, "llama")
    os.remove(os.path.join(hf_dir, "model.safetensors"))
    (tmp_path / "hf-llama" / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickle checkpoints are not loaded"):
        import_hf(hf_dir, str(tmp_path / "x"))


def test_interrupted_conversion_leaves_nothing_under_the_target(tmp_path):
    _, hf_dir = make_hf(tmp_path, "llama")
    with pytest.raises(RuntimeError, match="simulated failure"):
        import_hf(hf_dir, str(tmp_path / "out"), _fail_after_save=True)
    assert not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out.tmp")]


def test_convert_tool_end_to_end(tmp_path):
    import subprocess
    import sys

    _, hf_dir = make_hf(tmp_path, "qwen3")
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "convert_checkpoint.py")
    run = lambda *a: subprocess.run([sys.executable, tool, *a], capture_output=True, text=True, timeout=300)  # noqa: E731
    proc = run("import", "--hf-model", hf_dir, "--megatron-path", str(tmp_path / "mg"), "--tp", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert os.path.isfile(tmp_path / "mg" / "model_args.json")
    proc = run("import", "--hf-model", hf_dir, "--megatron-path", str(tmp_path / "mg"))
    assert proc.returncode == 2 and "exists and is not empty" in proc.stderr
    proc = run("export", "--megatron-path", str(tmp_path / "mg"), "--hf-model", str(tmp_path / "out"),
               "--hf-config", hf_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")) is not None


def test_sliding_window_is_refused():
    cfg = dict(COMMON, num_hidden_layers=2, architectures=["MistralForCausalLM"], sliding_window=4096)
    with pytest.raises(ValueError, match="sliding_window=4096"):
        megatron_args_from_hf(cfg)
    assert megatron_args_from_hf(dict(cfg, sliding_window=None))[0]["num_layers"] == 2


def test_moe_in_memory_load_and_export(tmp_path):
    hf, hf_dir = make_hf(tmp_path, "qwen3_moe")
    model, config = mb.hf.load_gpt_from_hf(hf_dir)
    assert config.num_moe_experts == 4 and config.moe_router_pre_softmax  # norm_topk_prob=false
    with torch.no_grad():
        lp = mb.rollout_logprobs(model, mb.BranchTree.from_sequences(BATCH.sequences))
    assert (lp - hf_logprobs(hf, BATCH.sequences)).abs().max() < 1e-5
    state = mb.hf.export_hf_state(model, json.load(open(os.path.join(hf_dir, "config.json"))))
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert set(state) == set(original) and all(torch.equal(state[k], original[k]) for k in original)


def test_the_model_config_pair_is_refused_where_a_model_is_expected(tmp_path):
    """load_gpt_from_hf returns (model, config); passing the pair on says so (it read as two
    virtual-pipeline chunks before), while a list of one model chunk still works."""
    from megatron_branch.training import zero_grads
    from megatron_branch.training.schedule import forward_backward

    _, hf_dir = make_hf(tmp_path, "llama")
    pair = mb.hf.load_gpt_from_hf(hf_dir)
    assert isinstance(pair, tuple) and len(pair) == 2
    model, config = pair
    tree = mb.BranchTree.from_sequences(BATCH.sequences)
    loss = lambda lp, ids: lp.sum()  # noqa: E731
    calls = {
        "rollout_logprobs": lambda m: mb.rollout_logprobs(m, tree),
        "replay_logprobs": lambda m: mb.replay_logprobs(m, tree),
        "replay_step": lambda m: mb.replay_step(m, tree, loss),
        "export_hf_state": lambda m: mb.hf.export_hf_state(m, json.load(open(os.path.join(hf_dir, "config.json")))),
        "zero_grads": zero_grads,
        "forward_backward": lambda m: forward_backward(m, [tree], loss, forward_only=True),
    }
    for name, call in calls.items():
        for wrong, kind in ((pair, "tuple"), ([model, config], "list")):
            with pytest.raises(ValueError, match=f"model: got a {kind} holding a TransformerConfig.*pass the model"):
                call(wrong)
    with torch.no_grad():
        assert torch.equal(mb.rollout_logprobs([model], tree), mb.rollout_logprobs(model, tree))


def test_moe_dense_layers_map_to_moe_layer_freq():
    cfg = dict(COMMON, architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=48, mlp_only_layers=[1])
    args, _ = megatron_args_from_hf(cfg)  # HF's mlp_only_layers: Megatron's per-layer moe_layer_freq
    assert args["moe_layer_freq"] == [1, 0] and args["ffn_hidden_size"] == 96
    args, _ = megatron_args_from_hf(dict(cfg, mlp_only_layers=[], norm_topk_prob=True))
    assert args["num_moe_experts"] == 4 and args["moe_ffn_hidden_size"] == 48 and not args["moe_router_pre_softmax"]
    assert "moe_layer_freq" not in args  # every layer MoE: Megatron's default


def test_moe_checkpoint_loads_expert_parallel(tmp_path):
    hf, hf_dir = make_hf(tmp_path, "mixtral")
    import_hf(hf_dir, str(tmp_path / "mg"))
    hf_cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    dist_worker.start(dist_worker.hf_moe_worker, (2, free_port(), str(tmp_path / "mg"), hf_cfg, BATCH.sequences,
                                                  str(tmp_path)), 2)
    ref = hf_logprobs(hf, BATCH.sequences)
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    for rank in range(2):
        out = torch.load(tmp_path / f"hf_moe{rank}.pt")
        assert (out["lp"] - ref).abs().max() < 1e-5
        assert set(out["state"]) == set(original)
        assert all(torch.equal(out["state"][k], original[k]) for k in original)


# DeepSeek-V3's own config.json (Hugging Face hub, deepseek-ai/DeepSeek-V3): legacy rope_scaling
# with "type", top-level rope_theta, and MoE layers from layer 3 on.
DEEPSEEK_V3_HUB = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 4,
    "v_head_dim": 128, "vocab_size": 129280,
}


def test_deepseek_v3_config_maps_to_mla_fields():
    config, model = megatron_args_from_hf(dict(DEEPSEEK_V3_HUB, first_k_dense_replace=61))
    assert {k: config[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")} == dict(
        num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432)
    assert {k: v for k, v in config.items() if k not in ("num_layers", "hidden_size", "num_attention_heads",
                                                          "ffn_hidden_size", "activation_func")} == dict(
        layernorm_epsilon=1e-06, normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
        qk_layernorm=True, multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
        qk_pos_emb_head_dim=64, v_head_dim=128, rotary_base=10000.0, rope_type="yarn", rotary_scaling_factor=40.0,
        original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    assert model["vocab_size"] == 129280 and not model["share_embeddings_and_output_weights"]
    # no mscale_all_dim: HF scales cos/sin by mscale(factor) and leaves the softmax alone (Megatron: 1 and 0)
    yarn = dict(DEEPSEEK_V3_HUB["rope_scaling"], mscale=0.5, mscale_all_dim=0)
    config, _ = megatron_args_from_hf(dict(DEEPSEEK_V3_HUB, first_k_dense_replace=61, rope_scaling=yarn))
    assert (config["mscale"], config["mscale_all_dim"]) == (1.0, 0.0)
    # no factor: HF takes max_position_embeddings / original_max_position_embeddings
    yarn = {k: v for k, v in DEEPSEEK_V3_HUB["rope_scaling"].items() if k != "factor"}
    config, _ = megatron_args_from_hf(dict(DEEPSEEK_V3_HUB, first_k_dense_replace=61, rope_scaling=yarn))
    assert config["rotary_scaling_factor"] == 40.0
    config, _ = megatron_args_from_hf(dict(DEEPSEEK_V3_HUB, first_k_dense_replace=61, rope_scaling=None))
    assert config["rope_type"] == "rope" and "rotary_scaling_factor" not in config


@pytest.mark.parametrize("change, message", [
    ({"first_k_dense_replace": -1}, "first_k_dense_replace is -1"),
    ({"q_lora_rank": None}, "q_lora_rank=null"),
    ({"q_lora_rank": 0}, "q_lora_rank is 0, expected a positive integer or null"),
    ({"kv_lora_rank": None}, "lacks kv_lora_rank"),
    ({"qk_rope_head_dim": 2.5}, "qk_rope_head_dim is 2.5, expected a positive integer"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 differs from num_attention_heads=4"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rms_norm_eps": 1e-5}, r"rms_norm_eps=1e-05 .*q_a_layernorm, kv_a_layernorm"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling type 'linear'"),
    ({"rope_parameters": dict(YARN, attention_factor=1.2)}, "yarn attention_factor=1.2"),
    ({"rope_parameters": dict(YARN, truncate=False)}, "yarn truncate=false"),
    ({"rope_parameters": dict(YARN, mscale=None)}, "yarn mscale=None with mscale_all_dim=0.6"),
    ({"rope_parameters": dict(YARN, partial_rotary_factor=0.5)}, "partial_rotary_factor=0.5"),
])
def test_deepseek_v3_bad_configs_raise_naming_the_field(change, message):
    cfg = transformers.DeepseekV3Config(**{**COMMON, **DEEPSEEK}).to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    megatron_args_from_hf(cfg)  # the unchanged config converts
    with pytest.raises(ValueError, match=message):
        megatron_args_from_hf(dict(cfg, **change))


def _deepseek_state(cfg):
    """Random HF-named DeepSeek-V3 tensors of ``cfg``'s shapes (through transformers' own model)."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_deepseek_v3_tensors_map_both_ways_bit_exactly(q_lora_rank):
    # Tensor level only (megatron-core builds no MLA layer without q_lora_rank, see the refusal above)
    cfg = {**COMMON, **DEEPSEEK, "q_lora_rank": q_lora_rank, "rope_interleave": False}
    hf_cfg = dict(transformers.DeepseekV3Config(**cfg).to_dict(), architectures=["DeepseekV3ForCausalLM"])
    state = _deepseek_state(cfg)
    mg = hf_to_megatron(state, hf_cfg)
    attn, hf_attn = "decoder.layers.1.self_attention.", "model.layers.1.self_attn."
    q_name = "linear_q_up_proj.weight" if q_lora_rank else "linear_q_proj.weight"
    assert (attn + "q_layernorm.weight" in mg) == bool(q_lora_rank) and attn + "kv_layernorm.weight" in mg
    # rotate-half RoPE: Megatron row 2i of each RoPE part is HF row i, row 2i+1 is HF row d/2 + i
    kv_a, kv_down = state[hf_attn + "kv_a_proj_with_mqa.weight"], mg[attn + "linear_kv_down_proj.weight"]
    assert torch.equal(kv_down[:16], kv_a[:16])
    assert torch.equal(kv_down[16::2], kv_a[16:20]) and torch.equal(kv_down[17::2], kv_a[20:24])
    q_hf = state[hf_attn + ("q_b_proj.weight" if q_lora_rank else "q_proj.weight")].reshape(4, 24, -1)
    q_mg = mg[attn + q_name].reshape(4, 24, -1)
    assert torch.equal(q_mg[:, :16], q_hf[:, :16]) and torch.equal(q_mg[:, 16::2], q_hf[:, 16:20])
    back = megatron_to_hf(mg, hf_cfg)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    broken = dict(state)
    broken[hf_attn + "kv_b_proj.weight"] = torch.zeros(4 * 28, 8)
    with pytest.raises(TensorError, match=r"'model.layers.1.self_attn.kv_b_proj.weight' has shape \[112, 8\], "
                                          r"config.json implies \[112, 16\]"):
        hf_to_megatron(broken, hf_cfg)


@needs_mla
def test_deepseek_v3_loads_as_mla_config_and_rope_pairing_matters(tmp_path):
    hf, hf_dir = make_hf(tmp_path, "deepseek_v3_rotate_half")
    import_hf(hf_dir, str(tmp_path / "mg"))
    model, _ = load_megatron(str(tmp_path / "mg"))
    config = model.config
    assert type(config).__name__ == "MLATransformerConfig" and config.qk_layernorm
    assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings,
            config.mscale, config.mscale_all_dim) == ("yarn", 4.0, 64, 0.8, 0.6)
    ref = hf_logprobs(hf, BATCH.sequences)
    # Guard: the same weights converted as interleaved pairs (the wrong RoPE rows) differ visibly
    cfg_path = os.path.join(hf_dir, "config.json")
    json.dump(dict(json.load(open(cfg_path)), rope_interleave=True), open(cfg_path, "w"))
    import_hf(hf_dir, str(tmp_path / "wrong"))
    wrong, _ = load_megatron(str(tmp_path / "wrong"))
    # exporting with a config of the other pairing would permute the RoPE rows wrongly: refused
    with pytest.raises(ValueError, match="describes another model .*rope_interleave True vs False"):
        export_hf(str(tmp_path / "mg"), str(tmp_path / "back"), hf_config_dir=hf_dir)
    with torch.no_grad():
        lp = mb.rollout_logprobs(model, mb.BranchTree.from_sequences(BATCH.sequences))
        lp_wrong = mb.rollout_logprobs(wrong, mb.BranchTree.from_sequences(BATCH.sequences))
    assert (lp - ref).abs().max() < 1e-5 < 0.1 < (lp_wrong - ref).abs().max()
