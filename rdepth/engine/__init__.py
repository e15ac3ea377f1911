"""Continuous depth batching (:class:`Engine`): many requests decoded at once, each row at its own position
and loop step, on the one model: a host scheduler, a tick from :data:`TICKS`, a key/value layout from
:data:`KV_LAYOUTS`."""

from rdepth.engine.engine import Engine
from rdepth.engine.request import Depth, Finished, Request
from rdepth.engine.scheduler import EngineStats
from rdepth.engine.slots import KV_LAYOUTS
from rdepth.engine.tick import TICKS, Tick, TickInput, TickOutput, TickPlan

__all__ = ["Depth", "Engine", "EngineStats", "Finished", "KV_LAYOUTS", "Request", "TICKS", "Tick", "TickInput", "TickOutput",
           "TickPlan"]
