"""The recurrent-depth model and the pieces that drive it."""

from rdepth.model.control import FixedController, LoopController
from rdepth.model.kv import AttentionContext, KVCache
from rdepth.model.recurrent import ModelOutput, RecurrentLM, Stage
from rdepth.model.schedule import sample_loop_counts, step_generator

__all__ = [
    "AttentionContext",
    "FixedController",
    "KVCache",
    "LoopController",
    "ModelOutput",
    "RecurrentLM",
    "Stage",
    "sample_loop_counts",
    "step_generator",
]
