"""Worker side of the multi-process tests: gloo processes on CPU, one per rank.

Each worker builds the tiny model for its TP/CP/PP layout, loads the reference weights,
runs the requested cases and saves, per rank, the unsharded gradients (stock names) and
the per-rollout log-probs. Tensors only (``torch.save`` of dicts of tensors).
"""

import contextlib
import os
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=192)
MLA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, rope_type="yarn", qk_layernorm=True)
GDN = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, linear_attention_freq=2)
VOCAB = 128


def trees():
    from megatron_branch import BranchTree
    from megatron_branch.commands.synthetic import branching_rollouts

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


def build(tp=1, pp=1, sp=False, mla=False, gdn=False, kernel=None, **overrides):
    """The test model for a layout; ``mla``: the multi-latent-attention model (YaRN RoPE);
    ``gdn``: the hybrid Gated DeltaNet model (GDN, attention, GDN, attention); ``kernel``:
    the tree attention kernel (default by device)."""
    from megatron_branch._megatron import parallel_state
    from megatron_branch.spec.builders import build_gpt, hybrid_config, llama_config, mla_config

    parallel = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    context_parallel_size=parallel_state.get_context_parallel_world_size(),
                    sequence_parallel=sp, pipeline_dtype=torch.float32, calculate_per_token_loss=True)
    if mla:
        config = mla_config(**MLA, **parallel, **overrides)
    elif gdn:
        config = hybrid_config(**GDN, **parallel, **overrides)
    else:
        config = llama_config(**MODEL, **parallel, **overrides)
    return build_gpt(config, VOCAB, seed=0, spec_kwargs={"kernel": kernel} if kernel else None,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())


def single_process_reference(weights: str, **build_kwargs):
    """Build the test model in this process, save its weights to ``weights`` and return
    every tree's one-pass results (the reference of the multi-process cases)."""
    from megatron_branch.full_state import full_state
    from megatron_branch.training import wrap_ddp

    model = build(**build_kwargs)
    torch.save(full_state(model, "param"), weights)
    model = wrap_ddp(model)
    return {name: run_case(model, batch, tree, None, "allgather", 1) for name, (batch, tree) in trees().items()}


def run_case(model, batch, tree, chunk, comm, pp):
    """One replay step on a Megatron-DDP-wrapped model, reduced by ``finalize_model_grads``
    (the loss is normalised by global counts, so DDP sums: ``calculate_per_token_loss``)."""
    from megatron_branch import replay_step, rollout_logprobs
    from megatron_branch._megatron import finalize_model_grads
    from megatron_branch.cpu import cuda_factories_on_cpu
    from megatron_branch.full_state import full_state

    loss_fn = make_loss(batch)
    model.zero_grad_buffer()
    lp = None
    if pp > 1:
        from megatron_branch.training.schedule import forward_backward

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
    from megatron_branch.full_state import load_full_state

    mb.enable_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"],
            context_parallel_size=layout["cp"])
        from megatron_branch.training import wrap_ddp

        model = build(layout["tp"], layout["pp"], layout.get("sp", False), layout.get("mla", False),
                      layout.get("gdn", False), layout.get("kernel"))
        load_full_state(model, torch.load(weights))
        model = wrap_ddp(model)
        data = trees()
        results = {}
        audit = contextlib.nullcontext()
        if layout.get("audit"):  # device discipline of every call (tests/device_audit.py)
            from device_audit import device_audit

            audit = device_audit()
        with audit as found:
            for name, chunk, comm in cases:
                batch, tree = data[name]
                results[f"{name}/{chunk}/{comm}"] = run_case(model, batch, tree, chunk, comm, layout["pp"])
        if found is not None:
            results["audit"] = {"missing": sorted(set(found.missing)), "collectives": sorted(set(found.bad_collectives))}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# Workers are forked from one server process that imported torch, megatron-core and the
# package once (``forkserver`` with a preload): a fresh interpreter per worker would spend
# ~4 s importing them, on every launch of every test.
PRELOAD = ["torch", "megatron.core", "megatron_branch.training", "megatron_branch.spec.builders",
           "megatron_branch.hf.convert", "dist_worker"]


def start(fn, args, nprocs):
    """``torch.multiprocessing.spawn`` from the preloaded fork server."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def spawn(layout, cases, weights, out_dir, port):
    world = layout["tp"] * layout["cp"] * layout["pp"]
    start(worker, (world, port, layout, cases, weights, out_dir), world)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def build_error_worker(rank, world, port, layout, out_dir, run=False):
    """Build the layout's model (and with ``run``, score a tree with it) and save the
    ``ValueError`` raised ("" if none)."""
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import megatron_branch as mb
    from megatron_branch._megatron import parallel_state

    mb.enable_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout["tp"],
                                                 context_parallel_size=layout["cp"])
        def build_and_run():
            model = build(layout["tp"], layout["pp"], layout.get("sp", False), layout.get("mla", False),
                          layout.get("gdn", False))
            if run:
                batch, tree = trees()["tiny"]
                with torch.no_grad():
                    mb.rollout_logprobs(model, tree)

        record_value_error(build_and_run, out_dir, rank)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def record_value_error(fn, out_dir, rank) -> None:
    """Run ``fn`` and save the ``ValueError`` it raises ("" if none) for the parent to read."""
    message = ""
    try:
        fn()
    except ValueError as e:
        message = str(e)
    with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
        f.write(message)


def spawn_build_error(layout, out_dir, port, run=False):
    world = layout["tp"] * layout["cp"] * layout["pp"]
    start(build_error_worker, (world, port, layout, out_dir, run), world)
    return [open(os.path.join(out_dir, f"error{r}.txt")).read() for r in range(world)]


def spawn_run_error(layout, out_dir, port):
    """The ``ValueError`` each rank raises scoring a tree with the layout's model."""
    return spawn_build_error(layout, out_dir, port, run=True)


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


# ---------------------------------------------------------------- Mixture of Experts (EP)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96, moe_token_dispatcher_type="alltoall",
           moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.01, 0.02],
           moe_z_loss_coeff=1e-3)
MOE_TREES = {"a": "multi_level", "b": "forest"}


def build_moe(tp=1, ep=1, sp=False):
    """The MoE model (alltoall dispatcher). Megatron DDP then averages over DP; the per-token
    loss mode is left off here: megatron-core 0.16 scales router losses by the rank's token
    count under it, which changes with the TP/CP split (tested in one process instead)."""
    from megatron_branch.spec.builders import build_gpt, llama_config

    config = llama_config(**MODEL, **MOE, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                          expert_tensor_parallel_size=1, sequence_parallel=sp)
    return build_gpt(config, VOCAB, seed=0, spec_kwargs=dict(num_experts=MOE["num_moe_experts"],
                                                            moe_grouped_gemm=False))


def run_moe_case(model, name, chunk):
    """One MoE replay step on a Megatron-DDP-wrapped model (``megatron_branch.replay_step``) reduced by Megatron's
    ``finalize_model_grads``; returns unsharded gradients (experts numbered globally), the
    log-probs, Megatron's logged router losses and the per-expert token counts, the last
    two summed over TP x CP (the z-loss averaged), as Megatron's report reduces them."""
    import megatron_branch as mb
    from megatron_branch import rollout_logprobs
    from megatron_branch._megatron import (
        clear_moe_logged_metrics,
        finalize_model_grads,
        moe_logged_metrics,
        parallel_state,
    )
    from megatron_branch.cpu import cuda_factories_on_cpu
    from megatron_branch.full_state import full_state
    from megatron_branch.spec import moe

    batch, tree = trees()[MOE_TREES[name]]
    loss_fn = make_loss(batch)
    model.zero_grad_buffer()
    clear_moe_logged_metrics()
    moe.tokens_per_expert(model, reset=True)
    mb.replay_step(model, tree, loss_fn, max_chunk_tokens=chunk)
    logged = {k: v.clone() for k, v in moe_logged_metrics().items() if v.abs().sum() > 0}
    counts = moe.tokens_per_expert(model, reset=True)
    with torch.no_grad():
        lp = rollout_logprobs(model, tree)
    with cuda_factories_on_cpu():
        finalize_model_grads([model])
    group = parallel_state.get_tensor_and_context_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
        for name_, values in logged.items():
            dist.all_reduce(values, group=group)
            if name_ == "z_loss":
                values /= dist.get_world_size(group)
    return {"grads": full_state(model, "grad"), "lp": lp, "logged": logged, "counts": counts}


def moe_worker(rank, world, port, layout, cases, weights, out_dir):
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import megatron_branch as mb
    from megatron_branch._megatron import MoEAuxLossAutoScaler, parallel_state
    from megatron_branch.full_state import load_full_state
    from megatron_branch.training import wrap_ddp

    mb.enable_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout["tp"], expert_model_parallel_size=layout["ep"],
            expert_tensor_parallel_size=1)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        model = build_moe(layout["tp"], layout["ep"], layout.get("sp", False))
        load_full_state(model, torch.load(weights))
        model = wrap_ddp(model)
        dp_rank = parallel_state.get_data_parallel_rank()
        results = {}
        for i, (names, chunk) in enumerate(cases):  # names[dp_rank]: this data-parallel rank's tree
            try:
                results[i] = run_moe_case(model, names[dp_rank], chunk)
            except ValueError as exc:  # a refusal the test expects; every rank raises it
                results[i] = {"error": str(exc)}
        torch.save(results, os.path.join(out_dir, f"moe{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def spawn_moe(layout, cases, weights, out_dir, port):
    world = max(layout["tp"], layout["ep"])  # expert parallelism over the TP ranks, or over DP
    start(moe_worker, (world, port, layout, cases, weights, out_dir), world)
    return [torch.load(os.path.join(out_dir, f"moe{r}.pt")) for r in range(world)]


def hf_moe_worker(rank, world, port, ckpt, hf_config, sequences, out_dir):
    """Load a converted MoE checkpoint with EP=world (experts split over the ranks), save the
    per-rollout log-probs and the weights ``export_hf_state`` gathers back under HF names."""
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import megatron_branch as mb
    from megatron_branch._megatron import parallel_state
    from megatron_branch.hf import export_hf_state
    from megatron_branch.hf.convert import load_megatron

    mb.enable_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
        model, _ = load_megatron(ckpt)
        moe_layer = next(layer for layer in model.decoder.layers if hasattr(layer.mlp, "experts"))  # dense ones first
        assert len(moe_layer.mlp.experts.local_experts) == model.config.num_moe_experts // world
        with torch.no_grad():
            lp = mb.rollout_logprobs(model, mb.BranchTree.from_sequences(sequences))
        torch.save({"lp": lp, "state": export_hf_state(model, hf_config)}, os.path.join(out_dir, f"hf_moe{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def fp8_plan_worker(rank, world, port, budgets, out_dir):
    """Data-parallel ranks planning the same tree under different budgets, under FP8: the
    ``ValueError`` of :func:`megatron_branch.replay.fp8.check_fp8_plan` on each ("" if none)."""
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import megatron_branch as mb
    from megatron_branch._megatron import parallel_state
    from megatron_branch.replay.fp8 import check_fp8_plan
    from megatron_branch.replay.plan import plan_replay

    mb.enable_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel()
        model = build(fp8="hybrid")
        record_value_error(lambda: check_fp8_plan(model, plan_replay(trees()["forest"][1], budgets[rank])),
                           out_dir, rank)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def spawn_fp8_plan(budgets, out_dir, port):
    start(fp8_plan_worker, (len(budgets), port, budgets, out_dir), len(budgets))
    return [open(os.path.join(out_dir, f"error{r}.txt")).read() for r in range(len(budgets))]
