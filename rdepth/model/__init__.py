"""The recurrent-depth model and the pieces that drive it."""

from rdepth.model.control import FixedController, LoopController
from rdepth.model.kv import AttentionContext, KVCache
from rdepth.model.recurrent import ModelOutput, RecurrentLM
from rdepth.model.schedule import sample_loop_counts, step_generator
from rdepth.model.walk import Stage, StageWalk

__all__ = [
    "AttentionContext",
    "FixedController",
    "KVCache",
    "LoopController",
    "ModelOutput",
    "RecurrentLM",
    "Stage",
    "StageWalk",
    "sample_loop_counts",
    "step_generator",
]
