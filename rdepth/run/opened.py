"""A trained run opened for analysis: model, config, device and held-out tokens together.

Every driver that needs "a checkpoint plus its held-out data on a device"
(eval, generate, analyze, sweep, the demo, benchmarks, surrogate teachers)
asks for it here, so the glue (device, tokenizer check, window length clamped
to the model and the text, vocabulary check) exists once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rdepth.config import ModelConfig
from rdepth.model import RecurrentLM
from rdepth.run.checkpoint import load_model, resolve_checkpoint
from rdepth.run.device import resolve_device
from rdepth.run.heldout import (
    check_vocabulary,
    held_out_problem_windows,
    held_out_tokens,
    held_out_windows,
    unigram_log_probs_for,
)


@dataclass
class OpenedRun:
    """``tokens``: 1-D held-out ids; ``baseline``: the data's unigram baseline over its whole val
    split (None for a text file); ``unigram``: the train unigram log-probabilities for a baseline
    on any evaluated subset (None when the training data is gone)."""

    checkpoint: Path
    model: RecurrentLM
    config: ModelConfig
    device: torch.device
    tokens: np.ndarray
    baseline: dict | None
    data: Path
    unigram: np.ndarray | None = None
    starts: np.ndarray | None = None  # task data: where each held-out problem starts (windows start there)

    def seq_len(self, requested: int | None = None) -> int:
        """Window length: ``requested`` (default the block size), at most the block size and the text."""
        return max(1, min(requested or self.config.block_size, self.config.block_size, len(self.tokens) - 1))

    def available_windows(self, seq_len: int | None = None) -> int:
        """How many held-out windows :meth:`windows` can give at most (the split's size, not a cap)."""
        if self.starts is not None:
            return int(self.windows(None, seq_len).shape[0])
        return (len(self.tokens) - 1) // self.seq_len(seq_len)

    def windows(self, max_windows: int | None = None, seq_len: int | None = None) -> torch.Tensor:
        """Held-out windows ``[S, T + 1]`` (see :func:`rdepth.run.heldout.held_out_windows`); on task
        data each starts at a problem (:func:`rdepth.run.heldout.held_out_problem_windows`), as in training."""
        if self.starts is not None:
            windows = held_out_problem_windows(self.tokens, self.starts, self.seq_len(seq_len), max_windows)
        else:
            windows = held_out_windows(self.tokens, self.seq_len(seq_len), max_windows)
        check_vocabulary(windows, self.config.vocab_size)
        return windows


def open_run(checkpoint: str | Path, data: str | Path, device: str | torch.device = "auto") -> OpenedRun:
    """Load ``checkpoint`` (a checkpoint or run folder) on ``device`` with the held-out tokens of ``data``."""
    device = device if isinstance(device, torch.device) else resolve_device(device)
    folder = resolve_checkpoint(checkpoint)
    model, config = load_model(folder, device)
    tokens, baseline = held_out_tokens(data, checkpoint, config)
    starts = None
    if (Path(data) / "val_problems.npy").is_file():
        from rdepth.data.shards import TokenShards

        starts = TokenShards.open(data).problem_index("val")[0]
    return OpenedRun(folder, model, config, device, tokens, baseline, Path(data),
                     unigram_log_probs_for(data, checkpoint), starts)
