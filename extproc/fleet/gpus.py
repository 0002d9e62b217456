"""Nominal prefill speed by GPU model: a prior for an engine whose prefill rate is not measured yet.

Prefill is compute-bound, so a GPU's dense BF16/FP16 tensor throughput orders engines of the same
model well enough to start with: `predicted-ttft` uses these figures (relative, not absolute) until
the engines' counters give measured rates (publishers/prefill_rate.py), which replace them. Without
it, a mixed fleet's first seconds treat an A10G like an H100 (~14x apart) and long prompts queue on
the slow ones.

Names are what NVIDIA's DCGM exporter puts in its `modelName` label ("NVIDIA H100 80GB HBM3",
"NVIDIA A10G", "Tesla T4") or what an operator writes in the publisher's `gpu:`; matched by the
first pattern that fits, most specific first. Figures: dense tensor TFLOPS, BF16 where the GPU has it
(FP16 otherwise), from the vendors' datasheets (nvidia.com product pages: H100, H200, B200, A100,
L40S, L40, L4, A10, T4, V100, RTX 4090, RTX A6000; amd.com: Instinct MI300X, MI250X). The A10G (AWS
G5) has no public datasheet; 70 is the figure the simulated profile assumes (lab/engines/profiles.py).
"""

from __future__ import annotations

import functools
import re

# (pattern, dense tensor TFLOPS). Order matters: "H100 PCIe" before "H100", "L40S" before "L40"
# before "L4", "A100" and "A10G" before "A10".
GPU_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bGB200\b|\bB200\b", 2250.0),
    (r"\bB100\b", 1750.0),
    (r"\bGH200\b|\bH200\b", 989.0),
    (r"\bH100\b.*\bPCIE\b", 756.0),
    (r"\bH100\b.*\bNVL\b", 835.0),
    (r"\bH100\b", 989.0),
    (r"\bH800\b", 989.0),
    (r"\bH20\b", 148.0),
    (r"\bA100\b", 312.0),
    (r"\bA800\b", 312.0),
    (r"\bL40S\b", 362.0),
    (r"\bL40\b", 181.0),
    (r"\bL4\b", 121.0),
    (r"\bA10G\b", 70.0),
    (r"\bA10\b", 125.0),
    (r"\bA6000\b", 155.0),
    (r"\bRTX\s*4090\b", 165.0),
    (r"\bT4\b", 65.0),
    (r"\bV100\b", 125.0),
    (r"\bMI3[02]5X\b|\bMI300X\b", 1307.0),
    (r"\bMI250X?\b", 383.0),
)
_COMPILED = tuple((re.compile(p, re.IGNORECASE), t) for p, t in GPU_TFLOPS)
MAX_GPU_NAME = 64


@functools.lru_cache(maxsize=256)
def gpu_speed(name: str | None) -> float | None:
    """The GPU's nominal prefill speed (dense tensor TFLOPS; only ratios matter), or None when the
    name is empty or not in the table. Cached: every view rebuild asks for each instance's name, and
    a fleet has a handful of GPU names."""
    if not name:
        return None
    for pattern, tflops in _COMPILED:
        if pattern.search(name):
            return tflops
    return None
