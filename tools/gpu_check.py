"""The GPU check: one prepared run on one GPU that tells the truth; writes a JSON report.

    python tools/gpu_check.py --quick                  # < 5 minutes on one H200
    python tools/gpu_check.py --out results/gpu_check.json

Sections (each reports ``status``: ``passed``, ``failed`` or ``skipped`` with its
``reason``; the run passes only when every section passed — a needed section that could
not run, e.g. without Transformer Engine, fails the run):

1. ``kernels``: cascade tree attention with the ``flash_cuda`` and ``math`` piece kernels
   vs the dense reference, in bf16, forward and backward; the error against a float32
   dense run must stay within 2x that of dense bf16.
2. ``exactness_local`` / ``exactness_te``: branch replay (one pass and streaming) vs the
   naive per-rollout computation on Megatron's stock spec (local, then Transformer
   Engine), in bf16, both against the float32 truth (2x rule). Weights load strictly
   (the branch spec has the stock parameter names).
3. ``fp8``: TE FP8 (``fp8="hybrid"``, delayed and tensorwise scaling) on a tree whose
   sizes are not multiples of 16: branch replay's errors against the float32 truth within
   2x of the naive computation's in the same recipe, gradients finite.
4. ``timing``: a Llama-style model (~1B; ``--quick``: ~0.3B) in bf16, forward+backward of
   a GRPO-style loss: the fair naive (every rollout in full on fused causal SDPA, in
   micro-batches of 1, 2, 4 and all rollouts; the fastest is the reference, as in
   ``megatron-branch bench``) vs branch replay, side by side; reports the speed-up and the
   fraction of the ideal position ratio; passes at ``--min-fraction`` (default 0.5).

Without CUDA it exits with code 2 and says so: nothing here runs on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from typing import Callable, Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)

warnings.filterwarnings("ignore")

import torch  # noqa: E402

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


class Skip(Exception):
    """A section that cannot run here; its message is the reason."""


def run_sections(sections: List[Tuple[str, Callable[[], dict]]], echo=print) -> Dict:
    """Run every section; each returns a dict with ``passed`` (bool) or raises :class:`Skip`
    or any error (recorded). Returns the report: ``sections`` by name with ``status`` and
    ``seconds``, and ``status`` of the run (``passed`` only when every section passed)."""
    report: Dict = {"sections": {}}
    for name, fn in sections:
        start = time.perf_counter()
        try:
            result = fn()
            result["status"] = PASSED if result.pop("passed") else FAILED
        except Skip as exc:
            result = {"status": SKIPPED, "reason": str(exc)}
        except Exception:  # noqa: BLE001 - recorded in the report, the next section still runs
            result = {"status": FAILED, "error": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - start, 2)
        report["sections"][name] = result
        echo(f"{name}: {result['status']}" + (f" ({result['reason']})" if "reason" in result else ""))
    statuses = [s["status"] for s in report["sections"].values()]
    report["status"] = PASSED if statuses and all(s == PASSED for s in statuses) else FAILED
    report["not_passed"] = [n for n, s in report["sections"].items() if s["status"] != PASSED]
    return report


# ------------------------------------------------------------------------------ sections
def _tree_batch(prompt, tails, tail_len, vocab, seed=0):
    from megatron_branch.commands.synthetic import branching_rollouts

    return branching_rollouts([prompt], [tails], [tail_len], vocab, seed=seed)


def check_kernels(quick: bool) -> dict:
    import megatron_branch as mb
    from megatron_branch.attention import cascade_attention, dense_tree_attention, plan_pieces

    batch = _tree_batch(512 if quick else 1024, 8 if quick else 16, 128, 1000)
    tree = mb.BranchTree.from_sequences(batch.sequences).to("cuda")
    U, h, hk, d = tree.unique_positions, 16, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q32, k32, v32 = (torch.randn(U, n, d, device="cuda", generator=gen).requires_grad_() for n in (h, hk, hk))
    scale = d ** -0.5
    ref = dense_tree_attention(q32, k32, v32, tree.last, scale)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), g)
    qb, kb, vb = (x.detach().bfloat16().requires_grad_() for x in (q32, k32, v32))

    def errors(fn):
        out = fn(qb, kb, vb)
        grads = torch.autograd.grad(out, (qb, kb, vb), g.bfloat16())
        return [(out.float() - ref).abs().max().item()] + [
            (a.float() - b).abs().max().item() for a, b in zip(grads, ref_grads)]

    base = errors(lambda q, k, v: dense_tree_attention(q, k, v, tree.last, scale))
    result = {"dense_bf16_error": base}
    for kernel in ("flash_cuda", "math"):
        pieces = plan_pieces(tree.segments, 1024 if kernel == "math" else None, 1024 if kernel == "math" else None)
        err = errors(lambda q, k, v: cascade_attention(q, k, v, pieces, scale, kernel))
        result[f"cascade_{kernel}_error"] = err
        result[f"cascade_{kernel}_within_2x"] = all(e <= 2 * b + 1e-6 for e, b in zip(err, base))
    result["passed"] = all(result[f"cascade_{k}_within_2x"] for k in ("flash_cuda", "math"))
    return result


def _need_te() -> None:
    from megatron_branch._deps import HAVE_TE

    if not HAVE_TE:
        raise Skip("Transformer Engine is not importable (pip install -e '.[te]' on this GPU machine)")


def _models(use_te, dtype, fp8=None, recipe=None, layers=2, hidden=512, vocab=1024):
    from megatron_branch._megatron import Float16Module, GPTModel, get_gpt_layer_with_transformer_engine_spec
    from megatron_branch.spec.builders import build_gpt, llama_config

    extra = {"fp8": fp8, "fp8_recipe": recipe} if fp8 else {}
    config = llama_config(num_layers=layers, hidden_size=hidden, num_attention_heads=8, num_query_groups=4,
                          bf16=dtype == torch.bfloat16, params_dtype=torch.float32,
                          use_cpu_initialization=True, **extra)
    branch = build_gpt(config, vocab, seed=0, spec_kwargs=dict(use_te=use_te))
    if use_te:
        stock = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab, 4096,
                         share_embeddings_and_output_weights=False, position_embedding_type="rope")
    else:
        stock = build_gpt(config, vocab, branch=False)
    stock.load_state_dict(branch.state_dict(), strict=True)  # the branch spec keeps the stock names
    branch, stock = branch.cuda(), stock.cuda()
    if dtype == torch.bfloat16:
        branch, stock = Float16Module(config, branch), Float16Module(config, stock)
    return branch, stock


def _grads(model):
    return {n.replace("module.", "", 1): p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss(batch):
    from megatron_branch import losses

    mask = losses.response_mask(batch.lengths, batch.prompt_lengths, device="cuda")
    adv = torch.linspace(-1, 1, len(batch.sequences), device="cuda")
    tokens = mask.sum()

    def loss_fn(x, ids):
        ids = ids.to(mask.device)
        return losses.ppo_policy_loss(x, x.detach(), adv[ids], mask[ids], global_tokens=tokens)[0]

    return loss_fn


def _step(model, batch, tree=None, chunk=None, naive_multiple=None):
    import megatron_branch as mb
    from megatron_branch.reference.naive import batched_rollout_logprobs, naive_rollout_logprobs

    loss_fn = _loss(batch)
    model.zero_grad(set_to_none=True)
    if tree is None:
        seqs = [s.cuda() for s in batch.sequences]
        # FP8: one right-padded batch whose width is a multiple of 16 (causal, so exact)
        lp = (batched_rollout_logprobs(model, seqs, naive_multiple) if naive_multiple
              else naive_rollout_logprobs(model, seqs))
        loss_fn(lp, torch.arange(len(seqs))).backward()
        return lp.detach().float(), _grads(model)
    lp = mb.replay_logprobs(model, tree, max_chunk_tokens=chunk)
    mb.replay_step(model, tree, loss_fn, max_chunk_tokens=chunk)
    return lp.float(), _grads(model)


def _rel(a, b):
    missing = set(b) - set(a)
    if missing:
        raise AssertionError(f"gradients missing for {sorted(missing)[:3]}")
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp(min=1e-30)).item() for n in b)


def check_exactness(use_te: bool, quick: bool) -> dict:
    import megatron_branch as mb

    if use_te:
        _need_te()
    batch = _tree_batch(256 if quick else 512, 8, 64, 1024)
    tree = mb.BranchTree.from_sequences(batch.sequences)
    _, stock32 = _models(use_te, torch.float32)
    lp_ref, g_ref = _step(stock32, batch)
    branch16, stock16 = _models(use_te, torch.bfloat16)
    lp_n, g_n = _step(stock16, batch)
    out = {"naive_bf16_lp_error": (lp_n - lp_ref).abs().max().item(), "naive_bf16_grad_error": _rel(g_n, g_ref)}
    for chunk in (None, 128 if quick else 256):
        lp_b, g_b = _step(branch16, batch, tree, chunk)
        key = "single_pass" if chunk is None else f"stream_{chunk}"
        out[f"{key}_lp_error"] = (lp_b - lp_ref).abs().max().item()
        out[f"{key}_grad_error"] = _rel(g_b, g_ref)
        out[f"{key}_within_2x"] = (out[f"{key}_lp_error"] <= 2 * out["naive_bf16_lp_error"]
                                   and out[f"{key}_grad_error"] <= 2 * out["naive_bf16_grad_error"])
    out["passed"] = all(out[k] for k in out if k.endswith("_within_2x"))
    return out


def check_fp8(quick: bool) -> dict:
    import megatron_branch as mb

    _need_te()
    batch = _tree_batch(509, 7, 37, 1024)  # 509 + 7 x 37 = 768 tokens, segments of 509 and 37
    tree = mb.BranchTree.from_sequences(batch.sequences)
    _, stock32 = _models(True, torch.float32)
    lp_ref, g_ref = _step(stock32, batch, naive_multiple=16)
    out = {"passed": True}
    for recipe in ("delayed",) if quick else ("delayed", "tensorwise"):
        branch8, stock8 = _models(True, torch.bfloat16, fp8="hybrid", recipe=recipe)
        lp_n, g_n = _step(stock8, batch, naive_multiple=16)
        lp_b, g_b = _step(branch8, batch, tree)
        res = {"naive_lp_error": (lp_n - lp_ref).abs().max().item(), "naive_grad_error": _rel(g_n, g_ref),
               "branch_lp_error": (lp_b - lp_ref).abs().max().item(), "branch_grad_error": _rel(g_b, g_ref),
               "grads_finite": all(torch.isfinite(g).all().item() for g in g_b.values())}
        res["passed"] = (res["grads_finite"] and res["branch_lp_error"] <= 2 * res["naive_lp_error"] + 1e-6
                         and res["branch_grad_error"] <= 2 * res["naive_grad_error"] + 1e-6)
        out[recipe] = res
        out["passed"] = out["passed"] and res["passed"]
    return out


def check_timing(quick: bool, min_fraction: float) -> dict:
    import megatron_branch as mb
    from megatron_branch.commands.bench.methods import causal_logprobs, naive_micro_batches

    batch = _tree_batch(2048 if quick else 4096, 8, 256 if quick else 512, 32000)
    tree = mb.BranchTree.from_sequences(batch.sequences)
    layers, hidden = (8, 1536) if quick else (16, 2048)
    model, _ = _models(False, torch.bfloat16, layers=layers, hidden=hidden, vocab=32000)
    loss_fn = _loss(batch)
    seqs = [s.cuda() for s in batch.sequences]
    width = max(len(s) for s in seqs) - 1

    def naive(k):
        def run():
            for lo in range(0, len(seqs), k):
                ids = torch.arange(lo, min(lo + k, len(seqs)))
                loss_fn(causal_logprobs(model, seqs[lo: lo + k], width), ids).backward()
        return run

    runs = {f"naive_mb{k}": naive(k) for k in naive_micro_batches(len(seqs))}
    runs["ours"] = lambda: mb.replay_step(model, tree, loss_fn)
    times: Dict[str, List[float]] = {name: [] for name in runs}
    for name, fn in runs.items():  # warm-up (allocator, kernels)
        model.zero_grad(set_to_none=True)
        fn()
    for _ in range(3):  # interleaved repeats: every method sees the same machine state
        for name, fn in runs.items():
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    best = min((n for n in medians if n.startswith("naive")), key=medians.get)
    speedup = medians[best] / medians["ours"]
    ideal = tree.naive_positions / tree.unique_positions
    return {"model": f"{layers} layers x {hidden} hidden, vocab 32000, bf16", "seconds_median": medians,
            "fastest_naive": best, "speedup": speedup, "ideal_position_ratio": ideal,
            "fraction_of_ideal": speedup / ideal, "min_fraction": min_fraction,
            "passed": speedup > 1.0 and speedup / ideal >= min_fraction}


# --------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "gpu_check.json"), help="the JSON report")
    p.add_argument("--quick", action="store_true", help="smaller shapes; fits in 5 minutes on one GPU")
    p.add_argument("--min-fraction", type=float, default=0.5,
                   help="timing passes at this fraction of the ideal position ratio")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: error: needs a CUDA GPU (torch.cuda.is_available() is False); the CPU suite is "
              "`python -m pytest -q tests`", file=sys.stderr)
        return 2
    from megatron_branch._deps import HAVE_TE
    from megatron_branch.distributed import init_distributed

    init_distributed()
    q = args.quick
    sections = [
        ("kernels", lambda: check_kernels(q)),
        ("exactness_local", lambda: check_exactness(False, q)),
        ("exactness_te", lambda: check_exactness(True, q)),
        ("fp8", lambda: check_fp8(q)),
        ("timing", lambda: check_timing(q, args.min_fraction)),
    ]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "have_te": HAVE_TE,
              "quick": q, "date": time.strftime("%Y-%m-%d"), **run_sections(sections)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}; {'all checks passed' if report['status'] == PASSED else 'NOT PASSED: ' + ', '.join(report['not_passed'])}")
    return 0 if report["status"] == PASSED else 1


if __name__ == "__main__":
    raise SystemExit(main())
