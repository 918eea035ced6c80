"""Python 3.11 shim for Megatron-LM ``core_v0.19.0`` and later (which declare Python >= 3.12).

Put this folder first on ``PYTHONPATH`` (Python imports ``sitecustomize`` at start-up):

    PYTHONPATH=tools/python311:$MEGATRON_LM_DIR torchrun ... train_rl.py ...

Why a shim and not Python 3.12: on this project's CPU machines torch for Python 3.12 is a
CUDA build of several GB, and what Megatron-LM needs from 3.12 is one decorator. Checked
at ``core_v0.19.0`` and at ``main`` ``d98e8a64dd``: every module of ``megatron/``,
``train_rl.py`` and the builders compiles on Python 3.11 (no 3.12 syntax), and the only
3.12 API imported is ``typing.override`` (``megatron/training/models/gpt.py`` and
``hybrid.py``, imported by ``megatron.training``). ``typing_extensions.override`` is the
same decorator (PEP 698: it sets ``__override__`` and returns its argument).

Nothing else is changed, and nothing at all on Python 3.12 or later.
"""

import sys
import typing

if sys.version_info < (3, 12) and not hasattr(typing, "override"):
    from typing_extensions import override

    typing.override = override
