"""Benchmark tooling: named workloads, load generation, side-by-side reports and plots."""

from extproc_lab.bench.loadgen import closed_loop, one_request, open_loop
from extproc_lab.bench.report import Report, RequestRecord, Slo, format_table, summarize, write_json
from extproc_lab.bench.workloads import WORKLOADS, Workload, make_workload

__all__ = [
    "WORKLOADS",
    "Report",
    "RequestRecord",
    "Slo",
    "Workload",
    "closed_loop",
    "format_table",
    "make_workload",
    "one_request",
    "open_loop",
    "summarize",
    "write_json",
]
