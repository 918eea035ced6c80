"""The GPU check: one prepared run that settles what the CPU suite cannot; one JSON report.

    python tools/gpu_check.py --quick        # at most 8 minutes on one H100 (each section has its own timeout)
    python tools/gpu_check.py                # larger trees (about 15 minutes: two calls where a command
                                             # may run 10 minutes, e.g. --only contract parity_bf16 ...)
    python tools/gpu_check.py --dry-run      # every section on the CPU at toy sizes: the script's own test

Sections (each reports ``status``: ``passed``, ``failed`` or ``skipped`` with its reason,
its numbers and its seconds; an error or a timeout fails that section and the next one
runs; the run passes only when every section passed, so a section that could not run,
e.g. without Transformer Engine, fails the run):

1. ``contract``: the CUDA varlen kernels (``flash_varlen`` in bf16, ``efficient_varlen`` in
   float32) and ``flash_cuda`` against the conventions the CPU side implements
   (``attention/varlen.py``): bottom-right causal alignment, GQA, LSE ``[heads, Tq]``,
   ``+inf`` and zero output for rows without keys, zero gradients for keys without
   queries, a backward given another (merged) output and LSE.
2. ``parity_bf16``: tree attention in bf16 through ``flash_varlen``, ``flash_cuda`` and the
   dense masked SDPA, each against float32 (TF32 off): the varlen and flash errors within
   2 x (calls per layer) of dense bf16's (each call rounds its partial output and gradients
   to bf16 once; dense rounds once); ``efficient_varlen`` in float32 within 2e-5 (relative
   to the largest entry).
3. ``exactness_local`` / ``exactness_te``: branch replay (one pass and streaming, the default
   kernel: ``flash_varlen``) against the naive per-rollout computation on Megatron's stock
   spec (local, then Transformer Engine) in bf16, both against the float32 truth (2x rule).
4. ``fp8``: Transformer Engine FP8 (``fp8="hybrid"``) on a tree whose sizes are not multiples
   of 16, errors within 2x of the naive computation's in the same recipe; then two optimizer
   steps: the forward after each update equals a freshly built model's with the updated
   weights (TE recasts its FP8 weights), and without the package's refresh it would not.
5. ``long_tree``: a prompt with 16 answers (8K-32K unique tokens) through a bf16 Llama-style
   model: the fair naive (every rollout on fused causal SDPA, micro-batches of every power
   of two, the fastest) against branch replay side by side: time, TFLOP/s, speed-up as a
   fraction of the ideal ratio (passes at ``--min-fraction``), peak memory of both, and
   ours' peak against the planner's (``megatron-branch plan``'s memory model).
6. ``streaming``: the same tree streamed, the answers' chunks under the cached prompt, against
   one pass: time ratio and gradient agreement.
7. ``host_syncs``: ``torch.cuda.set_sync_debug_mode`` counts the host syncs of one step, on
   models of two depths: not more with more layers.

Without CUDA (and without ``--dry-run``) it exits with code 2 and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
import traceback
import warnings
from typing import Callable, Dict, List, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)

warnings.filterwarnings("ignore")

import torch  # noqa: E402

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"

# Sizes per mode: "quick" fits 8 minutes on one H100, "dry" runs on 2 CPU cores in about a minute.
SIZES = {
    "full": dict(prompt=16384, answers=16, answer=1024, layers=8, hidden=2048, heads=16, kv=4, vocab=32000,
                 tree_prompt=2048, tree_tails=16, exact_prompt=512, chunk=4096, repeats=3),
    "quick": dict(prompt=8192, answers=16, answer=512, layers=4, hidden=2048, heads=16, kv=4, vocab=32000,
                  tree_prompt=1024, tree_tails=8, exact_prompt=256, chunk=2048, repeats=2),
    "dry": dict(prompt=96, answers=4, answer=16, layers=1, hidden=64, heads=4, kv=2, vocab=256,
                tree_prompt=48, tree_tails=4, exact_prompt=32, chunk=32, repeats=1),
}
# seconds per section in --quick (twice that otherwise); the sum stays under 8 minutes
TIMEOUTS = {"contract": 30, "parity_bf16": 40, "exactness_local": 60, "exactness_te": 60, "fp8": 80,
            "long_tree": 110, "streaming": 50, "host_syncs": 30}


class Skip(Exception):
    """A section that cannot run here; its message is the reason."""


class SectionTimeout(Exception):
    """A section ran past its time."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`SectionTimeout` in this (main) thread after ``seconds`` (no limit where
    SIGALRM is missing). A CUDA kernel in flight finishes first; the next Python line stops."""
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise SectionTimeout(f"ran past its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_sections(sections: Sequence[Tuple], echo=print) -> Dict:
    """Run every section ``(name, fn)`` or ``(name, fn, timeout_seconds)``; ``fn`` returns a
    dict with ``passed`` (bool) or raises :class:`Skip` or any error (recorded, as is a
    timeout). Returns the report: ``sections`` by name with ``status`` and ``seconds``, and
    ``status`` of the run (``passed`` only when every section passed)."""
    report: Dict = {"sections": {}}
    for name, fn, *limit in sections:
        start = time.perf_counter()
        try:
            with time_limit(limit[0] if limit else 0):
                result = fn()
            result["status"] = PASSED if result.pop("passed") else FAILED
        except Skip as exc:
            result = {"status": SKIPPED, "reason": str(exc)}
        except SectionTimeout as exc:
            result = {"status": FAILED, "reason": str(exc)}
        except Exception:  # noqa: BLE001 - recorded in the report, the next section still runs
            result = {"status": FAILED, "error": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - start, 2)
        report["sections"][name] = result
        echo(f"{name}: {result['status']}" + (f" ({result['reason']})" if "reason" in result else ""))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    statuses = [s["status"] for s in report["sections"].values()]
    report["status"] = PASSED if statuses and all(s == PASSED for s in statuses) else FAILED
    report["not_passed"] = [n for n, s in report["sections"].items() if s["status"] != PASSED]
    return report


class Check:
    """The sections, on ``device`` at ``sizes`` (:data:`SIZES`)."""

    def __init__(self, device: str, sizes: dict, min_fraction: float = 0.5):
        self.device, self.s, self.min_fraction = device, sizes, min_fraction
        self.cuda = device == "cuda"

    # ------------------------------------------------------------------------ helpers
    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def _timed(self, fn) -> float:
        self._sync()
        start = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - start

    def _batch(self, prompt, tails, tail_len, vocab, seed=0):
        from megatron_branch.commands.synthetic import branching_rollouts

        return branching_rollouts([prompt], [tails], [tail_len], vocab, seed=seed)

    def _models(self, use_te, dtype, fp8=None, layers=2, hidden=None, vocab=None, heads=None, kv=None,
                with_stock=True, **extra):
        """(branch, stock) with the same weights (stock: Megatron's own spec, local or TE;
        None without ``with_stock``)."""
        from megatron_branch._megatron import Float16Module, GPTModel, get_gpt_layer_with_transformer_engine_spec
        from megatron_branch.spec.builders import build_gpt, llama_config

        hidden, vocab = hidden or (512 if self.cuda else 64), vocab or 1024
        if fp8:
            extra.update(fp8=fp8, fp8_recipe="delayed")
        config = llama_config(num_layers=layers, hidden_size=hidden, num_attention_heads=heads or self.s["heads"],
                              num_query_groups=kv or self.s["kv"], bf16=dtype == torch.bfloat16,
                              params_dtype=torch.float32,
                              use_cpu_initialization=True, **extra)
        branch = build_gpt(config, vocab, seed=0, spec_kwargs=dict(use_te=use_te))
        if not with_stock:
            branch = branch.to(self.device)
            return (Float16Module(config, branch) if dtype == torch.bfloat16 else branch), None
        if use_te:
            stock = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab, 65536,
                             share_embeddings_and_output_weights=False, position_embedding_type="rope")
        else:
            stock = build_gpt(config, vocab, branch=False)
        load_same_weights(stock, branch.state_dict())
        branch, stock = branch.to(self.device), stock.to(self.device)
        if dtype == torch.bfloat16:
            branch, stock = Float16Module(config, branch), Float16Module(config, stock)
        return branch, stock

    def _loss(self, batch):
        from megatron_branch import losses

        mask = losses.response_mask(batch.lengths, batch.prompt_lengths, device=self.device)
        adv = torch.linspace(-1, 1, len(batch.sequences), device=self.device)
        tokens = mask.sum()

        def loss_fn(x, ids):
            ids = ids.to(mask.device)
            return losses.ppo_policy_loss(x, x.detach(), adv[ids], mask[ids], global_tokens=tokens)[0]

        return loss_fn

    def _step(self, model, batch, tree=None, chunk=None, naive_multiple=None):
        import megatron_branch as mb
        from megatron_branch.reference.naive import batched_rollout_logprobs, naive_rollout_logprobs

        loss_fn = self._loss(batch)
        model.zero_grad(set_to_none=True)
        if tree is None:
            seqs = [s.to(self.device) for s in batch.sequences]
            # FP8: one right-padded batch whose width is a multiple of 16 (causal, so exact)
            lp = (batched_rollout_logprobs(model, seqs, naive_multiple) if naive_multiple
                  else naive_rollout_logprobs(model, seqs))
            loss_fn(lp, torch.arange(len(seqs))).backward()
            return lp.detach().float(), grads_of(model)
        lp = mb.replay_logprobs(model, tree, max_chunk_tokens=chunk)
        mb.replay_step(model, tree, loss_fn, max_chunk_tokens=chunk)
        return lp.float(), grads_of(model)

    def _need_te(self):
        from megatron_branch._deps import HAVE_TE

        if not self.cuda:
            raise Skip("Transformer Engine runs on CUDA only")
        if not HAVE_TE:
            raise Skip("Transformer Engine is not importable (pip install -e '.[te]' on this GPU machine)")

    # ----------------------------------------------------------------------- sections
    def contract(self) -> dict:
        """The CUDA kernels against the contract's conventions (the CPU side in float64)."""
        from megatron_branch.attention import kernels
        from megatron_branch.attention.varlen import VarlenCall, varlen_backward, varlen_forward

        # (a dry run compares the CPU side in bf16 / float32 with itself in float64)
        # more queries than keys, none, keys without queries, fewer queries than keys, long
        spans = [(0, 70, 0, 40), (70, 90, 40, 40), (90, 90, 40, 75), (90, 150, 75, 300), (150, 406, 300, 556)]
        tq, tk, h, hk, d = 406, 556, 8, 2, 64
        gen = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(n, heads, d, generator=gen, dtype=torch.float64)
                         for n, heads in ((tq, h), (tk, hk), (tk, hk), (tq, h)))
        out: Dict = {}
        ok = True
        # errors relative to the reference's largest entry: bf16 rounds at 2^-8, float32 (TF32 off) at 2^-23
        for kernel, dtype, tol in (("flash_varlen", torch.bfloat16, 3e-2), ("efficient_varlen", torch.float32, 2e-5)):
            for causal in (False, True):
                ref_call = VarlenCall.from_spans(spans, causal, tq, tk)
                ref_o, ref_l = varlen_forward(kernel, q, k, v, ref_call, d ** -0.5)  # CPU side, float64
                ref_g = varlen_backward(kernel, dout, q, k, v, ref_o, ref_l, ref_call, d ** -0.5)
                call = VarlenCall.from_spans(spans, causal, tq, tk, self.device)
                dev = [x.to(self.device, dtype) for x in (q, k, v, dout)]
                o, lse = varlen_forward(kernel, *dev[:3], call, d ** -0.5)
                # the backward given the reference (out, lse): any merged pair must be taken
                g = varlen_backward(kernel, dev[3], *dev[:3], ref_o.to(self.device, dtype),
                                    ref_l.float().to(self.device), call, d ** -0.5)
                empty = torch.isinf(ref_l)
                res = {
                    "out_error": _rel(o, ref_o),
                    "lse_error": _rel(lse.cpu().double()[~empty], ref_l[~empty]),
                    "empty_rows_lse_inf_out_zero": bool(torch.isposinf(lse.cpu()[empty]).all()
                                                        and o.cpu()[70:90].abs().max() == 0),
                    "grad_errors": [_rel(a, b) for a, b in zip(g, ref_g)],
                    "keys_without_queries_zero": bool(g[1].cpu()[40:75].abs().max() == 0
                                                      and g[2].cpu()[40:75].abs().max() == 0),
                    "gqa_grad_shapes": [tuple(x.shape) for x in g[1:]] == [(tk, hk, d)] * 2,
                }
                res["passed"] = (res["out_error"] < tol and res["lse_error"] < tol and max(res["grad_errors"]) < tol
                                 and res["empty_rows_lse_inf_out_zero"] and res["keys_without_queries_zero"]
                                 and res["gqa_grad_shapes"])
                out[f"{kernel}_{'causal' if causal else 'full'}"] = res
                ok = ok and res["passed"]
        if not self.cuda:
            out["passed"] = ok
            return out
        # flash_cuda: a batch of equal pieces against math, forward and backward, GQA
        qb, kb, vb, db = (torch.randn(3, 96, heads, d, generator=gen) for heads in (h, hk, hk, h))
        for causal in (False, True):
            fwd, bwd = kernels.KERNELS["flash_cuda"]
            mo, ml = kernels.math_forward(qb, kb.repeat_interleave(h // hk, 2), vb.repeat_interleave(h // hk, 2),
                                          causal, 0.125)
            dev = [x.to(self.device, torch.bfloat16) for x in (qb, kb, vb, db)]
            o, lse = fwd(*dev[:3], causal, 0.125)
            g = bwd(dev[3], *dev[:3], o, lse, causal, 0.125)
            res = {"out_error": _rel(o, mo), "lse_error": _rel(lse, ml),
                   "gqa_grad_shapes": [tuple(x.shape) for x in g[1:]] == [tuple(kb.shape)] * 2}
            res["passed"] = res["out_error"] < 2e-2 and res["lse_error"] < 2e-2 and res["gqa_grad_shapes"]
            out[f"flash_cuda_{'causal' if causal else 'full'}"] = res
            ok = ok and res["passed"]
        out["passed"] = ok
        return out

    def parity_bf16(self) -> dict:
        import megatron_branch as mb
        from megatron_branch.attention import cascade_attention, dense_tree_attention, plan_pieces
        from megatron_branch.attention.varlen_cascade import varlen_calls, varlen_cascade_attention

        s = self.s
        batch = self._batch(s["tree_prompt"], s["tree_tails"], s["tree_prompt"] // 8, 1000)
        tree = mb.BranchTree.from_sequences(batch.sequences).to(self.device)
        U, h, hk, d = tree.unique_positions, s["heads"], s["kv"], 128 if self.cuda else 16
        gen = torch.Generator(device=self.device).manual_seed(0)
        q32, k32, v32 = (torch.randn(U, n, d, device=self.device, generator=gen).requires_grad_()
                         for n in (h, hk, hk))
        scale = d ** -0.5
        with no_tf32():
            ref = dense_tree_attention(q32, k32, v32, tree.last, scale)
            g = torch.randn_like(ref)
            ref_grads = torch.autograd.grad(ref, (q32, k32, v32), g)
        pieces = plan_pieces(tree.segments)
        calls = varlen_calls(pieces, U, U, self.device)

        def errors(fn, dtype=torch.bfloat16):
            q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q32, k32, v32))
            with no_tf32():
                out = fn(q, k, v)
                grads = torch.autograd.grad(out, (q, k, v), g.to(dtype))
            return [_rel(out, ref)] + [_rel(a, b) for a, b in zip(grads, ref_grads)]

        base = errors(lambda q, k, v: dense_tree_attention(q, k, v, tree.last, scale))
        result = {"tokens": U, "calls_per_layer": len(calls), "dense_bf16_error": base}
        runs = {"flash_varlen": lambda q, k, v: varlen_cascade_attention(q, k, v, calls, scale, "flash_varlen")}
        if self.cuda:
            runs["flash_cuda"] = lambda q, k, v: cascade_attention(q, k, v, pieces, scale, "flash_cuda")
        # Each call returns its output and gradients rounded to bf16 before the float32 merge /
        # sum, so an entry taking part in n calls is rounded up to n times where dense rounds
        # once: the 2x rule per rounding (a convention error is O(1), far beyond it).
        bound = 2 * len(calls)
        result["bound_over_dense"] = bound
        ok = True
        for kernel, fn in runs.items():
            err = errors(fn)
            result[f"{kernel}_error"] = err
            result[f"{kernel}_within_bound"] = all(e <= bound * b + 1e-6 for e, b in zip(err, base))
            ok = ok and result[f"{kernel}_within_bound"]
        err32 = errors(lambda q, k, v: varlen_cascade_attention(q, k, v, calls, scale, "efficient_varlen"),
                       torch.float32)
        result["efficient_varlen_fp32_error"] = err32
        result["passed"] = ok and max(err32) < 2e-5  # relative, TF32 off
        return result

    def exactness(self, use_te: bool) -> dict:
        import megatron_branch as mb

        if use_te:
            self._need_te()
        s = self.s
        batch = self._batch(s["exact_prompt"], 8, 64, 1024)
        tree = mb.BranchTree.from_sequences(batch.sequences)
        with no_tf32():
            _, stock32 = self._models(use_te, torch.float32)
            lp_ref, g_ref = self._step(stock32, batch)
        branch16, stock16 = self._models(use_te, torch.bfloat16)
        lp_n, g_n = self._step(stock16, batch)
        out = {"naive_bf16_lp_error": _err(lp_n, lp_ref), "naive_bf16_grad_error": rel_grads(g_n, g_ref),
               "kernel": kernel_of(branch16)}
        for chunk in (None, s["exact_prompt"] // 2):
            lp_b, g_b = self._step(branch16, batch, tree, chunk)
            key = "single_pass" if chunk is None else f"stream_{chunk}"
            out[f"{key}_lp_error"] = _err(lp_b, lp_ref)
            out[f"{key}_grad_error"] = rel_grads(g_b, g_ref)
            out[f"{key}_within_2x"] = (out[f"{key}_lp_error"] <= 2 * out["naive_bf16_lp_error"] + 1e-6
                                       and out[f"{key}_grad_error"] <= 2 * out["naive_bf16_grad_error"] + 1e-6)
        out["passed"] = all(out[k] for k in out if k.endswith("_within_2x"))
        return out

    def fp8(self) -> dict:
        import megatron_branch as mb

        self._need_te()
        batch = self._batch(509, 7, 37, 1024)  # 509 + 7 x 37 = 768 tokens, segments of 509 and 37
        tree = mb.BranchTree.from_sequences(batch.sequences)
        _, stock32 = self._models(True, torch.float32)
        with no_tf32():
            lp_ref, g_ref = self._step(stock32, batch, naive_multiple=16)
        branch8, stock8 = self._models(True, torch.bfloat16, fp8="hybrid")
        lp_n, g_n = self._step(stock8, batch, naive_multiple=16)
        lp_b, g_b = self._step(branch8, batch, tree)
        res = {"naive_lp_error": _err(lp_n, lp_ref), "naive_grad_error": rel_grads(g_n, g_ref),
               "branch_lp_error": _err(lp_b, lp_ref), "branch_grad_error": rel_grads(g_b, g_ref),
               "grads_finite": all(torch.isfinite(g).all().item() for g in g_b.values())}
        res["within_2x"] = (res["grads_finite"] and res["branch_lp_error"] <= 2 * res["naive_lp_error"] + 1e-6
                            and res["branch_grad_error"] <= 2 * res["naive_grad_error"] + 1e-6)
        res["refresh"] = self._fp8_refresh(branch8, batch, tree)
        res["passed"] = res["within_2x"] and res["refresh"]["passed"]
        return res

    def _fp8_refresh(self, model, batch, tree) -> dict:
        """Two optimizer steps: after each, the model's log-probs equal those of a model
        built afresh with the updated weights (which casts them to FP8 anew); the same
        forward without the refresh (the package's call removed) keeps the stale casts."""
        import megatron_branch as mb
        from megatron_branch import model as handle
        from megatron_branch.scoring import logprobs

        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        loss_fn = self._loss(batch)
        out = {"steps": []}
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            mb.replay_step(model, tree, loss_fn)
            opt.step()
            real = logprobs.refresh_fp8_weights
            logprobs.refresh_fp8_weights = lambda m: None  # what the loops did before: no refresh
            try:
                with torch.no_grad():
                    stale = mb.rollout_logprobs(model, tree)
            finally:
                logprobs.refresh_fp8_weights = real
            with torch.no_grad():
                now = mb.rollout_logprobs(model, tree)
                fresh_model, _ = self._models(True, torch.bfloat16, fp8="hybrid")
                load_same_weights(handle.unwrap(fresh_model), handle.unwrap(model).state_dict())
                fresh = mb.rollout_logprobs(fresh_model, tree)
            out["steps"].append({"refreshed_vs_fresh": _err(now, fresh), "stale_vs_fresh": _err(stale, fresh)})
        # stale_vs_fresh is what the refresh prevents (information: were TE to recast anyway, it would be ~0)
        out["passed"] = all(s["refreshed_vs_fresh"] <= 1e-4 for s in out["steps"])
        return out

    def _long_tree_setup(self):
        """The long tree and its model, built once for ``long_tree`` and ``streaming``."""
        import megatron_branch as mb

        if getattr(self, "_long", None) is None:
            s = self.s
            batch = self._batch(s["prompt"], s["answers"], s["answer"], s["vocab"])
            tree = mb.BranchTree.from_sequences(batch.sequences)
            model, _ = self._models(False, torch.bfloat16 if self.cuda else torch.float32, layers=s["layers"],
                                    hidden=s["hidden"], vocab=s["vocab"], heads=s["heads"], kv=s["kv"],
                                    with_stock=False)
            self._long = batch, tree, model
        return self._long

    def long_tree(self) -> dict:
        import megatron_branch as mb
        from megatron_branch.commands.bench.methods import causal_logprobs, naive_micro_batches
        from megatron_branch.commands.planner.memory import replay_peak_bytes
        from megatron_branch.commands.planner.presets import ModelSpec
        from megatron_branch.flops import ModelShape, causal_pairs, step_flops

        s = self.s
        batch, tree, model = self._long_tree_setup()
        loss_fn = self._loss(batch)
        seqs = [x.to(self.device) for x in batch.sequences]
        width = max(len(x) for x in seqs) - 1

        def naive(k):
            def run():
                for lo in range(0, len(seqs), k):
                    ids = torch.arange(lo, min(lo + k, len(seqs)))
                    loss_fn(causal_logprobs(model, seqs[lo: lo + k], width), ids).backward()
            return run

        runs = {f"naive_mb{k}": naive(k) for k in naive_micro_batches(len(seqs))}
        runs["ours"] = lambda: mb.replay_step(model, tree, loss_fn)
        peaks: Dict[str, int] = {}
        out_of_memory = []
        for name, fn in list(runs.items()):  # warm-up, and each method's peak memory
            model.zero_grad(set_to_none=True)
            try:
                peaks[name] = self._peak(fn)
            except torch.cuda.OutOfMemoryError:  # a naive micro-batch too large for this GPU: not a candidate
                out_of_memory.append(name)
                del runs[name]
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
        times: Dict[str, List[float]] = {name: [] for name in runs}
        for _ in range(s["repeats"]):  # interleaved: every method sees the same machine state
            for name, fn in runs.items():
                model.zero_grad(set_to_none=True)
                times[name].append(self._timed(fn))
        medians = {name: statistics.median(t) for name, t in times.items()}
        best = min((n for n in medians if n.startswith("naive")), key=medians.get)
        speedup = medians[best] / medians["ours"]
        ideal = tree.naive_positions / tree.unique_positions
        config = unwrap(model).config
        shape = ModelShape.from_config(config, s["vocab"])
        naive_flops = step_flops(shape, tree.naive_positions, sum(causal_pairs(len(x)) for x in seqs))["total"]
        tree_flops = step_flops(shape, tree.unique_positions, tree.attention_pairs())["total"]
        spec = ModelSpec("gpu_check", config.num_layers, config.hidden_size, config.num_attention_heads,
                         config.num_query_groups, config.ffn_hidden_size, s["vocab"])
        predicted = replay_peak_bytes(spec, tree, chunk_tokens=None, act_bytes=2 if self.cuda else 4)[0]
        ours_peak = peaks["ours"] - self._resident(model)
        result = {
            "model": f"{config.num_layers} layers x {config.hidden_size} hidden, {config.num_attention_heads} heads "
                     f"/ {config.num_query_groups} KV, vocab {s['vocab']}",
            "rollouts": f"{s['answers']} x ({s['prompt']} + {s['answer']})", "unique_tokens": tree.unique_positions,
            "naive_tokens": tree.naive_positions, "kernel": kernel_of(model), "seconds_median": medians,
            "fastest_naive": best, "speedup": speedup, "ideal_ratio": ideal, "fraction_of_ideal": speedup / ideal,
            "tflops_naive": naive_flops / medians[best] / 1e12, "tflops_ours": tree_flops / medians["ours"] / 1e12,
            "peak_bytes": peaks, "out_of_memory": out_of_memory, "ours_peak_above_weights_bytes": ours_peak,
            "planner_predicted_bytes": predicted, "measured_over_predicted": ours_peak / max(predicted, 1.0),
            "min_fraction": self.min_fraction,
        }
        # the planner may be generous, never short by much; timing decides only on a GPU
        timing_ok = not self.cuda or (speedup > 1.0 and speedup / ideal >= self.min_fraction)
        result["passed"] = timing_ok and (not self.cuda or result["measured_over_predicted"] <= 1.25)
        return result

    def streaming(self) -> dict:
        import megatron_branch as mb
        from megatron_branch.attention.varlen import VARLEN_KERNELS

        s = self.s
        batch, tree, model = self._long_tree_setup()
        loss_fn = self._loss(batch)
        chunk = max(s["chunk"], s["answer"])
        one = lambda: mb.replay_step(model, tree, loss_fn)  # noqa: E731
        streamed = lambda: mb.replay_step(model, tree, loss_fn, max_chunk_tokens=chunk)  # noqa: E731
        model.zero_grad(set_to_none=True)
        one()
        g_one = grads_of(model)
        model.zero_grad(set_to_none=True)
        stats = streamed()
        g_stream = grads_of(model)
        times = {"one_pass": [], "streaming": []}
        for _ in range(s["repeats"]):
            for name, fn in (("one_pass", one), ("streaming", streamed)):
                model.zero_grad(set_to_none=True)
                times[name].append(self._timed(fn))
        med = {n: statistics.median(t) for n, t in times.items()}
        result = {"cached_prompt_tokens": s["prompt"], "chunk_tokens": chunk, "stems": stats.num_stems,
                  "chunks": stats.num_chunks, "seconds_median": med,
                  "fraction_of_one_pass": med["one_pass"] / med["streaming"],
                  "grad_rel_diff_vs_one_pass": rel_grads(g_stream, g_one),
                  "kernel_is_varlen": kernel_of(model) in VARLEN_KERNELS or not self.cuda}
        # the same gradients up to bf16 summation order; a unit costs a pass, not more
        result["passed"] = (stats.num_stems >= 1 and result["grad_rel_diff_vs_one_pass"] < 5e-2
                            and result["kernel_is_varlen"]
                            and (not self.cuda or result["fraction_of_one_pass"] > 0.5))
        return result

    def host_syncs(self) -> dict:
        import megatron_branch as mb

        if not self.cuda:
            raise Skip("torch.cuda.set_sync_debug_mode needs CUDA (tests/test_varlen.py counts them on the CPU)")
        batch = self._batch(self.s["exact_prompt"], 8, 64, 1024)
        tree = mb.BranchTree.from_sequences(batch.sequences)
        counts = {}
        for layers in (2, 4):
            model, _ = self._models(False, torch.bfloat16, layers=layers)
            loss_fn = self._loss(batch)
            mb.replay_step(model, tree, loss_fn)  # warm
            self._sync()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    mb.replay_step(model, tree, loss_fn)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            counts[layers] = sum("synchroniz" in str(w.message) for w in seen)
        return {"syncs_per_step_by_layers": counts, "passed": counts[2] == counts[4]}

    # ------------------------------------------------------------------------- memory
    def _peak(self, fn) -> int:
        if not self.cuda:
            fn()
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    def _resident(self, model) -> int:
        if not self.cuda:
            return 0
        return sum(p.numel() * p.element_size() * 2 for p in model.parameters())  # weights and gradients

    def sections(self, quick: bool) -> List[Tuple[str, Callable[[], dict], float]]:
        scale = 1 if quick else 2
        named = [("contract", self.contract), ("parity_bf16", self.parity_bf16),
                 ("exactness_local", lambda: self.exactness(False)), ("exactness_te", lambda: self.exactness(True)),
                 ("fp8", self.fp8), ("long_tree", self.long_tree), ("streaming", self.streaming),
                 ("host_syncs", self.host_syncs)]
        return [(name, fn, scale * TIMEOUTS[name] if self.cuda else 0) for name, fn in named]


# ------------------------------------------------------------------------------- helpers
def _err(a, b) -> float:
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item() if a.numel() else 0.0


def _rel(a, b) -> float:
    """Largest error relative to the reference's largest entry."""
    return _err(a, b) / max(b.detach().double().abs().max().item(), 1e-30) if a.numel() else 0.0


@contextlib.contextmanager
def no_tf32():
    """Float32 matmuls in full precision (the float32 references)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def load_same_weights(model, state) -> None:
    """``load_state_dict`` that must match every parameter; only Transformer Engine's
    ``_extra_state`` (FP8 metadata, absent from a local-spec state) may be missing or extra."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad = [k for k in (*missing, *unexpected) if not k.endswith("_extra_state")]
    if bad:
        raise AssertionError(f"weights do not match: {bad[:5]}")


def grads_of(model) -> Dict[str, torch.Tensor]:
    return {n.replace("module.", "", 1): p.grad.float().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def rel_grads(a, b) -> float:
    missing = set(b) - set(a)
    if missing:
        raise AssertionError(f"gradients missing for {sorted(missing)[:3]}")
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp(min=1e-30)).item() for n in b)


def unwrap(model):
    from megatron_branch.model import unwrap as unwrap_model

    return unwrap_model(model)


def kernel_of(model) -> str:
    """The tree attention kernel the model's first branch core attention runs on its device
    and dtype (its own choice, or the default)."""
    from megatron_branch.attention.kernels import default_kernel
    from megatron_branch.spec.core_attention import BranchCoreAttention

    core = next(m for m in model.modules() if isinstance(m, BranchCoreAttention))
    param = next(model.parameters())
    dtype = torch.bfloat16 if getattr(core.config, "bf16", False) else param.dtype
    return core.kernel or default_kernel(param.device, dtype)


# --------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "gpu_check.json"), help="the JSON report")
    p.add_argument("--quick", action="store_true", help="smaller trees; fits in 8 minutes on one H100")
    p.add_argument("--dry-run", action="store_true",
                   help="every section on the CPU at toy sizes (checks the script, not the GPU)")
    p.add_argument("--only", nargs="+", default=None, metavar="SECTION", help="run only these sections")
    p.add_argument("--min-fraction", type=float, default=0.5,
                   help="long_tree passes at this fraction of the ideal position ratio")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: error: needs a CUDA GPU (torch.cuda.is_available() is False); the CPU suite is "
              "`python -m pytest -q tests` (--dry-run runs this script's sections on the CPU)", file=sys.stderr)
        return 2
    import megatron_branch as mb
    from megatron_branch._deps import HAVE_TE
    from megatron_branch.distributed import init_distributed

    if args.dry_run:
        mb.enable_cpu()
    init_distributed()
    sizes = SIZES["dry" if args.dry_run else "quick" if args.quick else "full"]
    check = Check("cpu" if args.dry_run else "cuda", sizes, args.min_fraction)
    sections = check.sections(args.quick)
    if args.only:
        unknown = sorted(set(args.only) - {name for name, *_ in sections})
        if unknown:
            print(f"gpu_check: error: --only: no section {unknown}", file=sys.stderr)
            return 2
        sections = [s for s in sections if s[0] in args.only]
    device = torch.cuda.get_device_name() if check.cuda else "cpu (dry run)"
    report = {"device": device, "torch": torch.__version__, "have_te": HAVE_TE, "quick": args.quick,
              "dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d"), **run_sections(sections)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    verdict = "all checks passed" if report["status"] == PASSED else "NOT PASSED: " + ", ".join(report["not_passed"])
    print(f"wrote {args.out}; {verdict}")
    return 0 if report["status"] == PASSED else 1


if __name__ == "__main__":
    raise SystemExit(main())
