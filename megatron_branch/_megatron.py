"""Every touch point with megatron-core internals, in one adapter module.

Megatron's API moves between releases (GPTModel -> HybridModel, ModuleSpec -> typed
builders); keeping the imports here confines a port to this file. Pinned: 0.16.x.
"""

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

vocab_parallel_cross_entropy = tensor_parallel.vocab_parallel_cross_entropy
reduce_from_tensor_model_parallel_region = tensor_parallel.reduce_from_tensor_model_parallel_region

__all__ = [
    "AttnMaskType",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "Float16Module",
    "MegatronOptimizer",
    "OptimizerConfig",
    "finalize_model_grads",
    "get_megatron_optimizer",
    "GPTModel",
    "MegatronModule",
    "ModuleSpec",
    "PackedSeqParams",
    "SelfAttention",
    "SelfAttentionSubmodules",
    "TransformerBlock",
    "TransformerBlockSubmodules",
    "TransformerConfig",
    "TransformerLayerSubmodules",
    "get_gpt_layer_local_spec",
    "parallel_state",
    "reduce_from_tensor_model_parallel_region",
    "tensor_parallel",
    "vocab_parallel_cross_entropy",
]
