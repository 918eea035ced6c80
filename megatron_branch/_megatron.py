"""Every touch point with megatron-core internals, in one adapter module.

Megatron's API moves between releases (GPTModel -> HybridModel, ModuleSpec -> typed
builders); keeping the imports here confines a port to this file. Pinned: 0.16.x.
"""

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
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
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

vocab_parallel_cross_entropy = tensor_parallel.vocab_parallel_cross_entropy
gather_from_sequence_parallel_region = tensor_parallel.gather_from_sequence_parallel_region
reduce_from_tensor_model_parallel_region = tensor_parallel.reduce_from_tensor_model_parallel_region

# --- Mixture of Experts (megatron_branch.spec.moe) -------------------------------------------
import inspect as _inspect  # noqa: E402

from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules  # noqa: E402
from megatron.core.transformer.moe.moe_utils import (  # noqa: E402
    MoEAuxLossAutoScaler,
    compute_routing_scores_for_aux_loss,
)
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402

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


def _after_0_16() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("megatron-core").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) > (0, 16)


def _source_has(fn, text: str) -> bool:
    """Whether the installed release's ``fn`` contains ``text``; without readable source
    (a bytecode-only install) the release number decides (each text is what came after 0.16)."""
    try:
        return text in _inspect.getsource(fn)
    except (OSError, TypeError):
        return _after_0_16()


# Per-token loss (``calculate_per_token_loss``) scaling of the router losses changed after
# 0.16: newer releases multiply by ``num_local_tokens * tp_cp_size`` (0.16: by
# ``num_local_tokens``), and the sequence aux loss counts the micro-batch's tokens (0.16:
# one sequence's). megatron_branch.spec.moe reproduces whichever the installed release does.
MOE_PER_TOKEN_SCALE_TIMES_TP_CP = _source_has(TopKRouter.apply_z_loss, "num_local_tokens * self.tp_cp_group.size()")
MOE_SEQ_AUX_COUNTS_MICRO_BATCH = _source_has(TopKRouter._apply_seq_aux_loss, "local_num_tokens * bsz")
# Newer releases log the z-loss averaged over TP x DP x CP (0.16: per rank).
MOE_Z_LOSS_LOG_AVG = _source_has(TopKRouter.apply_z_loss, "avg_group=self.tp_dp_cp_group")
# The global aux loss's logging flag: ``needs_dp_avg=False`` (newer) / ``reduce_group_has_dp=True`` (0.16).
MOE_GLOBAL_AUX_LOG_FLAG = (
    {"needs_dp_avg": False}
    if "needs_dp_avg" in _inspect.signature(TopKRouter.attach_and_log_load_balancing_loss).parameters
    else {"reduce_group_has_dp": True}
)


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
    "MOE_GLOBAL_AUX_LOG_FLAG",
    "MOE_PER_TOKEN_SCALE_TIMES_TP_CP",
    "MOE_SEQ_AUX_COUNTS_MICRO_BATCH",
    "MOE_Z_LOSS_LOG_AVG",
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
    "moe_logged_metrics",
    "parallel_state",
    "record_moe_metric",
    "reduce_from_tensor_model_parallel_region",
    "tensor_parallel",
    "vocab_parallel_cross_entropy",
]
