"""Every touch point with megatron-core internals, in one adapter module.

Megatron's API moves between releases (GPTModel -> HybridModel, ModuleSpec -> typed
builders); keeping the imports here confines a port to this file. Pinned: 0.16.x.
"""

import contextlib
import warnings as _warnings
from dataclasses import dataclass
from typing import Dict, Optional

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core import package_info as _package_info
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import multi_latent_attention as _mla_module
from megatron.core.transformer.attention import Attention, SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

vocab_parallel_cross_entropy = tensor_parallel.vocab_parallel_cross_entropy
gather_from_sequence_parallel_region = tensor_parallel.gather_from_sequence_parallel_region
reduce_from_tensor_model_parallel_region = tensor_parallel.reduce_from_tensor_model_parallel_region

# --- Mixture of Experts (megatron_branch.spec.moe) -------------------------------------------
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules  # noqa: E402
from megatron.core.transformer.moe.moe_utils import (  # noqa: E402
    MoEAuxLossAutoScaler,
    compute_routing_scores_for_aux_loss,
)
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402

# --- Gated DeltaNet (megatron-core >= 0.19; megatron_branch.spec.gdn) --------------------------
try:
    with _warnings.catch_warnings():
        # flash-linear-attention warns on import wherever Triton has no GPU; on every CPU run
        _warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (  # noqa: E402
            get_linear_attention_pattern,
            get_transformer_block_with_experimental_attention_variant_spec,
        )
        from megatron.core.models.hybrid import hybrid_block  # noqa: E402
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules  # noqa: E402
        from megatron.core.models.hybrid.hybrid_model import HybridModel  # noqa: E402
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules  # noqa: E402
        from megatron.core.ssm.gated_delta_net import common as gdn_common  # noqa: E402
        from megatron.core.ssm.mlp_layer import MLPLayer  # noqa: E402
except ImportError:  # 0.16: no GatedDeltaNet, no HybridModel
    GatedDeltaNet = GatedDeltaNetSubmodules = gdn_common = get_linear_attention_pattern = None
    get_transformer_block_with_experimental_attention_variant_spec = None
    hybrid_block = HybridStack = HybridStackSubmodules = HybridModel = MLPLayer = None

# --- Rollout routing replay (0.16.1 and 0.19.2 ship it; megatron_branch.spec.moe.routing_replay) --
try:
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # noqa: E402
except ImportError:  # older releases: no RouterReplay, no moe_enable_routing_replay
    RouterReplay = RouterReplayAction = None


def router_replay_unavailable_reason(config) -> Optional[str]:
    """Why a router of a model with ``config`` cannot replay given experts, or None.

    Megatron's ``TopKRouter`` holds a ``RouterReplay`` only when
    ``moe_enable_routing_replay`` is set (megatron-core 0.16.1 and 0.19.2 have it), and its fused top-k
    (``moe_router_fusion``, Transformer Engine's kernel) bypasses it.
    """
    if RouterReplay is None:
        major, minor = megatron_core_version()
        return (f"megatron-core {major}.{minor} has no RouterReplay (megatron/core/transformer/moe/"
                "router_replay.py, in 0.16.1 and 0.19.2: TransformerConfig(moe_enable_routing_replay=True))")
    if not getattr(config, "moe_enable_routing_replay", False):
        return ("moe_enable_routing_replay is off: build the model with "
                "TransformerConfig(moe_enable_routing_replay=True) so its routers hold Megatron's RouterReplay")
    if getattr(config, "moe_router_fusion", False):
        return "moe_router_fusion: the fused top-k kernel bypasses Megatron's RouterReplay; set it to False"
    return None


@contextlib.contextmanager
def replaying_topk(router, top_indices):
    """Inside, ``router`` (a ``TopKRouter`` with a ``RouterReplay``) routes every token to
    ``top_indices [tokens, topk]`` (Megatron's ``REPLAY_FORWARD``: the probabilities are its
    score function gathered at those experts). The replay's previous state (a caller's own
    global replay) is restored on exit."""
    replay = router.router_replay
    saved = (replay.target_topk_idx, list(replay.replay_backward_list), replay.router_replay_action)
    replay.set_target_indices(top_indices)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        replay.target_topk_idx, replay.replay_backward_list, replay.router_replay_action = saved


try:  # megatron-core >= 0.19: a metrics tracker object
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker as _metrics_tracker
except ImportError:  # 0.16: a module-level dict
    _metrics_tracker = None
    from megatron.core.transformer.moe.moe_utils import (  # noqa: E402
        get_moe_layer_wise_logging_tracker as _layer_wise_tracker,
    )
    from megatron.core.transformer.moe.moe_utils import (
        save_to_aux_losses_tracker as _save_to_tracker,
    )


def mla_unbuildable_reason() -> Optional[str]:
    """Why this megatron-core cannot build ``MLASelfAttention`` here, or None.

    megatron-core 0.16 decides "Transformer Engine present" in ``multi_latent_attention``
    from an import of its TE extension module, which imports without TE (it stands a mock
    in for TE); the layer's constructor then calls ``isinstance(..., TELinear)`` with that
    mock and raises ``TypeError``. 0.19 reads the extension's real ``HAVE_TE`` flag.
    """
    te_linear = getattr(_mla_module, "TELinear", None)
    if getattr(_mla_module, "HAVE_TE", False) and not isinstance(te_linear, type):
        major, minor = megatron_core_version()
        return (f"megatron-core {major}.{minor} cannot build MLASelfAttention without Transformer Engine "
                "(its TE check receives a mock class); use megatron-core >= 0.19 or install Transformer Engine")
    return None


def gdn_unavailable_reason() -> Optional[str]:
    """Why megatron-core's ``GatedDeltaNet`` cannot be built here, or None."""
    major, minor = megatron_core_version()
    if GatedDeltaNet is None:
        return f"megatron-core {major}.{minor} has no GatedDeltaNet (it ships in megatron-core >= 0.19)"
    if not getattr(gdn_common, "HAVE_FLA", False):
        return ("megatron-core's GatedDeltaNet requires flash-linear-attention at construction "
                "(pip install -e '.[hybrid]')")
    return None


def megatron_core_version() -> tuple:
    """``(major, minor)`` of the megatron-core that is imported.

    Read from the imported ``megatron.core.package_info``, not the installed package's
    metadata: under a Megatron-LM checkout on ``PYTHONPATH`` the checkout's
    ``megatron/core`` is the code that runs, whatever wheel is installed beside it.
    """
    return _package_info.MAJOR, _package_info.MINOR


def megatron_core_release() -> str:
    """The imported megatron-core's release (``"0.16.1"``, ``"0.19.0rc0"``), for reports.

    Composed from ``VERSION``, not ``__version__``: from 0.19 ``__version__`` appends the
    commit of whatever git repository holds the installed files, which for a venv inside
    a project checkout is the project's commit, not Megatron's.
    """
    return ".".join(map(str, _package_info.VERSION[:3])) + "".join(map(str, _package_info.VERSION[3:]))


@dataclass(frozen=True)
class MoERouterBehaviour:
    """How the installed release's ``TopKRouter`` scales and logs its router losses.

    megatron_branch.spec.moe reproduces whichever the installed release does. An explicit
    table per release, read from each release's ``moe/router.py`` (0.16.1 to 0.19.2, and main at d98e8a64dd), not a
    search of the installed source: a release that rewrites those lines without changing
    behaviour must not flip the scaling, and one that changes behaviour must be added here.

    Attributes:
        per_token_scale_times_tp_cp: under ``calculate_per_token_loss`` the z-loss is
            multiplied by ``num_local_tokens * tp_cp_size`` (older: ``num_local_tokens``).
        seq_aux_counts_micro_batch: the sequence aux loss's valid-token count is the
            micro-batch's tokens (older: one sequence's).
        z_loss_log_avg: the z-loss is logged averaged over TP x DP x CP (older: per rank).
        global_aux_log_flag: the keyword ``attach_and_log_load_balancing_loss`` takes for
            the global aux loss's DP handling.
    """

    per_token_scale_times_tp_cp: bool
    seq_aux_counts_micro_batch: bool
    z_loss_log_avg: bool
    global_aux_log_flag: Dict[str, bool]


_OLD_LOG = {"reduce_group_has_dp": True}
_NEW_LOG = {"needs_dp_avg": False}
MOE_ROUTER_BEHAVIOUR = {
    (0, 16): MoERouterBehaviour(False, False, False, _OLD_LOG),
    (0, 17): MoERouterBehaviour(False, False, False, _OLD_LOG),
    (0, 18): MoERouterBehaviour(False, False, False, _NEW_LOG),
    (0, 19): MoERouterBehaviour(True, True, True, _NEW_LOG),
    # Megatron-LM main at d98e8a64dd (package_info 0.20.0, unreleased): router losses as 0.19
    (0, 20): MoERouterBehaviour(True, True, True, _NEW_LOG),
}


def moe_router_behaviour(release: Optional[tuple] = None) -> MoERouterBehaviour:
    """The :class:`MoERouterBehaviour` of ``release`` (default: the installed one).

    Raises:
        ValueError: a release the table does not know (add its row after reading its
            ``megatron/core/transformer/moe/router.py``).
    """
    release = release or megatron_core_version()
    if release not in MOE_ROUTER_BEHAVIOUR:
        known = ", ".join(f"{a}.{b}" for a, b in sorted(MOE_ROUTER_BEHAVIOUR))
        raise ValueError(f"megatron-core {release[0]}.{release[1]}: its MoE router loss scaling is not in "
                         f"megatron_branch._megatron.MOE_ROUTER_BEHAVIOUR (known: {known})")
    return MOE_ROUTER_BEHAVIOUR[release]


def record_moe_metric(name, value, layer_number, num_layers, reduce_group=None, avg_group=None) -> None:
    """Add ``value`` to Megatron's per-layer MoE logging (the tracker its router writes)."""
    if _metrics_tracker is not None:
        _metrics_tracker().record(name, value, layer_number, num_layers, reduce_group=reduce_group,
                                  avg_group=avg_group)
    else:
        _save_to_tracker(name, value, layer_number, num_layers, reduce_group=reduce_group, avg_group=avg_group)


def moe_logged_metrics() -> dict:
    """``name -> [num_layers]`` values Megatron's MoE logging holds now (before its reduction)."""
    if _metrics_tracker is not None:
        return {name: entry.values for name, entry in _metrics_tracker().metrics.items()}
    return {name: entry["values"] for name, entry in _layer_wise_tracker().items()}


def clear_moe_logged_metrics() -> None:
    """Zero Megatron's per-layer MoE logging (as its training loop does after each report)."""
    for values in moe_logged_metrics().values():
        values.zero_()

__all__ = [
    "AttnMaskType",
    "ShardedObject",
    "TorchDistSaveShardedStrategy",
    "dist_checkpointing",
    "filesystem_async",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "Float16Module",
    "MegatronOptimizer",
    "OptimizerConfig",
    "finalize_model_grads",
    "gather_from_sequence_parallel_region",
    "get_megatron_optimizer",
    "GPTModel",
    "MegatronModule",
    "MoEAuxLossAutoScaler",
    "MoELayer",
    "MoESubmodules",
    "MOE_ROUTER_BEHAVIOUR",
    "MoERouterBehaviour",
    "ModuleSpec",
    "PackedSeqParams",
    "SelfAttention",
    "SelfAttentionSubmodules",
    "TransformerBlock",
    "TransformerBlockSubmodules",
    "TopKRouter",
    "TransformerConfig",
    "TransformerLayer",
    "TransformerLayerSubmodules",
    "clear_moe_logged_metrics",
    "compute_routing_scores_for_aux_loss",
    "get_forward_backward_func",
    "get_gpt_decoder_block_spec",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
    "get_num_layers_to_build",
    "get_transformer_layer_offset",
    "megatron_core_release",
    "megatron_core_version",
    "moe_logged_metrics",
    "moe_router_behaviour",
    "parallel_state",
    "record_moe_metric",
    "reduce_from_tensor_model_parallel_region",
    "tensor_parallel",
    "vocab_parallel_cross_entropy",
    # multi-latent attention, Gated DeltaNet, HybridModel (megatron-core >= 0.19; None before)
    "Attention",
    "ColumnParallelLinear",
    "DotProductAttention",
    "GatedDeltaNet",
    "GatedDeltaNetSubmodules",
    "HybridModel",
    "HybridStack",
    "HybridStackSubmodules",
    "IdentityFuncOp",
    "IdentityOp",
    "MLASelfAttention",
    "MLATransformerConfig",
    "MLPLayer",
    "RowParallelLinear",
    "gdn_common",
    "gdn_unavailable_reason",
    "get_linear_attention_pattern",
    "get_transformer_block_with_experimental_attention_variant_spec",
    "hybrid_block",
    "mla_unbuildable_reason",
    # rollout routing replay (None in releases without RouterReplay)
    "RouterReplay",
    "RouterReplayAction",
    "replaying_topk",
    "router_replay_unavailable_reason",
]
