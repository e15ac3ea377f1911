"""``rdepth train`` as one call: the model config from a preset (or the run being resumed), then train."""

from __future__ import annotations

from typing import Any

from rdepth.config import ModelConfig, get_preset
from rdepth.run import checkpoint as ckpt
from rdepth.train.config import TrainConfig
from rdepth.train.trainer import TrainResult, train


def model_config_for(preset: str, overrides: dict[str, Any], config: TrainConfig, resume: bool) -> ModelConfig:
    """The preset with ``overrides``; when resuming, the run's own config is the base instead
    (flags may only repeat it: a mismatch is refused by the trainer)."""
    if resume and ckpt.list_checkpoints(config.out):
        base = ckpt.load_model_config(ckpt.resolve_checkpoint(config.out)).to_dict()
        return ModelConfig.from_dict({**base, **overrides})
    return get_preset(preset, **overrides)


def launch(preset: str, overrides: dict[str, Any], config: TrainConfig, resume: bool = False) -> TrainResult:
    return train(model_config_for(preset, overrides, config, resume), config, resume=resume)
