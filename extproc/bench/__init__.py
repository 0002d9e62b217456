"""Benchmark tooling: load generation and side-by-side reports."""

from extproc.bench.loadgen import Result, Summary, closed_loop, format_table, open_loop, percentile, summarize

__all__ = ["Result", "Summary", "closed_loop", "format_table", "open_loop", "percentile", "summarize"]
