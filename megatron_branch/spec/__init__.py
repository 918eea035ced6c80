"""What fills Megatron's slots: layer specs, the ``apply_*`` steps and the modules they install.

:func:`get_branch_layer_spec` (:mod:`.layer_spec`) is Megatron's stock GPT layer spec with
each branch piece installed by its own step: :func:`apply_branch_attention`
(:mod:`.attention`: :mod:`.self_attention` and :mod:`.core_attention`, with the per-forward
tree data of :mod:`.packed_seq`) and :func:`apply_branch_moe` (:mod:`.moe`).
:mod:`.builders` builds small Llama-style GPTModels from them.
"""

from megatron_branch.spec.attention import apply_branch_attention, check_tree_attention, is_branch_model
from megatron_branch.spec.layer_spec import get_branch_layer_spec
from megatron_branch.spec.layers import map_layers
from megatron_branch.spec.moe import apply_branch_moe

__all__ = [
    "apply_branch_attention",
    "apply_branch_moe",
    "check_tree_attention",
    "get_branch_layer_spec",
    "is_branch_model",
    "map_layers",
]
