"""Teacher-forced evaluation with per-token exits (the paper's protocol, Appendix D).

Every window of held-out text runs through the model once; each group's loop
stops per token as its exit policy decides, and the loss is the mean
next-token cross-entropy of the resulting logits. Alongside: per group, the
mean number of loop steps computed and histograms of steps computed and of
the index of the state handed on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from rdepth.errors import RdepthError
from rdepth.model import RecurrentLM
from rdepth.model.control import LoopController
from rdepth.model.generation import teacher_forced
from rdepth.run.evaluate import eval_outputs


@dataclass
class ExitEvaluation:
    """Quality and compute of one evaluation.

    ``ce`` in nats/token, ``ppl = exp(ce)``; per group g: ``mean_steps[g]``
    loop steps computed per token, ``computed_histogram[g][k]`` tokens that
    computed k steps and ``used_histogram[g][k]`` tokens that handed on state
    k (k = 0..max_steps[g]).
    """

    ce: float
    ppl: float
    tokens: int
    max_steps: list[int]
    mean_steps: list[float]
    mean_used: list[float]
    computed_histogram: list[list[int]]
    used_histogram: list[list[int]]

    def to_dict(self) -> dict:
        return asdict(self)


class _Tally:
    """Running sums of loss and per-group step counts over batches."""

    def __init__(self, max_steps: Sequence[int]):
        self.max_steps = [int(k) for k in max_steps]
        self.loss_sum = 0.0
        self.tokens = 0
        self.computed = [torch.zeros(k + 1, dtype=torch.long) for k in self.max_steps]
        self.used = [torch.zeros(k + 1, dtype=torch.long) for k in self.max_steps]

    def add(self, loss: torch.Tensor, n_tokens: int, computed, used) -> None:
        self.loss_sum += float(loss) * n_tokens
        self.tokens += n_tokens
        for group, cap in enumerate(self.max_steps):
            if computed is None:  # dense fixed budget: every token ran the cap
                self.computed[group][cap] += n_tokens
                self.used[group][cap] += n_tokens
                continue
            self.computed[group] += torch.bincount(computed[group].flatten().cpu(), minlength=cap + 1)[: cap + 1]
            self.used[group] += torch.bincount(used[group].flatten().cpu(), minlength=cap + 1)[: cap + 1]

    def result(self) -> ExitEvaluation:
        if self.tokens == 0:
            raise RdepthError("evaluation saw no tokens")
        ce = self.loss_sum / self.tokens

        def mean(histogram: torch.Tensor) -> float:
            steps = torch.arange(histogram.numel(), dtype=torch.float64)
            return float((histogram.double() * steps).sum() / histogram.sum())

        return ExitEvaluation(
            ce=ce,
            ppl=math.exp(ce),
            tokens=self.tokens,
            max_steps=self.max_steps,
            mean_steps=[mean(h) for h in self.computed],
            mean_used=[mean(h) for h in self.used],
            computed_histogram=[h.tolist() for h in self.computed],
            used_histogram=[h.tolist() for h in self.used],
        )


@torch.no_grad()
def evaluate_with_exits(
    model: RecurrentLM,
    windows: torch.Tensor,
    *,
    controller: LoopController | Callable[[], LoopController] | None = None,
    loop_counts: Sequence[int] | None = None,
    batch_size: int = 8,
    device: str | torch.device = "cpu",
    seed: int = 0,
    autocast_dtype: torch.dtype | None = None,
    progress: bool = False,
    warm_start: bool = False,
) -> ExitEvaluation:
    """Cross-entropy, perplexity and loop steps over held-out ``windows`` ``[S, T + 1]``.

    Give either ``controller`` (a loop controller, or a zero-argument factory
    called per batch; per-token exits through the model's packed loop) or
    ``loop_counts`` (a fixed budget per group; the dense path). The loop runs
    through :func:`rdepth.run.evaluate.eval_outputs`, so every policy (and
    ``rdepth eval``) sees the same windows and the same initial states.
    """
    if (controller is None) == (loop_counts is None):
        raise RdepthError("evaluate_with_exits: give exactly one of controller or loop_counts")
    if loop_counts is not None:
        counts = model.resolve_loop_counts(loop_counts)
        tally = _Tally(counts)

        def forward(x, y, noise):
            return teacher_forced(model, x, y, loop_counts=counts, noise=noise, warm_start=warm_start)
    else:
        make = controller if not hasattr(controller, "after_step") else (lambda: controller)
        probe = make()
        tally = _Tally([probe.max_steps(group) for group in range(model.n_groups)])

        def forward(x, y, noise):
            return teacher_forced(model, x, y, controller_factory=make, noise=noise, warm_start=warm_start)
    for out, n_tokens in eval_outputs(model, windows, forward, batch_size=batch_size, device=device, seed=seed,
                                      autocast_dtype=autocast_dtype, progress=progress):
        tally.add(out.loss, n_tokens, out.computed, out.used)
    return tally.result()
