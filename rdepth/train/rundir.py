"""A training run's folder: checked before any work, and its run files written once everything is built.

The main rank holds the folder's write lock (:func:`rdepth.io.exclusive`, taken by the trainer) from
the check until the run ends, so a second training into the same folder stops at once."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from rdepth.config import ModelConfig
from rdepth.errors import RdepthError
from rdepth.io import LOCK_NAME, environment_info, truncate_jsonl, write_json
from rdepth.run import checkpoint as ckpt

log = logging.getLogger("rdepth.train.trainer")


# What a run writes before its first checkpoint: a folder holding only these is a run stopped before it
# saved anything (killed in its first steps), and a new run there starts over.
BEFORE_FIRST_CHECKPOINT = {"config.json", "environment.json", "metrics.jsonl", "tokenizer", "checkpoints"}


def check_run_folder(run_dir: Path, resume: bool, is_main: bool) -> dict:
    """Before a run: the debris of an interrupted checkpoint removed (main rank); ``--resume`` needs a
    checkpoint; a new run needs a folder that holds no checkpoint and nothing else. Returns the saved
    run config (``{}`` without checkpoints)."""
    if is_main:
        removed = ckpt.clean_debris(run_dir)
        if removed:
            log.info("removed what an interrupted checkpoint or consolidate left: %s", ", ".join(removed))
    existing = ckpt.list_checkpoints(run_dir)
    saved_run = ckpt.read_run_config(run_dir) if existing else {}
    if resume:
        if not existing:
            raise RdepthError(f"--resume: no checkpoint in {run_dir}")
    elif existing:
        raise RdepthError(f"{run_dir} already holds checkpoints; pass --resume or choose another --out")
    elif is_main:
        leftovers = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_NAME) if run_dir.is_dir() else []
        if leftovers and set(leftovers) <= BEFORE_FIRST_CHECKPOINT and (run_dir / "config.json").is_file():
            log.warning("%s: a run stopped there before its first checkpoint (%s): starting over", run_dir,
                        ", ".join(leftovers))
            for name in leftovers:
                path = run_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            leftovers = []
        if leftovers:
            raise RdepthError(
                f"{run_dir} is not empty ({', '.join(leftovers[:4])}) but holds no checkpoint; "
                "choose another --out, or remove the folder to start over"
            )
    return saved_run


def write_run_files(run_dir: Path, model_config: ModelConfig, train_config: dict, extra: dict,
                    environment: dict, tokenizer, start_step: int) -> None:
    """config.json (model and training config, and ``extra``: data record, preset, resumes),
    environment.json and the tokenizer: written only once everything is loaded and built, so a run
    (or a resume) that fails to start writes nothing. A resume at ``start_step`` drops the metrics
    after it, which the resumed steps log again."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.write_run_config(run_dir, model_config, train_config, **extra)
    write_json(run_dir / "environment.json", {**environment_info(), **environment})
    tokenizer_dir = run_dir / "tokenizer"
    if not tokenizer_dir.exists():
        tokenizer.save(tokenizer_dir)
    if start_step:  # the steps after the checkpoint will be logged again: whole lines up to it
        dropped = truncate_jsonl(run_dir / "metrics.jsonl",
                                 lambda record: isinstance(record.get("step"), int) and record["step"] <= start_step)
        if dropped:
            log.info("metrics.jsonl: dropped %d records after step %d", dropped, start_step)
