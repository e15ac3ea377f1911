"""Held-out tokens and the tokenizer of a run, for eval/generate/analyze/sweep."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rdepth.config import ModelConfig
from rdepth.errors import RdepthError


def run_tokenizer(checkpoint: str | Path):
    """The tokenizer saved with a run (``RUN/tokenizer``), found from a run or checkpoint path."""
    from rdepth.data.tokenizers import load_tokenizer

    path = Path(checkpoint).resolve()
    for folder in (path, *path.parents[:3]):
        if (folder / "tokenizer").is_dir():
            return load_tokenizer(folder / "tokenizer")
    raise RdepthError(f"no tokenizer saved with the run of {checkpoint} (expected RUN/tokenizer)")


def held_out_tokens(data: str | Path, checkpoint: str | Path, config: ModelConfig) -> tuple[np.ndarray, dict | None]:
    """Validation tokens: a prepared folder's val split (checked against the model's
    tokenizer), or a text file tokenised with the run's tokenizer. Also returns the
    folder's unigram baseline (``None`` for a text file)."""
    from rdepth.data.shards import TokenShards

    data = Path(data)
    if data.is_dir():
        shards = TokenShards.open(data)
        spec = shards.manifest.get("tokenizer")
        if spec != config.tokenizer or int(shards.manifest["vocab_size"]) != config.vocab_size:
            raise RdepthError(
                f"data in {data} was prepared with tokenizer {spec!r} but the checkpoint uses {config.tokenizer!r}"
            )
        return np.asarray(shards.val), shards.manifest.get("unigram_baseline")
    if not data.is_file():
        raise RdepthError(f"data not found: {data}")
    try:
        text = data.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RdepthError(f"{data} is not UTF-8 text") from None
    if not text.strip():
        raise RdepthError(f"{data} is empty")
    ids = run_tokenizer(checkpoint).encode(text)
    if len(ids) < 2:
        raise RdepthError(f"{data} has fewer than 2 tokens")
    return np.asarray(ids, dtype=np.int64), None
