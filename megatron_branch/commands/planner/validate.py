"""Check the planner's memory model against measured peaks of real CPU runs.

Small Llama-style models (fp32, Megatron's local layers, this package's replay) run one
replay step with :class:`megatron_branch.peak_memory.PeakMemory`; gradients are allocated
beforehand, so the peak is what :func:`megatron_branch.commands.planner.memory.replay_peak_bytes`
models (with 4-byte activations). These single-process cases are the ones the constants
were fitted on; ``megatron-branch bench-scale`` checks context-parallel runs they were not.
"""

from __future__ import annotations

from typing import Dict, List

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch.commands.planner.memory import replay_peak_bytes
from megatron_branch.commands.planner.presets import ModelSpec
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.distributed import init_distributed
from megatron_branch.spec.builders import build_gpt, llama_config

CASES = [
    # (layers, hidden, heads, kv heads, ffn, vocab, prompt, rollouts, response, chunk)
    (2, 64, 4, 2, 192, 128, 512, 16, 64, None),
    (4, 128, 8, 2, 256, 512, 512, 8, 64, None),
    (2, 128, 4, 2, 384, 256, 2048, 16, 64, 512),
    (2, 128, 4, 2, 384, 256, 2048, 16, 64, 1024),
    # the logits dominate (a wide vocabulary on a narrow model)
    (2, 64, 4, 2, 192, 8192, 512, 16, 64, None),
    (2, 64, 4, 2, 192, 8192, 256, 16, 64, 128),
]


def validate_on_cpu(cases=CASES) -> List[Dict]:
    import torch

    mb.enable_cpu()
    init_distributed()
    rows = []
    for layers, h, heads, kv, ffn, vocab, prompt, g, resp, chunk in cases:
        config = llama_config(num_layers=layers, hidden_size=h, num_attention_heads=heads,
                              num_query_groups=kv, ffn_hidden_size=ffn)
        model = build_gpt(config, vocab, seed=0)
        batch = branching_rollouts([prompt], [g], [resp], vocab, seed=0)
        tree = mb.BranchTree.from_sequences(batch.sequences)
        mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
        adv = torch.linspace(-1, 1, g)
        tokens = mask.sum()

        def loss_fn(lp, ids):
            return losses.ppo_policy_loss(lp, lp.detach(), adv[ids], mask[ids], global_tokens=tokens)[0]

        mb.replay_step(model, tree, loss_fn, max_chunk_tokens=chunk)
        model.zero_grad(set_to_none=False)
        stats = mb.replay_step(model, tree, loss_fn, max_chunk_tokens=chunk, recompute_stem=chunk is not None,
                               measure_memory=True)
        spec = ModelSpec("cpu", layers, h, heads, kv, ffn, vocab)
        predicted = replay_peak_bytes(spec, tree, chunk_tokens=chunk, act_bytes=4)[0]
        rows.append({"case": f"{layers}L h{h} kv{kv} ffn{ffn} V{vocab}; {prompt}+{g}x{resp}; "
                             f"{'one pass' if chunk is None else f'chunk {chunk}'}",
                     "measured_bytes": stats.peak_memory_bytes, "predicted_bytes": predicted,
                     "error": predicted / stats.peak_memory_bytes - 1.0})
    return rows


def format_validation(rows: List[Dict]) -> str:
    lines = ["memory model vs measured peak of CPU replay steps (fp32; what the replay allocates):"]
    for r in rows:
        lines.append(f"  {r['case']:<52s} measured {r['measured_bytes'] / 2**20:7.1f} MiB  "
                     f"model {r['predicted_bytes'] / 2**20:7.1f} MiB  ({100 * r['error']:+.0f}%)")
    return "\n".join(lines)
