"""One sweep point measured: quality and loop steps on held-out windows, then latency.

:class:`SweepMeasurer` evaluates a policy setting (through
:func:`rdepth.exits.evaluate.evaluate_with_exits`, so through the run layer's
one evaluation loop and its per-window noise) and times it (warm, synchronised,
median of repeats). Fixed budgets are measured once and reused: several policy
points often share the fixed budget at their mean steps.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from rdepth.errors import RdepthError
from rdepth.exits.base import Decode, ExitPolicy
from rdepth.exits.config import SweepConfig
from rdepth.exits.controller import PolicyController
from rdepth.exits.evaluate import evaluate_with_exits
from rdepth.exits.registry import get_policy_class
from rdepth.exits.timing import time_forward, time_generate
from rdepth.model import RecurrentLM

AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def policy_controller_factory(
    name: str, value: float, k_max: Sequence[int], decode: Decode | None
) -> Callable[[], PolicyController]:
    """A factory of fresh controllers running ``name`` with its sweep parameter set to ``value``."""
    cls = get_policy_class(name)

    def build_policy(group: int) -> ExitPolicy:
        if cls.sweep_parameter == "tau":
            return cls(tau=value, k_max=int(k_max[group]))
        return cls(k_max=int(k_max[group]), **{cls.sweep_parameter: _as_option(value)})

    build_policy(0)  # validate the settings before any work
    return lambda: PolicyController(build_policy, decode=decode)


def _as_option(value: float) -> Any:
    return int(value) if float(value).is_integer() else value


class SweepMeasurer:
    """Measures settings of one model on fixed held-out ``windows`` ``[S, T + 1]``.

    Every result is a dict: the :class:`~rdepth.exits.evaluate.ExitEvaluation`
    fields, ``steps`` (mean loop steps per token summed over groups) and, with
    timing, ``ms_per_token_b1``, ``ms_per_token_batched`` (the first
    ``timing_batch_size`` windows), ``timing_batch_size`` and, with
    ``generate_tokens``, ``ms_per_token_generate``.
    """

    def __init__(self, model: RecurrentLM, windows: torch.Tensor, config: SweepConfig, device: torch.device):
        self.model = model
        self.windows = windows
        self.config = config
        self.device = device
        self.autocast = AUTOCAST[config.autocast]
        seq_len = windows.shape[1] - 1
        self.timing_idx = windows[: config.timing_batch_size, :-1].to(device)  # (B, T) inputs only
        if config.timing and config.generate_tokens:
            if config.generate_prompt + config.generate_tokens > min(seq_len, model.config.block_size):
                raise RdepthError(
                    f"sweep: generate_prompt + generate_tokens = {config.generate_prompt + config.generate_tokens} "
                    f"exceeds the window of {seq_len} tokens"
                )
        self.fixed_cache: dict[tuple[int, ...], dict] = {}

    def _evaluate(self, **mode) -> dict:
        result = evaluate_with_exits(
            self.model, self.windows, batch_size=self.config.batch_size, device=self.device,
            seed=self.config.seed, autocast_dtype=self.autocast, **mode,
        ).to_dict()
        result["steps"] = sum(result["mean_steps"])
        return result

    def _time(self, **mode) -> dict:
        config = self.config
        if not config.timing:
            return {}
        timings: dict[str, Any] = {}
        for label, idx in (("b1", self.timing_idx[:1]), ("batched", self.timing_idx)):
            measured = time_forward(
                self.model, idx, warmup=config.warmup, repeats=config.repeats, seed=config.seed,
                autocast_dtype=self.autocast, **mode,
            )
            timings[f"ms_per_token_{label}"] = measured["ms_per_token"]
        timings["timing_batch_size"] = int(self.timing_idx.shape[0])
        if config.generate_tokens:
            measured = time_generate(
                self.model, self.timing_idx[:1, : config.generate_prompt], config.generate_tokens,
                warmup=min(config.warmup, 1), repeats=config.repeats, seed=config.seed, **mode,
            )
            timings["ms_per_token_generate"] = measured["ms_per_token"]
        return timings

    def policy(self, factory: Callable[[], PolicyController]) -> dict:
        """Quality, steps and latency of per-token exits by fresh controllers from ``factory``."""
        return {**self._evaluate(controller=factory), **self._time(controller_factory=factory)}

    def fixed(self, budget: Sequence[int]) -> dict:
        """The fixed budget (loop steps per group), measured once; with its ``budget``."""
        budget = tuple(int(k) for k in budget)
        if budget not in self.fixed_cache:
            self.fixed_cache[budget] = {
                "budget": list(budget),
                **self._evaluate(loop_counts=budget),
                **self._time(loop_counts=budget),
            }
        return self.fixed_cache[budget]
