"""Device discipline, checked on the CPU: what would put a tensor on the wrong device on a GPU.

On a CPU-only machine every tensor is on the CPU, so a tensor that a GPU run would leave
on the host (a factory without ``device=``, then used with CUDA tensors or handed to an
NCCL collective) goes unnoticed. Two checks make it visible here:

* :class:`FactoryAudit` (a ``TorchFunctionMode``) records every tensor factory
  (``torch.zeros``, ``torch.tensor``, ``torch.arange``, ...) called from the package's own
  code without a ``device`` argument. The rule: every tensor the package creates names
  its device — the model's, or ``"cpu"`` for host bookkeeping that is moved explicitly.
* :func:`collective_audit` wraps ``torch.distributed``'s collectives and records every
  call (the package's, or megatron-core's on a tensor the package handed it) on a tensor
  the package created or moved to the host on purpose (a factory with ``device="cpu"``,
  ``.cpu()``, ``.to("cpu")``) or derived from one: NCCL rejects host tensors.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from typing import Dict, List

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_branch") + os.sep
# audited code: the package, and the examples users copy from
SCOPES = (PACKAGE, os.path.join(ROOT, "examples") + os.sep)
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.linspace,
             torch.eye, torch.rand, torch.randn, torch.randint, torch.as_tensor}
HOST_MOVES = {torch.Tensor.cpu, torch.Tensor.numpy}
# (isend/irecv stay unwrapped: P2POp checks them by identity; their tensors are checked
# where they are batched, in batch_isend_irecv)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "reduce", "all_to_all_single", "batch_isend_irecv")


# frames passed through to find who called: torch's own, this module, and the package's
# CPU shim, whose cuda_factories_on_cpu mode forwards megatron-core's calls
TRANSPARENT = ("torch" + os.sep, os.path.join("tests", "device_audit.py"), os.path.join(PACKAGE, "cpu.py"))


def _package_caller() -> str:
    """``file:line`` of the audited code that called directly (``""`` for any other
    caller, e.g. megatron-core's own code, which the package calls and cannot change)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if any(t in path for t in TRANSPARENT) and not path.startswith(SCOPES[1]):
            frame = frame.f_back
            continue
        return f"{os.path.relpath(path, ROOT)}:{frame.f_lineno}" if path.startswith(SCOPES) else ""
    return ""


class _TensorSet:
    """Tensors by identity (a ``WeakSet`` would compare tensors elementwise), with the
    place each was made."""

    def __init__(self):
        self._ids: Dict[int, str] = {}

    def add(self, t: torch.Tensor, where: str) -> None:
        key = id(t)
        if key not in self._ids:
            self._ids[key] = where
            weakref.finalize(t, self._ids.pop, key, None)

    def where(self, t: torch.Tensor) -> str:
        return self._ids.get(id(t), "")

    def __contains__(self, t) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self._ids


def _is_host(device) -> bool:
    """A deliberate host device: the package's ``HOST`` (by identity) or the literal "cpu"
    (a device taken from the model is another object, even on a CPU machine)."""
    from megatron_branch.model import HOST

    return device is HOST or device == "cpu"


class FactoryAudit(TorchFunctionMode):
    """Records package factory calls without ``device=`` (``missing``) and marks the
    tensors the package puts on the host on purpose (``host``)."""

    def __init__(self):
        super().__init__()
        self.missing: List[str] = []
        self.host = _TensorSet()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES:
            where = _package_caller()
            if where:
                if "device" not in kwargs:
                    self.missing.append(f"{where}: torch.{func.__name__} without device=")
                elif _is_host(kwargs["device"]) and isinstance(out, torch.Tensor):
                    self.host.add(out, where)
        elif func in HOST_MOVES or (func is torch.Tensor.to and _to_host(args, kwargs)):
            where = _package_caller()
            if isinstance(out, torch.Tensor) and where:
                self.host.add(out, where)
        elif isinstance(out, torch.Tensor):
            hosts = [a for a in args if a in self.host]
            # derived from a host tensor with no device-side operand: still on the host
            if hosts and not any(isinstance(a, torch.Tensor) and a not in self.host and a.dim() > 0 for a in args):
                self.host.add(out, self.host.where(hosts[0]))
        return out


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and _is_host(target)


@contextlib.contextmanager
def collective_audit(factories: FactoryAudit):
    """Inside, ``torch.distributed`` collectives called from the package record host
    tensors in ``factories.bad_collectives``."""
    factories.bad_collectives = []
    saved = {}

    def wrap(name, fn):
        def checked(*args, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            tensors += [op.tensor for a in args if isinstance(a, (list, tuple)) for op in a
                        if isinstance(op, dist.P2POp)]
            for t in tensors:
                if t in factories.host:  # whoever calls (the package, or megatron-core on its behalf)
                    caller = _package_caller() or "megatron-core"
                    factories.bad_collectives.append(
                        f"{caller}: dist.{name} on a host tensor made at {factories.host.where(t)} "
                        "(NCCL needs CUDA tensors)")
            return fn(*args, **kwargs)

        return checked

    for name in COLLECTIVES:
        if hasattr(dist, name):
            saved[name] = getattr(dist, name)
            setattr(dist, name, wrap(name, saved[name]))
    try:
        yield factories
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def device_audit():
    """Both audits; yields the :class:`FactoryAudit` (``missing``, ``bad_collectives``)."""
    audit = FactoryAudit()
    with audit, collective_audit(audit):
        yield audit
