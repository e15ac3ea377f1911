"""``rdepth train`` as one call: the model config from a preset (or the run being resumed), then train.

A resume continues the run as it was saved: its training config comes from the
latest checkpoint (or the run's config.json), and only the flags the user typed
change it; the trainer refuses any change other than where and how the run
executes and a new ``max_steps`` (recorded in config.json's ``resumes``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rdepth.config import ModelConfig, get_preset
from rdepth.errors import RdepthError
from rdepth.io import read_json_object
from rdepth.run import checkpoint as ckpt
from rdepth.train.config import TrainConfig
from rdepth.train.trainer import TrainResult, train

log = logging.getLogger(__name__)


def model_config_for(preset: str, overrides: dict[str, Any], config: TrainConfig, resume: bool) -> ModelConfig:
    """The preset with ``overrides``; when resuming, the run's own config is the base instead
    (flags may only repeat it: a mismatch is refused by the trainer)."""
    if resume and ckpt.list_checkpoints(config.out):
        base = ckpt.load_model_config(ckpt.resolve_checkpoint(config.out)).to_dict()
        return ModelConfig.from_dict({**base, **overrides})
    if config.init_from:  # the weights' own model config, as --resume does with the run's
        base = ckpt.load_model_config(ckpt.resolve_checkpoint(config.init_from)).to_dict()
        return ModelConfig.from_dict({**base, **overrides})
    return get_preset(preset, **overrides)


def saved_train_config(out: str | Path) -> dict[str, Any] | None:
    """The training config the run in ``out`` was last saved with (its latest checkpoint's,
    else its config.json's), or None for a run that records none."""
    if not ckpt.list_checkpoints(out):
        raise RdepthError(f"--resume: no checkpoint in {out}")
    from rdepth.train import dcp

    checkpoint = ckpt.resolve_checkpoint(out)
    state = dcp.read_state(checkpoint) if dcp.is_dcp_checkpoint(checkpoint) else ckpt.load_trainer_state(checkpoint)[1]
    return state.get("train_config") or ckpt.read_run_config(Path(out)).get("train")


def train_config_for(overrides: dict[str, Any], resume: bool) -> TrainConfig:
    """The flags the user typed over the defaults; when resuming, over the saved config."""
    if not resume:
        return TrainConfig(**overrides)
    if overrides.get("time_limit") is not None:
        raise RdepthError("--time-limit fits a fresh run's schedule to a wall-clock budget; a resumed run keeps the "
                          "schedule it was saved with, so a new limit would not apply: drop --time-limit (use "
                          "--stop-at to end the resumed run sooner)")
    out = overrides.get("out", TrainConfig.out)
    saved = saved_train_config(out)
    if saved is None:
        return TrainConfig(**overrides)
    saved = {k: v for k, v in saved.items() if k != "stop_at"}  # an early stop applies to one launch
    return TrainConfig.from_dict({**saved, **overrides})


def resume_preset(out: str | Path, preset: str | None) -> None:
    """A --preset given with --resume must be the run's own (the model comes from the checkpoint)."""
    if preset is None:
        return
    recorded = ckpt.read_run_config(Path(out)).get("preset")
    if recorded != preset:
        raise RdepthError(f"--resume continues the saved model; --preset {preset} does not match the run's "
                          f"preset ({recorded or 'not recorded'}): drop --preset")


def launch(preset: str, overrides: dict[str, Any], config: TrainConfig, resume: bool = False) -> TrainResult:
    return train(model_config_for(preset, overrides, config, resume), config, resume=resume,
                 preset=None if resume else preset)


# Settings a finished or interrupted run may be reused or resumed under: a time limit is the
# budget left when the command started, which differs from one invocation to the next.
REUSE_FREE = {("train", "time_limit")}


def train_or_reuse(model_config: ModelConfig, config: TrainConfig) -> Path:
    """Train ``config.out``; reuse it when it finished ``config.max_steps`` with the same settings, or
    resume it when it was interrupted. A folder trained with other settings is an error."""
    run = Path(config.out)
    saved_path = run / "config.json"
    if saved_path.exists():
        saved = ckpt.read_run_config(run)  # validated like user input: JSON objects all the way down
        wanted = {"model": model_config.to_dict(), "train": config.to_dict()}
        changed = sorted(f"{part}.{key}" for part in wanted for key in wanted[part]
                         if saved.get(part, {}).get(key) != wanted[part][key]
                         and (part, key) not in REUSE_FREE)
        if changed:
            raise RdepthError(f"{run} was trained with other settings ({', '.join(changed[:4])}); "
                              "pass another --out")
        summary = run / "summary.json"
        done = read_json_object(summary, "run summary") if summary.exists() else {}
        # A time limit may have ended the schedule sooner: the summary records where it ended.
        step, max_steps = done.get("step"), done.get("max_steps", config.max_steps)
        for name, value in (("step", step), ("max_steps", max_steps)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise RdepthError(f"run summary {summary}: {name} must be an integer >= 0, got {value!r}: corrupt")
        if step is not None and step == max_steps:
            log.info("reusing the finished training run in %s", run)
            return run
    train(model_config, config, resume=bool(ckpt.list_checkpoints(run)))
    return run
