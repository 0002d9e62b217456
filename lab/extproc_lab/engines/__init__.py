"""Simulated GPU engines: OpenAI-compatible HTTP servers that stand in for real model servers."""

from extproc_lab.engines.group import EngineGroup
from extproc_lab.engines.server import SimEngine

__all__ = ["EngineGroup", "SimEngine"]
