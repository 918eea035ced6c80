"""verl 0.9.1 integration: an engine verl picks up through its own plugin and registry.

Installing ``megatron_branch`` registers a ``verl.plugins`` entry point; verl imports this
package when it starts (in the driver and in every Ray worker), which registers
:class:`~megatron_branch.integrations.verl.engine.BranchMegatronEngine` for
``model_type="language_model"``, ``backend="megatron"``, device ``cuda`` and vendor
``branch``. verl uses it when ``VERL_ENGINE_VENDOR=branch`` is set (in the Ray runtime
environment); anything else, a critic for example, keeps verl's stock engine. No patch
of verl. The tree-attention kernel and the streaming budget of forward-only log-probs come
from the engine config's ``override_mcore_model_config.branch`` (``kernel``,
``max_chunk_tokens``). MoE rollout routing replay (``megatron.router_replay.mode=R3``) hands
verl's ``routed_experts`` to the package (:func:`~.engine.rollout_routing`). The layer spec goes
into either bridge verl builds with (:mod:`.bridges`);
``megatron-branch verl-check`` says which engine verl would build. See ``docs/integrations.md``.
"""

from megatron_branch.integrations.verl.bridges import branch_layer_spec, check_branch_model, hook_mbridge, hook_provider
from megatron_branch.integrations.verl.engine import (
    VENDOR,
    BranchMegatronEngine,
    check_config,
    check_micro_batch,
    rollout_routing,
)
from megatron_branch.integrations.verl.micro_batches import (
    SharingStats,
    group_micro_batches,
    pack_groups,
    split_group,
    split_to,
)

__all__ = ["VENDOR", "BranchMegatronEngine", "SharingStats", "branch_layer_spec", "check_branch_model",
           "check_config", "check_micro_batch", "group_micro_batches", "hook_mbridge", "hook_provider",
           "pack_groups", "rollout_routing", "split_group", "split_to"]
