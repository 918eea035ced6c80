"""HF <-> Megatron conversion, checked against ``transformers`` itself."""

import json
import os

import dist_worker
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import megatron_branch as mb
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.distributed import free_port
from megatron_branch.hf.convert import export_hf, import_hf, load_megatron
from megatron_branch.hf.mapping import megatron_args_from_hf

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


def make_hf(tmp_path, arch):
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**COMMON, **extra)).float().eval()
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


@pytest.mark.parametrize("arch", list(ARCHS))
def test_imported_model_matches_transformers_on_a_branching_tree(arch, tmp_path):
    hf, hf_dir = make_hf(tmp_path, arch)
    import_hf(hf_dir, str(tmp_path / "mg"))
    model, _ = load_megatron(str(tmp_path / "mg"))
    with torch.no_grad():
        lp = mb.rollout_logprobs(model, mb.BranchTree.from_sequences(BATCH.sequences))
    assert (lp - hf_logprobs(hf, BATCH.sequences)).abs().max() < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama_tied", "qwen3_moe", "mixtral"])
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


def test_moe_dense_layers_are_refused():
    cfg = dict(COMMON, architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=48, mlp_only_layers=[1])
    with pytest.raises(ValueError, match="dense layers"):
        megatron_args_from_hf(cfg)
    args, _ = megatron_args_from_hf(dict(cfg, mlp_only_layers=[], norm_topk_prob=True))
    assert args["num_moe_experts"] == 4 and args["moe_ffn_hidden_size"] == 48 and not args["moe_router_pre_softmax"]


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
