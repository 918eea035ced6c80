"""Issue 21, device placement: the checks that a CPU run can make of a GPU run's devices.

Every tensor factory the package calls names its device (the model's, or ``HOST`` for
bookkeeping moved explicitly), and no collective — the package's, or megatron-core's on a
tensor the package handed it — gets a host tensor (NCCL takes CUDA tensors only). Checked
on the main paths in one process and on TP x SP and CP layouts over gloo; the planted
mistakes show the audit fails. Device selection under torchrun is a pure function.
"""

import importlib.util
import os

import dist_worker
import pytest
import torch
import torch.distributed as dist
from conftest import make_pair
from device_audit import PACKAGE, device_audit

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch._megatron import OptimizerConfig
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.distributed import choose_cuda_device, free_port
from megatron_branch.full_state import full_state
from megatron_branch.spec.builders import build_gpt, llama_config
from megatron_branch.training import get_optimizer, plan_data_parallel, train_step, wrap_ddp


def _batch():
    batch = branching_rollouts([24, 11], [2, 3], [5, 6], 128, seed=2, jitter=3)
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    adv = torch.linspace(-1, 1, len(batch.sequences))
    return batch, mb.BranchTree.from_sequences(batch.sequences), mask, adv


def test_the_main_paths_name_every_device():
    batch, tree, mask, adv = _batch()
    branch, _ = make_pair()
    cfg = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       calculate_per_token_loss=True)
    ddp = wrap_ddp(build_gpt(cfg, 128, seed=0))
    opt = get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [ddp])
    plan = plan_data_parallel(batch.sequences, batch.group, 1, micro_batch_tokens=80, score_mask=mask)
    moe_cfg = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                           num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96,
                           moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="aux_loss",
                           moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    moe = build_gpt(moe_cfg, 128, seed=0, spec_kwargs=dict(num_experts=4, moe_grouped_gemm=False))

    def ppo(lp, ids):
        return losses.ppo_policy_loss(lp, lp.detach(), adv[ids], mask[ids], global_tokens=mask.sum())[0]

    def per_token(lp, ids):
        m = mask[ids][:, : lp.shape[1]]
        return losses.ppo_policy_loss(lp, lp.detach(), adv[ids], m, global_tokens=1.0)[0], m.sum()

    with device_audit() as audit:
        mb.rollout_logprobs(branch, tree, score_mask=mask, entropy=True)
        mb.replay_step(branch, tree, ppo, max_chunk_tokens=10)
        mb.replay_step(branch, tree, ppo, max_chunk_tokens=10, recompute_stem=True)
        mb.replay_step(branch, tree, ppo, max_chunk_tokens=10, prefix_grad="detached")
        mb.replay_logprobs(branch, tree, max_chunk_tokens=10)
        mb.replay_step(moe, tree, ppo, max_chunk_tokens=12)
        train_step([ddp], opt, plan.ranks[0], per_token)  # Megatron's schedule
        train_step([ddp], opt, plan.ranks[0], per_token, max_chunk_tokens=12)  # streaming
        full_state(ddp, "grad")
    assert sorted(set(audit.missing)) == []
    assert audit.bad_collectives == []


def _planted(source: str):
    """A function compiled as if it were package code (the audit attributes by file)."""
    namespace = {"torch": torch, "dist": dist}
    exec(compile(source, os.path.join(PACKAGE, "planted_for_the_test.py"), "exec"), namespace)
    return namespace["planted"]


def test_the_audit_fails_on_planted_mistakes():
    # the bug of issue 21: a token counter made without a device, then reduced
    counter = _planted("def planted():\n    return torch.zeros([], dtype=torch.int)\n")
    host_reduce = _planted("def planted(lp):\n    full = lp.cpu().clone()\n    dist.all_reduce(full)\n    return full\n")
    with device_audit() as audit:
        counter()
        host_reduce(torch.ones(3))
    assert audit.missing == ["megatron_branch/planted_for_the_test.py:2: torch.zeros without device="]
    assert audit.bad_collectives and "dist.all_reduce on a host tensor made at megatron_branch/planted_for_the_test" \
        in audit.bad_collectives[0]


def test_the_training_example_reduces_device_tensors():
    """``examples/train_branch_replay.py``'s ``global_logprobs`` all-reduced a CPU copy."""
    spec = importlib.util.spec_from_file_location("train_example", os.path.join(
        os.path.dirname(PACKAGE.rstrip(os.sep)), "examples", "train_branch_replay.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with device_audit() as audit:
        group = dist.new_group([0])
        full = torch.zeros(4, 3, device=torch.ones(1).device)
        dist.all_reduce(example.global_logprobs(full), group=group)
    assert audit.bad_collectives == [] and audit.missing == []


@pytest.mark.parametrize("layout", [{"tp": 2, "cp": 1, "pp": 1, "sp": True, "audit": True},
                                    {"tp": 1, "cp": 2, "pp": 1, "audit": True}], ids=["tp2-sp", "cp2"])
def test_parallel_layouts_name_every_device(layout, tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(full_state(dist_worker.build(), "param"), path)
    cases = [("multi_level", 12, "p2p"), ("forest", None, "allgather")]
    ranks = dist_worker.spawn(layout, cases, str(path), str(tmp_path), free_port())
    for rank, res in enumerate(ranks):
        assert res["audit"] == {"missing": [], "collectives": []}, (rank, res["audit"])


def test_device_choice_under_torchrun():
    assert choose_cuda_device(3, 8, None) == 3
    assert choose_cuda_device(None, 8, 5) == 5  # not torchrun: the device the process chose
    assert choose_cuda_device(None, 2, None) == 0
    assert choose_cuda_device(2, 4, 2) == 2  # chosen already and agrees
    with pytest.raises(ValueError, match=r"LOCAL_RANK=4: only 4 CUDA device\(s\) are visible"):
        choose_cuda_device(4, 4, None)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1: this process already selected cuda:3"):
        choose_cuda_device(1, 4, 3)
    with pytest.raises(ValueError, match="no visible device"):
        choose_cuda_device(0, 0, None)
