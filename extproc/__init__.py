"""llm-extproc: an Envoy ext_proc service that routes LLM inference requests to GPU upstreams."""

__version__ = "0.1.0"
