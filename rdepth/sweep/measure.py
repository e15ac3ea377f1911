"""Sweep points measured: quality and loop steps on held-out windows, then latency, interleaved.

:class:`SweepMeasurer` evaluates a policy setting (through
:func:`rdepth.exitrun.evaluate.evaluate_with_exits`, so through the run layer's
one evaluation loop and its per-window noise) or a fixed budget (measured once
and reused: several points often share the fixed budget at their mean steps),
and registers what to time. :meth:`SweepMeasurer.time_all` then times every
registered call together (:func:`rdepth.sweep.timing.time_interleaved`: each
round calls every setting once, shuffled), so the full-budget reference and
each candidate are timed under the same load, and writes each entry's median
and interquartile range.

Timing paths. Every ``ms_per_token_*`` key is the **packed** path (active rows
gathered, per-token keys/values): the path of every exit policy, and of a fixed
budget run through :class:`rdepth.model.control.FixedController`, so a speedup
compares equal machinery. Fixed budgets are also timed on the **dense** path
(``dense_ms_per_token_*``, the layout of training and ``rdepth eval``) as a
separate reference. Generation is always packed (it needs the cache).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from rdepth.errors import RdepthError
from rdepth.exitrun.evaluate import evaluate_with_exits
from rdepth.exits.base import Decode
from rdepth.exits.controller import PolicyController
from rdepth.exits.decode import make_decode
from rdepth.model import RecurrentLM
from rdepth.model.control import FixedController
from rdepth.run.config import autocast_dtype
from rdepth.sweep.config import MeasureSettings
from rdepth.sweep.stats import spread
from rdepth.sweep.timing import Call, forward_call, generate_call, time_interleaved

# Saved latency keys and the path each is timed on (also in the summary's ``latency_definitions``).
PACKED_KEYS = ("ms_per_token_b1", "ms_per_token_batched", "ms_per_token_generate")
DENSE_KEYS = ("dense_ms_per_token_b1", "dense_ms_per_token_batched")


def decode_factory(model: RecurrentLM, settings: MeasureSettings, seq_len: int) -> Callable[[], Decode]:
    """Fresh readings of ``settings.decode`` (``head`` or ``rest``) for windows of ``seq_len`` tokens."""
    return lambda: make_decode(model, settings.decode, seq_len=seq_len, loops=settings.decode_loops,
                               seed=settings.seed)


class SweepMeasurer:
    """Measures settings of one model on fixed held-out ``windows`` ``[S, T + 1]``.

    Every result is a dict: the :class:`~rdepth.exitrun.evaluate.ExitEvaluation`
    fields and ``steps`` (mean loop steps per token summed over groups). With
    timing, after :meth:`time_all`: ``timing_path`` ("packed"),
    ``timing_batch_size`` and, per latency key (:data:`PACKED_KEYS`, and
    :data:`DENSE_KEYS` for fixed budgets), the median ms/token under the key,
    ``<key>_iqr`` ``[q1, q3]`` and the per-round samples in
    ``timing_samples[<key>]``. ``ms_per_token_b1``/``_batched`` are
    teacher-forced (one window of T tokens per forward, time / tokens, batch 1
    or ``timing_batch_size`` windows); ``ms_per_token_generate`` is decode
    latency (greedy cached generation of :attr:`generate_tokens` tokens at batch 1,
    ms per generated token), all under ``settings.autocast``.
    """

    def __init__(self, model: RecurrentLM, windows: torch.Tensor, settings: MeasureSettings, device: torch.device):
        self.model = model
        self.windows = windows
        self.settings = settings
        self.device = device
        self.autocast = autocast_dtype(settings.autocast)
        seq_len = windows.shape[1] - 1
        self.timing_idx = windows[: settings.timing_batch_size, :-1].to(device)  # (B, T) inputs only
        window = min(seq_len, model.config.block_size)
        self.generate_tokens = settings.generate_tokens_for(window)  # 0: decode latency not timed
        if self.generate_tokens and settings.generate_prompt + self.generate_tokens > window:
            raise RdepthError(
                f"sweep: generate_prompt + generate_tokens = {settings.generate_prompt + self.generate_tokens} "
                f"exceeds the window of {seq_len} tokens"
            )
        self.fixed_cache: dict[tuple[int, ...], dict] = {}
        # What time_all times: label -> call, and label -> (entry, key, tokens of work per call).
        self.calls: dict[str, Call] = {}
        self.targets: dict[str, tuple[dict, str, int]] = {}
        self.entries = 0

    def _evaluate(self, **mode) -> dict:
        result = evaluate_with_exits(
            self.model, self.windows, batch_size=self.settings.batch_size, device=self.device,
            seed=self.settings.seed, autocast_dtype=self.autocast, **mode,
        ).to_dict()
        result["steps"] = sum(result["mean_steps"])
        return result

    def _register(self, entry: dict, controller_factory, dense_counts: Sequence[int] | None = None) -> None:
        """Queue the latencies of ``entry``: packed through ``controller_factory``; dense with ``dense_counts``."""
        settings = self.settings
        if not settings.timing:
            return
        entry_id = self.entries
        self.entries += 1
        timed = dict(seed=settings.seed, autocast_dtype=self.autocast)
        jobs: list[tuple[str, Call, int]] = []
        for label, idx in (("b1", self.timing_idx[:1]), ("batched", self.timing_idx)):
            jobs.append((f"ms_per_token_{label}", forward_call(self.model, idx, controller_factory=controller_factory,
                                                               **timed), idx.numel()))
            if dense_counts is not None:
                jobs.append((f"dense_ms_per_token_{label}", forward_call(self.model, idx, loop_counts=dense_counts,
                                                                         **timed), idx.numel()))
        if self.generate_tokens:
            prompt = self.timing_idx[:1, : settings.generate_prompt]
            jobs.append(("ms_per_token_generate", generate_call(
                self.model, prompt, self.generate_tokens, controller_factory=controller_factory, **timed,
            ), self.generate_tokens))
        for key, call, work in jobs:
            label = f"{entry_id}:{key}"
            self.calls[label] = call
            self.targets[label] = (entry, key, work)
        entry["timing_path"] = "packed"
        entry["timing_batch_size"] = int(self.timing_idx.shape[0])

    def policy(self, factory: Callable[[], PolicyController], labels: dict | None = None) -> dict:
        """Quality and steps of per-token exits by fresh controllers from ``factory``, after ``labels``;
        latency queued (written into this dict by :meth:`time_all`)."""
        entry = {**(labels or {}), **self._evaluate(controller=factory)}
        self._register(entry, factory)
        return entry

    def fixed(self, budget: Sequence[int]) -> dict:
        """The fixed budget (loop steps per group), measured once, with its ``budget``; quality on the dense
        path (equal to the packed path's), latency queued on both paths."""
        budget = tuple(int(k) for k in budget)
        if budget not in self.fixed_cache:
            entry = {"budget": list(budget), **self._evaluate(loop_counts=budget)}
            self._register(entry, lambda: FixedController(budget), dense_counts=budget)
            self.fixed_cache[budget] = entry
        return self.fixed_cache[budget]

    def time_all(self, progress: bool = False) -> None:
        """Time every queued call interleaved (``warmup`` each, then ``repeats`` shuffled rounds) and write
        each entry's median, ``_iqr`` and ``timing_samples``."""
        if not self.calls:
            return
        settings = self.settings
        with tqdm(total=settings.repeats, desc=f"timing {len(self.calls)} settings", disable=not progress) as bar:
            samples = time_interleaved(self.calls, self.device, warmup=settings.warmup, repeats=settings.repeats,
                                       seed=settings.seed, progress=lambda _: bar.update())
        for label, times_ms in samples.items():
            entry, key, work = self.targets[label]
            per_token = [t / work for t in times_ms]
            stats = spread(per_token)
            entry[key] = stats["median"]
            entry[f"{key}_iqr"] = stats["iqr"]
            entry.setdefault("timing_samples", {})[key] = per_token
