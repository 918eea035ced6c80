"""Run-time exactness check (issue 20): ``train_step(..., verify=ExactnessCheck(...))``
reports the largest log-prob difference of a sampled group on its due steps and raises on
a planted inexact attention."""

import pytest
import torch

from megatron_branch import losses
from megatron_branch._megatron import AttnMaskType, OptimizerConfig
from megatron_branch.attention.plain import unmasked_attention
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.spec import get_branch_layer_spec
from megatron_branch.spec.builders import build_gpt, llama_config
from megatron_branch.spec.core_attention import BranchCoreAttention
from megatron_branch.training import ExactnessCheck, ExactnessError, get_optimizer, plan_data_parallel, train_step
from megatron_branch.training import wrap_ddp


class PackedCausalAttention(BranchCoreAttention):
    """A planted bug: with tree data, plain causal attention over the packed sequence."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or getattr(packed_seq_params, "tree", None) is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        return unmasked_attention(query, key, value, AttnMaskType.causal, self.softmax_scale)


def setup(core=None):
    batch = branching_rollouts([20, 14], [3], [6], 128, seed=8, jitter=2)
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    cfg = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       calculate_per_token_loss=True)
    spec = get_branch_layer_spec(normalization="RMSNorm")
    if core is not None:
        spec.submodules.self_attention.submodules.core_attention.module = core
    ddp = wrap_ddp(build_gpt(cfg, 128, seed=0, spec_kwargs={}) if core is None else _build(cfg, spec))
    opt = get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4), [ddp])
    plan = plan_data_parallel(batch.sequences, batch.group, 1)

    def loss_fn(lp, ids):
        m = mask[ids][:, : lp.shape[1]]
        return (lp * m).sum(), m.sum()

    return ddp, opt, plan.ranks[0], loss_fn


def _build(cfg, spec):
    from megatron_branch._megatron import GPTModel

    torch.manual_seed(0)
    return GPTModel(cfg, spec, 128, 4096, position_embedding_type="rope", share_embeddings_and_output_weights=False)


def test_due_steps_report_the_difference():
    ddp, opt, data, loss_fn = setup()
    check = ExactnessCheck(every=2, rollouts=3, tolerance=1e-4)
    temps = torch.linspace(0.7, 1.3, 6)
    results = [train_step([ddp], opt, data, loss_fn, verify=check, temperature=temps) for _ in range(3)]
    assert [r.max_logprob_diff is not None for r in results] == [True, False, True]
    assert all(r.max_logprob_diff < 1e-5 for r in results if r.max_logprob_diff is not None)
    assert [c for c, _ in check.history] == [1, 3]


def test_a_planted_inexact_attention_is_caught():
    ddp, opt, data, loss_fn = setup(core=PackedCausalAttention)
    with pytest.raises(ExactnessError, match="differ from the per-rollout forward by .* > verify_tolerance 0.001"):
        train_step([ddp], opt, data, loss_fn, verify=ExactnessCheck(every=1))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="verify_every: must be >= 1"):
        ExactnessCheck(every=0)
    with pytest.raises(ValueError, match="verify_rollouts: must be >= 1"):
        ExactnessCheck(rollouts=0)
    with pytest.raises(ValueError, match="verify_tolerance: must be > 0 or None"):
        ExactnessCheck(tolerance=0.0)
