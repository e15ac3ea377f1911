"""Continuous depth batching (:class:`Engine`): many requests decoded at once, each row at its own position
and loop step, on the one model."""

from rdepth.engine.engine import Engine, EngineStats
from rdepth.engine.request import Finished, Request
from rdepth.engine.slots import KV_LAYOUTS

__all__ = ["Engine", "EngineStats", "Finished", "KV_LAYOUTS", "Request"]
