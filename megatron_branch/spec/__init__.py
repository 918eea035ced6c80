"""What fills Megatron's slots: layer specs and the modules they install."""

from megatron_branch.spec.layer_spec import (  # noqa: F401
    _map_layers,
    apply_branch_attention,
    get_branch_layer_spec,
    is_branch_model,
)
