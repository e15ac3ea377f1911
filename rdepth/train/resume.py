"""What a resumed run must share with the run it continues: the model config, the training settings
(some may change, :data:`RESUME_FREE`; a longer schedule is recorded, :data:`RESUME_RECORDED`), and the
data and tokenizer it was trained on (their hashes, recorded in ``config.json`` by :func:`data_record`).
The data also decides the model's vocabulary (:func:`data_model_config`)."""

from __future__ import annotations

import logging
from pathlib import Path

from rdepth.config import ModelConfig
from rdepth.data.shards import TokenShards
from rdepth.errors import RdepthError
from rdepth.train.config import TrainConfig

log = logging.getLogger("rdepth.train.trainer")


def data_model_config(model_config: ModelConfig, shards: TokenShards) -> ModelConfig:
    """The data decides the vocabulary: take its size and tokenizer spec."""
    manifest = shards.manifest
    changes = {"vocab_size": int(manifest["vocab_size"]), "tokenizer": str(manifest["tokenizer"])}
    if any(getattr(model_config, k) != v for k, v in changes.items()):
        log.info("vocabulary from the data: %s (%d tokens)", changes["tokenizer"], changes["vocab_size"])
    return model_config.replace(**changes)


def data_model_config_for(model_config: ModelConfig, data: str | Path) -> ModelConfig:
    """:func:`data_model_config` for the prepared folder ``data``."""
    return data_model_config(model_config, TokenShards.open(data))


def config_mismatch(saved: ModelConfig, wanted: ModelConfig) -> list[str]:
    a, b = saved.to_dict(), wanted.to_dict()
    return [f"{k}={a[k]!r} (checkpoint) vs {b[k]!r}" for k in a if a[k] != b[k]]


# Fields a resume may change. Free: where and how the run executes, and its cadences
# (none changes the weights). Recorded: a new schedule end (e.g. a longer --max-steps), and the switch
# to or from float8 matmuls (fp8: the checkpoint is the same float32 state either way, so a run may go on
# without float8 or on a card without it, but its steps from then on round differently: its history says so).
# state_noise is not free: the two schemes draw different initial states, so a resume that switched
# would not continue the run it names (runs saved before the field existed load as "sequence", what they used).
RESUME_FREE = ("data", "out", "device", "threads", "compile", "compile_scope", "compile_mode", "fused_loss",
               "stop_at", "eval_every", "log_every", "checkpoint_every", "keep_last", "milestone_every", "time_limit",
               "activation_checkpointing")
RESUME_RECORDED = ("max_steps", "fp8")


def check_resume_config(saved: TrainConfig, wanted: TrainConfig, step: int) -> dict:
    """The changes a resume at ``step`` makes to the saved training config, as
    ``{field: [saved, new]}`` for the recorded ones; a one-line error for any other change."""
    a, b = saved.to_dict(), wanted.to_dict()
    refused = [f"{k} {a[k]!r} (saved) vs {b[k]!r}" for k in a
               if a[k] != b[k] and k not in RESUME_FREE + RESUME_RECORDED]
    if refused:
        raise RdepthError(f"--resume continues the run as it was saved, but {'; '.join(refused[:4])}; "
                          "start a new run (another --out) to change these")
    if a["max_steps"] == wanted.max_steps == step:
        raise RdepthError(f"--resume: the run is already finished (it reached its --max-steps, step {step}); to "
                          f"train it further, resume with --max-steps above {step}")
    if wanted.max_steps <= step:
        raise RdepthError(f"--resume: --max-steps {wanted.max_steps} ends at or before the checkpoint's step {step}, "
                          f"leaving nothing to train; to train the run further, give --max-steps above {step}")
    return {k: [a[k], b[k]] for k in RESUME_RECORDED if a[k] != b[k]}


def data_record(shards: TokenShards, model_config: ModelConfig) -> dict:
    """What the run was trained on, recorded in config.json and compared on resume."""
    manifest = shards.manifest
    return {"tokenizer": model_config.tokenizer, "tokenizer_sha256": shards.tokenizer_fingerprint,
            "splits_sha256": {split: manifest["splits"][split]["sha256"] for split in ("train", "val")}}


def check_same_data(recorded: dict | None, current: dict, run_dir: Path, data: str) -> None:
    """Resume only on the data (and the tokenizer) the run in ``run_dir`` was trained on: ``recorded``
    from its config.json against ``current`` (:func:`data_record` of the data folder ``data``)."""
    if not isinstance(recorded, dict):
        recorded = {}
    fingerprint = recorded.get("tokenizer_sha256")
    if fingerprint is None:
        from rdepth.data.tokenizers import saved_tokenizer_fingerprint

        fingerprint = saved_tokenizer_fingerprint(run_dir / "tokenizer")
    if fingerprint is not None and current["tokenizer_sha256"] is not None \
            and fingerprint != current["tokenizer_sha256"]:
        raise RdepthError(
            f"data in {data} was tokenized by a different {current['tokenizer']!r} tokenizer "
            f"than the run {run_dir} (same name, other tokens): resume on the data it was trained on"
        )
    hashes = recorded.get("splits_sha256")
    if isinstance(hashes, dict) and hashes.get("train") not in (None, current["splits_sha256"]["train"]):
        raise RdepthError(f"the training tokens in {data} differ from the ones the run "
                          f"{run_dir} was trained on (train.bin SHA-256): resume on the same data")
