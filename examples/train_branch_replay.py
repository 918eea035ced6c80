"""Branch-replay GRPO training of a tiny Llama-style model on any TP x CP x PP layout.

    torchrun --nproc_per_node 4 examples/train_branch_replay.py --tp 2 --cp 2 --steps 3
    torchrun --nproc_per_node 2 examples/train_branch_replay.py --pp 2 --dump-grads grads.safetensors

Random branching rollouts (from ``--seed``), a GRPO loss normalised by global token
counts, plain ``torch.optim.AdamW``. Weights are drawn per parameter *name* from the
seed, so every layout starts from the same model; ``--dump-grads`` writes the first
step's full, unsharded gradients under stock Megatron names, identical in layout
whatever TP/CP/PP was used, and ``--dump-logprobs`` the per-rollout log-probs. Runs on
CPU with gloo (CPU shims applied) and on GPU with NCCL.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

import megatron_branch as mb  # noqa: E402
from megatron_branch import losses  # noqa: E402
from megatron_branch._megatron import parallel_state  # noqa: E402
from megatron_branch.context_parallel import balance_report, shard_bounds  # noqa: E402
from megatron_branch.distributed import destroy_distributed, init_distributed  # noqa: E402
from megatron_branch.models import build_gpt, llama_config  # noqa: E402
from megatron_branch.parallel import finalize_grads, full_state, load_full_state  # noqa: E402
from megatron_branch.synthetic import branching_rollouts  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (single-pass replay)")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (needs --tp > 1)")
    p.add_argument("--cp-comm", choices=["allgather", "p2p"], default="allgather", help="CP K/V exchange")
    p.add_argument("--chunk-tokens", type=int, default=None, help="streaming replay budget (None: one pass)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--prompts", type=int, nargs="+", default=[48, 32], help="prompt lengths (one tree each)")
    p.add_argument("--branching", type=int, nargs="+", default=[2, 4], help="fan-out per response level")
    p.add_argument("--segments", type=int, nargs="+", default=[8, 12], help="tokens per response level")
    p.add_argument("--dump-grads", metavar="PATH", help="first step's unsharded gradients (safetensors)")
    p.add_argument("--dump-logprobs", metavar="PATH", help="first step's per-rollout log-probs (safetensors)")
    return p.parse_args(argv)


def seeded_state(model, seed: int):
    """Weights drawn per parameter name, so every layout gets the same model."""
    state = {}
    for name, t in full_state(model, "param").items():
        digest = int(hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()[:8], 16)
        gen = torch.Generator().manual_seed(digest)
        state[name] = torch.ones_like(t) if "norm" in name else torch.randn(t.shape, generator=gen) * 0.02
    return state


def save_tensors(path: str, tensors) -> None:
    from safetensors.torch import save_file

    tmp = f"{path}.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
    os.replace(tmp, path)


def pipeline_logprobs(model, tree):
    """Per-rollout log-probs from a forward-only schedule, on every rank."""
    from megatron_branch.pipeline import forward_backward

    box = {}

    def keep(lp, ids):
        box["lp"] = lp.detach()
        return lp.new_zeros(())

    forward_backward(model, [tree], keep, forward_only=True)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, box.get("lp"))
    return next(x for x in found if x is not None)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        mb.enable_cpu()
    init_distributed(args.tp, args.pp, args.cp)
    rank = dist.get_rank()
    config = llama_config(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4, num_query_groups=2,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        context_parallel_size=args.cp, sequence_parallel=args.sequence_parallel,
        pipeline_dtype=torch.float32,
    )
    model = build_gpt(config, args.vocab, pre_process=parallel_state.is_pipeline_first_stage(),
                      post_process=parallel_state.is_pipeline_last_stage())
    if torch.cuda.is_available():
        model.cuda()
    load_full_state(model, seeded_state(model, args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    batch = branching_rollouts(args.prompts, args.branching, args.segments, args.vocab, seed=args.seed)
    tree = mb.BranchTree.from_sequences(batch.sequences, vocab_size=args.vocab)
    group = len(batch.sequences) // len(args.prompts)
    rewards = torch.rand(len(batch.sequences), generator=torch.Generator().manual_seed(args.seed))
    adv = losses.grpo_advantages(rewards, group)
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    tokens = mask.sum()
    if rank == 0:
        print(f"layout tp={args.tp} cp={args.cp} pp={args.pp}; {tree}")
        if args.cp > 1:
            print(balance_report(tree.positions, shard_bounds(tree.positions, args.cp)))

    for step in range(args.steps):
        old = mb.replay_logprobs(model, tree) if args.pp == 1 else pipeline_logprobs(model, tree)

        def loss_fn(lp, ids):
            return losses.ppo_policy_loss(lp, old[ids].to(lp.device), adv[ids].to(lp.device),
                                          mask[ids].to(lp.device), global_tokens=tokens)[0]

        optimizer.zero_grad(set_to_none=True)
        if args.pp == 1:
            loss = mb.replay_step(model, tree, loss_fn, max_chunk_tokens=args.chunk_tokens,
                                  cp_comm_type=args.cp_comm).loss
        else:
            from megatron_branch.pipeline import forward_backward

            out = forward_backward(model, [tree], loss_fn)
            loss = float(out[0]["loss"]) if out else float("nan")
        finalize_grads(model)
        if step == 0 and args.dump_grads:
            grads = full_state(model, "grad")
            if rank == 0:
                save_tensors(args.dump_grads, grads)
        if step == 0 and args.dump_logprobs and rank == 0:
            save_tensors(args.dump_logprobs, {"logprobs": old.float().cpu()})
        optimizer.step()
        reporter = (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
                    and parallel_state.get_context_parallel_rank() == 0)
        if reporter:
            print(f"step {step}: loss {loss:+.6e}")
    destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
