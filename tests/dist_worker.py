"""Worker side of the multi-process tests: gloo processes on CPU, one per rank.

Each worker builds the tiny model for its TP/CP/PP layout, loads the reference weights,
runs the requested cases and saves, per rank, the unsharded gradients (stock names) and
the per-rollout log-probs. Tensors only (``torch.save`` of dicts of tensors).
"""

import os
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=192)
VOCAB = 128


def trees():
    from megatron_branch import BranchTree
    from megatron_branch.synthetic import branching_rollouts

    multi = branching_rollouts([24], [2, 2, 3], [6, 5, 7], VOCAB, seed=2, jitter=3)
    forest = branching_rollouts([30, 17, 45], [3], [9], VOCAB, seed=3, jitter=5)
    tiny = branching_rollouts([5], [2], [3], VOCAB, seed=1)  # 2 rollouts, 11 packed tokens
    return {name: (b, BranchTree.from_sequences(b.sequences)) for name, b in
            (("multi_level", multi), ("forest", forest), ("tiny", tiny))}


def make_loss(batch):
    from megatron_branch import losses

    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    adv = torch.linspace(-1.0, 1.0, len(batch.sequences))
    old = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(3))
    tokens = mask.sum()

    def loss_fn(lp, ids):
        return losses.ppo_policy_loss(lp, old[ids], adv[ids], mask[ids], global_tokens=tokens)[0]

    return loss_fn


def build(tp=1, pp=1, sp=False, **overrides):
    from megatron_branch._megatron import parallel_state
    from megatron_branch.models import build_gpt, llama_config

    config = llama_config(**MODEL, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          context_parallel_size=parallel_state.get_context_parallel_world_size(),
                          sequence_parallel=sp, pipeline_dtype=torch.float32,
                          calculate_per_token_loss=True, **overrides)
    return build_gpt(config, VOCAB, seed=0,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())


def run_case(model, batch, tree, chunk, comm, pp):
    """One replay step on a Megatron-DDP-wrapped model, reduced by ``finalize_model_grads``
    (the loss is normalised by global counts, so DDP sums: ``calculate_per_token_loss``)."""
    from megatron_branch import replay_step, rollout_logprobs
    from megatron_branch._megatron import finalize_model_grads
    from megatron_branch.cpu import cuda_factories_on_cpu
    from megatron_branch.parallel import full_state

    loss_fn = make_loss(batch)
    model.zero_grad_buffer()
    lp = None
    if pp > 1:
        from megatron_branch.pipeline import forward_backward

        forward_backward(model, [tree], lambda lp, ids: (loss_fn(lp, ids), torch.ones(())), cp_comm_type=comm)
    else:
        replay_step(model, tree, loss_fn, max_chunk_tokens=chunk, cp_comm_type=comm)
        with torch.no_grad():
            lp = rollout_logprobs(model, tree, cp_comm_type=comm)
    with cuda_factories_on_cpu():
        finalize_model_grads([model])
    out = {"grads": full_state(model, "grad")}
    if lp is not None:
        out["lp"] = lp
    return out


def worker(rank, world, port, layout, cases, weights, out_dir):
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import megatron_branch as mb
    from megatron_branch._megatron import parallel_state
    from megatron_branch.parallel import load_full_state

    mb.enable_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"],
            context_parallel_size=layout["cp"])
        from megatron_branch.training import wrap_ddp

        model = build(layout["tp"], layout["pp"], layout.get("sp", False))
        load_full_state(model, torch.load(weights))
        model = wrap_ddp(model)
        data = trees()
        results = {}
        for name, chunk, comm in cases:
            batch, tree = data[name]
            results[f"{name}/{chunk}/{comm}"] = run_case(model, batch, tree, chunk, comm, layout["pp"])
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def spawn(layout, cases, weights, out_dir, port):
    world = layout["tp"] * layout["cp"] * layout["pp"]
    mp.spawn(worker, args=(world, port, layout, cases, weights, out_dir), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def hf_worker(rank, world, port, ckpt, sequences, out_dir):
    """Load a converted checkpoint at TP=world and save the per-rollout log-probs."""
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import megatron_branch as mb
    from megatron_branch._megatron import parallel_state
    from megatron_branch.hf.convert import load_megatron

    mb.enable_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        model, _ = load_megatron(ckpt)
        with torch.no_grad():
            lp = mb.rollout_logprobs(model, mb.BranchTree.from_sequences(sequences))
        torch.save({"lp": lp}, os.path.join(out_dir, f"hf{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
