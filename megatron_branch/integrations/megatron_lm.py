"""Megatron-LM entry point: ``--spec megatron_branch.integrations.megatron_lm branch_layer_spec``.

Megatron-LM's GPT builder (``gpt_builders.py``, releases ``core_v0.16.1`` to
``core_v0.19.0``) resolves ``--spec MODULE NAME`` to the object ``NAME`` of ``MODULE`` and
passes it to ``GPTModel`` as the layer spec, without calling it. ``branch_layer_spec`` is
therefore a spec that builds itself from Megatron-LM's parsed arguments the first time
GPTModel reads it: the layer (or, for MoE layer patterns, block) spec Megatron-LM would
have built without ``--spec`` — ``--normalization``, ``--qk-layernorm``,
``--num-experts``/``--moe-layer-freq``/``--moe-grouped-gemm``,
``--transformer-impl``, ``--multi-latent-attention``,
``--experimental-attention-variant gated_delta_net`` with ``--linear-attention-freq``, ... —
with tree attention in every attention layer and the tree recurrence in every Gated DeltaNet layer
(:func:`megatron_branch.spec.apply_branch_attention`), and for MoE the routers that keep
naive-batch statistics (:func:`megatron_branch.spec.moe.apply_branch_moe`). Model dimensions (``--kv-channels``
and the rest) live in the ``TransformerConfig``, which Megatron-LM builds as usual.

The tree-attention kernel comes from ``$MEGATRON_BRANCH_KERNEL`` (``flash_varlen``,
``efficient_varlen``, ``flash_cpu``, ``flash_cuda`` or ``math``; unset: by device and dtype),
read and checked when the spec is built and logged once
(:mod:`megatron_branch.integrations.options`): ``--spec`` imports a fixed object, and stock
``pretrain_gpt.py`` has no place for an argument of ours.

Use :func:`branch_spec_from_args` to build the spec yourself (e.g. in a model provider).
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_branch._deps import HAVE_TE
from megatron_branch._megatron import (
    ModuleSpec,
    TransformerBlock,
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_transformer_block_with_experimental_attention_variant_spec,
)
from megatron_branch.integrations.options import KERNEL_ENV, check_kernel, describe_kernel, kernel_from_env, log_once
from megatron_branch.spec import apply_branch_attention, apply_branch_moe, get_branch_layer_spec
from megatron_branch.spec.stock_hybrid import get_local_hybrid_block_spec


def spec_kernel(kernel: Optional[str] = None) -> Optional[str]:
    """The tree-attention kernel of a spec built from Megatron-LM's arguments: ``kernel``
    if given, else ``$MEGATRON_BRANCH_KERNEL``, else ``None`` (the default by device and
    dtype). Logged once per process.

    Raises:
        ValueError: a name that is not a kernel, or ``kernel`` and the variable naming two.
    """
    from_env = kernel_from_env()
    kernel = check_kernel(kernel, "kernel")
    if kernel is not None and from_env is not None and kernel != from_env:
        raise ValueError(f"kernel: {kernel!r} given, but {KERNEL_ENV}={from_env}; unset one of them")
    chosen = kernel if kernel is not None else from_env
    if kernel is not None:
        source = "argument"
    else:
        source = f"${KERNEL_ENV}" if from_env is not None else f"${KERNEL_ENV} unset"
    log_once(f"megatron_branch: tree-attention kernel {describe_kernel(chosen)} ({source})")
    return chosen


def branch_spec_from_args(args, config=None, vp_stage: Optional[int] = None, kernel: Optional[str] = None):
    """The branch spec for Megatron-LM's parsed ``args``.

    Args:
        args: Megatron-LM's argument namespace (``megatron.training.get_args()``).
        config: the model's ``TransformerConfig`` (needed for MoE layer patterns; built
            from ``args`` with Megatron-LM's ``core_transformer_config_from_args`` if None).
        vp_stage: the virtual pipeline stage (block specs are per stage).
        kernel: the tree-attention kernel; ``None``: ``$MEGATRON_BRANCH_KERNEL``, else the
            default by device and dtype (:func:`spec_kernel`).

    Raises:
        ValueError: options the branch spec cannot honour exactly (experimental
            attention variants other than ``gated_delta_net``, ``--mla-down-proj-fusion``,
            ``--qk-l2-norm``, heterogeneous
            layers, multi-token prediction, attention dropout, ``--attention-backend
            local``, ``--transformer-impl`` other than ``local``/``transformer_engine``),
            or an unknown kernel (``MEGATRON_BRANCH_KERNEL=...`` named).
    """
    variant = getattr(args, "experimental_attention_variant", None)
    if variant not in (None, "gated_delta_net"):
        raise ValueError(f"--experimental-attention-variant {variant}: not supported by the branch spec "
                         "(gated_delta_net is)")
    for flag, what in (("mla_down_proj_fusion", "--mla-down-proj-fusion"),
                       ("qk_l2_norm", "--qk-l2-norm"),
                       ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path"),
                       # gpt_builder builds MTP layers from Megatron's stock layer specs
                       ("mtp_num_layers", "--mtp-num-layers")):
        if getattr(args, flag, None):
            raise ValueError(f"{what}: not supported by the branch spec")
    if getattr(args, "transformer_impl", "local") not in ("local", "transformer_engine"):
        raise ValueError(f"--transformer-impl {args.transformer_impl}: the branch spec builds on the local "
                         "or transformer_engine layers")
    backend = getattr(args, "attention_backend", None)
    if getattr(backend, "name", backend) == "local":
        # core_v0.19.0's GPTModelConfig.build_model swaps the spec's core attention for Megatron's
        # DotProductAttention under this backend, which would drop the tree attention
        raise ValueError("--attention-backend local: Megatron-LM replaces the spec's core attention with its "
                         "own under it, dropping the tree attention; leave the default (auto)")
    if getattr(args, "attention_dropout", 0.0):
        raise ValueError(f"--attention-dropout: branch replay is exact only without dropout, got "
                         f"{args.attention_dropout}; pass --attention-dropout 0")
    use_te = getattr(args, "transformer_impl", "local") == "transformer_engine"
    if use_te:
        if not HAVE_TE:
            raise ValueError("--transformer-impl transformer_engine: Transformer Engine is not importable "
                             "here; pass --transformer-impl local")
    kernel = spec_kernel(kernel)  # checked before the base spec is built, logged once
    if variant == "gated_delta_net":
        # Qwen3-Next / Qwen3.5 layout: GDN and attention layers from --linear-attention-freq
        if config is None:
            # Megatron-LM is an optional checkout, importable only inside its own runs
            from megatron.training.arguments import core_transformer_config_from_args

            config = core_transformer_config_from_args(args)
        if use_te:
            base = get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage)
        else:
            base = get_local_hybrid_block_spec(config, normalization=args.normalization,
                                               qk_layernorm=args.qk_layernorm)
    elif getattr(args, "num_experts", None):
        if config is None:
            # Megatron-LM is an optional checkout, importable only inside its own runs
            from megatron.training.arguments import core_transformer_config_from_args

            config = core_transformer_config_from_args(args)
        base = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                normalization=args.normalization, vp_stage=vp_stage)
    elif use_te:
        base = get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=args.qk_layernorm, moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
            multi_latent_attention=bool(getattr(args, "multi_latent_attention", False)))
    else:
        base = get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm,
                                        multi_latent_attention=bool(getattr(args, "multi_latent_attention", False)))
    spec = apply_branch_attention(base, kernel=kernel)
    # router statistics weighted by multiplicity (naive-batch aux/z losses and counts); a no-op without MoE layers
    return apply_branch_moe(spec)


class ArgsBranchSpec(ModuleSpec):
    """A ``ModuleSpec`` whose ``module``/``params``/``submodules`` are those of
    :func:`branch_spec_from_args` for Megatron-LM's global arguments, resolved on first use
    (after Megatron-LM has parsed its arguments and initialised parallel state)."""

    def __init__(self):  # no dataclass fields: everything is resolved lazily
        object.__setattr__(self, "_resolved", None)

    def _spec(self):
        if self._resolved is None:
            try:
                from megatron.training import get_args
            except ImportError as exc:
                raise ImportError(
                    "branch_layer_spec is built from Megatron-LM's parsed arguments, but megatron.training "
                    f"is not importable here ({exc}); outside Megatron-LM use get_branch_spec(...) or "
                    "branch_spec_from_args(args)"
                ) from exc
            args = get_args()
            if getattr(args, "num_experts", None) and getattr(args, "virtual_pipeline_model_parallel_size", None):
                # One object serves every model chunk, but MoE block specs differ per chunk.
                raise ValueError(
                    "--virtual-pipeline-model-parallel-size: with --num-experts the branch spec is per "
                    "virtual stage; build it in a model provider with branch_spec_from_args(args, config, vp_stage)")
            spec = branch_spec_from_args(args)
            if not isinstance(spec, ModuleSpec):  # a block spec (MoE layer pattern)
                spec = ModuleSpec(module=TransformerBlock, submodules=spec)
            object.__setattr__(self, "_resolved", spec)
        return self._resolved

    @property
    def module(self) -> Any:  # type: ignore[override]
        return self._spec().module

    @property
    def params(self) -> dict:  # type: ignore[override]
        return self._spec().params

    @property
    def submodules(self) -> Any:  # type: ignore[override]
        return self._spec().submodules

    def __repr__(self) -> str:
        return "ArgsBranchSpec(resolved from Megatron-LM's arguments)"


branch_layer_spec = ArgsBranchSpec()


def get_branch_spec(normalization: str = "RMSNorm", qk_layernorm: bool = False, **kwargs):
    """The branch layer spec for explicit options (outside Megatron-LM's argument parser)."""
    return get_branch_layer_spec(normalization=normalization, qk_layernorm=qk_layernorm, **kwargs)
