"""Determinism: the same seed and layout give bit-identical log-probs, gradients and
parameters, run after run (CPU, fp32).

In one process: two models built from the same seed, trained two Megatron optimizer
steps (one-pass and streaming replay), compared with ``torch.equal``. Across processes:
the example under torchrun (TP=2 with sequence parallelism, streaming replay, two DP
micro-batches) run twice, its dumps compared bit for bit.
"""

import pytest
import torch
from safetensors.torch import load_file
from torchrun import run_example

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch._megatron import OptimizerConfig
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.spec.builders import build_gpt, llama_config
from megatron_branch.training import get_optimizer, plan_data_parallel, train_step, wrap_ddp

VOCAB = 128


def one_run(streaming):
    config = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          calculate_per_token_loss=True)
    ddp = wrap_ddp(build_gpt(config, VOCAB, seed=0), overlap_grad_reduce=True, bucket_size=5000)
    opt = get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), [ddp])
    batch = branching_rollouts([24, 17, 30], [2, 3], [5, 6], VOCAB, seed=5, jitter=3)
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    adv = losses.grpo_advantages(torch.rand(len(batch.sequences), generator=torch.Generator().manual_seed(2)),
                                 len(batch.sequences) // 3)
    plan = plan_data_parallel(batch.sequences, batch.group, 1, micro_batch_tokens=100, streaming=streaming,
                              score_mask=mask)
    tree = mb.BranchTree.from_sequences(batch.sequences)
    out = {"logprobs": [], "grads": [], "params": []}
    for _ in range(2):
        with torch.no_grad():
            old = mb.rollout_logprobs(ddp, tree).detach()
        out["logprobs"].append(old)

        def loss_fn(lp, ids, old=old):
            m = mask[ids][:, : lp.shape[1]]
            return losses.ppo_policy_loss(lp, old[ids][:, : lp.shape[1]], adv[ids], m, global_tokens=1.0)[0], m.sum()

        train_step([ddp], opt, plan.ranks[0], loss_fn, max_chunk_tokens=9 if streaming else None)
        out["grads"].append({n: p.main_grad.clone() for n, p in ddp.module.named_parameters()})
        out["params"].append({n: p.detach().clone() for n, p in ddp.module.named_parameters()})
    return out


def identical(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


@pytest.mark.parametrize("streaming", [False, True], ids=["one-pass", "streaming"])
def test_two_runs_in_one_process_are_bit_identical(streaming):
    first, second = one_run(streaming), one_run(streaming)
    assert identical(first, second)
    assert not identical(first["params"][0], first["params"][1])  # the steps did move the model


def test_two_torchrun_runs_are_bit_identical(tmp_path):
    flags = ["--tp", "2", "--sequence-parallel", "--chunk-tokens", "24", "--micro-batch-tokens", "200",
             "--prompts", "48", "32", "40", "--jitter", "4", "--steps", "2"]
    dumps = []
    for tag in ("a", "b"):
        paths = {k: tmp_path / f"{tag}-{k}.safetensors" for k in ("grads", "logprobs", "params")}
        run_example(2, *flags, *[x for k, p in paths.items() for x in (f"--dump-{k}", p)])
        dumps.append({k: load_file(p) for k, p in paths.items()})
    assert identical(dumps[0], dumps[1])
