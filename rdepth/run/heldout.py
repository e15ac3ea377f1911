"""Held-out tokens of a run: its tokenizer, the validation tokens, and the one window maker.

Every evaluation (``rdepth eval``, ``analyze``, ``sweep``, the trainer's
validation, the demo) cuts held-out tokens into the same windows with
:func:`held_out_windows`: the text is cut into consecutive windows of ``T + 1`` tokens
(``tokens[j*T : j*T + T + 1]``: inputs and next-token targets overlap by one), and a
capped count takes windows spread evenly over the whole split, not its first ones: a
prepared corpus keeps its sources in order, so the first windows are one source's.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np
import torch

from rdepth.config import ModelConfig
from rdepth.errors import RdepthError

log = logging.getLogger(__name__)


def run_tokenizer_dir(checkpoint: str | Path) -> Path:
    """The folder of the tokenizer saved with a run (``RUN/tokenizer``), found from a run or checkpoint path."""
    path = Path(checkpoint).resolve()
    for folder in (path, *path.parents[:3]):
        if (folder / "tokenizer").is_dir():
            return folder / "tokenizer"
    raise RdepthError(f"no tokenizer saved with the run of {checkpoint} (expected RUN/tokenizer)")


def run_tokenizer(checkpoint: str | Path):
    """The tokenizer saved with a run (``RUN/tokenizer``), found from a run or checkpoint path."""
    from rdepth.data.tokenizers import load_tokenizer

    return load_tokenizer(run_tokenizer_dir(checkpoint))


def run_tokenizer_fingerprint(checkpoint: str | Path) -> str | None:
    """The fingerprint of the tokenizer a run was trained with: recorded in its ``config.json``
    (``data.tokenizer_sha256``), else computed from ``RUN/tokenizer``; None when neither exists."""
    import json

    from rdepth.data.tokenizers import saved_tokenizer_fingerprint

    path = Path(checkpoint).resolve()
    for folder in (path, *path.parents[:3]):
        if (folder / "tokenizer").is_dir():
            try:
                recorded = json.loads((folder / "config.json").read_text()).get("data", {}).get("tokenizer_sha256")
            except (OSError, json.JSONDecodeError, AttributeError):
                recorded = None
            return recorded or saved_tokenizer_fingerprint(folder / "tokenizer")
    return None


def held_out_tokens(data: str | Path, checkpoint: str | Path, config: ModelConfig) -> tuple[np.ndarray, dict | None]:
    """Validation tokens: a prepared folder's val split (checked against the model's
    tokenizer), or a text file tokenised with the run's tokenizer. Also returns the
    folder's unigram baseline (``None`` for a text file)."""
    from rdepth.data.shards import TokenShards

    data = Path(data)
    if data.is_dir():
        shards = TokenShards.open(data, verify=("val",))  # as train checks its shards: never score damaged ids
        spec = shards.manifest.get("tokenizer")
        if spec != config.tokenizer or int(shards.manifest["vocab_size"]) != config.vocab_size:
            raise RdepthError(
                f"data in {data} was prepared with tokenizer {spec!r} (vocabulary {shards.manifest['vocab_size']}) "
                f"but the checkpoint uses {config.tokenizer!r} (vocabulary {config.vocab_size})"
            )
        ours, theirs = run_tokenizer_fingerprint(checkpoint), shards.tokenizer_fingerprint
        if ours is not None and theirs is not None and ours != theirs:
            raise RdepthError(
                f"data in {data} and the checkpoint both use a tokenizer named {spec!r}, but they are different "
                "tokenizers (their fingerprints differ): ids would mean other tokens"
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


def held_out_windows(tokens: np.ndarray, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """``max_windows`` (default: all) non-overlapping windows of ``seq_len + 1`` tokens -> int64
    ``[S, seq_len + 1]``, in text order. The text is cut into consecutive windows
    ``tokens[j*seq_len : j*seq_len + seq_len + 1]``; with ``max_windows`` below their number the chosen
    ``j`` are spread evenly over them (``j = i * available // max_windows``), so a capped evaluation
    samples the whole split rather than its first documents. Fewer if the text is short (with a warning)."""
    if seq_len < 1:
        raise RdepthError(f"window length must be >= 1, got {seq_len}")
    available = (len(tokens) - 1) // seq_len
    if available < 1:
        raise RdepthError(f"held-out text has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    count = available if max_windows is None else min(max_windows, available)
    if max_windows is not None and count < max_windows:
        log.warning("held-out text holds only %d windows of %d tokens (asked for %d)", count, seq_len, max_windows)
    chosen = [i * available // count for i in range(count)]
    rows = [np.asarray(tokens[j * seq_len : j * seq_len + seq_len + 1], dtype=np.int64) for j in chosen]
    return torch.from_numpy(np.stack(rows))


def held_out_problem_windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int,
                             max_windows: int | None = None) -> torch.Tensor:
    """Like :func:`held_out_windows`, but each window starts at a problem (task data's problem
    index ``starts``): the first problem, then the first problem after each window ends, so
    windows never overlap -> int64 ``[S, seq_len + 1]``."""
    if seq_len < 1:
        raise RdepthError(f"window length must be >= 1, got {seq_len}")
    chosen: list[int] = []
    next_free = 0
    for start in np.asarray(starts, dtype=np.int64):
        if start < next_free:
            continue
        if start + seq_len + 1 > len(tokens) or (max_windows is not None and len(chosen) >= max_windows):
            break
        chosen.append(int(start))
        next_free = start + seq_len + 1
    if not chosen:
        raise RdepthError(f"held-out text holds no problem with a whole window of {seq_len + 1} tokens")
    if max_windows is not None and len(chosen) < max_windows:
        log.warning("held-out text holds only %d problem windows of %d tokens (asked for %d)",
                    len(chosen), seq_len, max_windows)
    return torch.from_numpy(np.stack([np.asarray(tokens[o : o + seq_len + 1], dtype=np.int64) for o in chosen]))


def check_vocabulary(windows: torch.Tensor, vocab_size: int) -> None:
    """A one-line error when held-out ids fall outside the model's vocabulary."""
    if windows.numel() and (int(windows.max()) >= vocab_size or int(windows.min()) < 0):
        raise RdepthError(
            f"held-out text has token id {int(windows.max())}, outside the model's vocabulary of {vocab_size}: "
            "data and checkpoint use different tokenizers"
        )


def tokenizer_for(data: str | Path, checkpoint: str | Path):
    """The tokenizer to show token text with (None, with a warning, if none can be found)."""
    from rdepth.data.shards import TokenShards

    try:
        if Path(data).is_dir():
            return TokenShards.open(data).tokenizer
        return run_tokenizer(checkpoint)
    except RdepthError as exc:
        log.warning("token text unavailable: %s", exc)
        return None


def unigram_log_probs_for(data: str | Path, checkpoint: str | Path) -> np.ndarray | None:
    """The smoothed train-split unigram log-probabilities behind a baseline on any held-out tokens:
    the prepared folder's ``unigram.npy``, else (held-out text from a file) that of the folder the
    run was trained on, if it is still there. None when neither exists."""
    import json

    from rdepth.data.prepare import UNIGRAM_FILE

    candidates = [Path(data)] if Path(data).is_dir() else []
    path = Path(checkpoint).resolve()
    for folder in (path, *path.parents[:3]):
        config = folder / "config.json"
        if config.is_file() and (folder / "tokenizer").is_dir():
            with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):
                candidates.append(Path(json.loads(config.read_text())["train"]["data"]))
            break
    for folder in candidates:
        file = folder / UNIGRAM_FILE
        if file.is_file():
            try:
                return np.load(file, allow_pickle=False)
            except (OSError, ValueError):
                raise RdepthError(f"unigram file {file} is corrupt") from None
    return None
