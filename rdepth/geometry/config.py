"""Settings of ``rdepth analyze`` (kept free of torch so that ``rdepth --help`` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass

from rdepth.config import MAX_LOOPS
from rdepth.errors import RdepthError
from rdepth.fields import check_fields, is_int, option
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
    sequences: int = option(64, "held-out windows to analyse", bounds="[1, inf)")
    seq_len: int | None = option(None, "tokens per window", default_text="the model's block size", bounds="[2, inf)")
    batch_size: int = option(4, "windows per forward pass; lower it to save memory", bounds="[1, inf)")
    long_loops: int = option(30, "the long fixed loop budget of every group (the paper's Fig. 5 uses 30)",
                             bounds=f"[1, {MAX_LOOPS}]")
    train_loops: tuple[int, ...] | None = option(
        None, "loop counts of the 'train' budget: N (every group) or N,N,... (one per group)",
        default_text="the config's eval loop counts", metavar="N[,N...]",
    )
    threshold: float = option(0.01, "relative step size under which a token counts as converged", bounds="(0, inf)")
    keep_sequence: int = option(0, "index of the window whose iterates are drawn in the PCA figure")
    seed: int = option(0, "seed of the initial loop-state noise (the same as rdepth eval's)", bounds="[0, inf)")
    rank: bool = option(True, "compute the effective rank of the updates")
    top_tokens: int = option(20, "rows in the slowest-converging-token table", bounds="[1, inf)")
    device: str = option("auto", "auto (CUDA when present), cpu or cuda[:N]")
    threads: int = option(0, THREADS_HELP, bounds="[0, inf)")
    progress: bool = option(True, "progress bars while measuring (the demo turns them off)")
    precision: str = option(
        "float64", "dtype the model runs in while measured: float64 (loop geometry free of float32 rounding "
        "where a loop contracts to tiny steps) or float32 (the dtype it trained in)", choices=PRECISIONS)
    dlr_curve_loops: int = option(
        30, "the DLR loop-budget curve: every group at K = 1..N loops, on the last checkpoint (0: off)",
        bounds=f"[0, {MAX_LOOPS}]")
    dlr_curve_sequences: int = option(4, "held-out windows of the DLR loop-budget curve (the first ones)",
                                      bounds="[1, inf)")
    jacobian_positions: int = option(
        4, "sampled positions (one per window) whose own-state Jacobian spectrum is measured at each "
        "group's last iterate of the long budget, every checkpoint (0: off)", bounds=f"[0, {MAX_LOOPS}]")

    def __post_init__(self) -> None:
        if isinstance(self.checkpoints, (str, bytes)):
            raise RdepthError("analyze: checkpoints must be a list of paths")
        self.checkpoints = [str(path) for path in self.checkpoints]
        if self.train_loops is not None:  # counts, never a string, so that the model gets integers
            counts = (self.train_loops,) if isinstance(self.train_loops, int) else self.train_loops
            if (isinstance(counts, (str, bytes)) or not counts
                    or not all(is_int(n) and n >= 1 for n in counts)):
                raise RdepthError(f"analyze: train_loops must be positive integers (N or N,N,...), "
                                  f"got {self.train_loops!r}")
            self.train_loops = tuple(counts)
        check_fields(self, "analyze")
        if not is_int(self.keep_sequence) or not 0 <= self.keep_sequence < self.sequences:
            raise RdepthError(
                f"analyze: keep_sequence must be in 0..{self.sequences - 1}, got {self.keep_sequence!r}"
            )
        self.data, self.out = str(self.data), str(self.out)
