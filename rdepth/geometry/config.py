"""Settings of ``rdepth analyze`` (kept free of torch so that ``rdepth --help`` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass

from rdepth.config import MAX_LOOPS
from rdepth.errors import RdepthError
from rdepth.fields import option
from rdepth.threads import THREADS_HELP

# The dtypes ``rdepth analyze`` can run a model in (AnalyzeConfig.precision).
PRECISIONS = ("float64", "float32")


@dataclass
class AnalyzeConfig:
    """One ``rdepth analyze`` run (validated; every CLI flag is a field)."""

    checkpoints: list[str] = option(
        [], "run folders (every checkpoint in RUN/checkpoints) and/or checkpoint folders, in order: several "
        "after one flag (a shell glob works) and/or the flag repeated",
        required=True, metavar="PATH",
    )
    data: str = option("", "prepared data folder (its val split) or a UTF-8 text file", required=True,
                       metavar="PATH")
    out: str = option("", "output folder (may be the run folder itself)", required=True, metavar="DIR")
    sequences: int = option(64, "held-out windows to analyse")
    seq_len: int | None = option(None, "tokens per window", default_text="the model's block size")
    batch_size: int = option(4, "windows per forward pass; lower it to save memory")
    long_loops: int = option(30, "the long fixed loop budget of every group (the paper's Fig. 5 uses 30)")
    train_loops: tuple[int, ...] | None = option(
        None, "loop counts of the 'train' budget: N (every group) or N,N,... (one per group)",
        default_text="the config's eval loop counts", metavar="N[,N...]",
    )
    threshold: float = option(0.01, "relative step size under which a token counts as converged")
    keep_sequence: int = option(0, "index of the window whose iterates are drawn in the PCA figure")
    seed: int = option(0, "seed of the initial loop-state noise (the same as rdepth eval's)")
    rank: bool = option(True, "compute the effective rank of the updates")
    top_tokens: int = option(20, "rows in the slowest-converging-token table")
    device: str = option("auto", "auto (CUDA when present), cpu or cuda[:N]")
    threads: int = option(0, THREADS_HELP)
    progress: bool = option(True, "progress bars while measuring (the demo turns them off)")
    precision: str = option(
        "float64", "dtype the model runs in while measured: float64 (loop geometry free of float32 rounding "
        "where a loop contracts to tiny steps) or float32 (the dtype it trained in)")
    dlr_curve_loops: int = option(
        30, "the DLR loop-budget curve: every group at K = 1..N loops, on the last checkpoint (0: off)")
    dlr_curve_sequences: int = option(4, "held-out windows of the DLR loop-budget curve (the first ones)")
    jacobian_positions: int = option(
        4, "sampled positions (one per window) whose own-state Jacobian spectrum is measured at each "
        "group's last iterate of the long budget, every checkpoint (0: off)")

    def __post_init__(self) -> None:
        if isinstance(self.checkpoints, (str, bytes)):
            raise RdepthError("analyze: checkpoints must be a list of paths")
        self.checkpoints = [str(path) for path in self.checkpoints]
        if self.train_loops is not None:  # counts, never a string, so that the model gets integers
            counts = (self.train_loops,) if isinstance(self.train_loops, int) else self.train_loops
            if (isinstance(counts, (str, bytes)) or not counts
                    or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts)):
                raise RdepthError(f"analyze: train_loops must be positive integers (N or N,N,...), "
                                  f"got {self.train_loops!r}")
            self.train_loops = tuple(counts)
        if self.precision not in PRECISIONS:
            raise RdepthError(f"analyze: precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for name in ("dlr_curve_loops", "jacobian_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOOPS:
                raise RdepthError(f"analyze: {name} must be an integer in 0..{MAX_LOOPS}, got {value!r}")
        for name in ("sequences", "batch_size", "long_loops", "top_tokens", "dlr_curve_sequences"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RdepthError(f"analyze: {name} must be a positive integer, got {value!r}")
        if self.long_loops > MAX_LOOPS:
            raise RdepthError(f"analyze: long_loops must be <= {MAX_LOOPS}, got {self.long_loops!r}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 2):
            raise RdepthError(f"analyze: seq_len must be an integer >= 2, got {self.seq_len!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise RdepthError(f"analyze: threads must be an integer >= 0, got {self.threads!r}")
        if not self.threshold > 0:
            raise RdepthError(f"analyze: threshold must be > 0, got {self.threshold!r}")
        if not 0 <= self.keep_sequence < self.sequences:
            raise RdepthError(
                f"analyze: keep_sequence must be in 0..{self.sequences - 1}, got {self.keep_sequence!r}"
            )
        if not isinstance(self.seed, int) or self.seed < 0:
            raise RdepthError(f"analyze: seed must be a non-negative integer, got {self.seed!r}")
        self.data, self.out = str(self.data), str(self.out)
