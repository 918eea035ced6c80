"""``megatron-branch plan``: hand-checked arithmetic, a workload that cannot fit, bad input."""

import json
import subprocess
import sys

import pytest

from megatron_branch.commands.planner.estimate import GB, Layout, Workload, memory_per_gpu, stage_params, step_flops
from megatron_branch.commands.planner.memory import (
    LAYER_ELEMS,
    cache_bytes,
    gdn_layer_elems,
    kv_widths,
    recurrent_state_bytes,
    replay_peak_bytes,
    replay_peak_parts,
    workload_tree,
)
from megatron_branch.commands.planner.plan import candidate_layouts, plan
from megatron_branch.commands.planner.presets import GPUS, MODELS, ModelSpec, model_from_hf_config

TINY = ModelSpec("tiny", num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=1,
                 ffn_hidden_size=16, vocab_size=10)


def test_workload_counts_by_hand():
    w = Workload(prompt_len=100, rollouts=4, response_len=10)
    assert w.naive_positions == 4 * 110 and w.unique_positions == 140
    assert w.attention_pairs(True) == 100 * 101 / 2 + 4 * (10 * 100 + 55)
    assert w.attention_pairs(False) == 4 * 110 * 111 / 2


def test_params_memory_and_flops_by_hand():
    # per layer: q 8*8, k/v 2*8*4, o 8*8, mlp 3*8*16, norms 16 -> 64+64+64+384+16 = 592
    assert TINY.params_per_layer() == 592
    assert TINY.num_params() == 2 * 592 + 2 * 10 * 8 + 8
    lay = Layout(tp=1, cp=1, pp=1, dp=1, chunk_tokens=40, recompute="none", fp8=False)
    mem = memory_per_gpu(TINY, Workload(50, 2, 5), lay, act_bytes=2)
    # every parameter on one stage: layers, the embedding, the untied output layer, the final norm
    stage = 2 * 592 + 80 + 80 + 8
    assert mem["weights"] == stage * 2 and mem["grads"] == stage * 4 and mem["optimizer"] == stage * 12
    # the replay plan: a stem [0, 40) (the prompt does not fit the 40-token chunk with its
    # answers), then one chunk with the prompt's last 10 tokens and the answers. The cache:
    # stem tokens x layers x (K, V) x kv_dim x (2 B values + 4 B float32 gradient accumulators)
    assert mem["stem_kv_cache"] == 40 * 2 * 2 * 4 * (2 + 4)
    # the peak unit is the stem (40 tokens, nothing cached above it, all 40 rows scored)
    per_token_layer = 10.2 * 8 + 3.1 * 4 + 5.1 * 16  # saved activation elements (fitted)
    assert mem["unit_activations"] == pytest.approx(40 * (2 * per_token_layer + 2.0 * 8) * 2)
    logits = 40 * 3.0 * 10 * 4
    attention = 4 * (12.5 * 40 * 8)
    assert mem["logits_or_attention"] == pytest.approx(max(logits, attention))
    assert mem["logprob_leaves"] == (50 + 10) * 8
    fl = step_flops(TINY, positions=3, pairs=6)
    assert fl["linear"] == 6 * 3 * (2 * (592 - 16) + 80)
    assert fl["attention"] == 12 * 6 * 4 * 2 * 2


def test_every_parameter_is_counted_per_pipeline_stage():
    """Issue 21: the untied output layer is counted (it was missing: 262.7M parameters per
    GPU of Llama-3-8B at TP=2), on the last stage under PP, the embedding on the first."""
    m = MODELS["Llama-3-8B"]
    vh = m.vocab_size * m.hidden_size
    one = stage_params(m, Layout(2, 4, 1, 1, 8192, "none", False))
    assert one["total"] == pytest.approx(m.num_params() / 2)  # PP = 1: every parameter, split over TP
    two = stage_params(m, Layout(2, 1, 2, 1, 8192, "none", False))
    per_layer = m.params_per_layer()
    assert two["total"] == pytest.approx((16 * per_layer + max(vh, vh + m.hidden_size)) / 2)
    tied = ModelSpec("tied", 2, 8, 2, 1, 16, 10, tied_embeddings=True)
    assert stage_params(tied, Layout(1, 1, 1, 1, 64, "none", False))["total"] == tied.num_params()
    # under PP the last stage keeps its own copy of the tied embedding (Megatron's output_layer)
    assert stage_params(tied, Layout(1, 1, 2, 1, 64, "none", False))["total"] == 592 + 80 + 8


# Published sizes (model cards; one or two significant decimals, so 1% for the totals).
PUBLISHED = {"Llama-3-8B": 8.03e9, "Qwen2.5-7B": 7.61e9, "Qwen3-8B": 8.2e9, "Qwen2.5-14B": 14.7e9,
             "Qwen2.5-32B": 32.5e9, "Qwen3-30B-A3B": 30.5e9, "DeepSeek-V3": 671e9, "Qwen3-Next-80B-A3B": 80e9,
             "Qwen3.5-397B-A17B": 397e9, "GLM-4.5": 355e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_their_published_size(name):
    assert MODELS[name].num_params() == pytest.approx(PUBLISHED[name], rel=0.01)


def test_exact_counts_where_the_safetensors_are_known():
    assert MODELS["Llama-3-8B"].num_params() == 8_030_261_248  # Meta's safetensors
    moe = MODELS["Qwen3-30B-A3B"]
    assert moe.num_params() == pytest.approx(30.5e9, rel=0.002)
    assert moe.active_params() == pytest.approx(3.3e9, rel=0.02)  # "3.3B activated" (card rounds down)


def test_the_plan_uses_the_memory_function_bench_scale_checks():
    """``plan`` reports what :func:`replay_peak_parts` gives for the workload's tree on the
    busiest CP rank: the function ``megatron-branch bench-scale`` compares with measured peaks."""
    m, w = TINY, Workload(60, 3, 7)
    lay = Layout(tp=1, cp=2, pp=1, dp=1, chunk_tokens=32, recompute="none", fp8=False)
    mem = memory_per_gpu(m, w, lay)
    ranks = replay_peak_parts(m, workload_tree(60, 3, 7), chunk_tokens=32, cp=2, act_bytes=2)
    busiest = max(ranks, key=lambda parts: sum(parts.values()))
    assert {k: mem[k] for k in busiest} == busiest
    assert sum(busiest.values()) == max(replay_peak_bytes(m, workload_tree(60, 3, 7), chunk_tokens=32, cp=2,
                                                          act_bytes=2))


def test_parallel_layout_divides_memory():
    lay1 = Layout(1, 1, 1, 1, 8192, "none", False)
    lay8 = Layout(2, 4, 1, 1, 8192, "none", False)
    m, w = MODELS["Llama-3-8B"], Workload(131072, 16, 3072)
    a, b = memory_per_gpu(m, w, lay1), memory_per_gpu(m, w, lay8)
    assert b["weights"] == pytest.approx(a["weights"] / 2)
    assert b["optimizer"] == pytest.approx(a["optimizer"] / 8)
    # CP shards are balanced by attention work, not tokens: the busiest rank's share of the
    # cached prompt is a little over a quarter (TP halves the KV heads); the shares add up
    assert a["stem_kv_cache"] / 8 <= b["stem_kv_cache"] <= 1.1 * a["stem_kv_cache"] / 8
    ranks = replay_peak_parts(m, workload_tree(131072, 16, 3072), chunk_tokens=8192, tp=2, cp=4)
    assert sum(r["stem_kv_cache"] for r in ranks) == pytest.approx(a["stem_kv_cache"] / 2)


def test_headline_scenario_fits_on_8_h20():
    result = plan(MODELS["Llama-3-8B"], Workload(131072, 16, 3072), GPUS["H20"], 8)
    assert result["fits"], result["reason"]
    assert result["naive_positions"] > 2_000_000
    best = result["best"]
    assert best["memory_total_bytes"] <= 0.9 * 96 * GB
    assert best["naive_flops"] / best["flops"] > 5


def test_a_workload_that_cannot_fit_says_why():
    result = plan(MODELS["Qwen2.5-32B"], Workload(1_000_000, 16, 3072), GPUS["H100"], 1)
    assert not result["fits"]
    assert "does not fit" in result["reason"] and "GB" in result["reason"]


def test_the_plan_says_why_pp_or_cp_is_held(tmp_path, capsys):
    """Issue 53: DeepSeek-V3's 61 layers keep PP at 1, a hybrid model CP; the plan says so."""
    from megatron_branch import cli

    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "DeepSeek-V3", "--json", str(out)]) == 1  # 671B does not fit 8 x H20
    held = "PP held at 1: none of the pipeline sizes searched (2, 4, 8) divides the model's 61 layers"
    assert f"\n  {held}\n" in capsys.readouterr().out
    assert json.loads(out.read_text())["held"] == [held]
    hybrid = plan(MODELS["Qwen3-Next-80B-A3B"], Workload(131072, 16, 3072, num_prompts=2), GPUS["H20"], 32)
    assert hybrid["held"] == ["PP held at 8: the only pipeline size that fills the 32 GPUs with the TP, CP and DP "
                              "the model and workload allow",
                              "CP held at 1: the package refuses context parallelism for Gated DeltaNet layers"]
    three = plan(MODELS["Llama-3-8B"], Workload(131072, 16, 3072), GPUS["H20"], 3)["held"]
    assert three[0] == "PP held at 1: PP 2, 4, 8 divide the 32 layers but not the 3 GPUs"
    assert three[1].startswith("CP held at 3: CP = GPUs / (TP x PP x DP)")
    # free to vary (Llama-3-8B on 8 GPUs), or one GPU: nothing is said
    assert plan(MODELS["Llama-3-8B"], Workload(131072, 16, 3072), GPUS["H20"], 8)["held"] == []
    assert plan(TINY, Workload(10, 2, 2), GPUS["H20"], 1)["held"] == []


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="prompt_len: must be >= 1"):
        Workload(0, 16, 10)
    with pytest.raises(ValueError, match="gpus: must be >= 1"):
        plan(TINY, Workload(10, 2, 2), GPUS["H20"], 0)
    with pytest.raises(ValueError, match="mfu"):
        plan(TINY, Workload(10, 2, 2), GPUS["H20"], 1, mfu=2.0)
    proc = subprocess.run([sys.executable, "-m", "megatron_branch.cli", "plan", "--naive-positions", "1001",
                           "--rollouts", "16"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "not a multiple of --rollouts" in proc.stderr
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="lacks num_hidden_layers"):
        model_from_hf_config(str(bad))


def test_hf_config_and_cli(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}))
    assert model_from_hf_config(str(cfg)).num_params() == MODELS["Llama-3-8B"].num_params()
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "megatron_branch.cli", "plan", "--hf-config", str(cfg),
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FITS" in proc.stdout and "MFU assumed" in proc.stdout
    assert json.loads(out.read_text())["fits"]


def test_memory_model_within_20_percent_of_measured_cpu_peak():
    from megatron_branch.commands.planner.validate import CASES, validate_on_cpu

    rows = validate_on_cpu([CASES[0], CASES[2]])
    for row in rows:
        assert abs(row["error"]) <= 0.20, row


TINY_MOE = ModelSpec("tiny-moe", num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=1,
                     ffn_hidden_size=2 * 4, vocab_size=10, num_experts=4, experts_per_token=2, moe_ffn_hidden_size=4)


def test_moe_params_and_memory_by_hand():
    # attention 192, router 4*8, norms 16; experts 4 x 3*8*4 = 384 of which 2 x 96 active
    assert TINY_MOE.dense_params_per_layer() == 192 + 32 + 16
    assert TINY_MOE.expert_params_per_layer() == 384
    assert TINY_MOE.params_per_layer() == 240 + 384
    assert TINY_MOE.active_params_per_layer() == 240 + 192
    assert TINY_MOE.num_params() == 2 * 624 + 160 + 8 and TINY_MOE.active_params() == 2 * 432 + 160 + 8
    lay = Layout(tp=2, cp=1, pp=1, dp=2, chunk_tokens=40, recompute="none", fp8=False, ep=4)
    mem = memory_per_gpu(TINY_MOE, Workload(50, 2, 5), lay, act_bytes=2)
    # dense over TP (layers, embedding, untied output layer, final norm), experts over EP
    dense, experts = (2 * 240 + 80 + 80 + 8) / 2, 2 * 384 / 4
    assert mem["weights"] == (dense + experts) * 2 and mem["grads"] == (dense + experts) * 4
    assert mem["optimizer"] == dense * 12 / 2 + experts * 12 / 1  # expert DP = TP x CP x DP / EP = 1
    fl = step_flops(TINY_MOE, positions=3, pairs=0)
    assert fl["linear"] == 6 * 3 * (2 * (432 - 16) + 80)  # active parameters only
    with pytest.raises(ValueError, match="experts_per_token x moe_ffn_hidden_size"):
        ModelSpec("bad", 2, 8, 2, 1, 9, 10, num_experts=4, experts_per_token=2, moe_ffn_hidden_size=4)


def test_qwen3_30b_a3b_preset_and_plan(tmp_path):
    m = MODELS["Qwen3-30B-A3B"]
    assert 30.0e9 < m.num_params() < 31.0e9 and 3.2e9 < m.active_params() < 3.5e9
    result = plan(m, Workload(131072, 16, 3072), GPUS["H200"], 8)
    assert result["fits"], result["reason"]
    lay = result["best"]["layout"]
    assert m.num_experts % lay["ep"] == 0 and (lay["tp"] * lay["cp"] * lay["dp"]) % lay["ep"] == 0
    # the routed experts dominate: without EP the weights per GPU would be far larger
    no_ep = memory_per_gpu(m, Workload(131072, 16, 3072), Layout(**dict(lay, ep=1)))
    assert no_ep["weights"] > 3 * result["best"]["memory_bytes"]["weights"]
    # FLOPs follow the active parameters: close to a dense model of 3.4B
    assert result["best"]["naive_flops"] / result["best"]["flops"] > 5
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
                               "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                               "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                               "vocab_size": 151936}))
    assert model_from_hf_config(str(cfg)).num_params() == m.num_params()
    proc = subprocess.run([sys.executable, "-m", "megatron_branch.cli", "plan", "--model", "Qwen3-30B-A3B",
                           "--gpu", "H200"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "3.4B active" in proc.stdout and "EP=" in proc.stdout


def test_a_preset_whose_counts_do_not_add_up_is_refused():
    with pytest.raises(ValueError, match="bad: num_attention_heads 30 is not a multiple of num_kv_heads 8"):
        ModelSpec("bad", 32, 4096, 30, 8, 14336, 128256)
    with pytest.raises(ValueError, match="bad: hidden_size 4001 is not divisible by num_attention_heads 32"):
        ModelSpec("bad", 32, 4001, 32, 8, 14336, 128256)
    with pytest.raises(ValueError, match="bad: vocab_size must be >= 1"):
        ModelSpec("bad", 32, 4096, 32, 8, 14336, 0)
    with pytest.raises(ValueError, match=r"bad: experts_per_token 9 must be in \[1, num_experts 8\]"):
        ModelSpec("bad", 2, 64, 4, 2, 9 * 16, 100, num_experts=8, experts_per_token=9, moe_ffn_hidden_size=16)



# multi-latent attention by hand: 2 heads, query/key heads 3 + 2 (RoPE), value heads 3, latents q 4 / kv 4
TINY_MLA = ModelSpec("tiny-mla", num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=2,
                     ffn_hidden_size=16, vocab_size=10, kv_lora_rank=4, q_lora_rank=4, qk_head_dim=3,
                     qk_pos_emb_head_dim=2, v_head_dim=3)


def test_mla_params_flops_and_kv_by_hand():
    # q: q_a 8*4, q_a_norm 4, q_b 4*2*5; kv: kv_a 8*(4+2), kv_a_norm 4, kv_b 4*2*(3+3); o 2*3*8
    attention = (32 + 4 + 40) + (48 + 4 + 48) + 48
    assert TINY_MLA.params_per_layer() == attention + 3 * 8 * 16 + 16
    # K: every head's 3 + 2 wide key (the RoPE part expanded per head), V: 2 x 3; not the latent
    assert kv_widths(TINY_MLA) == (2 * 5, 2 * 3) and kv_widths(TINY_MLA, tp=2) == (5, 3)
    # Q K^T over 5 and P V over 3 per head: 2 FLOPs each per pair, x3 for forward + backward
    assert step_flops(TINY_MLA, positions=3, pairs=6)["attention"] == 3 * 2 * 6 * (5 + 3) * 2 * 2
    assert TINY_MLA.key_channels == 5 and TINY_MLA.value_channels == 3


def test_mla_preset_caches_the_uncompressed_kv():
    m = MODELS["DeepSeek-V3"]
    assert m.is_mla and m.is_moe and m.active_params() == pytest.approx(37e9, rel=0.02)  # "37B activated"
    heads, k_head, v_head = 128, 128 + 64, 128
    # per token per layer: K = heads x (qk_head_dim + qk_pos_emb_head_dim), V = heads x v_head_dim (bf16)
    assert kv_widths(m) == (heads * k_head, heads * v_head)
    assert cache_bytes(m, 1, tp=1, layers=1, act_bytes=2, exact=False) == 2 * (heads * k_head + heads * v_head)
    assert cache_bytes(m, 1, tp=8, layers=1, act_bytes=2, exact=False) == 2 * 16 * (k_head + v_head)
    # grouped-query attention keeps its equal widths: kv_heads x head_dim each
    assert kv_widths(MODELS["Llama-3-8B"]) == (8 * 128, 8 * 128)
    # through the plan's memory function: the 40-token stem's K/V in every layer, bf16 values and
    # float32 gradient accumulators (the replay plan of test_params_memory_and_flops_by_hand)
    mem = memory_per_gpu(m, Workload(50, 2, 5), Layout(1, 1, 1, 1, 40, "none", False), act_bytes=2)
    assert mem["stem_kv_cache"] == 40 * 61 * (heads * k_head + heads * v_head) * (2 + 4)


def test_mla_moe_preset_counts_dense_layers_and_shared_experts():
    m = MODELS["DeepSeek-V3"]
    assert m.ffn_hidden_size == 8 * 2048 + 2048 == 18432  # the first 3 dense layers' width too
    experts = 256 * 3 * 7168 * 2048
    assert m.num_params() == (58 * (m.dense_params_per_layer() + experts) + 3 * m.first_dense_layer_params()
                              + 2 * 129280 * 7168 + 7168)
    assert m.dense_params_per_layer() == m.active_params_per_layer() - 3 * 7168 * 8 * 2048  # the shared expert stays
    # PP: the first stage holds the dense layers and the embedding; the busiest is another one
    two = ModelSpec("two", 4, 8, 2, 2, 2 * 4 + 4, 10, num_experts=4, experts_per_token=2, moe_ffn_hidden_size=4,
                    shared_expert_ffn_hidden_size=4, first_dense_layers=1)
    stage = stage_params(two, Layout(1, 1, 2, 1, 64, "none", False, ep=2))
    last = 2 * two.dense_params_per_layer() + 80 + 8
    assert stage["dense"] == last and stage["experts"] == 2 * two.expert_params_per_layer() / 2
    assert stage_params(two, Layout(1, 1, 1, 1, 64, "none", False))["total"] == two.num_params()
    with pytest.raises(ValueError, match="experts_per_token x moe_ffn_hidden_size \\+ shared_expert_ffn_hidden_size"):
        ModelSpec("bad", 2, 8, 2, 2, 8, 10, num_experts=4, experts_per_token=2, moe_ffn_hidden_size=4,
                  shared_expert_ffn_hidden_size=4)
    with pytest.raises(ValueError, match="num_kv_heads 1 must equal num_attention_heads 2"):
        ModelSpec("bad", 2, 8, 2, 1, 16, 10, kv_lora_rank=4, qk_head_dim=3, qk_pos_emb_head_dim=2, v_head_dim=3)
    with pytest.raises(ValueError, match="needs v_head_dim >= 1"):
        ModelSpec("bad", 2, 8, 2, 2, 16, 10, kv_lora_rank=4, qk_head_dim=3, qk_pos_emb_head_dim=2)
    with pytest.raises(ValueError, match="first_dense_layers need num_experts"):
        ModelSpec("bad", 2, 8, 2, 2, 16, 10, first_dense_layers=1)


DEEPSEEK_V3_CONFIG = {  # deepseek-ai/DeepSeek-V3 config.json, the fields the planner reads
    "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "head_dim": 64,  # as transformers writes it (the RoPE part); not the attention's head size
}


def test_mla_preset_from_hf_config_and_cli(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    spec = model_from_hf_config(str(cfg))
    assert spec.num_params() == MODELS["DeepSeek-V3"].num_params()
    assert kv_widths(spec) == kv_widths(MODELS["DeepSeek-V3"])
    # DeepSeek-V2-Lite: its dense layer (10944) is narrower than a MoE layer's 6 + 2 shared experts of 1408
    cfg.write_text(json.dumps(dict(DEEPSEEK_V3_CONFIG, intermediate_size=10944, moe_intermediate_size=1408,
                                   num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1)))
    with pytest.raises(ValueError, match="intermediate_size 10944 differs from a MoE layer's active width 11264"):
        model_from_hf_config(str(cfg))
    proc = subprocess.run([sys.executable, "-m", "megatron_branch.cli", "plan", "--model", "DeepSeek-V3", "--gpu",
                           "H200", "--gpus", "256", "--prompt-len", "65536", "--rollouts", "16",
                           "--response-len", "2048"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FITS" in proc.stdout and "37.6B active" in proc.stdout
    assert "uncompressed K (128 x 192) and V (128 x 128)" in proc.stdout


# hybrid Gated DeltaNet by hand: 4 layers (3 GDN, then attention), GDN 2 key heads of 3, 4 value
# heads of 2, convolution of 3 taps; gated attention of 2 heads of 4 over 1 KV head
TINY_GDN = ModelSpec("tiny-gdn", num_layers=4, hidden_size=8, num_attention_heads=2, num_kv_heads=1,
                     ffn_hidden_size=16, vocab_size=10, attention_output_gate=True,
                     linear_attention_pattern=(1, 1, 1, 0), linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=3, linear_value_head_dim=2, linear_conv_kernel_dim=3)


def test_gdn_params_flops_and_activations_by_hand():
    m = TINY_GDN
    assert m.is_hybrid and m.gdn_layers == 3 and m.attention_layers == 1
    # qk_dim 2*3 = 6, v_dim 4*2 = 8; conv over q, k, v: 6+6+8 = 20; in_proj [q; k; v; z; beta; alpha]: 6+6+8+8+4+4
    assert (m.gdn_qk_dim, m.gdn_v_dim, m.gdn_conv_dim, m.gdn_in_proj_dim) == (6, 8, 20, 36)
    # in_proj 8*36, conv 20*3, A_log + dt_bias 2*4, out_norm 2, out_proj 8*8
    gdn = 288 + 60 + 8 + 2 + 64
    # q 8*8, its gate 8*8, k/v 2*8*4, o 8*8
    attention = 64 + 64 + 64 + 64
    mlp_norms = 3 * 8 * 16 + 16
    assert m.params_per_layer() == attention + mlp_norms
    assert m.num_params() == 3 * (gdn + mlp_norms) + (attention + mlp_norms) + 2 * 10 * 8 + 8
    assert [m.layer_params(i)[0] for i in range(4)] == [gdn + mlp_norms] * 3 + [attention + mlp_norms]
    # PP: each stage's layers, the embedding on the first, the output layer and final norm on the last
    assert stage_params(m, Layout(1, 1, 1, 1, 64, "none", False))["total"] == m.num_params()
    assert m.stage_mixers(2) == [(0, 2), (1, 1)]
    two = stage_params(m, Layout(1, 1, 2, 1, 64, "none", False))
    assert two["total"] == max(2 * (gdn + mlp_norms) + 80, (gdn + mlp_norms) + (attention + mlp_norms) + 80 + 8)
    # FLOPs: the weights of every layer, attention over the one attention layer only, and the
    # recurrence linear in the positions: 3 (fwd + bwd) x 8 x heads x d_k x d_v per token and GDN layer
    fl = step_flops(m, positions=5, pairs=7)
    assert fl["linear"] == 6 * 5 * (3 * (gdn + mlp_norms - 16) + (attention + mlp_norms - 16) + 80)
    assert fl["attention"] == 6 * 7 * (4 + 4) * 2 * 1
    assert fl["recurrence"] == 3 * 5 * 8 * (4 * 3 * 2) * 3
    assert step_flops(MODELS["Llama-3-8B"], positions=5, pairs=7)["recurrence"] == 0
    # saved activations of a GDN layer: the fitted hidden and MLP terms, 4 x the in_proj width
    a_h, _, a_f = LAYER_ELEMS
    assert gdn_layer_elems(m) == pytest.approx(a_h * 8 + 4.0 * 36 + a_f * 16)
    assert gdn_layer_elems(m, tp=2) == pytest.approx(gdn_layer_elems(m) / 2)


def test_hybrid_path_cache_holds_kv_of_attention_layers_and_a_state_per_stem():
    m = MODELS["Qwen3-Next-80B-A3B"]
    assert m.attention_layers == 12 and m.gdn_layers == 36 and m.linear_attention_pattern[:4] == (1, 1, 1, 0)
    # per token: K and V of 2 KV heads x 256 in the 12 attention layers only (bf16)
    assert kv_widths(m) == (2 * 256, 2 * 256)
    assert cache_bytes(m, 1, tp=1, layers=m.attention_layers, act_bytes=2, exact=False) == 12 * 2 * 512 * 2
    # per stem and GDN layer: the state 32 x 128 x 128 in float32, and the last 4 - 1 convolution
    # inputs of 2*16*128 + 32*128 = 8192 channels at the activation width (bf16) ...
    state, conv = 32 * 128 * 128 * 4, 3 * (2 * 16 * 128 + 32 * 128) * 2
    assert recurrent_state_bytes(m, 1, layers=1, act_bytes=2, exact=False) == state + conv == 2_146_304
    # ... and float32 gradient accumulators of both in exact replay; TP splits heads and channels
    exact = state * 2 + 3 * 8192 * (2 + 4)
    assert recurrent_state_bytes(m, 1, layers=1, act_bytes=2) == exact
    assert recurrent_state_bytes(m, 3, tp=2, layers=36, act_bytes=2) == 3 * 36 * exact / 2
    # through the plan's memory function: the replay plan of test_params_memory_and_flops_by_hand
    # (one 40-token stem); the K/V grow with the stem, the recurrent state does not
    lay = Layout(1, 1, 1, 1, 40, "none", False)
    mem = memory_per_gpu(m, Workload(50, 2, 5), lay, act_bytes=2)
    assert mem["stem_kv_cache"] == 40 * 12 * (512 + 512) * (2 + 4)
    assert mem["stem_gdn_state"] == 1 * 36 * exact
    longer = memory_per_gpu(m, Workload(75, 2, 5), Layout(1, 1, 1, 1, 70, "none", False), act_bytes=2)
    assert longer["stem_kv_cache"] > mem["stem_kv_cache"] and longer["stem_gdn_state"] == mem["stem_gdn_state"]
    # two stems on the path (a 90-token prompt in 40-token chunks): two states per GDN layer
    assert memory_per_gpu(m, Workload(90, 2, 5), lay)["stem_gdn_state"] == 2 * 36 * exact
    # a model without GDN layers has no such part (its numbers are unchanged)
    assert "stem_gdn_state" not in memory_per_gpu(MODELS["Llama-3-8B"], Workload(50, 2, 5), lay)


def test_hybrid_models_are_never_planned_with_context_parallelism():
    m, w = MODELS["Qwen3-Next-80B-A3B"], Workload(131072, 16, 3072)
    layouts = candidate_layouts(m, w, 8)
    assert layouts and {lay.cp for lay in layouts} == {1}
    assert {lay.tp for lay in layouts} <= {1, 2}  # 2 KV heads
    assert any(lay.cp > 1 for lay in candidate_layouts(MODELS["Qwen3-30B-A3B"], w, 8))
    with pytest.raises(ValueError, match="refuses under context parallelism"):
        replay_peak_parts(m, workload_tree(60, 3, 7), chunk_tokens=32, cp=2)
    # 32 GPUs, one prompt: no DP, no CP -> TP x PP reach 16 at most; the error says why
    with pytest.raises(ValueError, match="CP fixed at 1.*DP must divide the 1 prompt"):
        plan(m, w, GPUS["H200"], 32)
    result = plan(m, Workload(131072, 16, 3072, num_prompts=2), GPUS["H20"], 32)
    assert result["fits"] and result["best"]["layout"]["cp"] == 1 and result["best"]["layout"]["dp"] == 2
    assert any("refuses context parallelism" in c for c in result["constraints"])


def test_hybrid_headline_plan_cli():
    """The headline workload on 8 x H20 for Qwen3-Next-80B-A3B: an 80B-parameter model's
    weights, gradients and Adam state alone exceed 8 x 96 GB, so it does not fit; the plan says so."""
    proc = subprocess.run([sys.executable, "-m", "megatron_branch.cli", "plan", "--model", "Qwen3-Next-80B-A3B",
                           "--gpu", "H20", "--gpus", "8", "--prompt-len", "131072", "--rollouts", "16",
                           "--response-len", "3072"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "DOES NOT FIT" in out and "largest part: optimizer" in out and " CP=1 " in out
    assert "36 Gated DeltaNet + 12 attention layers" in out and "stem_gdn_state" in out
    assert "refuses context parallelism" in out and "sequence parallelism" in out


QWEN3_NEXT_CONFIG = {  # Qwen/Qwen3-Next-80B-A3B-Instruct config.json, the fields the planner reads
    "model_type": "qwen3_next", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "partial_rotary_factor": 0.25, "vocab_size": 151936, "tie_word_embeddings": False,
}


def test_hybrid_presets_from_hf_config(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN3_NEXT_CONFIG))
    spec = model_from_hf_config(str(cfg))
    preset = MODELS["Qwen3-Next-80B-A3B"]
    assert spec.num_params() == preset.num_params() and spec.active_params() == preset.active_params()
    assert spec.linear_attention_pattern == preset.linear_attention_pattern and spec.attention_output_gate
    # layer_types, when given, is the pattern
    types = ["linear_attention", "full_attention"] * 24
    cfg.write_text(json.dumps(dict(QWEN3_NEXT_CONFIG, layer_types=types)))
    assert model_from_hf_config(str(cfg)).linear_attention_pattern == (1, 0) * 24
    # Qwen3.5: a multimodal config whose text_config is the decoder (attn_output_gate named)
    text = {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 60, "hidden_size": 4096,
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 4096 * 3,
            "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024, "num_experts": 512,
            "num_experts_per_tok": 10, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 64, "attn_output_gate": True, "vocab_size": 248320}
    cfg.write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": False}))
    assert model_from_hf_config(str(cfg)).num_params() == MODELS["Qwen3.5-397B-A17B"].num_params()
    cfg.write_text(json.dumps({k: v for k, v in QWEN3_NEXT_CONFIG.items() if k != "linear_value_head_dim"}))
    with pytest.raises(ValueError, match="Gated DeltaNet config.json lacks linear_value_head_dim"):
        model_from_hf_config(str(cfg))
    cfg.write_text(json.dumps(dict(QWEN3_NEXT_CONFIG, mlp_only_layers=[0])))
    with pytest.raises(ValueError, match="mlp_only_layers"):
        model_from_hf_config(str(cfg))
    with pytest.raises(ValueError, match="linear_attention_pattern must hold num_layers 4 entries"):
        ModelSpec("bad", 4, 8, 2, 1, 16, 10, linear_attention_pattern=(1, 0), linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=3, linear_value_head_dim=2, linear_conv_kernel_dim=3)
    with pytest.raises(ValueError, match="linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"):
        ModelSpec("bad", 2, 8, 2, 1, 16, 10, linear_attention_pattern=(1, 0), linear_num_key_heads=2,
                  linear_num_value_heads=3, linear_key_head_dim=3, linear_value_head_dim=2, linear_conv_kernel_dim=3)
    with pytest.raises(ValueError, match="need linear_attention_pattern"):
        ModelSpec("bad", 2, 8, 2, 1, 16, 10, linear_num_key_heads=2)
