"""Branch-replay GRPO training of a tiny Llama-style model on Megatron's machinery.

    torchrun --nproc_per_node 4 examples/train_branch_replay.py --tp 2 --cp 2 --steps 3
    torchrun --nproc_per_node 4 examples/train_branch_replay.py --distributed-optimizer \\
        --prompts 48 32 40 24 --overlap-grad-reduce --micro-batch-tokens 200
    python examples/train_branch_replay.py --naive --prompts 48 32 40 24 --dump-params naive.safetensors

The data-parallel size is ``world / (tp * cp * pp)``. Random branching rollouts (one tree
per ``--prompts`` entry, from ``--seed``) form the global batch; whole trees are balanced
over the DP ranks by work and packed into micro-batches of at most
``--micro-batch-tokens`` unique tokens (a group is never cut). Each step computes the
behaviour policy's log-probs (forward only), then one PPO/GRPO update with a loss summed
over tokens; Megatron normalises by the global token count
(``calculate_per_token_loss``). ``--optimizer megatron`` (default) wraps the model in
Megatron's DDP and steps ``get_megatron_optimizer``'s Adam; ``--optimizer torch`` keeps
Megatron's DDP for the gradient reduction and steps ``torch.optim.AdamW`` (fp32 only).

``--naive`` trains the truth: the stock ``get_gpt_layer_local_spec`` model, every rollout
its own sequence, the same micro-batches, DDP, optimizer and loss normalisation.
Weights are drawn per parameter *name* from the seed, so every layout starts from the
same model; ``--dump-params`` writes the unsharded parameters after the last step
(``--steps 0``: the initial ones), ``--dump-grads`` the first step's reduced gradients and
``--dump-logprobs`` its behaviour log-probs (the first step this run executes, after a
``--load``), all under stock Megatron names and identical in layout whatever TP/CP/PP/DP
was used. Runs on CPU with gloo (CPU shims applied) and on GPU with NCCL.

Checkpoints (Megatron's ``dist_checkpointing``, :mod:`megatron_branch.training.checkpoint`):
``--save DIR --save-interval N`` saves model, optimizer (the distributed optimizer's shards
included), RNG and step every N steps and after the last one, atomically; ``--load DIR``
resumes from ``DIR/latest`` on any TP/PP/DP layout. ``--steps`` counts total steps, as
Megatron's ``--train-iters``: a checkpoint saved at step 2 with ``--steps 3`` runs one more.
``--check-finite`` stops at the first NaN/Inf (activation, log-prob, loss, gradient or
parameter) with the step, rollout and layer (:mod:`megatron_branch.training.finite_guard`).

Failures print one line (``rank N failed: ...``; ``--debug`` adds the traceback) and exit
nonzero: 2 for bad flags, missing/corrupt files and unwritable targets (checked before
the model is built), 1 otherwise. Collectives time out after ``$MEGATRON_BRANCH_TIMEOUT``
seconds (default 600). ``$MEGATRON_BRANCH_FAULT=RANK:STEP:KIND`` injects a fault for tests:
KIND ``raise`` (an exception at that step), ``hang`` (sleeps), ``kill-in-save`` (SIGKILL
while the checkpoint of that step is being written, before it is committed).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*is deprecated. Please use.*")  # torch.distributed names
warnings.filterwarnings("ignore", message=".*of a Tensor that is not a leaf Tensor is being accessed.*")

import megatron_branch as mb  # noqa: E402
from megatron_branch import losses  # noqa: E402
from megatron_branch._megatron import OptimizerConfig, parallel_state  # noqa: E402
from megatron_branch.attention.context_parallel import balance_report, shard_bounds  # noqa: E402
from megatron_branch.commands.synthetic import branching_rollouts  # noqa: E402
from megatron_branch.distributed import destroy_distributed, heartbeat, init_distributed, run_main  # noqa: E402
from megatron_branch.full_state import full_state, load_full_state  # noqa: E402
from megatron_branch.reference.naive import make_naive_forward_step  # noqa: E402
from megatron_branch.scoring.unit import linear_weight  # noqa: E402
from megatron_branch.spec.builders import build_gpt, llama_config  # noqa: E402
from megatron_branch.training import (  # noqa: E402
    check_load_dir,
    check_save_dir,
    forward_backward_step,
    get_optimizer,
    load_checkpoint,
    optimizer_step,
    plan_data_parallel,
    save_checkpoint,
    wrap_ddp,
)
from megatron_branch.training.finite_guard import FiniteGuard  # noqa: E402
from megatron_branch.training.schedule import forward_backward  # noqa: E402


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv=None):
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("layout (data-parallel size = world / (tp * cp * pp))")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--cp", type=int, default=1, help="context-parallel size")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (one pass per micro-batch)")
    g.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (needs --tp > 1)")
    g.add_argument("--cp-comm", choices=["allgather", "p2p"], default="allgather", help="CP K/V exchange")
    g = p.add_argument_group("replay")
    g.add_argument("--chunk-tokens", type=int, default=None,
                   help="streaming replay budget per forward (default: one pass per micro-batch)")
    g.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="most unique tokens per micro-batch (default: one micro-batch per DP rank)")
    g.add_argument("--naive", action="store_true",
                   help="train the truth: stock local spec, every rollout its own sequence (pp = cp = 1)")
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=["megatron", "torch"], default="megatron",
                   help="megatron: get_megatron_optimizer's Adam; torch: torch.optim.AdamW on main_grad")
    g.add_argument("--distributed-optimizer", action="store_true", help="shard optimizer state over DP")
    g.add_argument("--overlap-grad-reduce", action="store_true", help="reduce DDP buckets during the backward")
    g.add_argument("--bucket-size", type=int, default=None, help="DDP bucket size (parameters)")
    g.add_argument("--bf16", action="store_true", help="bf16 model (Float16Module), fp32 main params and grads")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    g.add_argument("--steps", type=int, default=3, help="optimizer steps (0: only dump the initial weights)")
    g = p.add_argument_group("model and data")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--hidden", type=int, default=64)
    g.add_argument("--vocab", type=int, default=128)
    g.add_argument("--tie-embeddings", action="store_true", help="share input embeddings and output layer")
    g.add_argument("--prompts", type=int, nargs="+", default=[48, 32], help="prompt lengths (one group/tree each)")
    g.add_argument("--branching", type=int, nargs="+", default=[2, 4], help="fan-out per response level")
    g.add_argument("--segments", type=int, nargs="+", default=[8, 12], help="tokens per response level")
    g.add_argument("--jitter", type=int, default=0, help="up to this many extra tokens per leaf (ragged rollouts)")
    g = p.add_argument_group("layout-dependent baselines (what whole-tree DP and global counts avoid)")
    g.add_argument("--cut-groups", action="store_true",
                   help="deal single rollouts over DP ranks instead of whole groups (loses the sharing)")
    g.add_argument("--per-microbatch-mean", action="store_true",
                   help="normalise each micro-batch by its own token count (Megatron's default mean): "
                        "the update then depends on the layout")
    g = p.add_argument_group("outputs")
    g.add_argument("--dump-grads", metavar="PATH", help="first step's reduced, unsharded gradients (safetensors)")
    g.add_argument("--dump-logprobs", metavar="PATH", help="first step's per-rollout behaviour log-probs")
    g.add_argument("--dump-params", metavar="PATH", help="unsharded parameters after the last step")
    g = p.add_argument_group("checkpoints and reliability")
    g.add_argument("--save", metavar="DIR", help="save checkpoints here (Megatron dist_checkpointing, atomic)")
    g.add_argument("--save-interval", type=int, default=None, metavar="N",
                   help="save every N steps (and after the last step); needs --save")
    g.add_argument("--load", metavar="DIR", help="resume from DIR/latest (any TP/PP/DP layout)")
    g.add_argument("--check-finite", action="store_true",
                   help="stop at the first NaN/Inf with its step, rollout and layer (a few percent slower)")
    g.add_argument("--debug", action="store_true", help="print tracebacks of failures")
    args = p.parse_args(argv)
    if args.naive and (args.pp > 1 or args.cp > 1):
        p.error("--naive: runs with --pp 1 --cp 1 (the stock local spec has no tree CP)")
    if args.optimizer == "torch" and (args.bf16 or args.distributed_optimizer):
        p.error("--optimizer torch: fp32 without --distributed-optimizer (use --optimizer megatron)")
    if args.dump_grads and args.distributed_optimizer:
        p.error("--dump-grads: the distributed optimizer keeps only each rank's shard of the reduced gradient")
    if args.chunk_tokens is not None and args.pp > 1:
        p.error("--chunk-tokens: streaming replay runs with --pp 1")
    for name in ("tp", "cp", "pp"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be >= 1")
    for name in ("chunk_tokens", "micro_batch_tokens", "bucket_size", "save_interval"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    if args.steps < 0:
        p.error("--steps: must be >= 0")
    if args.save_interval is not None and not args.save:
        p.error("--save-interval: needs --save DIR")
    if (args.save or args.load) and args.optimizer != "megatron":
        p.error("--save/--load: checkpoints hold Megatron optimizer state; use --optimizer megatron")
    return args


def check_files(args) -> None:
    """Inputs and outputs, before anything heavy: one ValueError/OSError naming the flag."""
    if args.load:
        check_load_dir(args.load)
    if args.save:
        check_save_dir(args.save, resume_from=args.load)
    for flag in ("dump_grads", "dump_logprobs", "dump_params"):
        path = getattr(args, flag)
        if path is None:
            continue
        name = "--" + flag.replace("_", "-")
        if os.path.isdir(path):
            raise ValueError(f"{name} {path}: is a directory; give a file path")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"{name} {path}: directory {parent} does not exist; create it first")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(f"{name} {path}: directory {parent} is not writable")


def injected_fault():
    """``$MEGATRON_BRANCH_FAULT=RANK:STEP:KIND`` (tests): (rank, step, kind) or None."""
    text = os.environ.get("MEGATRON_BRANCH_FAULT")
    if not text:
        return None
    parts = text.split(":")
    kinds = ("raise", "hang", "kill-in-save")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in kinds:
        raise ValueError(f"MEGATRON_BRANCH_FAULT={text!r}: expected RANK:STEP:KIND with KIND one of {kinds}")
    return int(parts[0]), int(parts[1]), parts[2]


def model_fingerprint(args):
    """What a checkpoint must share with this run (checked on --load)."""
    return {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "heads": 4, "query_groups": 2,
            "tie_embeddings": args.tie_embeddings, "bf16": args.bf16}


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


def build(args):
    config = llama_config(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4, num_query_groups=2,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        context_parallel_size=args.cp, sequence_parallel=args.sequence_parallel,
        pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32, bf16=args.bf16,
        calculate_per_token_loss=True,
        # Trees differ in size and CP shards are work-balanced (uneven), so pipeline stages
        # exchange shapes; Megatron's config validation ties that to the alltoall dispatcher
        # even for dense models.
        **(dict(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall") if args.pp > 1 else {}),
    )
    model = build_gpt(config, args.vocab, branch=not args.naive,
                      share_embeddings_and_output_weights=args.tie_embeddings,
                      pre_process=parallel_state.is_pipeline_first_stage(),
                      post_process=parallel_state.is_pipeline_last_stage())
    if torch.cuda.is_available():
        model.cuda()
    load_full_state(model, seeded_state(model, args.seed))
    ddp = wrap_ddp(model, bf16=args.bf16, overlap_grad_reduce=args.overlap_grad_reduce,
                   use_distributed_optimizer=args.distributed_optimizer, bucket_size=args.bucket_size)
    if args.optimizer == "megatron":
        optimizer = get_optimizer(OptimizerConfig(
            optimizer="adam", lr=args.lr, adam_eps=args.adam_eps, weight_decay=0.0, clip_grad=0.0, bf16=args.bf16,
            use_distributed_optimizer=args.distributed_optimizer), [ddp])
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=0.0)
    return config, model, ddp, optimizer


def behaviour_logprobs(args, ddp, items, width, num_rollouts, sequences):
    """``[R, width]`` log-probs of this rank's rollouts under the current policy (zeros
    elsewhere), on the model's device (the collectives of ``global_logprobs`` need it there)."""
    device = next(ddp.parameters()).device
    out = torch.zeros(num_rollouts, width, device=device)

    def keep(lp, ids):
        out[ids.to(device)] = lp.detach().float()
        return lp.new_zeros(())

    if args.naive:
        forward_backward([ddp], items, keep, forward_only=True,
                         forward_step_func=make_naive_forward_step(keep, sequences, forward_only=True))
    elif args.pp == 1:
        for item in items:
            mask = None if item.score_mask is None else item.score_mask[:, : item.tree.max_len - 1]
            lp = mb.replay_logprobs(ddp, item.tree, max_chunk_tokens=args.chunk_tokens, score_mask=mask,
                                    cp_comm_type=args.cp_comm)
            out[item.rollouts.to(device)] = item.pad(lp).float()
    else:
        forward_backward([ddp], items, keep, forward_only=True, cp_comm_type=args.cp_comm)
    return out


def global_logprobs(local: torch.Tensor) -> torch.Tensor:
    """Every rollout's log-probs on every rank: each lives on one DP rank's last stage.
    ``local`` stays on the model's device (NCCL reduces CUDA tensors only)."""
    full = local.clone()
    for group in (parallel_state.get_data_parallel_group(), parallel_state.get_pipeline_model_parallel_group()):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(full, group=group)
    return full


def main(argv=None) -> int:
    args = parse_args(argv)
    check_files(args)
    fault = injected_fault()
    if not torch.cuda.is_available():
        mb.enable_cpu()
    init_distributed(args.tp, args.pp, args.cp)
    rank = dist.get_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    config, model, ddp, optimizer = build(args)
    fingerprint = model_fingerprint(args)
    start = 0
    if args.load:
        loaded = load_checkpoint(args.load, [ddp], optimizer, fingerprint=fingerprint)
        start = loaded.iteration
        if rank == 0:
            rng = "RNG restored" if loaded.rng_restored else \
                "RNG from the seed (saved on another layout: {})".format(loaded.layout)
            print(f"loaded {loaded.path} (step {start}; {rng})", flush=True)
            if start >= args.steps:
                print(f"checkpoint at step {start} >= --steps {args.steps}: nothing to train", flush=True)
    guard = FiniteGuard(ddp, enabled=args.check_finite)

    batch = branching_rollouts(args.prompts, args.branching, args.segments, args.vocab, seed=args.seed,
                               jitter=args.jitter)
    sequences = batch.sequences
    groups = list(range(len(sequences))) if args.cut_groups else batch.group
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    plan = plan_data_parallel(sequences, groups, dp_size, micro_batch_tokens=args.micro_batch_tokens,
                              streaming=args.chunk_tokens is not None, linear_weight=linear_weight(config),
                              score_mask=None if args.naive else mask)
    items = plan.ranks[dp_rank]
    width = max(len(s) for s in sequences) - 1
    group = len(sequences) // len(args.prompts)
    rewards = torch.rand(len(sequences), generator=torch.Generator().manual_seed(args.seed))
    adv = losses.grpo_advantages(rewards, group)
    if rank == 0:
        mode = "naive (stock spec, every rollout alone)" if args.naive else "branch replay"
        tree = mb.BranchTree.from_sequences(sequences)
        print(f"{mode}; layout tp={args.tp} cp={args.cp} pp={args.pp} dp={dp_size}; {tree}", flush=True)
        print(plan.report(), flush=True)
        if args.cp > 1:
            first = items[0].tree
            print("context-parallel shards of the first micro-batch:")
            print(balance_report(first.positions, shard_bounds(first.positions, args.cp, linear_weight(config))),
                  flush=True)

    def before_commit(tmp, step):
        if fault is not None and fault[2] == "kill-in-save" and fault[:2] == (rank, step):
            print(f"rank {rank}: injected fault: SIGKILL while saving step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    for step in range(start, args.steps):
        guard.step = step
        heartbeat(f"step {step}: start")
        if fault is not None and fault[:2] == (rank, step):
            if fault[2] == "raise":
                raise RuntimeError(f"injected fault at step {step} (MEGATRON_BRANCH_FAULT)")
            if fault[2] == "hang":
                print(f"rank {rank}: injected fault: hanging at step {step}", file=sys.stderr, flush=True)
                time.sleep(3600)
        old = behaviour_logprobs(args, ddp, items, width, len(sequences), sequences)
        guard.check_logprobs(old, what="behaviour log-prob")
        heartbeat(f"step {step}: forward/backward")

        def loss_fn(lp, ids):
            m = mask[ids].to(lp.device)
            loss = losses.ppo_policy_loss(lp, old[ids].to(lp.device), adv[ids].to(lp.device), m,
                                          global_tokens=1.0)[0]
            if args.per_microbatch_mean:
                return loss / m.sum().clamp(min=1.0), torch.ones(())
            return loss, m.sum()

        loss_fn = guard.wrap_loss(loss_fn)
        optimizer.zero_grad()  # torch: .grad back to None, or DDP's hook would add it to main_grad again
        loss_sum, tokens = forward_backward_step([ddp], items, loss_fn, max_chunk_tokens=args.chunk_tokens,
                                                 cp_comm_type=args.cp_comm, forward_step_func=(
                                                     make_naive_forward_step(loss_fn, sequences)
                                                     if args.naive else None))
        guard.check_grads()
        if step == start and args.dump_grads:
            grads = full_state(ddp, "grad")
            if rank == 0:
                save_tensors(args.dump_grads, grads)
        if step == start and args.dump_logprobs:
            lp_all = global_logprobs(old)
            if rank == 0:
                save_tensors(args.dump_logprobs, {"logprobs": lp_all.cpu()})
        heartbeat(f"step {step}: optimizer")
        if args.optimizer == "megatron":
            ok, grad_norm, _ = optimizer_step(optimizer)
        else:
            for p in model.parameters():
                p.grad = p.main_grad.to(p.dtype)
            optimizer.step()
            grad_norm = None
        guard.check_params()
        reporter = (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
                    and parallel_state.get_context_parallel_rank() == 0 and dp_rank == 0)
        if reporter:
            norm = f", grad norm {grad_norm:.6e}" if grad_norm is not None else ""
            print(f"step {step}: rank-0 loss sum {loss_sum:+.6e} over {tokens} tokens{norm}", flush=True)
        done = step + 1
        if args.save and (done == args.steps or (args.save_interval and done % args.save_interval == 0)):
            heartbeat(f"step {step}: save")
            path = save_checkpoint(args.save, done, [ddp], optimizer, data_state={"consumed_batches": done},
                                   fingerprint=fingerprint, before_commit=lambda tmp, s=done: before_commit(tmp, s))
            if rank == 0:
                print(f"saved {path}", flush=True)
    guard.close()
    if args.dump_params:
        params = full_state(ddp, "param")
        if rank == 0:
            save_tensors(args.dump_params, params)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, prog=os.path.basename(sys.argv[0])))
