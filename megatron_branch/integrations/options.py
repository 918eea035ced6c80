"""The tree-attention kernel and the streaming budget, as the integrations read them.

Each stack names the two choices its own way; this module checks a value once, where the
integration reads it, and raises ``ValueError`` naming that option:

* Megatron-LM: the kernel from ``$MEGATRON_BRANCH_KERNEL`` (:data:`KERNEL_ENV`), read
  where the branch spec is built from Megatron-LM's arguments (``--spec`` imports a fixed
  object, and an unpatched ``pretrain_gpt.py`` has no argument to add); the budget from
  Megatron-RL's ``--rl-branch-replay-max-chunk-tokens`` (the ``patches/megatron-lm-*`` flag).
* verl: ``kernel`` and ``max_chunk_tokens`` under the engine config's
  ``override_mcore_model_config.branch`` (:func:`verl_branch_options`), a free-form dict
  verl hands through unread.

Kernels (:func:`kernel_names`): the varlen kernels ``flash_varlen`` / ``efficient_varlen``
and the piece kernels ``flash_cpu``, ``flash_cuda``, ``math``; ``None`` picks by device and
dtype (:func:`~megatron_branch.attention.kernels.default_kernel`). :func:`log_once` tells
the log which choice is in use, once per process.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from megatron_branch.attention.kernels import KERNELS
from megatron_branch.attention.varlen import VARLEN_KERNELS

logger = logging.getLogger(__name__)

KERNEL_ENV = "MEGATRON_BRANCH_KERNEL"
VERL_BRANCH_KEY = "megatron.override_mcore_model_config.branch"
DEFAULT_KERNEL = ("default by device and dtype: flash_cpu on CPU; on CUDA flash_varlen for bf16/fp16, "
                  "efficient_varlen for float32")

_logged = set()


def kernel_names() -> Tuple[str, ...]:
    """Every kernel name the branch spec accepts."""
    return tuple(VARLEN_KERNELS) + tuple(KERNELS)


def check_kernel(value, option: str) -> Optional[str]:
    """``value`` as a kernel name (``None`` or ``""``: the default).

    Raises:
        ValueError: not a kernel name; ``option`` is named.
    """
    if value is None or value == "":
        return None
    if not isinstance(value, str) or value not in kernel_names():
        raise ValueError(f"{option}: {value!r} is not a tree-attention kernel; use one of {kernel_names()} "
                         "(or leave it unset for the default by device and dtype)")
    return value


def check_max_chunk_tokens(value, option: str) -> Optional[int]:
    """``value`` as a streaming budget in tokens (``None`` or ``""``: one pass per tree).

    Raises:
        ValueError: not a positive whole number; ``option`` is named.
    """
    if value is None or value == "":
        return None
    tokens = None
    if isinstance(value, int) and not isinstance(value, bool):
        tokens = value
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        tokens = int(value)
    if tokens is None:
        raise ValueError(f"{option}: {value!r} is not a whole number of tokens")
    if tokens < 1:
        raise ValueError(f"{option}: must be a positive number of tokens, got {tokens}")
    return tokens


def kernel_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The kernel named by ``$MEGATRON_BRANCH_KERNEL`` (``None`` when unset or empty).

    Raises:
        ValueError: ``MEGATRON_BRANCH_KERNEL=...`` is not a kernel name.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(KERNEL_ENV, "").strip()
    return check_kernel(value, f"{KERNEL_ENV}={value}")


def describe_kernel(kernel: Optional[str]) -> str:
    """The kernel as the log names it."""
    return kernel if kernel is not None else DEFAULT_KERNEL


def describe_budget(max_chunk_tokens: Optional[int]) -> str:
    """The streaming budget as the log names it."""
    return "one pass per tree" if max_chunk_tokens is None else f"at most {max_chunk_tokens} tokens per forward"


def log_once(message: str, level: int = logging.INFO) -> None:
    """Log ``message`` the first time this process sees it."""
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


@dataclass(frozen=True)
class BranchOptions:
    """The two choices: tree-attention ``kernel`` (``None``: default) and streaming
    ``max_chunk_tokens`` (``None``: one pass)."""

    kernel: Optional[str] = None
    max_chunk_tokens: Optional[int] = None


def verl_branch_options(engine_config) -> BranchOptions:
    """The choices in verl's Megatron engine config: ``override_mcore_model_config.branch``,
    a dict with ``kernel`` and ``max_chunk_tokens`` (both optional).

    verl 0.9.1 reads only ``moe_config`` from ``override_mcore_model_config``, and its
    ``McoreEngineConfig`` refuses keys it does not declare, so the choices live there
    (``+actor_rollout_ref.actor.megatron.override_mcore_model_config.branch.kernel=...``).

    Raises:
        ValueError: a ``branch`` that is not a dict, a key other than the two, a kernel
            that is not one, a budget that is not a positive number; the key is named.
    """
    overrides = getattr(engine_config, "override_mcore_model_config", None) or {}
    branch = overrides.get("branch") if isinstance(overrides, Mapping) else None
    if branch is None:
        return BranchOptions()
    if not isinstance(branch, Mapping):
        raise ValueError(f"{VERL_BRANCH_KEY}: expected a dict with kernel and/or max_chunk_tokens, got {branch!r}")
    unknown = sorted(set(branch) - {"kernel", "max_chunk_tokens"})
    if unknown:
        raise ValueError(f"{VERL_BRANCH_KEY}.{unknown[0]}: unknown key; megatron_branch reads kernel and "
                         "max_chunk_tokens")
    return BranchOptions(
        kernel=check_kernel(branch.get("kernel"), f"{VERL_BRANCH_KEY}.kernel"),
        max_chunk_tokens=check_max_chunk_tokens(branch.get("max_chunk_tokens"),
                                                f"{VERL_BRANCH_KEY}.max_chunk_tokens"),
    )
