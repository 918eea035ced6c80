"""Numerical guards: NaN/Inf found where it first appears, reported with step, rollout and layer.

Opt-in and free when off (nothing is attached unless a :class:`FiniteGuard` is built):

    guard = FiniteGuard(ddp)                 # forward hooks on embedding, layers, final norm, output
    loss_fn = guard.wrap_loss(loss_fn)       # log-probs per rollout, then the loss value
    for step in ...:
        guard.step = step
        ... forward/backward ...             # raises NonFiniteError at the first bad value
        guard.check_grads()                  # after finalize: reduced gradients per parameter
        ... optimizer step ...
        guard.check_params()                 # an update that produced NaN/Inf
    guard.close()

What is checked, in the order training meets it:

* **activations** (forward): the output of the word embedding, of every transformer
  layer, of the final norm and of the output layer. The first non-finite one raises,
  naming the layer (stock, global name: ``decoder.layers.3``), the packed token and the
  rollouts that contain it (with tree data), and whether the layer's own parameters are
  already non-finite;
* **log-probs and the loss** (:meth:`FiniteGuard.wrap_loss`): the first rollout and token
  with a non-finite log-prob, or a non-finite loss from finite log-probs (then the
  loss's other inputs are suspect);
* **gradients** (backward): the gradient flowing into each hooked module's output; the
  first non-finite one names the module whose backward produced it;
* **reduced gradients and parameters** (:meth:`check_grads`, :meth:`check_params`): per
  parameter, after ``finalize_model_grads`` (so NaN arriving from another rank is caught)
  and after the optimizer step.

Each check is one ``isfinite().all()`` per tensor (a host sync on GPU per hooked module),
so a guarded step costs a few percent; an unguarded one nothing.
"""

from __future__ import annotations

import re
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_branch.layout import ParallelLayout
from megatron_branch.model import as_chunks, param_grad, unwrap

_LAYER = re.compile(r"^decoder\.layers\.(\d+)$")
_PARAM_LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)(\..*)$")


class NonFiniteError(FloatingPointError):
    """A NaN or Inf where training expects finite numbers; the message says where."""


def _finite(x: Tensor) -> bool:
    return bool(torch.isfinite(x).all())


def _first_bad(x: Tensor) -> Tuple[int, ...]:
    """Index of the first non-finite element."""
    return tuple(int(i) for i in (~torch.isfinite(x)).nonzero()[0])


def _kind(x: Tensor) -> str:
    bad = x[~torch.isfinite(x)]
    return "NaN" if bool(torch.isnan(bad).any()) else "Inf"


def _first_tensor(output: Any) -> Optional[Tensor]:
    if torch.is_tensor(output):
        return output
    if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        return output[0]
    return None


class FiniteGuard:
    """NaN/Inf detection on one model (a chunk or Megatron's list of chunks).

    Args:
        model: the (wrapped) GPTModel chunk(s).
        activations: hook the forward (and, through the outputs, the backward).
        enabled: False builds a guard that does nothing (no hooks), for ``if`` -free code.

    Attributes:
        step: the training step named in messages; set it each iteration.
    """

    def __init__(self, model, *, activations: bool = True, enabled: bool = True):
        self.enabled = enabled
        self.step: Optional[int] = None
        self.chunks = as_chunks(model)
        self._handles: List[Any] = []
        self._order: List[str] = []  # hooked modules in forward order (names)
        self._params: Any = None  # the packed_seq_params of the forward in flight
        if enabled and activations:
            for chunk in self.chunks:
                self._attach(unwrap(chunk))

    # ------------------------------------------------------------------ attach/close
    def _attach(self, gpt) -> None:
        names = dict(gpt.named_modules())
        self._handles.append(gpt.register_forward_pre_hook(self._remember_params, with_kwargs=True))
        picked: List[Tuple[str, torch.nn.Module]] = []
        if "embedding" in names:  # [s, b, h] (the word embedding alone is [b, s, h])
            picked.append(("embedding", names["embedding"]))
        for name, module in names.items():
            m = _LAYER.match(name)
            if m:
                number = getattr(module, "layer_number", int(m.group(1)) + 1)
                picked.append((f"decoder.layers.{number - 1}", module))
        for name in ("decoder.final_layernorm", "output_layer"):
            if name in names:
                picked.append((name, names[name]))
        for name, module in picked:
            self._order.append(name)
            self._handles.append(module.register_forward_hook(self._forward_hook(name, module), with_kwargs=True))

    def close(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._params = None

    def __enter__(self) -> "FiniteGuard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def hooks(self) -> int:
        """Hooks attached (0 when disabled)."""
        return len(self._handles)

    # ------------------------------------------------------------------------ messages
    def _where(self) -> str:
        return f"step {self.step}" if self.step is not None else "this step"

    def _next_after(self, name: str) -> str:
        i = self._order.index(name) if name in self._order else -1
        return self._order[i + 1] if 0 <= i < len(self._order) - 1 else "the loss"

    # --------------------------------------------------------------------------- hooks
    def _remember_params(self, module, args, kwargs):
        self._params = (kwargs or {}).get("packed_seq_params")
        return None

    def _forward_hook(self, name: str, module: torch.nn.Module) -> Callable:
        def hook(mod, args, kwargs, output):
            out = _first_tensor(output)
            if out is None or not out.is_floating_point():
                return None
            if not _finite(out):
                raise NonFiniteError(self._activation_message(name, module, out, kwargs))
            if out.requires_grad:
                out.register_hook(self._grad_hook(name))
            return None

        return hook

    def _grad_hook(self, name: str) -> Callable:
        def hook(grad: Tensor):
            if grad is not None and not _finite(grad):
                raise NonFiniteError(
                    f"{self._where()}: {_kind(grad)} in the gradient flowing into the output of {name} "
                    f"(backward); it arose in the backward of {self._next_after(name)}"
                )
            return None

        return hook

    def _activation_message(self, name: str, module, out: Tensor, kwargs) -> str:
        index = _first_bad(out)
        own = [n for n, p in module.named_parameters() if not _finite(p.detach())]
        cause = (f"its parameters are already non-finite ({', '.join(own[:3])})" if own
                 else "its inputs were finite, so it arose here")
        local = index[0] if out.dim() >= 1 else 0
        # the output layer runs on the rows a loss reads, not on packed positions
        token = f" at row {local}" if name == "output_layer" else self._token_of(local, self._params, out)
        return f"{self._where()}: {_kind(out)} in the forward output of {name}{token}; {cause}"

    @staticmethod
    def _token_of(local: int, params, out: Tensor) -> str:
        """`` at packed token i (position p of rollouts r...)`` when the forward got tree data."""
        tree = getattr(params, "tree", None)
        if tree is None:
            return f" at sequence position {local}"
        offset = getattr(params, "start", 0)
        expected = getattr(params, "total", 0) or 0
        cp = getattr(params, "cp", None)
        if cp is not None:  # this context-parallel rank's shard of the unit
            offset += cp.local[0]
            expected = cp.local[1] - cp.local[0]
        if expected and out.shape[0] < expected:  # sequence parallel: this TP rank's slice
            offset += ParallelLayout.current().tp_rank * out.shape[0]
        packed = offset + local
        if packed >= tree.unique_positions:
            return f" at padding token {packed}"
        rollouts = (tree.rows == packed).any(1).nonzero().flatten().tolist()
        shown = ", ".join(str(r) for r in rollouts[:8]) + (" ..." if len(rollouts) > 8 else "")
        depth = int(tree.positions[packed])
        return f" at packed token {packed} (position {depth} of rollout(s) {shown} of this micro-batch)"

    # ------------------------------------------------------------------- loss and grads
    def check_logprobs(self, lp: Tensor, rollouts: Optional[Sequence[int]] = None, what: str = "log-prob") -> None:
        """Raise :class:`NonFiniteError` naming the first rollout/token of ``lp [r, T]``
        that is not finite (``rollouts`` maps rows to global rollout ids)."""
        if not self.enabled or _finite(lp.detach()):
            return
        r, t = _first_bad(lp.detach())[:2] if lp.dim() >= 2 else (_first_bad(lp.detach())[0], 0)
        rollout = int(rollouts[r]) if rollouts is not None else r
        raise NonFiniteError(
            f"{self._where()}: {_kind(lp.detach())} {what} of rollout {rollout} at token {t + 1} "
            f"(log p(token {t + 1} | tokens <= {t}))"
        )

    def check_loss(self, loss: Tensor, rollouts: Optional[Sequence[int]] = None) -> None:
        """Raise when ``loss`` is not finite (its log-probs were, if they were checked)."""
        if not self.enabled or not torch.is_tensor(loss) or _finite(loss.detach()):
            return
        ids = "" if rollouts is None else f" on rollouts {_short(rollouts)}"
        raise NonFiniteError(
            f"{self._where()}: {_kind(loss.detach())} loss from loss_fn{ids} although its log-probs are "
            f"finite; check the loss's other inputs (advantages, old/reference log-probs, mask)"
        )

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """``loss_fn(lp, ids)`` with its log-probs and loss checked (returns it unchanged when disabled)."""
        if not self.enabled:
            return loss_fn

        def guarded(lp, ids, *args, **kwargs):
            rollouts = ids.tolist() if torch.is_tensor(ids) else ids
            self.check_logprobs(lp, rollouts)
            result = loss_fn(lp, ids, *args, **kwargs)
            loss = result[0] if isinstance(result, (tuple, list)) else result
            self.check_loss(loss, rollouts)
            return result

        return guarded

    def _named(self):
        for chunk in self.chunks:
            gpt = unwrap(chunk)
            for name, p in gpt.named_parameters():
                m = _PARAM_LAYER.match(name)
                if m:
                    layer = gpt.decoder.layers[int(m.group(2))]
                    name = f"{m.group(1)}{layer.layer_number - 1}{m.group(3)}"
                yield name, p

    def check_grads(self) -> None:
        """Raise naming the parameters whose accumulated gradient (``main_grad`` under
        Megatron DDP) is not finite; call after the backward/``finalize_model_grads``."""
        if not self.enabled:
            return
        bad = [n for n, p in self._named() if (g := param_grad(p)) is not None and not _finite(g)]
        if bad:
            raise NonFiniteError(f"{self._where()}: non-finite gradient in {_short(bad)}")

    def check_params(self) -> None:
        """Raise naming the parameters that are not finite (e.g. after an optimizer step)."""
        if not self.enabled:
            return
        bad = [n for n, p in self._named() if not _finite(p.detach())]
        if bad:
            raise NonFiniteError(f"{self._where()}: non-finite parameters after the update: {_short(bad)}")


def _short(items: Sequence, limit: int = 4) -> str:
    items = list(items)
    head = ", ".join(str(i) for i in items[:limit])
    return head + (f" and {len(items) - limit} more" if len(items) > limit else "")
