"""The real peer: the ``prefix_grouper`` package (what verl's ``use_prefix_grouper`` runs).

Same weights on both sides: a tiny Hugging Face ``LlamaForCausalLM`` is saved as a
safetensors checkpoint and loaded into the Megatron GPTModel (branch spec) by our
converter (:func:`megatron_branch.hf.load_gpt_from_hf`). Same rollouts (prompt-only
sharing: one prompt, G responses). Compared, forward+backward of one per-token loss:

* ``hf_naive_mb{k}``: every rollout through HF transformers (``attn_implementation="sdpa"``),
  ``k`` rollouts per right-padded micro-batch (1, 2, 4, all; gradient accumulation);
  the fastest is the reference;
* ``prefix_grouper``: the package itself, through its transformers integration
  (``register_attention()``, ``attn_implementation="prefix_grouper_attention"``, the model
  called with ``prefix_grouper=...`` and the position ids its README prescribes: every
  response restarts after its prompt). Its default inner attention is
  ``flash_attention_2`` (CUDA only); on CPU we register ``mb_sdpa_varlen``, the same
  masking semantics with torch SDPA: the 2-D padding mask selects the valid keys, the
  queries are the last ``q_len`` columns of it, causal aligned bottom-right over the
  valid tokens (what flash-attn's unpad + ``causal=True`` does);
* ``megatron_naive_mb{k}``: the same rollouts through the Megatron model (fused causal
  SDPA, the bench's naive): with HF naive, the frameworks' per-position costs;
* ``ours``: branch replay on the Megatron model (tree building included).

Reported per shape: ours' speed against prefix_grouper's (``ours_over_peer``), the
framework cost (fastest Megatron naive / fastest HF naive) and the method ratio (ours'
speed-up over Megatron naive / prefix_grouper's over HF naive), each paired per repeat.

Exactness: response-token log-probs (max abs difference) and gradients (max relative
difference per tensor, Megatron's converted to HF names) vs the HF naive run.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from typing import Dict, List

import torch
import torch.nn.functional as F

from megatron_branch.commands.bench.methods import causal_logprobs
from megatron_branch.commands.bench.stats import spread
from megatron_branch.hf.mapping import megatron_to_hf
from megatron_branch.hf.model import load_gpt_from_hf, model_state
from megatron_branch.replay import replay_step
from megatron_branch.scoring.logprobs import rollout_logprobs
from megatron_branch.tree import BranchTree

ATTN_NAME = "mb_sdpa_varlen"


def available() -> bool:
    try:
        import prefix_grouper  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def sdpa_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """CPU stand-in for flash-attn's padded path: ``query [b, h, sq, d]``, ``key/value
    [b, hk, sk, d]``, ``attention_mask [b, sk]`` (True = valid token). Query row ``i`` is
    token ``attention_mask[:, -sq:]``'s ``i``; valid query ``n`` (0-based among the valid
    queries) sees valid keys ``m <= n + (#valid keys - #valid queries)``. Padded queries
    give zeros. Returns ``([b, sq, h, d], None)`` as transformers' attention functions do."""
    b, h, sq, d = query.shape
    sk = key.shape[2]
    if attention_mask is None:
        attention_mask = torch.ones(b, sk, dtype=torch.bool, device=query.device)
    kv_ok = attention_mask.bool()
    if sq == sk and bool(kv_ok.all()):
        # nothing padded: plain causal attention, torch's fused is_causal kernel (as flash-attn's would be)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                             enable_gqa=key.shape[1] != h)
        return out.transpose(1, 2).contiguous(), None
    q_ok = kv_ok[:, -sq:]
    k_rank = kv_ok.long().cumsum(1) - 1
    q_rank = q_ok.long().cumsum(1) - 1
    shift = (kv_ok.sum(1) - q_ok.sum(1))[:, None, None]
    allowed = kv_ok[:, None, :] & q_ok[:, :, None] & (k_rank[:, None, :] <= q_rank[:, :, None] + shift)
    empty = ~allowed.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=(allowed | empty)[:, None], scale=scaling,
                                         enable_gqa=key.shape[1] != h)
    out = out.masked_fill(empty[:, None], 0.0)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface

    register_attention()
    AttentionInterface.register(ATTN_NAME, sdpa_varlen_attention)


def _hf_models(cfg, tmp: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=3 * cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=False, attention_bias=False, mlp_bias=False, torch_dtype="float32")
    torch.manual_seed(cfg.seed)
    naive = LlamaForCausalLM._from_config(copy.deepcopy(hf_cfg), attn_implementation="sdpa").float()
    naive.save_pretrained(tmp, safe_serialization=True)
    # its own config object: the attention implementation is a config attribute
    pg = LlamaForCausalLM._from_config(copy.deepcopy(hf_cfg), attn_implementation="prefix_grouper_attention").float()
    pg.load_state_dict(naive.state_dict())
    return naive, pg, hf_cfg.to_dict()


def _adv(num: int) -> torch.Tensor:
    return torch.rand(num, generator=torch.Generator().manual_seed(1)) - 0.5


def _hf_naive_logprobs(model, seqs: List[torch.Tensor], prompts: List[int]) -> List[torch.Tensor]:
    """Response-token log-probs of every rollout of one right-padded micro-batch."""
    lens = [s.numel() for s in seqs]
    width = max(lens)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : lens[i]] = s
        mask[i, : lens[i]] = 1
    logits = model(input_ids=ids, attention_mask=None if all(n == width for n in lens) else mask).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return [lp[i, prompts[i] - 1: lens[i] - 1] for i in range(len(seqs))]


def _pg_logprobs(model, seqs, prompts, groups) -> List[torch.Tensor]:
    from prefix_grouper import PrefixGrouper

    order = sorted(set(groups), key=groups.index)
    members = {g: [i for i, x in enumerate(groups) if x == g] for g in order}
    p_lens = [prompts[members[g][0]] for g in order]
    s_lens = [seqs[i].numel() - prompts[i] for i in range(len(seqs))]
    prefix = torch.zeros(len(order), max(p_lens), dtype=torch.long)
    prefix_mask = torch.zeros_like(prefix, dtype=torch.bool)
    for j, g in enumerate(order):
        prefix[j, : p_lens[j]] = seqs[members[g][0]][: p_lens[j]]
        prefix_mask[j, : p_lens[j]] = True
    suffix = torch.zeros(len(seqs), max(s_lens), dtype=torch.long)
    suffix_mask = torch.zeros_like(suffix, dtype=torch.bool)
    for i in range(len(seqs)):
        suffix[i, : s_lens[i]] = seqs[i][prompts[i]:]
        suffix_mask[i, : s_lens[i]] = True
    pg = PrefixGrouper.from_ungrouped_masks(prefix_mask, suffix_mask, [len(members[g]) for g in order],
                                            padding_mode="right")
    input_ids = pg.concat_input(prefix, prefix_mask, suffix, suffix_mask)
    # README: every response's positions restart after its prompt
    pos = torch.zeros_like(input_ids)
    for j, g in enumerate(order):
        row = list(range(p_lens[j]))
        for i in members[g]:
            row += list(range(p_lens[j], p_lens[j] + s_lens[i]))
        pos[j, : len(row)] = torch.tensor(row)
    logits = model(input_ids=input_ids, attention_mask=pg.padding_mask.long(), position_ids=pos,
                   prefix_grouper=pg, prefix_grouper_attn_func=ATTN_NAME).logits
    _, _, suf_out, suf_mask = pg.split_output(logits, include_prefix_last=1)
    targets = pg.convert_padding(suffix, suffix_mask, padding_mode="right")
    lp = torch.log_softmax(suf_out[:, :-1].float(), -1).gather(-1, targets[..., None])[..., 0]
    valid = suf_mask[:, 1:]
    return [lp[i][valid[i]] for i in range(len(seqs))]


def _loss(lps: List[torch.Tensor], ids: List[int], adv: torch.Tensor, tokens: int) -> torch.Tensor:
    return -sum((adv[i] * lp).sum() for i, lp in zip(ids, lps)) / tokens


def _grad_state(model) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, r in ref.items():
        if name not in a:
            return float("inf")
        worst = max(worst, float((a[name] - r).norm() / r.norm().clamp_min(1e-30)))
    return worst


def run_peer(cfg, echo=print) -> dict:
    """Time and exactness of HF naive, prefix_grouper and ours on ``cfg.peer_shapes``."""
    if not available():
        return {"skipped": "prefix_grouper or transformers is not installed (pip install -e .[peer])"}
    _register()
    with tempfile.TemporaryDirectory() as tmp:
        hf_naive, hf_pg, hf_cfg = _hf_models(cfg, tmp)
        ours_model, _ = load_gpt_from_hf(tmp)
    out = {"model": {k: hf_cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "num_key_value_heads", "intermediate_size", "vocab_size")},
           "inner_attention": f"{ATTN_NAME}: torch SDPA with flash-attn's padded varlen causal semantics "
                              "(prefix_grouper's default flash_attention_2 needs CUDA)",
           "shapes": []}
    for shape in cfg.peer_shapes:
        batch = shape.batch(cfg.vocab_size, cfg.seed)
        seqs, prompts, groups = batch.sequences, batch.prompt_lengths, batch.group
        num = len(seqs)
        adv = _adv(num)
        tokens = sum(s.numel() - p for s, p in zip(seqs, prompts))
        width = max(batch.lengths) - 1
        resp = torch.zeros(num, width, dtype=torch.bool)
        for i, (s, p) in enumerate(zip(seqs, prompts)):
            resp[i, p - 1: s.numel() - 1] = True

        def ours_loss(lp, ids):
            return -(adv[ids][:, None] * lp * resp[ids]).sum() / tokens

        def hf_step(k):
            def run():
                for lo in range(0, num, k):
                    ids = list(range(lo, min(lo + k, num)))
                    lps = _hf_naive_logprobs(hf_naive, [seqs[i] for i in ids], [prompts[i] for i in ids])
                    _loss(lps, ids, adv, tokens).backward()
            return run

        def megatron_step(k):  # the same rollouts through the Megatron model: the framework's own naive
            def run():
                for lo in range(0, num, k):
                    ids = torch.arange(lo, min(lo + k, num))
                    ours_loss(causal_logprobs(ours_model, seqs[lo: lo + k], width), ids).backward()
            return run

        def pg_step():
            _loss(_pg_logprobs(hf_pg, seqs, prompts, groups), list(range(num)), adv, tokens).backward()

        def ours_step():
            replay_step(ours_model, BranchTree.from_sequences(seqs, share_limit=prompts), ours_loss)

        sizes = sorted({min(k, num) for k in (1, 2, 4, num)})
        steps = {f"hf_naive_mb{k}": (hf_step(k), hf_naive) for k in sizes}
        steps.update({f"megatron_naive_mb{k}": (megatron_step(k), ours_model) for k in sizes})
        steps["prefix_grouper"] = (pg_step, hf_pg)
        steps["ours"] = (ours_step, ours_model)

        def zero():
            for m in (hf_naive, hf_pg, ours_model):
                m.zero_grad(set_to_none=True)

        # exactness (and warm-up)
        with torch.no_grad():
            ref_lp = torch.cat(_hf_naive_logprobs(hf_naive, seqs, prompts))
            pg_lp = torch.cat(_pg_logprobs(hf_pg, seqs, prompts, groups))
            ours_lp = rollout_logprobs(ours_model, BranchTree.from_sequences(seqs))[resp]
        lp_diff = {"prefix_grouper": float((pg_lp - ref_lp).abs().max()),
                   "ours": float((ours_lp - ref_lp).abs().max())}
        grad = {}
        for name, (step, model) in steps.items():
            zero()
            step()
            if model is ours_model:
                g = megatron_to_hf(model_state(model, "grad"), hf_cfg)
                g = {f"model.{k}" if not k.startswith(("model.", "lm_head")) else k: v for k, v in g.items()}
            else:
                g = _grad_state(model)
            grad[name] = g
        ref_name = f"hf_naive_mb{sizes[0]}"
        grad_diff = {n: _rel(g, grad[ref_name]) for n, g in grad.items()}
        times = {n: [] for n in steps}
        for _ in range(cfg.repeats):
            for name, (step, _m) in steps.items():
                zero()
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
        best = min((n for n in times if n.startswith("hf_naive")), key=lambda n: statistics.median(times[n]))
        positions_naive = sum(batch.lengths)
        unique = BranchTree.from_sequences(seqs, share_limit=prompts).unique_positions
        rows = []
        for name in steps:
            ratios = [a / b for a, b in zip(times[best], times[name])]
            rows.append({"method": name, "seconds": spread(times[name]), "speedup": spread(ratios),
                         "max_rel_grad_diff": grad_diff[name],
                         "max_abs_logprob_diff": lp_diff.get(name, 0.0 if name.startswith("hf_naive") else None)})
        meg = min((n for n in times if n.startswith("megatron_naive")), key=lambda n: statistics.median(times[n]))
        # paired per repeat: the framework's per-position cost (Megatron naive / HF naive) and the
        # method's (ours' speed-up over Megatron naive / prefix_grouper's over HF naive)
        framework = [m / h for m, h in zip(times[meg], times[best])]
        method = [(m / o) / (h / p) for m, o, h, p in zip(times[meg], times["ours"], times[best],
                                                          times["prefix_grouper"])]
        overall = [p / o for p, o in zip(times["prefix_grouper"], times["ours"])]
        out["shapes"].append({"shape": shape.name, "rollouts": num, "naive_positions": positions_naive,
                              "unique_positions": unique, "position_ratio": positions_naive / unique,
                              "hf_naive_reference": best, "megatron_naive_reference": meg, "methods": rows,
                              "ours_over_peer": spread(overall), "framework_cost": spread(framework),
                              "method_ratio": spread(method)})
        echo(f"peer {shape.name}: done")
    return out


def format_peer(peer: dict) -> str:
    if "skipped" in peer:
        return f"\nprefix_grouper comparison skipped: {peer['skipped']}"
    lines = [f"\nthe real peer: prefix_grouper on a Hugging Face Llama ({peer['model']}), same weights as ours "
             f"(converter); inner attention {peer['inner_attention']}"]
    for s in peer["shapes"]:
        lines.append(f"\n{s['shape']}: {s['rollouts']} rollouts, position ratio {s['position_ratio']:.2f}x; "
                     f"reference: {s['hf_naive_reference']}")
        lines.append(f"{'method':<16s}{'seconds [min-max]':>26s}{'speed-up [min-max]':>24s}{'lp diff':>10s}"
                     f"{'grad diff':>11s}")
        for r in s["methods"]:
            sec, sp = r["seconds"], r["speedup"]
            lp = r["max_abs_logprob_diff"]
            lines.append(f"{r['method']:<16s}"
                         f"{'%.3f [%.3f-%.3f]' % (sec['median'], sec['min'], sec['max']):>26s}"
                         f"{'%.2f [%.2f-%.2f]' % (sp['median'], sp['min'], sp['max']):>24s}"
                         f"{('%.1e' % lp) if lp is not None else '-':>10s}{r['max_rel_grad_diff']:>11.1e}")
        if "ours_over_peer" in s:
            o, f, m = s["ours_over_peer"], s["framework_cost"], s["method_ratio"]
            lines.append(f"ours vs prefix_grouper: {o['median']:.2f}x its speed [{o['min']:.2f}-{o['max']:.2f}]; "
                         f"framework per-position cost (Megatron naive / HF naive) {f['median']:.2f}x; "
                         f"method alone (each speed-up over its own framework's naive) {m['median']:.2f}x "
                         f"[{m['min']:.2f}-{m['max']:.2f}]")
    return "\n".join(lines)
