"""Settings of ``rdepth analyze`` (kept free of torch so that ``rdepth --help`` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass

from rdepth.errors import RdepthError


@dataclass
class AnalyzeConfig:
    """Settings of one ``rdepth analyze`` run (validated; every CLI flag maps to a field)."""

    sequences: int = 64
    seq_len: int | None = None  # tokens per sequence; default: the model's block size
    batch_size: int = 4
    long_loops: int = 30
    train_loops: str | None = None  # override of the config's eval loop counts ("12" or "8,12,4")
    threshold: float = 0.01  # relative step size under which a token counts as converged
    keep_sequence: int = 0  # which sequence's full iterates feed the PCA figure
    seed: int = 0
    rank: bool = True
    top_tokens: int = 20
    device: str = "auto"

    def __post_init__(self) -> None:
        for name in ("sequences", "batch_size", "long_loops", "top_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise RdepthError(f"analyze: {name} must be a positive integer, got {value!r}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 2):
            raise RdepthError(f"analyze: seq_len must be an integer >= 2, got {self.seq_len!r}")
        if not self.threshold > 0:
            raise RdepthError(f"analyze: threshold must be > 0, got {self.threshold!r}")
        if not 0 <= self.keep_sequence < self.sequences:
            raise RdepthError(
                f"analyze: keep_sequence must be in 0..{self.sequences - 1}, got {self.keep_sequence!r}"
            )
