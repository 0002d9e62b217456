"""How fast each candidate prefills, in the engine's tokens per second: what `predicted-ttft` divides
work by and what `bounded-load` shares new work by.

The figure comes from the engines' own counters where published (snapshots' `prefill_tokens_per_s`,
publishers/prefill_rate.py), else from the configured guess:

- Measured rates within `tolerance` of each other are one GPU type measured with noise and get their
  group's upper quartile: a busy engine's prefills share steps with its decodes, so its samples read
  low, never high; a lower reading is load, which the scheduler counts on its own (its queue), not a
  slower GPU. An H100 next to an A10G (~14x) stays its own group.
- The slowest group's figure is the base rate; the configured `prefill_tokens_per_s` stands in only
  until some candidate is measured.
- An upstream not measured yet counts as the fastest group (one taken for slow would get too little
  traffic ever to be measured), unless its snapshots name a GPU in fleet/gpus.py's table
  (`gpu_prior`): then its GPU's nominal speed, scaled to the measured ones (`_with_prior`), so a
  mixed fleet starts out balanced.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.fleet import Load, Upstream

GROUP_QUANTILE = 0.75  # the figure of a group of alike readings (readings err low: see above)


def prefill_rates(
    candidates: Sequence[Upstream],
    loads: Sequence[Load | None],
    *,
    configured: float,
    tolerance: float,
    measured: bool = True,
    gpu_prior: bool = True,
) -> dict[str, float]:
    """Prefill tokens/s per candidate id (engine tokens), capacity weight included."""
    speed: dict[str, float] = {}
    nominal: dict[str, float] = {}
    if measured:
        for u, load in zip(candidates, loads, strict=True):
            if load is None:
                continue
            if load.prefill_tokens_per_s:
                speed[u.id] = load.prefill_tokens_per_s / u.weight
            if gpu_prior and load.gpu_speed:
                nominal[u.id] = load.gpu_speed / u.weight
    base = configured
    if speed:
        speed = _grouped(speed, tolerance)
        slowest = min(speed.values())
        base = slowest
        speed = {uid: r / slowest for uid, r in speed.items()}
    if len(speed) < len(candidates) and nominal:
        speed = _with_prior(speed, nominal)
    fastest = max(speed.values()) if speed else 1.0
    return {u.id: base * u.weight * speed.get(u.id, fastest) for u in candidates}


def _with_prior(measured: dict[str, float], nominal: dict[str, float]) -> dict[str, float]:
    """Relative speeds with unmeasured upstreams filled in from their GPUs' nominal speeds.

    With measurements, a nominal figure is scaled by the median ratio of measured to nominal speed
    over the upstreams that have both (how this model runs on these GPUs); with none to compare,
    nominal speeds alone order the upstreams whenever nothing is measured yet."""
    out = dict(measured)
    if measured:
        ratios = sorted(measured[uid] / nominal[uid] for uid in measured if uid in nominal)
        if not ratios:
            return out
        scale = ratios[len(ratios) // 2]
    else:
        scale = 1.0 / min(nominal.values())
    for uid, n in nominal.items():
        if uid not in out:
            out[uid] = n * scale
    return out


def _grouped(rates: dict[str, float], tolerance: float) -> dict[str, float]:
    """Rates sorted and split where one is more than `tolerance` x the previous; each group's
    members get the group's upper quartile (GROUP_QUANTILE)."""
    ordered = sorted(rates.items(), key=lambda kv: kv[1])
    out: dict[str, float] = {}
    group: list[tuple[str, float]] = [ordered[0]]

    def close() -> None:
        value = group[min(len(group) - 1, int(len(group) * GROUP_QUANTILE))][1]
        out.update(dict.fromkeys((k for k, _ in group), value))

    for item in ordered[1:]:
        if item[1] > group[-1][1] * tolerance:
            close()
            group = []
        group.append(item)
    close()
    return out
