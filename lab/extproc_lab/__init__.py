"""The lab: everything that stands in for or measures the world around the service — simulated GPU
engines, the discrete-event mode, the benchmark harness and the local process launcher.

Nothing on the request path imports this package (import-linter contracts in pyproject.toml).
"""
