"""The parallel layout of this process, read from Megatron's ``parallel_state`` in one place.

Like torchtitan's ``ParallelDims``: one validated object with every size, rank and
process group the package needs (tensor, context, pipeline, data, expert and
expert-tensor parallelism), instead of ``parallel_state.get_*`` calls spread over the
files. Before Megatron is initialised the layout is a single process (every size 1,
no groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch.distributed as dist

from megatron_branch._megatron import parallel_state


def check_sizes(world: int, tp: int = 1, pp: int = 1, cp: int = 1) -> int:
    """The data-parallel size of ``world`` ranks split into ``tp x pp x cp`` model-parallel groups.

    Raises:
        ValueError: a size below 1, or ``tp x pp x cp`` not dividing ``world`` (sizes named).
    """
    for name, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                       ("context_parallel_size", cp)):
        if int(size) < 1:
            raise ValueError(f"{name}: must be >= 1, got {size}")
    model_parallel = tp * pp * cp
    if world % model_parallel:
        raise ValueError(f"tensor/pipeline/context parallel sizes {tp}x{pp}x{cp} do not divide world size {world}")
    return world // model_parallel


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes, ranks and groups of this process's parallel layout.

    Attributes:
        world: ranks in the default process group.
        tp, cp, pp, dp, ep, etp: tensor, context, pipeline, data, expert and
            expert-tensor parallel sizes.
        tp_rank, cp_rank, pp_rank, dp_rank, ep_rank: this process's rank in each.
        tp_group, cp_group, pp_group, dp_group, ep_group, etp_group: Megatron's groups
            (``None`` before Megatron is initialised).
    """

    world: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    tp_rank: int = 0
    cp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    ep_rank: int = 0
    tp_group: Optional[dist.ProcessGroup] = None
    cp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    ep_group: Optional[dist.ProcessGroup] = None
    etp_group: Optional[dist.ProcessGroup] = None

    def __post_init__(self):
        if self.world % (self.tp * self.cp * self.pp):
            raise ValueError(f"parallel layout: tp {self.tp} x cp {self.cp} x pp {self.pp} does not divide "
                             f"world {self.world}")

    @classmethod
    def current(cls) -> "ParallelLayout":
        """The layout Megatron's ``parallel_state`` holds now (one process before it is initialised)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if not parallel_state.model_parallel_is_initialized():
            return cls(world=world, dp=world)
        ps = parallel_state
        return cls(
            world=world,
            tp=ps.get_tensor_model_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            dp=ps.get_data_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(),
            etp=ps.get_expert_tensor_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            tp_group=ps.get_tensor_model_parallel_group(),
            cp_group=ps.get_context_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            dp_group=ps.get_data_parallel_group(),
            ep_group=ps.get_expert_model_parallel_group(),
            etp_group=ps.get_expert_tensor_parallel_group(),
        )

    @property
    def initialized(self) -> bool:
        """Megatron's groups exist."""
        return self.tp_group is not None

    @property
    def first_stage(self) -> bool:
        """This rank runs the first pipeline stage (the embedding)."""
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        """This rank runs the last pipeline stage (the output layer)."""
        return self.pp_rank == self.pp - 1

    def group(self, kind: str) -> Optional[dist.ProcessGroup]:
        """The group of ``kind`` (``"tp"``, ``"cp"``, ...) when it has more than one rank, else None."""
        if getattr(self, kind) <= 1:
            return None
        return getattr(self, f"{kind}_group")

    def sizes(self) -> Dict[str, int]:
        """``{"world", "tp", "pp", "cp", "dp"}``: what a checkpoint records of the layout."""
        return {"world": self.world, "tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp}
