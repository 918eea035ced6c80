"""The branch layer spec in the model verl builds: Megatron-Bridge's provider or verl's vanilla ``mbridge``.

verl 0.9.1 builds its Megatron model through one of two bridges (``megatron.vanilla_mbridge``):

* **Megatron-Bridge** (the default): a model *provider* whose ``transformer_layer_spec`` (a
  spec or a builder ``(provider[, vp_stage]) -> spec``) verl already replaces for QAT;
  :func:`hook_provider` wraps it. Megatron-Bridge's ``provide()`` then puts Megatron's stock
  ``DotProductAttention`` into every core-attention slot when
  ``attention_backend=local``, beside the branch self-attention: refused, naming the option.
* **mbridge** (``vanilla_mbridge=True``): the bridge builds the layer spec itself in
  ``_get_transformer_layer_spec(vp_stage)``; :func:`hook_mbridge` makes the one bridge object
  verl made an instance of a subclass that overrides it. mbridge asks for Transformer Engine's spec; where TE does
  not import (a CPU machine) the wrapper builds Megatron's local spec instead and lets
  mbridge's weight-name map read the local norm names as TE's fused ones (same tensors).

:func:`check_branch_model` checks the built model: every self-attention holds tree
attention, whatever a bridge did after the spec was built.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Callable, Optional

from megatron_branch._deps import HAVE_TE
from megatron_branch.spec import apply_branch_attention, apply_branch_moe
from megatron_branch.spec.core_attention import BranchCoreAttention
from megatron_branch.spec.mla_attention import BranchMLASelfAttention
from megatron_branch.spec.self_attention import BranchSelfAttention

ATTENTION_BACKEND_OPTION = "megatron.override_transformer_config.attention_backend"

# Megatron's local spec keeps the norms as modules of their own; Transformer Engine's spec
# fuses them into the next linear (same tensor, other name), which is what mbridge maps.
_LOCAL_TO_TE_NAMES = ((".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
                      (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"))
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def branch_layer_spec(spec, kernel: Optional[str] = None):
    """The branch pieces in a layer or block spec: tree attention (with ``kernel``;
    ``None``: by device and dtype), MoE statistics."""
    return apply_branch_moe(apply_branch_attention(spec, kernel=kernel))


def _attention_backend_name(value) -> str:
    return str(getattr(value, "name", value)).lower()


def hook_provider(provider, kernel: Optional[str] = None) -> None:
    """Put the branch pieces into a Megatron-Bridge provider's ``transformer_layer_spec``.

    Raises:
        ValueError: the provider's ``attention_backend`` is ``local`` (Megatron-Bridge would
            put Megatron's stock ``DotProductAttention`` beside the branch self-attention).
    """
    backend = getattr(provider, "attention_backend", None)
    if backend is not None and _attention_backend_name(backend) == "local":
        raise ValueError(f"{ATTENTION_BACKEND_OPTION}=local: Megatron-Bridge then puts Megatron's stock "
                         "DotProductAttention into the core-attention slot beside megatron_branch's tree "
                         "self-attention (wrong positions and visibility); leave attention_backend unset")
    base = provider.transformer_layer_spec
    if callable(base) and not hasattr(base, "submodules"):  # a spec builder (config[, vp_stage]) -> spec
        takes_vp = "vp_stage" in inspect.signature(base).parameters

        # Megatron-Bridge passes vp_stage only to builders that name it: keep the signature's shape
        if takes_vp:
            def build(config, vp_stage=None):
                return branch_layer_spec(base(config, vp_stage=vp_stage), kernel=kernel)
        else:
            def build(config):
                return branch_layer_spec(base(config), kernel=kernel)
        provider.transformer_layer_spec = build
    else:
        provider.transformer_layer_spec = branch_layer_spec(base, kernel=kernel)


def hook_mbridge(bridge, kernel: Optional[str] = None) -> None:
    """Put the branch pieces into the layer spec of verl's vanilla ``mbridge`` bridge object.

    With Transformer Engine importable the bridge's own spec is kept (TE linears); without
    it, Megatron's local block spec for the bridge's config (:func:`use_mbridge_local_spec`).
    """
    use_mbridge_local_spec(bridge, transform=lambda spec: branch_layer_spec(spec, kernel=kernel))


def use_mbridge_local_spec(bridge, transform: Optional[Callable] = None) -> None:
    """Make an ``mbridge`` bridge object build ``transform(spec)`` of its layer spec, and,
    without Transformer Engine, build Megatron's local block spec (mbridge asks for TE's,
    which does not build without TE) with its weight-name map taught the local names (norms; an MoE
    layer's ``SequentialMLP`` experts, named as TE's grouped experts).

    The object becomes an instance of a subclass of its own class (:func:`_branch_bridge_class`)
    that overrides those two methods: mbridge has no public hook for its layer spec. Also what
    lets verl's stock engine build on a CPU machine (no ``transform``).
    """
    if not getattr(type(bridge), "megatron_branch_spec", False):
        bridge.__class__ = _branch_bridge_class(type(bridge))
    bridge.branch_transform = transform or (lambda spec: spec)


@functools.lru_cache(maxsize=None)
def _branch_bridge_class(base: type) -> type:
    """``base`` (an mbridge bridge class) with the layer spec of :func:`use_mbridge_local_spec`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    class BranchBridge(base):
        megatron_branch_spec = True
        branch_transform: Callable = staticmethod(lambda spec: spec)

        def _get_transformer_layer_spec(self, vp_stage=None):
            if HAVE_TE:
                return self.branch_transform(super()._get_transformer_layer_spec(vp_stage))
            # mbridge's own call, with Megatron's local modules
            takes_vp = "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters
            self.has_vp_stage = takes_vp  # what mbridge's builder records for its model provider
            extra = {"vp_stage": vp_stage} if takes_vp else {}
            return self.branch_transform(get_gpt_decoder_block_spec(self.config, use_transformer_engine=False,
                                                                    **extra))

        def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str):
            if not HAVE_TE:
                # local experts (SequentialMLP) under the names of TE's grouped experts: linear_fc1.weight<i>
                mcore_weights_name = _LOCAL_EXPERT.sub(r".mlp.experts.\2.weight\1", mcore_weights_name)
                for local, te in _LOCAL_TO_TE_NAMES:
                    if mcore_weights_name.endswith(local):
                        try:
                            return super()._weight_name_mapping_mcore_to_hf(mcore_weights_name[: -len(local)] + te)
                        except NotImplementedError:  # an MoE layer: its pre-MLP norm keeps the local name under TE
                            break
            return super()._weight_name_mapping_mcore_to_hf(mcore_weights_name)

    BranchBridge.__name__ = BranchBridge.__qualname__ = f"Branch{base.__name__}"
    return BranchBridge


def check_branch_model(modules) -> None:
    """Every self-attention of the built model chunks holds tree attention.

    Raises:
        ValueError: a branch self-attention whose core attention is another module (a bridge
            replaced the slot after the spec was built), naming the attention-backend option.
    """
    for chunk in modules:
        for name, module in chunk.named_modules():
            if isinstance(module, (BranchSelfAttention, BranchMLASelfAttention)):
                core = getattr(module, "core_attention", None)
                if not isinstance(core, BranchCoreAttention):
                    raise ValueError(
                        f"{ATTENTION_BACKEND_OPTION}: {name}.core_attention is {type(core).__name__}, not "
                        "megatron_branch's tree attention (a bridge replaced the slot after the layer spec was "
                        "built, e.g. Megatron-Bridge with attention_backend=local); leave attention_backend unset")
