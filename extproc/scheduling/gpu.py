"""GPU utilisation: steer away from GPUs that are busier than a threshold.

`Load.gpu_utilization` is the busiest GPU of the upstream (0..1), from an NVIDIA DCGM exporter
(`DCGM_FI_DEV_GPU_UTIL`, configured per instance in the publisher) or from the engine itself (Triton's
`nv_gpu_utilization`). It is the share of time some kernel ran, not how much of the GPU the kernels
used: an LLM engine with any running batch reads close to 100 %, so this separates idle GPUs from busy
ones and catches GPUs shared with other work, rather than ranking busy engines; weigh it lightly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from extproc.fleet import Upstream
from extproc.openai import InferenceRequest
from extproc.scheduling.framework import SCORERS, FleetState


@SCORERS.register("gpu-utilization")
@dataclass(slots=True)
class GpuUtilizationScorer:
    """1.0 up to `threshold` (0.85, as in the seed routers), then falling linearly to 0.0 at 100 %.
    Unknown utilisation (no snapshot, or none published) is neutral: 1.0, no penalty."""

    threshold: float = 0.85

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"threshold must be within [0, 1), got {self.threshold}")

    def score(
        self, request: InferenceRequest, candidates: Sequence[Upstream], state: FleetState
    ) -> Sequence[float]:
        threshold = self.threshold
        span = 1.0 - threshold
        out = []
        for u in candidates:
            load = state.load(u.id)
            used = None if load is None else load.gpu_utilization
            if used is None or used <= threshold:
                out.append(1.0)
            else:
                out.append(max(0.0, (1.0 - used) / span))
        return out
