"""Sampling temperature: log-probs of ``softmax(logits / T)``, as the rollout engine sampled.

Every RL stack (verl's logits processor, slime, NeMo-RL, Megatron-RL) divides the logits
by the rollout's sampling temperature before the log-probs and the entropy; old
log-probs from the rollout engine are at that temperature. Rollouts of one batch may have
been sampled at different temperatures, and a logits row of a shared token then serves
rollouts of several: each such row is scored once per distinct temperature (the output
layer still runs once; only the softmax is repeated), and every rollout reads the column
of its own temperature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from megatron_branch.model import HOST

Temperature = Union[float, int, Sequence[float], Tensor]


@dataclass(frozen=True)
class Temperatures:
    """The distinct temperatures of a batch and each rollout's column among them.

    Attributes:
        values: ``[k]`` float32, the distinct temperatures (ascending; ``k >= 1``).
        column: ``[R]`` long, the index in ``values`` of each rollout's temperature.
    """

    values: Tensor
    column: Tensor

    @property
    def count(self) -> int:
        return int(self.values.numel())

    @property
    def is_one(self) -> bool:
        """Plain log-probs (one temperature, 1.0): no division at all."""
        return self.count == 1 and float(self.values[0]) == 1.0

    @classmethod
    def of(cls, temperature: Optional[Temperature], num_rollouts: int) -> "Temperatures":
        """Validate ``temperature`` (a number, or one value per rollout) for ``num_rollouts``.

        Raises:
            ValueError: a value that is not a finite number > 0 (the rollout named), or a
                per-rollout list of the wrong length.
        """
        if temperature is None:
            temperature = 1.0
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
            value = float(temperature)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"temperature: must be a finite number > 0, got {temperature}")
            return cls(torch.tensor([value], dtype=torch.float32, device=HOST),
                       torch.zeros(num_rollouts, dtype=torch.long, device=HOST))
        try:
            per = torch.as_tensor(temperature, dtype=torch.float64, device=HOST).reshape(-1)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"temperature: a number or one number per rollout, got {type(temperature).__name__} "
                             f"({exc})") from None
        if per.numel() != num_rollouts:
            raise ValueError(f"temperature: {per.numel()} values for {num_rollouts} rollouts (give one per rollout, "
                             "or a single number)")
        bad = (~torch.isfinite(per) | (per <= 0)).nonzero()
        if bad.numel():
            r = int(bad[0])
            raise ValueError(f"rollout {r}: temperature must be a finite number > 0, got {float(per[r])}")
        values, column = torch.unique(per.float(), return_inverse=True)
        return cls(values, column.reshape(-1))

    def select(self, rollouts: Tensor) -> "Temperatures":
        """The temperatures of a subset of rollouts (same ``values``)."""
        return Temperatures(self.values, self.column[rollouts.to(HOST)])


def micro_batch_temperatures(temperature: Optional[Temperature], rollouts: Tensor,
                             batch_size: Optional[int] = None) -> "Temperatures":
    """The :class:`Temperatures` of a micro-batch whose rollouts are ``rollouts`` (indices
    into the global batch): a single number applies to all; one value per rollout of the
    global batch (``batch_size`` of them, when known) is selected.

    Raises:
        ValueError: as :meth:`Temperatures.of`, for the global batch.
    """
    if temperature is None or (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)):
        return Temperatures.of(temperature, int(rollouts.numel()))
    per = torch.as_tensor(temperature, dtype=torch.float64, device=HOST).reshape(-1)
    total = batch_size if batch_size is not None else per.numel()
    Temperatures.of(per, total)  # validates the global batch's values, naming the rollout
    return Temperatures.of(per[rollouts.to(HOST)], int(rollouts.numel()))
