"""The released model families with their experts, HF <-> Megatron, checked against transformers.

Tiny configs made by transformers 5.25 itself (2-3 layers, 4-8 experts), float32:

* Qwen3-Next with MoE layers (routed experts, renormalised top-k, a sigmoid-gated shared
  expert) and a dense layer between them (``mlp_only_layers``);
* DeepSeek-V3 with MoE layers: sigmoid scores, the expert-bias correction, group-limited
  routing, the routed scaling factor, a shared expert and a first dense layer
  (``first_k_dense_replace``);
* Qwen3.5 dense and Qwen3.5-MoE (Qwen3-Next's hybrid with split GDN projections);
* GLM-4.5 MoE (DeepSeek-V3's router on grouped-query attention with partial RoPE).

For each: the converted checkpoint's per-rollout log-probs on a branching forest (one packed
pass and streaming) within 1e-5 of transformers, the tree's gradients equal to the sum of the
single rollouts' gradients, and the export giving every HF tensor back bit for bit.
"""

import json
import os

import dist_worker
import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_hf import BATCH, hf_logprobs

import megatron_branch as mb
from megatron_branch._megatron import gdn_unavailable_reason, mla_unbuildable_reason
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.distributed import free_port
from megatron_branch.hf.convert import export_hf, import_hf, load_megatron
from megatron_branch.hf.mapping import megatron_args_from_hf
from megatron_branch.reference.agreement import grad_agreement, grads
from megatron_branch.replay import replay_logprobs, replay_step

TOL = 1e-5
# a smaller forest for the gradient comparison (each rollout also runs alone): two prompts, a stem that
# branches twice in one of them
GRAD_BATCH = branching_rollouts([10, 6], [2, 2], [4, 3], 128, seed=2)
DECAY = ("A_log", "dt_bias")
LINEAR, FULL = "linear_attention", "full_attention"
GDN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
           linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
           vocab_size=128, max_position_embeddings=256, initializer_range=0.05)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
MLA = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
           max_position_embeddings=256, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=12, initializer_range=0.05)
# sigmoid routing: 8 experts in 4 groups, 2 groups kept, 4 experts chosen (top 4 // 2 = 2 per group, as HF scores)
SIGMOID = dict(n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
               n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, norm_topk_prob=True)
GQA = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           vocab_size=128, max_position_embeddings=256, initializer_range=0.05)
needs_gdn = pytest.mark.skipif(gdn_unavailable_reason() is not None, reason=str(gdn_unavailable_reason()))
needs_mla = pytest.mark.skipif(mla_unbuildable_reason() is not None, reason=str(mla_unbuildable_reason()))

# name -> (config class, model class, config kwargs, zero-centred norms, marks)
FAMILIES = {
    "qwen3_next_moe": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                       dict(GDN, **EXPERTS, intermediate_size=96, num_hidden_layers=3,
                            layer_types=[LINEAR, FULL, LINEAR], mlp_only_layers=[1]), True, needs_gdn),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(GDN, intermediate_size=96, num_hidden_layers=2, layer_types=[LINEAR, FULL]), True, needs_gdn),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(GDN, **EXPERTS, num_hidden_layers=2, layer_types=[LINEAR, FULL]), True, needs_gdn),
    "deepseek_v3_moe": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(MLA, **SIGMOID, num_hidden_layers=2),
                        False, needs_mla),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(GQA, **SIGMOID, num_hidden_layers=2, attention_bias=True, use_qk_norm=True), False, None),
}


def params(names=FAMILIES):
    return [pytest.param(n, marks=FAMILIES[n][4]) if FAMILIES[n][4] else n for n in names]


@pytest.fixture(autouse=True)
def hf_torch_kernels(monkeypatch):
    """transformers' torch delta rule: with flash-linear-attention installed, transformers
    calls FLA's Triton kernel, which has no CPU backend."""
    for name in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        module = pytest.importorskip(f"transformers.models.{name}.modeling_{name}")
        chunk = module.torch_chunk_gated_delta_rule
        monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", getattr(chunk, "__wrapped__", chunk))


def make_hf(tmp_path, name, seed=0):
    """transformers' model of family ``name`` (float32, eval), saved under ``tmp_path``: norms
    around their neutral value (zero-centred ones around 0, rounded to bf16 values so the
    shift 1 + w keeps every bit), routers and correction biases large enough to separate the
    experts, so a wrong mapping of any of them shows."""
    cfg_cls, model_cls, kwargs, zero_centred, _ = FAMILIES[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs)).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                centre = 1.0 if (not zero_centred or "linear_attn.norm" in n) else 0.0
                p.copy_((torch.randn_like(p) * 0.5 + centre).bfloat16().float())
            elif n.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 1.0)
            elif n.endswith("bias") and "self_attn" in n:
                p.normal_(0.0, 0.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    path = tmp_path / f"hf-{name}"
    model.save_pretrained(path)
    return model, str(path)


def tensors(path):
    return {k: v for f in sorted(os.listdir(path)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(path, f)).items()}


def weighted_loss(weights):
    """A loss linear in the log-probs, with per-rollout, per-position weights."""
    return lambda lp, ids: (lp * weights[ids, : lp.shape[1]]).sum()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (transformers model, HF dir, Megatron checkpoint dir), converted once per family."""
    cache = {}

    def get(name):
        if name not in cache:
            tmp = tmp_path_factory.mktemp(name)
            hf, hf_dir = make_hf(tmp, name)
            import_hf(hf_dir, str(tmp / "mg"))
            cache[name] = hf, hf_dir, str(tmp / "mg")
        return cache[name]

    return get


@pytest.mark.parametrize("name", params())
def test_logprobs_match_transformers_one_pass_and_streaming(name, converted):
    hf, _, mg = converted(name)
    model, _ = load_megatron(mg)
    tree = mb.BranchTree.from_sequences(BATCH.sequences)
    ref = hf_logprobs(hf, BATCH.sequences)
    with torch.no_grad():
        one_pass = mb.rollout_logprobs(model, tree)
        streamed = replay_logprobs(model, tree, max_chunk_tokens=8)
    assert (one_pass - ref).abs().max() < TOL
    assert (streamed - ref).abs().max() < TOL


@pytest.mark.parametrize("name", params())
def test_tree_gradients_equal_the_sum_over_single_rollouts(name, converted):
    _, _, mg = converted(name)
    model, _ = load_megatron(mg)
    sequences = GRAD_BATCH.sequences
    weights = torch.randn(len(sequences), max(len(s) for s in sequences), generator=torch.Generator().manual_seed(1))
    loss = weighted_loss(weights)
    model.zero_grad(set_to_none=True)
    for r, s in enumerate(sequences):  # each rollout alone
        loss(mb.rollout_logprobs(model, mb.BranchTree.from_sequences([s])), [r]).backward()
    ref = grads(model)
    top = max(g.abs().max() for g in ref.values())
    assert all(g.abs().sum() > 0 for n, g in ref.items() if "expert" not in n), "a parameter got no gradient"
    for budget in (None, 8):  # one pass, streaming
        model.zero_grad(set_to_none=True)
        replay_step(model, mb.BranchTree.from_sequences(sequences), loss, max_chunk_tokens=budget)
        got = grads(model)
        for n, diff in grad_agreement(got, ref).per_param.items():
            if n.endswith(DECAY):
                # the GDN decay parameters' float32 gradients differ by kernel (Megatron's chunked one for a
                # single rollout, the tree recurrence) by float32 rounding of the model's gradient scale;
                # tests/test_gdn.py checks them against float64
                diff = (got[n] - ref[n]).abs().max() / top
            assert diff < TOL, (budget, n, float(diff))


@pytest.mark.parametrize("name", params())
def test_export_gives_the_hf_tensors_back_bit_for_bit(name, converted, tmp_path):
    hf, hf_dir, mg = converted(name)
    export_hf(mg, str(tmp_path / "back"))
    original, back = tensors(hf_dir), tensors(tmp_path / "back")
    assert set(back) == set(original)
    for n, t in original.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n], t), n
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).float().eval()
    assert torch.equal(hf_logprobs(reloaded, BATCH.sequences), hf_logprobs(hf, BATCH.sequences))


# ------------------------------------------------------------------ guards: each field matters
def _moved(model, ref, change):
    """Max log-prob change against ``ref`` after ``change(model)`` (undone afterwards)."""
    undo = change(model)
    try:
        with torch.no_grad():
            return (mb.rollout_logprobs(model, mb.BranchTree.from_sequences(BATCH.sequences)) - ref).abs().max()
    finally:
        undo()


def _set_config(field, value):
    def change(model):
        old = getattr(model.config, field)
        setattr(model.config, field, value)  # the routers read their (shared) config at each forward
        return lambda: setattr(model.config, field, old)
    return change


def _zero(suffix):
    def change(model):
        saved = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]
                 if n.endswith(suffix)}
        with torch.no_grad():
            for n, t in [*model.named_parameters(), *model.named_buffers()]:
                if n in saved:
                    t.zero_()

        def undo():
            with torch.no_grad():
                for n, t in [*model.named_parameters(), *model.named_buffers()]:
                    if n in saved:
                        t.copy_(saved[n])
        return undo
    return change


GUARDS = {
    "glm4_moe": {
        "no expert bias": _zero("router.expert_bias"),
        "no group limit": _set_config("moe_router_group_topk", None),
        "no routed scaling": _set_config("moe_router_topk_scaling_factor", None),
        "no shared experts": _zero("shared_experts.linear_fc2.weight"),
    },
    "qwen3_5_moe": {
        "ungated shared expert": _zero("shared_experts.gate_weight"),  # sigmoid(0) = 1/2 instead of the gate
        "softmax before top-k": _set_config("moe_router_pre_softmax", True),  # no renormalisation
    },
}


@pytest.mark.parametrize("name", params(GUARDS))
def test_each_routing_field_moves_the_logprobs(name, converted):
    hf, _, mg = converted(name)
    model, _ = load_megatron(mg)
    ref = hf_logprobs(hf, BATCH.sequences)
    assert _moved(model, ref, lambda m: (lambda: None)) < TOL
    for what, change in GUARDS[name].items():
        assert _moved(model, ref, change) > 1e-3, what


# ------------------------------------------------------------------ layouts: TP and EP
@pytest.mark.parametrize("name", params(["deepseek_v3_moe"]))
def test_expert_parallel_load_and_export(name, converted, tmp_path):
    hf, hf_dir, mg = converted(name)
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    dist_worker.start(dist_worker.hf_moe_worker, (2, free_port(), mg, cfg, BATCH.sequences, str(tmp_path)), 2)
    ref, original = hf_logprobs(hf, BATCH.sequences), tensors(hf_dir)
    for rank in range(2):
        out = torch.load(tmp_path / f"hf_moe{rank}.pt")
        assert (out["lp"] - ref).abs().max() < TOL
        assert set(out["state"]) == set(original)
        assert all(torch.equal(out["state"][k].to(original[k].dtype), original[k]) for k in original)


# (multi-latent attention refuses TP on local modules: spec/mla_attention.py)
@pytest.mark.parametrize("name", params(["qwen3_5_moe", "glm4_moe"]))
def test_tensor_parallel_load(name, converted, tmp_path):
    hf, _, mg = converted(name)
    dist_worker.start(dist_worker.hf_worker, (2, free_port(), mg, BATCH.sequences, str(tmp_path)), 2)
    ref = hf_logprobs(hf, BATCH.sequences)
    for rank in range(2):
        assert (torch.load(tmp_path / f"hf{rank}.pt")["lp"] - ref).abs().max() < TOL


# ------------------------------------------------------------------ configs
@needs_gdn
def test_float32_zero_centred_norms_import_with_a_warning_naming_the_tensors(tmp_path):
    hf, hf_dir = make_hf(tmp_path, "qwen3_5_moe")
    state = tensors(hf_dir)
    name = "model.layers.1.self_attn.q_norm.weight"
    state[name][3] = 1e-9  # 1 + 1e-9 == 1 in float32
    from safetensors.torch import save_file
    save_file(state, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    with hf_torch_state(hf, state):
        ref = hf_logprobs(hf, BATCH.sequences)
    with pytest.warns(UserWarning, match=rf"1 zero-centered norm tensor\(s\) \('{name}'\).*within 2\^-23"):
        import_hf(hf_dir, str(tmp_path / "mg"))
    model, _ = load_megatron(str(tmp_path / "mg"))
    with torch.no_grad():  # the forward is transformers' own: it multiplies by the same float32 1 + w
        assert (mb.rollout_logprobs(model, mb.BranchTree.from_sequences(BATCH.sequences)) - ref).abs().max() < TOL
    export_hf(str(tmp_path / "mg"), str(tmp_path / "back"))
    back = tensors(tmp_path / "back")
    changed = [k for k in state if not torch.equal(back[k], state[k])]
    assert changed == [name] and (back[name] - state[name]).abs().max() <= 2.0 ** -23


def hf_torch_state(model, state):
    """Inside, ``model`` holds ``state`` (HF names as saved; the experts fused in memory)."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict({k: v for k, v in state.items() if k in saved}, strict=False)
        try:
            yield
        finally:
            model.load_state_dict(saved)
    return ctx()


@pytest.mark.parametrize("change, message", [
    ({"topk_group": 1}, r"topk_group=1 with num_experts_per_tok=4 is not supported: HF scores a group by its top-2"),
    ({"norm_topk_prob": False}, r"norm_topk_prob=False with num_experts_per_tok=4 is not supported"),
    ({"n_group": 3}, r"n_group=3, topk_group=2 do not divide the 8 experts"),
    ({"routed_scaling_factor": 0}, r"routed_scaling_factor is 0"),
    ({"first_k_dense_replace": -1}, r"first_k_dense_replace is -1"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok 9 exceeds the 8 experts"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, r"rope_scaling type 'yarn'"),
    ({"partial_rotary_factor": 0.1, "rope_parameters": None}, r"partial_rotary_factor=0.1 with head_dim=16"),
])
def test_bad_glm_configs_raise_naming_the_field(change, message):
    cfg = dict(transformers.Glm4MoeConfig(**FAMILIES["glm4_moe"][2]).to_dict(), architectures=["Glm4MoeForCausalLM"])
    megatron_args_from_hf(cfg)
    with pytest.raises(ValueError, match=message):
        megatron_args_from_hf(dict(cfg, **change))


def test_released_routing_fields_map_to_megatron():
    from test_hf import DEEPSEEK_V3_HUB

    config, _ = megatron_args_from_hf(DEEPSEEK_V3_HUB)
    assert {k: v for k, v in config.items() if k.startswith("moe_") or k == "num_moe_experts"} == dict(
        num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048, moe_router_score_function="sigmoid",
        moe_aux_loss_coeff=0.0, moe_router_pre_softmax=False, moe_layer_freq=[0] * 3 + [1] * 58,
        moe_shared_expert_intermediate_size=2048, moe_shared_expert_gate=False, moe_router_num_groups=8,
        moe_router_group_topk=4, moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
        moe_router_dtype="fp32")


@needs_gdn
def test_released_multimodal_qwen3_5_checkpoint_converts_as_its_text_model(tmp_path):
    """Qwen3.5 as released: Qwen3_5MoeForConditionalGeneration, the decoder's config in
    text_config and its tensors under model.language_model., beside a vision tower (skipped)."""
    from safetensors.torch import save_file

    hf, hf_dir = make_hf(tmp_path, "qwen3_5_moe")
    text = json.load(open(os.path.join(hf_dir, "config.json")))
    released = tmp_path / "released"
    released.mkdir()
    json.dump({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "text_config": {k: v for k, v in text.items() if k != "architectures"},
               "vision_config": {"depth": 1}, "tie_word_embeddings": False}, open(released / "config.json", "w"))
    state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
             for k, v in tensors(hf_dir).items()}
    extra = {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(4, 4)}
    save_file({**state, **extra}, str(released / "model.safetensors"), metadata={"format": "pt"})
    model, _ = mb.hf.load_gpt_from_hf(str(released))
    with torch.no_grad():
        lp = mb.rollout_logprobs(model, mb.BranchTree.from_sequences(BATCH.sequences))
    assert (lp - hf_logprobs(hf, BATCH.sequences)).abs().max() < TOL
    back = mb.hf.export_hf_state(model, json.load(open(released / "config.json")))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


@needs_gdn
def test_export_refuses_a_config_of_another_architecture(converted, tmp_path):
    # Qwen3-Next's and Qwen3.5's GDN projections are laid out differently: the same shapes do not suffice
    _, hf_dir, mg = converted("qwen3_5")
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    json.dump(dict(cfg, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
                   mlp_only_layers=[0, 1]), open(other / "config.json", "w"))
    with pytest.raises(ValueError, match="describes another model .*architecture Qwen3NextForCausalLM vs "
                                         "Qwen3_5ForCausalLM"):
        export_hf(mg, str(tmp_path / "back"), hf_config_dir=str(other))
