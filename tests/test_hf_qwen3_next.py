"""Qwen3-Next (Gated DeltaNet + gated attention hybrid) HF <-> Megatron, checked against transformers.

Two comparisons. With ``initializer_range=0.1`` every mapped piece moves the log-probs
visibly, but transformers' own float32 forward is then up to 3.4e-5 from its float64 one
(measured), so a float32 comparison at 1e-5 could not tell a mapping error from rounding:

* float64, ``initializer_range=0.1``: transformers and Megatron's stock local model (each
  rollout alone), both with every float32 cast lifted (:func:`float64_throughout`) and the
  step-by-step delta rule (:mod:`megatron_branch.reference.recurrent`) — the mapping itself:
  log-probs within 1e-6 (measured 2e-8 / 7e-8), while each wrong mapping a guard tries moves
  them by > 0.01; the branch model on the tree (float64 parameters, Megatron's own float32
  casts, float32 log-probs) against the stock model with the same casts within 2e-6 (measured
  one float32 ulp of a log-prob near -8);
* float32 with each side's own chunked kernel, through the converter's files, at
  ``initializer_range=0.05`` (transformers' float32 error ~1e-6): within 1e-5 of transformers
  (measured 1.9e-6 / 9.5e-7).

The round trip is bit-exact for weights whose zero-centered norm shift ``1 + w`` keeps every
bit (all bf16 values; the test's norm weights are bf16 values); tensors with entries it would
lose import with a warning naming them (:mod:`megatron_branch.hf.qwen3_next`). The MoE layers:
tests/test_hf_moe_families.py.
"""

import contextlib
import copy
import re

import dist_worker
import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_hf import BATCH, hf_logprobs

import megatron_branch as mb
from megatron_branch._megatron import gdn_unavailable_reason
from megatron_branch.distributed import free_port
from megatron_branch.hf.convert import export_hf, import_hf, load_megatron
from megatron_branch.hf.mapping import TensorError, hf_to_megatron, megatron_args_from_hf, megatron_to_hf
from megatron_branch.hf.model import build_from_hf_config, load_state
from megatron_branch.reference.naive import naive_rollout_logprobs
from megatron_branch.reference.recurrent import recurrent_gated_delta_rule
from megatron_branch.spec.builders import build_gpt

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
needs_gdn = pytest.mark.skipif(gdn_unavailable_reason() is not None, reason=str(gdn_unavailable_reason()))

ARCH = "Qwen3NextForCausalLM"
LINEAR, FULL = "linear_attention", "full_attention"
PATTERNS = {"lllf": [LINEAR, LINEAR, LINEAR, FULL], "lflf": [LINEAR, FULL, LINEAR, FULL]}
TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, vocab_size=128, max_position_embeddings=256, initializer_range=0.1)


def hf_cfg(pattern="lllf", **extra) -> dict:
    """A tiny dense Qwen3-Next config.json (every layer in ``mlp_only_layers``; HF's default
    ``partial_rotary_factor`` 0.25: 4 of 16 head channels rotate)."""
    types = PATTERNS[pattern]
    cfg = transformers.Qwen3NextConfig(**TINY, num_hidden_layers=len(types), layer_types=types,
                                       mlp_only_layers=list(range(len(types))))
    return {**cfg.to_dict(), "architectures": [ARCH], **extra}


def make_hf(cfg: dict, seed: int = 0):
    """transformers' model of ``cfg`` (float32, eval) with norm weights that show a wrong shift:
    the zero-centered ones around 0, the gated GDN norm around 1, rounded to bf16 values."""
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((torch.randn_like(p) * 0.5 + float("linear_attn.norm" in name)).bfloat16().float())
    return model


@pytest.fixture(autouse=True)
def hf_torch_kernels(monkeypatch):
    """transformers' torch delta rule: with flash-linear-attention installed, transformers
    calls FLA's Triton kernel, which has no CPU backend."""
    chunk = qwen3_next.torch_chunk_gated_delta_rule
    monkeypatch.setattr(qwen3_next, "torch_chunk_gated_delta_rule", getattr(chunk, "__wrapped__", chunk))


def _hf_step_rule(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                  **_):
    """transformers' delta-rule contract (q/k on key heads, L2 norm in the kernel) on the
    step-by-step kernel, in the inputs' dtype."""
    if use_qk_l2norm_in_kernel:
        q, k = qwen3_next.l2norm(q, dim=-1, eps=1e-6), qwen3_next.l2norm(k, dim=-1, eps=1e-6)
    # [B, T, key heads, dk] -> [B, T, value heads, dk]: each key head serves consecutive value heads
    r = v.shape[2] // k.shape[2]
    return recurrent_gated_delta_rule(q.repeat_interleave(r, 2), k.repeat_interleave(r, 2), v, g, beta,
                                      initial_state=initial_state, output_final_state=output_final_state)


def _gated_norm_float64(self, x, gate):
    # Qwen3NextRMSNormGated.forward without its float32 casts
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x * torch.nn.functional.silu(gate)


@contextlib.contextmanager
def float64_throughout(monkeypatch):
    """Both implementations in float64: ``Tensor.float()`` keeps float64 tensors (the casts
    in HF's norms, decay and logits, Megatron's decay, gates and L2 norm), HF's gated norm
    without its casts, and transformers' chunked kernel (float32 inside) replaced by the
    step-by-step one."""
    to_float = torch.Tensor.float
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "float", lambda t, *a, **k: t if t.dtype == torch.float64 else to_float(t, *a, **k))
        m.setattr(qwen3_next.Qwen3NextRMSNormGated, "forward", _gated_norm_float64)
        m.setattr(qwen3_next, "torch_chunk_gated_delta_rule", _hf_step_rule)
        yield


def hf_float64_logprobs(hf, monkeypatch):
    """transformers' per-rollout log-probs of ``hf``'s weights in float64 (a copy; sdpa
    attention, whose softmax keeps the dtype)."""
    model = copy.deepcopy(hf).double()
    model.config._attn_implementation = "sdpa"
    with float64_throughout(monkeypatch):
        return hf_logprobs(model, BATCH.sequences).double()


def megatron_float64(cfg: dict, state: dict, branch: bool = True):
    """``(model, config)`` of ``cfg`` with Megatron-named ``state`` in float64, on the
    step-by-step kernel: the branch spec, or (``branch=False``) Megatron's stock local one."""
    model, config = build_from_hf_config(cfg, torch.float64)
    if not branch:
        _, kwargs = megatron_args_from_hf(cfg)
        model = build_gpt(config, kwargs.pop("vocab_size"), branch=False,
                          max_sequence_length=kwargs.pop("max_sequence_length"), **kwargs)
    load_state(model, state)
    model = model.double()  # the local norms are built in float32 whatever params_dtype says
    for layer in model.decoder.layers:
        if hasattr(layer.self_attention, "gated_delta_rule"):
            layer.self_attention.gated_delta_rule = recurrent_gated_delta_rule
    return model, config


def stock_float64_logprobs(model, monkeypatch=None):
    """Each rollout alone through the stock model, float64 throughout (without
    ``monkeypatch``: with Megatron's float32 casts)."""
    context = float64_throughout(monkeypatch) if monkeypatch is not None else contextlib.nullcontext()
    with context, torch.no_grad():
        return naive_rollout_logprobs(model, BATCH.sequences).double()


def branch_logprobs(model):
    with torch.no_grad():
        return mb.rollout_logprobs(model, mb.BranchTree.from_sequences(BATCH.sequences)).double()


# ------------------------------------------------------------------ against transformers
@needs_gdn
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_mapping_matches_transformers_in_float64(pattern, monkeypatch):
    cfg = hf_cfg(pattern)
    hf = make_hf(cfg)
    state = hf_to_megatron(dict(hf.state_dict()), cfg)
    stock, config = megatron_float64(cfg, state, branch=False)
    expected = [int(t == LINEAR) for t in PATTERNS[pattern]]
    assert config.linear_attention_freq == expected and config.deterministic_mode and config.attention_output_gate
    assert (config.kv_channels, config.qk_layernorm, stock.rotary_pos_emb.inv_freq.numel()) == (16, True, 2)
    ref = hf_float64_logprobs(hf, monkeypatch)
    assert (stock_float64_logprobs(stock, monkeypatch) - ref).abs().max() < 1e-6
    # the tree (gated attention, partial RoPE, GDN) against each rollout alone, same casts
    branch, _ = megatron_float64(cfg, state)
    assert (branch_logprobs(branch) - stock_float64_logprobs(stock)).abs().max() < 2e-6

    # Guards: each of these wrong mappings moves the log-probs visibly
    gdn, attn = "decoder.layers.0.self_attention.", f"decoder.layers.{expected.index(0)}.self_attention."
    hf_gdn = "model.layers.0.linear_attn."
    wrong = {
        # HF's per-key-head grouping kept instead of Megatron's sections
        "in_proj grouped": {gdn + "in_proj.weight": torch.cat([hf.state_dict()[hf_gdn + "in_proj_qkvz.weight"],
                                                               hf.state_dict()[hf_gdn + "in_proj_ba.weight"]])},
        # the zero-centered weights w copied as they are (no 1 + w)
        "norms unshifted": {k: v - 1 for k, v in state.items() if k.endswith("layernorm.weight")},
        # queries and gates swapped: per KV group [q0, q1, gate0, gate1, k, v] blocks of head_dim rows
        "gate as query": {attn + "linear_qkv.weight": state[attn + "linear_qkv.weight"].reshape(2, 6, 16, 64)
                          [:, [2, 3, 0, 1, 4, 5]].reshape(-1, 64)},
    }
    for name, change in wrong.items():
        load_state(stock, {**state, **change})
        assert (stock_float64_logprobs(stock, monkeypatch) - ref).abs().max() > 0.01, name
    # RoPE on the whole head instead of HF's partial_rotary_factor 0.25
    full_rope = dict(cfg, rope_parameters=dict(cfg["rope_parameters"], partial_rotary_factor=1.0))
    stock, _ = megatron_float64(full_rope, state, branch=False)
    assert (stock_float64_logprobs(stock, monkeypatch) - ref).abs().max() > 0.01


@needs_gdn
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_converted_checkpoint_matches_transformers_in_float32(pattern, tmp_path):
    hf = make_hf(hf_cfg(pattern, initializer_range=0.05))
    hf.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "mg"))
    model, saved = load_megatron(str(tmp_path / "mg"))
    # model_args.json rebuilds the hybrid config: layer pattern, GDN sizes, Megatron's torch kernels
    assert saved["layer_types"] == PATTERNS[pattern]
    assert (model.config.experimental_attention_variant, model.config.linear_attention_freq,
            model.config.deterministic_mode) == ("gated_delta_net", [int(t == LINEAR) for t in saved["layer_types"]],
                                                 True)
    assert (branch_logprobs(model) - hf_logprobs(hf, BATCH.sequences)).abs().max() < 1e-5


@needs_gdn
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_round_trip_is_bit_exact_and_loads_in_transformers(pattern, tmp_path):
    hf = make_hf(hf_cfg(pattern))
    hf.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "mg"))
    export_hf(str(tmp_path / "mg"), str(tmp_path / "back"))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original)
    for name, t in original.items():
        assert torch.equal(back[name], t), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).float().eval()
    assert torch.equal(hf_logprobs(reloaded, BATCH.sequences), hf_logprobs(hf, BATCH.sequences))


@needs_gdn
def test_import_at_tp1_load_at_tp2(tmp_path):
    # the GDN heads, in_proj sections and conv channels split over two ranks by megatron-core's
    # own sharded state dict
    make_hf(hf_cfg("lflf")).save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "mg"))
    one = branch_logprobs(load_megatron(str(tmp_path / "mg"))[0])
    dist_worker.start(dist_worker.hf_worker, (2, free_port(), str(tmp_path / "mg"), BATCH.sequences, str(tmp_path)), 2)
    for rank in range(2):
        assert (torch.load(tmp_path / f"hf{rank}.pt")["lp"] - one).abs().max() < 1e-5


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("change, message", [
    ({"num_experts": -1}, "num_experts is -1"),
    ({"mlp_only_layers": [], "num_experts_per_tok": 0}, "num_experts_per_tok is 0"),
    ({"mlp_only_layers": [], "shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size is -1"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"layer_types": [LINEAR, FULL]}, "layer_types has 2 entries, expected num_hidden_layers=4"),
    ({"layer_types": [LINEAR, "sliding_attention", LINEAR, FULL]}, r"layer_types \['sliding_attention'\]"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    ({"linear_key_head_dim": 0}, "linear_key_head_dim is 0, expected a positive integer"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
     "partial_rotary_factor=0.1 with head_dim=16 gives a rotary part of 1 channels"),
])
def test_bad_configs_raise_naming_the_field(change, message):
    cfg = hf_cfg()
    megatron_args_from_hf(cfg)  # the unchanged config converts
    with pytest.raises(ValueError, match=message):
        megatron_args_from_hf(dict(cfg, **change))


def test_a_dense_config_without_experts_converts():
    config, _ = megatron_args_from_hf(dict(hf_cfg(), num_experts=0, mlp_only_layers=[]))
    assert config["linear_attention_freq"] == [1, 1, 1, 0] and "num_moe_experts" not in config


@pytest.mark.parametrize("change, moe_layer_freq", [
    ({"mlp_only_layers": []}, None), ({"mlp_only_layers": [0, 1]}, [0, 0, 1, 1]),
    ({"mlp_only_layers": [], "decoder_sparse_step": 2}, [0, 1, 0, 1])])
def test_moe_layers_map_to_moe_layer_freq(change, moe_layer_freq):
    # HF's rule (mlp_only_layers, every decoder_sparse_step-th layer); checked against transformers
    # numerically in tests/test_hf_moe_families.py
    config, _ = megatron_args_from_hf(dict(hf_cfg(), **change))
    assert config.get("moe_layer_freq") == moe_layer_freq and config["num_moe_experts"] == 512
    assert (config["moe_shared_expert_intermediate_size"], config["moe_shared_expert_gate"]) == (512, True)


# Shaped like the hub's Qwen3-Next-80B-A3B config.json: top-level rope_theta and
# partial_rotary_factor, full_attention_interval instead of layer_types, MoE on every layer.
HUB_STYLE = {
    "architectures": [ARCH], "model_type": "qwen3_next", "decoder_sparse_step": 1, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "vocab_size": 151936,
}


@pytest.mark.parametrize("omit", [(), ("head_dim", "partial_rotary_factor", "full_attention_interval",
                                       "linear_key_head_dim", "num_key_value_heads")])
def test_hub_style_config_reads_as_transformers_does(omit):
    config, _ = megatron_args_from_hf(HUB_STYLE)  # Qwen3-Next-80B-A3B: 512 experts, top-10, a gated shared one
    assert {k: config[k] for k in ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                                   "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                                   "moe_router_pre_softmax")} == dict(
        num_moe_experts=512, moe_router_topk=10, moe_ffn_hidden_size=512, moe_shared_expert_intermediate_size=512,
        moe_shared_expert_gate=True, moe_router_pre_softmax=False)
    cfg = {k: v for k, v in dict(HUB_STYLE, mlp_only_layers=list(range(48))).items() if k not in omit}
    config, model = megatron_args_from_hf(cfg)
    theirs = transformers.Qwen3NextConfig(**cfg)  # what from_pretrained makes of the same file
    assert config["linear_attention_freq"] == [int(t == LINEAR) for t in theirs.layer_types]
    assert (config["kv_channels"], config["num_query_groups"], config["linear_key_head_dim"]) == (
        theirs.head_dim, theirs.num_key_value_heads, theirs.linear_key_head_dim)
    assert (model["rotary_percent"], model["rotary_base"]) == (
        theirs.rope_parameters["partial_rotary_factor"], theirs.rope_parameters["rope_theta"])
    assert model["max_sequence_length"] == 262144 and config["ffn_hidden_size"] == 5120


def test_norm_entries_the_shift_would_lose_are_named_in_a_warning(tmp_path):
    cfg = hf_cfg()
    state = {k: v.clone() for k, v in make_hf(cfg).state_dict().items()}
    state["model.layers.3.self_attn.k_norm.weight"][5] = 1e-9  # 1 + 1e-9 == 1 in float32
    with pytest.warns(UserWarning, match=r"\('model.layers.3.self_attn.k_norm.weight'\) have entries that 1 \+ w"):
        back = megatron_to_hf(hf_to_megatron(state, cfg), cfg)
    assert [k for k, v in state.items() if not torch.equal(back[k], v)] == ["model.layers.3.self_attn.k_norm.weight"]
    state["model.layers.3.self_attn.k_norm.weight"][5] = 2.0 ** -16  # kept
    back = megatron_to_hf(hf_to_megatron(state, cfg), cfg)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_mtp_head_is_ignored_as_transformers_ignores_it():
    cfg = hf_cfg()
    state = dict(make_hf(cfg).state_dict())
    mapped = hf_to_megatron(dict(state, **{"mtp.fc.weight": torch.zeros(64, 128)}), cfg)
    assert set(megatron_to_hf(mapped, cfg)) == set(state)
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.mtp.fc.weight'\]"):
        hf_to_megatron(dict(state, **{"model.mtp.fc.weight": torch.zeros(2)}), cfg)


def test_misshapen_gdn_tensor_is_named():
    cfg = hf_cfg()
    state = dict(make_hf(cfg).state_dict())
    state["model.layers.1.linear_attn.in_proj_ba.weight"] = torch.zeros(6, 64)
    with pytest.raises(TensorError, match=r"'model.layers.1.linear_attn.in_proj_ba.weight' has shape \[6, 64\], "
                                          r"config.json implies \[8, 64\]"):
        hf_to_megatron(state, cfg)


@needs_gdn
def test_bf16_parameters_are_refused(tmp_path):
    make_hf(hf_cfg()).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"--dtype: bfloat16 is not supported for Qwen3NextForCausalLM.*1 \+ w"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "mg"), dtype="bf16")
    assert not (tmp_path / "mg").exists()


@pytest.mark.skipif(gdn_unavailable_reason() is None, reason="this megatron-core has GatedDeltaNet")
def test_megatron_core_without_gated_delta_net_refuses_by_reason():
    with pytest.raises(ValueError, match=f"{ARCH}: " + re.escape(gdn_unavailable_reason())):
        build_from_hf_config(hf_cfg())
