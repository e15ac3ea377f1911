"""Realistic exit spreads for random weights: each row's exit step drawn on the device from a histogram.

On random weights every token converges alike, so a batch's rows leave the loop together and batched
exits look better than they are. :class:`HistogramExits` is a loop controller
(:class:`rdepth.model.control.LoopController`) that ignores the states and stops each row at a step
drawn, per token and group, from a recorded histogram of a trained model's exits (``exit_histogram.json``
beside this file, written by ``python bench/exit_spread.py record``): the batch then leaves the loop as
a trained model's batch would. The draws live on the device, so a token needs no host read and can be
captured.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DEFAULT_HISTOGRAM = HERE / "exit_histogram.json"


class HistogramExits:
    """Stop each row of group g at a step drawn from ``probabilities[g]`` (index s - 1: the chance of
    stopping after step s), handing on its newest state (used index = the step).

    A pool of ``pool`` exit steps per group is drawn once on the device (``torch.multinomial``, seeded);
    each ``begin`` takes the next N of them (a device-side offset, advanced in place), so that a token
    draws new exits with no host read and no random-number call (CUDA-graph safe, deterministic).

    Args:
        probabilities: per group, the exit-step weights (normalised here), length = k_max of the group.
        seed: of the draws (the same seed, the same exits).
        device: where the pool lives (the decoder's device).
        pool: draws kept per group.
    """

    def __init__(self, probabilities: Sequence[Sequence[float]], seed: int = 0, device: str | torch.device = "cpu",
                 pool: int = 4096):
        self.device = torch.device(device)
        generator = torch.Generator().manual_seed(seed)
        self.pools, self.caps = [], []
        for weights in probabilities:
            tensor = torch.tensor([float(w) for w in weights], dtype=torch.float64)
            if tensor.numel() < 1 or (tensor < 0).any() or tensor.sum() <= 0:
                raise ValueError(f"exit histogram: bad weights {list(weights)}")
            drawn = torch.multinomial(tensor / tensor.sum(), pool, replacement=True, generator=generator) + 1
            self.pools.append(drawn.to(self.device))
            self.caps.append(tensor.numel())
        self.offset = [torch.zeros(1, dtype=torch.long, device=self.device) for _ in self.pools]
        self.exit_step: dict[int, torch.Tensor] = {}
        self._arange: dict[int, torch.Tensor] = {}

    def max_steps(self, group: int) -> int:
        return self.caps[group]

    def begin(self, group: int, state: torch.Tensor) -> None:
        rows = state.shape[0]
        if rows not in self._arange:
            self._arange[rows] = torch.arange(rows, device=self.device)
        pool = self.pools[group]
        index = (self.offset[group] + self._arange[rows]) % pool.numel()
        drawn = pool.index_select(0, index)
        if group in self.exit_step and self.exit_step[group].shape == drawn.shape:
            self.exit_step[group].copy_(drawn)  # the same address for captured graphs
        else:
            self.exit_step[group] = drawn
        self.offset[group].add_(rows)

    def after_step(self, group, step, rows, prev, new):
        done = self.exit_step[group].index_select(0, rows) <= step
        return done, new, torch.full_like(rows, step)

    def mean_steps(self) -> list[float]:
        """The mean exit step of each group's pool."""
        return [float(pool.double().mean()) for pool in self.pools]


def load_histogram(path: str | Path = DEFAULT_HISTOGRAM) -> dict:
    """The recorded histogram: ``{"groups": [[count per exit step 1..k], ...], "source": {...}}``."""
    return json.loads(Path(path).read_text())


def factory(histogram: dict, k_max: Sequence[int], seed: int = 0, device="cpu"):
    """A decoder ``controller_factory`` drawing from ``histogram``, folded onto ``k_max`` steps per group
    (a recorded step beyond k_max counts as k_max; a model with more groups than recorded reuses the
    last recorded group's histogram)."""
    recorded = histogram["groups"]
    probabilities = []
    for group, cap in enumerate(k_max):
        counts = recorded[min(group, len(recorded) - 1)]
        folded = [0.0] * cap
        for index, count in enumerate(counts):
            folded[min(index, cap - 1)] += float(count)
        probabilities.append(folded)
    return lambda: HistogramExits(probabilities, seed, device)


def record(checkpoint: str, data: str, policy: str, tau: float, k_max: int, difficulty: int, windows: int) -> dict:
    """Exit steps of ``policy`` at ``tau`` (cap ``k_max``) on a trained task run's held-out problems of
    ``difficulty`` (teacher-forced, which the decoder equals), counted per group over every position."""
    import numpy as np

    from rdepth.exits.controller import controller_factory
    from rdepth.model.noise import StateNoise
    from rdepth.run.checkpoint import load_model
    from rdepth.tasks.data import load_heldout

    model = load_model(checkpoint, torch.device("cpu"))[0].eval()
    heldout = load_heldout(data, difficulty)
    idx = torch.from_numpy(np.asarray(heldout.tokens[:windows, :-1], dtype=np.int64))
    counts = [[0] * k_max for _ in range(model.n_groups)]
    with torch.no_grad():
        for start in range(0, idx.shape[0], 16):
            part = idx[start:start + 16]
            controller = controller_factory(policy, tau, k_max, lambda: model.readout)()
            out = model(part, controller=controller, noise=StateNoise(0, range(start, start + part.shape[0])))
            for group, computed in enumerate(out.computed):
                steps = torch.bincount(computed.flatten() - 1, minlength=k_max)
                counts[group] = [a + int(b) for a, b in zip(counts[group], steps.tolist(), strict=False)]
    total = sum(counts[0])
    means = [sum((s + 1) * c for s, c in enumerate(group)) / total for group in counts]
    return {"groups": counts, "mean_steps": means,
            "source": {"checkpoint": str(checkpoint), "data": str(data), "difficulty": difficulty, "policy": policy,
                       "tau": tau, "k_max": k_max, "windows": int(idx.shape[0]), "positions": total,
                       "how": "teacher-forced forward with the policy's controller; every position of each window"}}


def main(argv=None) -> int:
    import sys

    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/exit_spread.py",
                           description="Record a trained model's exit-step histogram as JSON.")
    parser.add_argument("command", choices=["record"])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", required=True, help="the run's prepared task data")
    parser.add_argument("--policy", default="kl")
    parser.add_argument("--tau", type=float, default=0.01)
    parser.add_argument("--k-max", type=int, default=12)
    parser.add_argument("--difficulty", type=int, default=2)
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--out", default=str(DEFAULT_HISTOGRAM))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    torch.set_num_threads(1)
    histogram = record(args.checkpoint, args.data, args.policy, args.tau, args.k_max, args.difficulty, args.windows)
    from rdepth.io import json_text  # standard JSON: a NaN or infinity is null
    Path(args.out).write_text(json_text(histogram, indent=1) + "\n")
    print(json.dumps({"mean_steps": histogram["mean_steps"], "groups": histogram["groups"]}))
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/exit_spread.py", main))
