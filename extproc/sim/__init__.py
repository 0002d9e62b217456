"""Simulated GPU engines: OpenAI-compatible HTTP servers that stand in for real model servers."""

from extproc.sim.group import EngineGroup
from extproc.sim.server import SimEngine

__all__ = ["EngineGroup", "SimEngine"]
