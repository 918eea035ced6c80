"""FP8 numerics without a GPU: nvidia-modelopt fake quantisation of a Megatron GPTModel.

On GPU machines real FP8 GEMMs come from Transformer Engine
(``get_branch_layer_spec(use_te=True)`` + ``TransformerConfig(fp8="hybrid")``). On CPU,
:func:`emulate_fp8` inserts ModelOpt's FP8 quantisers (``FP8_DEFAULT_CFG``: E4M3 weights and
activations, per-tensor scales) into the linear layers, calibrates their ranges with a
forward loop and leaves the model trainable (straight-through gradients), so branch
replay under FP8 rounding can be compared with the naive computation under the same
rounding. Tree attention itself is not quantised, as with TE.
"""

from __future__ import annotations

from typing import Callable

from megatron_branch._deps import HAVE_MODELOPT


def emulate_fp8(model, calibrate: Callable[[object], None], config: str = "FP8_DEFAULT_CFG"):
    """Quantise ``model`` in place with ModelOpt's ``config`` after running ``calibrate(model)``.

    Calibrate the branch and the naive model on the same tokens (e.g. the tree vs its
    rollouts one by one) so that both get the same scales.

    Raises:
        ValueError: nvidia-modelopt is not installed (the ``[modelopt]`` extra).
    """
    if not HAVE_MODELOPT:
        raise ValueError("emulate_fp8: nvidia-modelopt is not installed; pip install -e '.[modelopt]'")
    import modelopt.torch.quantization as mtq

    if not hasattr(mtq, config):
        raise ValueError(f"config: modelopt has no quantisation config {config!r}")
    return mtq.quantize(model, getattr(mtq, config), calibrate)
