"""Optional dependencies, checked in one place.

Transformer Engine is probed without importing megatron's TE wrappers: a half-installed
TE raises ``RuntimeError`` (not ``ImportError``) on import, which is treated as absent.
"""

from __future__ import annotations

import importlib.util


def _probe(module: str) -> bool:
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


HAVE_TE: bool = _probe("transformer_engine")
HAVE_MODELOPT: bool = importlib.util.find_spec("modelopt") is not None
