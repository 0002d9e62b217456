"""What it costs to learn that a routed request ended, three ways, side by side in one run.

- `stream_end`: the ext_proc stream stays open for the whole response (response_trailer_mode SEND);
  the response then depends on the service (a dead replica resets it under fail-closed).
- `access_log` (shipped): the service ends the stream after routing; Envoy's gRPC access log
  reports each finished request (one entry, batched, on a long-lived stream per Envoy worker).
- `observe_stream`: access_log's routing plus a second, observability-mode ext_proc filter that
  opens one more stream per request (headers only, not awaited) and would report the end by
  closing it. The service does not release through it; the stream is here only so its CPU cost
  is measured: the alternative the shipped design was chosen over.

Engines answer at once (1 output token), so the differences are the gateway's own cost. CPU is read
from /proc for the service and Envoy processes around the measured run.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from extproc_lab.bench.loadgen import closed_loop
from extproc_lab.bench.report import summarize
from extproc_lab.engines import EngineGroup
from extproc_lab.stack import LocalGateway, ext_proc_filter, find_envoy

MODEL = "sim-llama"
MODES = ("stream_end", "access_log", "observe_stream")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _edit(mode: str) -> Callable[[dict[str, Any]], None]:
    def edit(cfg: dict[str, Any]) -> None:
        routing = ext_proc_filter(cfg)
        if mode == "stream_end":
            routing["processing_mode"]["response_trailer_mode"] = "SEND"
        if mode == "observe_stream":
            hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            observe = {
                "name": "llm-extproc-observe",
                "typed_config": {
                    "@type": routing["@type"],
                    "grpc_service": routing["grpc_service"],
                    "failure_mode_allow": True,
                    "observability_mode": True,
                    "deferred_close_timeout": "0.05s",
                    "processing_mode": {
                        "request_header_mode": "SEND",
                        "request_body_mode": "NONE",
                        "request_trailer_mode": "SKIP",
                        "response_header_mode": "SKIP",
                        "response_body_mode": "NONE",
                        "response_trailer_mode": "SEND",
                    },
                },
            }
            hcm["http_filters"].insert(len(hcm["http_filters"]) - 1, observe)  # before the router

    return edit


async def run_release_cost(
    *, requests: int = 1500, concurrency: int = 8, out_dir: Path = Path("out/release-cost")
) -> Path:
    find_envoy()
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    group = EngineGroup([0.0, 0.0], MODEL)
    clusters = {"gpu-a": [group.ports[0]], "gpu-b": [group.ports[1]]}
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 3000}]}
    rows: list[dict[str, Any]] = []
    try:
        for mode in MODES:
            service = {
                "routing": "cluster",
                "release_on": "stream_end" if mode == "stream_end" else "access_log",
                "pool": {"clusters": [{"name": c, "models": [MODEL]} for c in clusters]},
            }
            gw = LocalGateway(out_dir / mode, clusters=clusters, service=service, envoy_edit=_edit(mode))
            gw.start()
            try:
                url = gw.url + "/v1/chat/completions"
                await closed_loop(url, body, 100, concurrency)  # warm-up
                assert gw.service.proc is not None and gw.envoy.proc is not None
                svc0, env0 = _cpu_seconds(gw.service.proc.pid), _cpu_seconds(gw.envoy.proc.pid)
                records, wall = await closed_loop(url, body, requests, concurrency)
                svc1, env1 = _cpu_seconds(gw.service.proc.pid), _cpu_seconds(gw.envoy.proc.pid)
                await asyncio.sleep(0.5)
                metrics = gw.metrics()
                s = summarize(mode, records, wall)
                row = {
                    "mode": mode,
                    **s.as_dict(),
                    "service_cpu_ms_per_request": 1000 * (svc1 - svc0) / requests,
                    "envoy_cpu_ms_per_request": 1000 * (env1 - env0) / requests,
                    "inflight_after": sum(
                        v for k, v in metrics.items() if k.startswith("llm_extproc_inflight_requests{")
                    ),
                }
                rows.append(row)
                print(
                    f"{mode:15s} {s.throughput_rps:7.0f} req/s  p50 {s.e2e_p50_ms:6.2f} ms  "
                    f"p99 {s.e2e_p99_ms:6.2f} ms  service {row['service_cpu_ms_per_request']:.3f} "
                    f"ms CPU/req  envoy {row['envoy_cpu_ms_per_request']:.3f} ms CPU/req  "
                    f"errors {s.errors}  in-flight after {row['inflight_after']:.0f}",
                    flush=True,
                )
            finally:
                gw.stop()
    finally:
        group.close()
    path = out_dir / "results.json"
    path.write_text(
        json.dumps(
            {"scenario": f"release cost, closed loop c={concurrency}, 3 KB chat", "rows": rows}, indent=2
        )
    )
    return path


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("out/release-cost"))
    args = parser.parse_args()
    path = asyncio.run(
        run_release_cost(requests=args.requests, concurrency=args.concurrency, out_dir=args.out)
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
