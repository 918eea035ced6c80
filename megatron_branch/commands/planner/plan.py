"""``megatron-branch plan``: choose TP/CP/PP, chunk, recompute and FP8 for a workload.

Searches the layouts a cluster allows, keeps those whose per-GPU memory fits (90% of
the GPU, the rest for the allocator and communication buffers), and picks the fastest
at a stated MFU. Prints the memory breakdown, FLOPs and step time next to the naive
computation, and whether it fits. Where PP or CP can take one value only (PP must divide
the layers, CP is the GPUs TP x PP x DP leave), a line says why (the JSON's ``held``).
``--validate`` first checks the activation model against peak memory measured on small
CPU runs of this package.

Hybrid Gated DeltaNet models (Qwen3-Next, Qwen3.5) are planned with CP = 1 only: the
package refuses context parallelism for their recurrent layers (a tree split over CP ranks
has no state exchange), and TP runs them with sequence parallelism, which the package
requires for these layers (and which the memory model assumes for every ``TP > 1``).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict
from typing import Dict, List

from megatron_branch.commands.planner.estimate import GB, Layout, Workload, memory_per_gpu, step_time
from megatron_branch.commands.planner.presets import GPUS, MODELS, GPUSpec, ModelSpec, model_from_hf_config
from megatron_branch.commands.planner.validate import format_validation, validate_on_cpu

USABLE = 0.9
CHUNKS = (4096, 8192, 16384, 32768)
PIPELINE_SIZES = (1, 2, 4, 8)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def hybrid_constraints(model: ModelSpec) -> List[str]:
    """Why a hybrid Gated DeltaNet model's layouts are restricted (empty for other models)."""
    if not model.is_hybrid:
        return []
    return [f"CP fixed at 1: the package refuses context parallelism for Gated DeltaNet layers (no state exchange "
            f"for a tree split over CP ranks), so {model.name} scales over TP, PP and DP (prompts) only",
            f"TP > 1 runs with sequence parallelism (required for Gated DeltaNet layers) and must divide "
            f"{model.linear_num_key_heads} key / {model.linear_num_value_heads} value heads and "
            f"{model.num_kv_heads} KV heads"]


def candidate_layouts(model: ModelSpec, work: Workload, gpus: int) -> List[Layout]:
    out = []
    for tp, pp, dp in itertools.product(_divisors(gpus), PIPELINE_SIZES, _divisors(gpus)):
        if tp > 8 or model.num_attention_heads % tp or model.num_kv_heads % tp:
            continue
        if gpus % (tp * pp * dp) or model.num_layers % pp or work.num_prompts % dp:
            continue
        cp = gpus // (tp * pp * dp)
        if model.is_hybrid and (cp > 1 or model.linear_num_key_heads % tp or model.linear_num_value_heads % tp):
            continue  # hybrid_constraints
        # expert parallelism: over the TP x CP x DP ranks, dividing the experts
        eps = [e for e in _divisors(tp * cp * dp) if model.num_experts % e == 0] if model.is_moe else [1]
        for ep, chunk, recompute, fp8 in itertools.product(eps, CHUNKS, ("none", "full"), (False, True)):
            if chunk < tp * cp:
                continue
            out.append(Layout(tp, cp, pp, dp, chunk, recompute, fp8, ep))
    return out


def held_dimensions(model: ModelSpec, gpus: int, layouts: List[Layout]) -> List[str]:
    """Why PP or CP has one value in every candidate layout: one line per such dimension.

    Args:
        model: the model planned.
        gpus: the GPU count (on one GPU every size is 1; nothing is said).
        layouts: :func:`candidate_layouts`' result.

    Returns:
        Lines such as "PP held at 1: none of the pipeline sizes searched (2, 4, 8) divides
        the model's 61 layers"; empty when the search could vary both.
    """
    if gpus == 1 or not layouts:
        return []
    lines = []
    pps = {lay.pp for lay in layouts}
    if len(pps) == 1:
        lines.append(f"PP held at {pps.pop()}: {_pp_reason(model, gpus)}")
    cps = {lay.cp for lay in layouts}
    if len(cps) == 1:
        cp = cps.pop()
        why = ("the package refuses context parallelism for Gated DeltaNet layers" if model.is_hybrid else
               f"CP = GPUs / (TP x PP x DP), and TP x PP x DP = {gpus // cp} is the only product the model and "
               f"workload allow on {gpus} GPUs")
        lines.append(f"CP held at {cp}: {why}")
    return lines


def _pp_reason(model: ModelSpec, gpus: int) -> str:
    searched = [p for p in PIPELINE_SIZES if p > 1]
    dividing = [p for p in searched if model.num_layers % p == 0]
    if not dividing:
        return (f"none of the pipeline sizes searched ({', '.join(map(str, searched))}) divides the model's "
                f"{model.num_layers} layers")
    if all(gpus % p for p in dividing):
        return f"PP {', '.join(map(str, dividing))} divide the {model.num_layers} layers but not the {gpus} GPUs"
    return f"the only pipeline size that fills the {gpus} GPUs with the TP, CP and DP the model and workload allow"


def evaluate(model: ModelSpec, work: Workload, lay: Layout, gpu: GPUSpec, mfu: float) -> Dict:
    per_dp = Workload(work.prompt_len, work.rollouts, work.response_len, work.num_prompts // lay.dp)
    mem = memory_per_gpu(model, per_dp, lay)
    total = sum(mem.values())
    t = step_time(model, work, lay, gpu, mfu)
    return {"layout": asdict(lay), "memory_bytes": mem, "memory_total_bytes": total,
            "fits": total <= USABLE * gpu.memory_gb * GB, **t}


def plan(model: ModelSpec, work: Workload, gpu: GPUSpec, gpus: int, mfu: float = 0.4) -> Dict:
    """The fastest fitting layout (or, if none fits, the one using least memory)."""
    if gpus < 1:
        raise ValueError(f"gpus: must be >= 1, got {gpus}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu: must be in (0, 1], got {mfu}")
    layouts = candidate_layouts(model, work, gpus)
    options = [evaluate(model, work, lay, gpu, mfu) for lay in layouts]
    if not options:
        hybrid = ("; " + "; ".join(hybrid_constraints(model)) + f"; DP must divide the {work.num_prompts} prompt(s)"
                  if model.is_hybrid else "")
        raise ValueError(f"gpus: no TP/CP/PP/DP layout of {gpus} GPUs suits {model.name} "
                         f"({model.num_attention_heads} heads, {model.num_kv_heads} KV heads, "
                         f"{model.num_layers} layers){hybrid}")
    fitting = [o for o in options if o["fits"]]
    if fitting:
        # the time model does not model communication, so layouts that keep the same GPUs
        # busy tie: the one with the most memory headroom wins
        best = min(fitting, key=lambda o: (round(o["seconds"], 6), o["layout"]["pp"], -o["layout"]["chunk_tokens"],
                                           o["memory_total_bytes"]))
        reason = ""
    else:
        best = min(options, key=lambda o: o["memory_total_bytes"])
        reason = (f"does not fit: the leanest layout needs {best['memory_total_bytes'] / GB:.1f} GB per GPU, "
                  f"{gpu.name} offers {USABLE * gpu.memory_gb:.1f} GB usable; largest part: "
                  f"{max(best['memory_bytes'], key=best['memory_bytes'].get)}")
    return {"model": asdict(model), "workload": asdict(work), "gpu": asdict(gpu), "gpus": gpus, "mfu": mfu,
            "params_total": model.num_params(), "params_active": model.active_params(),
            "naive_positions": work.naive_positions, "unique_positions": work.unique_positions,
            "best": best, "fits": bool(fitting), "reason": reason, "layouts_considered": len(options),
            "constraints": hybrid_constraints(model), "held": held_dimensions(model, gpus, layouts)}


def format_plan(result: Dict) -> str:
    b, lay, gpu = result["best"], result["best"]["layout"], result["gpu"]
    lines = [
        f"model {result['model']['name']} on {result['gpus']} x {gpu['name']} ({gpu['memory_gb']:.0f} GB, "
        f"{gpu['bf16_tflops']:.0f} bf16 / {gpu['fp8_tflops']:.0f} FP8 TFLOPs), MFU assumed {result['mfu']:.0%}",
        f"workload: {result['workload']['num_prompts']} prompt(s) x {result['workload']['rollouts']} rollouts "
        f"x ({result['workload']['prompt_len']} prompt + {result['workload']['response_len']} response) = "
        f"{result['naive_positions']:,} naive / {result['unique_positions']:,} unique positions "
        f"({result['naive_positions'] / result['unique_positions']:.1f}x)",
        f"layout: TP={lay['tp']} CP={lay['cp']} PP={lay['pp']} DP={lay['dp']}"
        f"{' EP=' + str(lay['ep']) if result['model'].get('num_experts') else ''}, chunk {lay['chunk_tokens']} tokens, "
        f"recompute {lay['recompute']}, FP8 {'on' if lay['fp8'] else 'off'}, streaming exact replay "
        f"(recompute_stem=True)",
        *(f"  {why}" for why in result.get("held", ())),
        "memory per GPU:",
    ]
    if result["model"].get("num_experts"):
        m = result["model"]
        lines.insert(2, f"MoE: {m['num_experts']} experts, top-{m['experts_per_token']}: "
                        f"{result['params_total'] / 1e9:.1f}B parameters, {result['params_active'] / 1e9:.1f}B active "
                        f"per token; experts sharded over EP")
    if result["model"].get("kv_lora_rank"):
        m = result["model"]
        lines.insert(2, f"MLA: the path cache holds each head's uncompressed K ({m['num_attention_heads']} x "
                        f"{m['qk_head_dim'] + m['qk_pos_emb_head_dim']}) and V ({m['num_attention_heads']} x "
                        f"{m['v_head_dim']}) per token and layer, not the {m['kv_lora_rank']}-wide latent")
    if result["model"].get("linear_attention_pattern") and any(result["model"]["linear_attention_pattern"]):
        m = result["model"]
        gdn = sum(m["linear_attention_pattern"])
        conv = 2 * m["linear_num_key_heads"] * m["linear_key_head_dim"] + m["linear_num_value_heads"] * m[
            "linear_value_head_dim"]
        lines.insert(2, f"hybrid: {gdn} Gated DeltaNet + {m['num_layers'] - gdn} attention layers; the path cache "
                        f"holds K/V of the attention layers only, and per stem on the path each GDN layer's "
                        f"recurrent state ({m['linear_num_value_heads']} x {m['linear_key_head_dim']} x "
                        f"{m['linear_value_head_dim']} fp32) and last {m['linear_conv_kernel_dim'] - 1} convolution "
                        f"inputs ({conv} wide), whatever the stem's length")
        for i, why in enumerate(result.get("constraints", ())):
            lines.insert(3 + i, f"  {why}")
    for name, value in b["memory_bytes"].items():
        lines.append(f"  {name:<18s}{value / GB:>9.2f} GB")
    lines.append(f"  {'total':<18s}{b['memory_total_bytes'] / GB:>9.2f} GB of {USABLE * gpu['memory_gb']:.1f} "
                 f"usable -> {'FITS' if result['fits'] else 'DOES NOT FIT'}")
    lines.append(f"compute: {b['flops'] / 1e15:,.1f} PFLOP per step (naive {b['naive_flops'] / 1e15:,.1f}, "
                 f"{b['naive_flops'] / b['flops']:.1f}x); step {b['seconds']:.1f} s vs naive "
                 f"{b['naive_seconds']:.1f} s at the same MFU")
    if result["reason"]:
        lines.append(result["reason"])
    lines.append("an estimate, not measured on a GPU: the memory model is fitted on CPU fp32 runs and checked rank "
                 "by rank by megatron-branch bench-scale; bf16/FP8 activations, TE workspaces, NCCL buffers and "
                 "allocator fragmentation are not measured; communication time is not modelled")
    return "\n".join(lines)


def main(args) -> int:
    if args.validate:
        print(format_validation(validate_on_cpu()))
        print()
    if args.hf_config:
        model = model_from_hf_config(args.hf_config)
    else:
        model = MODELS[args.model]
    if args.naive_positions:
        if args.naive_positions % args.rollouts:
            raise SystemExit(f"--naive-positions {args.naive_positions} is not a multiple of "
                             f"--rollouts {args.rollouts}")
        per = args.naive_positions // args.rollouts
        work = Workload(per - args.response_len, args.rollouts, args.response_len, args.prompts)
    else:
        work = Workload(args.prompt_len, args.rollouts, args.response_len, args.prompts)
    result = plan(model, work, GPUS[args.gpu], args.gpus, args.mfu)
    print(format_plan(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["fits"] else 1


def add_arguments(parser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="Llama-3-8B", help="model preset")
    parser.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json instead of a preset")
    parser.add_argument("--prompt-len", type=int, default=131072, help="prompt tokens")
    parser.add_argument("--rollouts", type=int, default=16, help="rollouts per prompt")
    parser.add_argument("--response-len", type=int, default=3072, help="response tokens per rollout")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per step")
    parser.add_argument("--naive-positions", type=int, default=None,
                        help="total naive positions instead of --prompt-len (prompt = this / rollouts - response)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="H20", help="GPU preset")
    parser.add_argument("--gpus", type=int, default=8, help="number of GPUs")
    parser.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed for time")
    parser.add_argument("--validate", action="store_true", help="check the memory model on CPU runs first")
    parser.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
