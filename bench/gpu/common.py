"""What every section of the GPU suite shares: the section list and the budget each may use, median
and IQR, ratios, the error text a failed section records, and the environment the numbers were taken in."""

from __future__ import annotations

import gc
import hashlib
import math
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SECTIONS = ("ceiling", "train", "decode", "exits", "batched", "spread", "loss", "fp8")
# Run when none are named (--sections): fp8 only when named, since it needs torchao on the card (a
# carried wheel) and trains two runs (about 2 minutes on an H100).
DEFAULT_SECTIONS = tuple(name for name in SECTIONS if name != "fp8")
# Share of the remaining budget each section may use (of the sections still to run).
SHARES = {"ceiling": 0.03, "train": 0.33, "decode": 0.19, "exits": 0.14, "batched": 0.16, "spread": 0.12,
          "loss": 0.03, "fp8": 0.33}
CUDA_ONLY = "cuda only"


def stats(values: list[float]) -> dict:
    """Median and interquartile range of ``values`` (the rounds kept too)."""
    if len(values) > 1:
        q = statistics.quantiles(values, n=4)
        low, high = q[0], q[2]
    else:
        low = high = values[0]
    return {"median": statistics.median(values), "iqr": [low, high], "n": len(values), "values": values}


def ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def finite(value):
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def free_memory(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def code_fingerprint() -> str:
    """SHA-256 (16 hex digits) of the Python sources under rdepth/ and bench/: names the code measured
    even where the working tree is uncommitted or carries no .git folder."""
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("rdepth/**/*.py"), *ROOT.glob("bench/**/*.py")]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def environment(args, device) -> dict:
    import subprocess

    import torch

    from rdepth.io import environment_info
    from rdepth.run.device import device_name

    info = environment_info()
    info["device"] = device_name(device)
    info["cuda"] = torch.version.cuda
    info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                       "multiprocessors": props.multi_processor_count,
                       "capability": f"{props.major}.{props.minor}"}
    revision, dirty = args.revision, None
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        if rev.returncode == 0:
            revision = revision or rev.stdout.strip()
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=10)
            dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    info["revision"] = revision or "unknown"
    info["uncommitted_changes"] = dirty
    info["code_sha256"] = code_fingerprint()
    info["date_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return info


class Budget:
    """The suite's wall-time budget, shared out to the sections still to run."""

    def __init__(self, seconds: float, sections: list[str]):
        self.start = time.perf_counter()
        self.end = self.start + seconds
        self.pending = list(sections)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def deadline_for(self, section: str) -> float:
        """A ``perf_counter`` deadline: the section's share of what is left among the pending sections."""
        now = time.perf_counter()
        shares = sum(SHARES[s] for s in self.pending)
        self.pending.remove(section)
        return now + max(self.end - now, 0.0) * SHARES[section] / shares

def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


