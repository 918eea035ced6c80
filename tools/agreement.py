"""Agreement tables of the docs, computed and written to JSON by one command each.

    python tools/agreement.py training --out results/agreement_training.json   # ~3 minutes on 2 cores
    python tools/agreement.py moe --out results/agreement_moe.json             # ~1 minute

``training``: ``examples/train_branch_replay.py`` under torchrun (gloo, CPU) on several
TP/CP/PP/DP layouts, 3 Megatron-Adam steps, against ``--naive`` (Megatron's stock spec,
every rollout its own sequence, the same DDP, optimizer and normalisation) on one
process. Per layout: the worst per-tensor ``|p - p_naive| / |p_naive - p_init|``; plus the
guard (groups cut over DP ranks and a per-micro-batch mean) and bf16 against fp32 naive
as a multiple of naive bf16's error. ``tests/test_training_parallel.py`` asserts the same
runs (its layouts are these).

``moe``: an MoE model (Megatron's MoE layer, 4 experts top-2, the three aux losses and the
z-loss) in one process: branch replay in one pass and streaming against the naive MoE
batch (log-probs, every gradient), the guard (Megatron's stock router on the tree: its
statistics count unique tokens) and approximate token dropping's bias
(``megatron_branch.reference.bias.token_dropping_bias``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train_branch_replay.py")
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)

DATA = ["--prompts", "48", "32", "40", "24", "--jitter", "6", "--adam-eps", "1e-6", "--seed", "3"]
LAYOUTS = {
    "dp2-distopt": (2, ["--distributed-optimizer"]),
    "tp2-dp2-streaming-overlap": (4, ["--tp", "2", "--sequence-parallel", "--chunk-tokens", "24",
                                      "--overlap-grad-reduce", "--bucket-size", "4000",
                                      "--micro-batch-tokens", "200"]),
    "pp2-dp2-microbatches": (4, ["--pp", "2", "--micro-batch-tokens", "200", "--distributed-optimizer"]),
    "pp2-cp2": (4, ["--pp", "2", "--cp", "2", "--cp-comm", "p2p", "--micro-batch-tokens", "200"]),
    "dp1-microbatches-torch-adam": (1, ["--micro-batch-tokens", "200", "--optimizer", "torch"]),
}
GUARD = (2, ["--cut-groups", "--per-microbatch-mean", "--micro-batch-tokens", "150"])
BF16 = (2, ["--bf16", "--distributed-optimizer", "--micro-batch-tokens", "200"])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_example(nproc: int, *flags, timeout: int = 600) -> str:
    """``examples/train_branch_replay.py`` with ``nproc`` processes (torchrun; one: directly)."""
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                                      f"--master_port={free_port()}"]
    proc = subprocess.run([sys.executable, *launcher, TRAIN, *[str(f) for f in flags]], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-4000:])
    return proc.stdout


def params(directory: str, tag: str, nproc: int, *flags, steps: int = 3):
    from safetensors.torch import load_file

    path = os.path.join(directory, f"{tag}.safetensors")
    out = run_example(nproc, *DATA, "--steps", steps, "--dump-params", path, *flags)
    return load_file(path), out


def rel_errors(got, ref, init) -> Dict[str, float]:
    """Per tensor ``|got - ref| / |ref - init|``: the error relative to the update itself."""
    if set(got) != set(ref):
        raise ValueError(f"parameter names differ: {sorted(set(got) ^ set(ref))[:5]}")
    return {k: float((got[k] - ref[k]).norm() / (ref[k] - init[k]).norm().clamp(min=1e-30)) for k in ref}


def training(echo=print) -> dict:
    rows: List[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        init, _ = params(tmp, "init", 1, steps=0)
        naive, _ = params(tmp, "naive", 1, "--naive")
        naive_torch, _ = params(tmp, "naive-torch", 1, "--naive", "--optimizer", "torch")
        for name, (nproc, flags) in LAYOUTS.items():
            truth = naive_torch if "torch" in flags else naive
            got, _ = params(tmp, name, nproc, *flags)
            errors = rel_errors(got, truth, init)
            worst = max(errors, key=errors.get)
            rows.append({"layout": name, "processes": nproc, "flags": flags, "max_rel_error": errors[worst],
                         "worst_tensor": worst})
            echo(f"{name:<30s}{errors[worst]:>10.1e}  ({worst})")
        got, _ = params(tmp, "guard", GUARD[0], *GUARD[1])
        guard = max(rel_errors(got, naive, init).values())
        echo(f"{'guard: groups cut + per-micro-batch mean':<30s}{guard:>10.1e}")
        naive_bf16, _ = params(tmp, "naive-bf16", 1, "--naive", "--bf16")
        got, _ = params(tmp, "bf16", BF16[0], *BF16[1])
        ratio = max(float((got[k] - naive[k]).norm()) / max(float((naive_bf16[k] - naive[k]).norm()), 1e-30)
                    for k in naive)
        echo(f"{'bf16: error vs naive bf16 error':<30s}{ratio:>10.2f}x")
    return {"command": "python tools/agreement.py training", "steps": 3, "data": DATA, "layouts": rows,
            "guard_max_rel_error": guard, "bf16_error_ratio_vs_naive_bf16": ratio}


def moe(echo=print) -> dict:
    warnings.filterwarnings("ignore")
    import torch

    import megatron_branch as mb
    from megatron_branch._megatron import GPTModel, MoEAuxLossAutoScaler, TopKRouter
    from megatron_branch.commands.synthetic import branching_rollouts
    from megatron_branch.distributed import init_distributed
    from megatron_branch.reference.agreement import grad_agreement, grads
    from megatron_branch.reference.bias import token_dropping_bias
    from megatron_branch.reference.naive import naive_moe_logprobs
    from megatron_branch.spec.builders import build_gpt, llama_config

    mb.enable_cpu()
    init_distributed()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    seqs = branching_rollouts([20, 13], [2, 3], [6, 5], 128, seed=3, jitter=3).sequences
    tree = mb.BranchTree.from_sequences(seqs)
    weights = torch.linspace(-1.0, 1.0, len(seqs))

    def loss_fn(lp, ids=None):
        ids = torch.arange(len(seqs)) if ids is None else ids
        return (lp.sum(1) * weights[ids]).sum() / 100

    def pair(**overrides):
        config = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                              num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96,
                              moe_token_dispatcher_type="allgather",
                              moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
                              moe_aux_loss_coeff=[0.01, 0.02, 0.03], moe_z_loss_coeff=1e-3, **overrides)
        spec = dict(num_experts=4, moe_grouped_gemm=False)
        extra = {"moe_token_dropping": "approximate"} if overrides.get("moe_expert_capacity_factor") else {}
        branch = build_gpt(config, 128, seed=0, spec_kwargs={**spec, **extra})
        stock = build_gpt(config, 128, branch=False, spec_kwargs=spec)
        stock.load_state_dict(branch.state_dict())
        return branch, stock

    def compare(branch, stock, run) -> dict:
        for m in (branch, stock):
            m.zero_grad(set_to_none=True)
        lp = run(branch)
        lp_ref = naive_moe_logprobs(stock, seqs)
        loss_fn(lp_ref).backward()
        agreement = grad_agreement(grads(branch), grads(stock))
        return {"max_abs_logprob_diff": float((lp.detach() - lp_ref.detach()).abs().max()) if lp is not None else None,
                "max_rel_grad_diff": agreement.max_rel_diff, "worst_param": agreement.worst_param}

    def one_pass(model):
        lp = mb.rollout_logprobs(model, tree)
        loss_fn(lp).backward()
        return lp

    def streaming(model):
        mb.replay_step(model, tree, loss_fn, max_chunk_tokens=10)
        return mb.replay_logprobs(model, tree)

    rows = {}
    branch, stock = pair()
    rows["one_pass"] = compare(branch, stock, one_pass)
    branch, stock = pair()
    rows["streaming_chunk_10"] = compare(branch, stock, streaming)
    # the guard: the same layer with Megatron's stock router computes statistics over unique tokens
    spec = mb.get_branch_layer_spec(normalization="RMSNorm", num_experts=4, moe_grouped_gemm=False)
    mlp = spec.submodules.mlp
    (mlp.submodules if hasattr(mlp, "submodules") else mlp.keywords["submodules"]).router = TopKRouter
    branch, stock = pair()
    guard = GPTModel(branch.config, spec, 128, 4096, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    guard.load_state_dict(branch.state_dict())
    rows["guard_stock_router"] = compare(guard, stock, one_pass)
    branch, stock = pair(moe_expert_capacity_factor=1.0)
    bias = token_dropping_bias(branch, stock, seqs, loss_fn)
    rows["approximate_token_dropping"] = {"grad_rel_error": bias["grad_rel_error"], "grad_cosine": bias["grad_cosine"],
                                          "dropped_tree": bias["dropped_tree"], "dropped_naive": bias["dropped_naive"]}
    for name, row in rows.items():
        echo(f"{name:<28s}" + ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    return {"command": "python tools/agreement.py moe", "model": "2 layers x 64 hidden, 4 experts top-2, "
            "aux 0.01 + seq-aux 0.02 + global-aux 0.03 + z-loss 1e-3, fp32", "rows": rows}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", choices=["training", "moe"])
    p.add_argument("--out", default=None, help="the JSON (default results/agreement_TABLE.json)")
    args = p.parse_args(argv)
    out = args.out or os.path.join(ROOT, "results", f"agreement_{args.table}.json")
    result = training() if args.table == "training" else moe()
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
