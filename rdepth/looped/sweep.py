"""``rdepth sweep`` on an HRM-Text folder: every training-free exit rule against the full budget on a text.

Each rule, at each value of its grid (``SweepConfig.values``), exits tokens per position through
:func:`rdepth.looped.exits.decode_with_exits` (teacher-forced a position at a time over the cache, the latest-KV
rule for skipped slots) on the same windows, at three targets: ``L`` (the L loop of every H step; H full),
``H`` (the H loop; L full) and ``L+H`` (both). Rules that read the prediction (``needs_decode``) run on the H loop
only: the L state has no readout of its own. Quality is the next-token cross-entropy (and perplexity) against
the full budget's on the same predictions, and the share of positions whose argmax agrees with it; cost is stack
calls per token (one L or H step runs one stack of ``num_layers_per_stack`` layers; the full budget runs
``H_cycles (L_cycles + 1)``). Beside the rules, every fixed budget (H, L) runs through the class's own loops at
those cycle counts; each rule's cheapest point within ``tolerance`` of the full budget's perplexity is set
against the cheapest fixed budget within it. No latency: the exit decode is a Python loop over positions, so
its wall time measures the loop, not the model; steps are the cost reported.

Saved as ``OUT/looped_sweep.json`` with a section of ``OUT/index.html``. Inkling-2 is refused in one line: its
passes have no per-token exit (:mod:`rdepth.looped.inkling2` says why).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from rdepth.errors import RdepthError
from rdepth.exits.base import ExitPolicy
from rdepth.looped.exits import build_policy, decode_with_exits
from rdepth.looped.hrm_text import HrmTextAdapter
from rdepth.looped.load import check_flags_apply, folder_tokenizer, open_looped, read_text, text_windows
from rdepth.looped.protocol import forward

# The flags of rdepth sweep an HRM-Text folder reads; the rest time, calibrate or read rdepth runs and tasks.
APPLICABLE = ("checkpoint", "data", "out", "policies", "taus", "grid", "tolerance", "batch_size", "block_size",
              "max_batches", "kl_direction", "kl_prior", "device", "progress", "threads")
TARGETS = ("L", "H", "L+H")
RESULT_FILE = "looped_sweep.json"
SECTION = "looped_early_exit"
LATEST_KV = ("a token that stopped a loop still fills the cache slots of the steps it skipped, with the keys and "
             "values of its latest computed step of the same stack, so every slot holds one entry per position")


def targets_of(name: str) -> tuple[str, ...]:
    """Where a rule runs: every target for a latent rule, the H loop alone for one that reads the prediction."""
    from rdepth.exits.registry import get_policy_class

    return ("H",) if get_policy_class(name).needs_decode else TARGETS


class Scorer:
    """Next-token quality of decodes of the same windows against the full budget's, batch by batch."""

    def __init__(self, windows: torch.Tensor, batch_size: int, device: torch.device) -> None:
        self.batches = [windows[start:start + batch_size].to(device) for start in range(0, len(windows), batch_size)]
        self.full_argmax: list[torch.Tensor] = []

    def score(self, logits_of) -> dict[str, float]:
        """``logits_of(inputs [B, T]) -> (logits [B, T, V], stack calls [B, T])`` over every batch: cross-entropy,
        perplexity, argmax agreement with the first call's (the full budget's), mean stack calls per token."""
        loss = agree = calls = 0.0
        count = 0
        first = not self.full_argmax
        for index, batch in enumerate(self.batches):
            logits, stack_calls = logits_of(batch[:, :-1])
            targets = batch[:, 1:]
            loss += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                                            targets.reshape(-1), reduction="sum"))
            chosen = logits.argmax(-1)
            if first:
                self.full_argmax.append(chosen)
            agree += float((chosen == self.full_argmax[index]).sum())
            calls += float(stack_calls.double().sum())
            count += targets.numel()
        ce = loss / count
        return {"ce": ce, "ppl": math.exp(min(ce, 700.0)), "argmax_agreement": agree / count,
                "stack_calls": calls / count}


class _Exits:
    """``logits_of`` for :meth:`Scorer.score`: decodes with exits, counting the L steps of every L loop run and
    the H steps of every token."""

    def __init__(self, adapter: HrmTextAdapter, low: ExitPolicy | None, high: ExitPolicy | None) -> None:
        self.adapter, self.low, self.high = adapter, low, high
        self.low_steps = self.low_runs = self.high_steps = self.tokens = 0

    def __call__(self, inputs: torch.Tensor):
        run = decode_with_exits(self.adapter, inputs, self.low, self.high)
        ran = run.low_steps > 0  # the L loops run (none after a token's H loop stopped)
        self.low_steps += int(run.low_steps.sum())
        self.low_runs += int(ran.sum())
        self.high_steps += int(run.high_steps.sum())
        self.tokens += run.high_steps.numel()
        return run.logits, run.low_steps.sum(-1) + run.high_steps

    def steps(self) -> dict[str, float]:
        return {"mean_low_steps": self.low_steps / max(self.low_runs, 1),
                "mean_high_steps": self.high_steps / max(self.tokens, 1)}


def _fixed(adapter: HrmTextAdapter, high: int, low: int):
    def logits_of(inputs: torch.Tensor):
        with torch.no_grad():
            logits = forward(adapter, inputs, budgets={"H": high, "L": low})
        return logits, torch.full(inputs.shape, high * (low + 1))

    return logits_of


def _relative(point: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    point["ppl_vs_full"] = point["ppl"] / full["ppl"] - 1.0
    point["compute_saved"] = 1.0 - point["stack_calls"] / full["stack_calls"]
    return point


def matched(points: list[dict[str, Any]], fixed: list[dict[str, Any]], tolerance: float) -> list[dict[str, Any]]:
    """Per rule and target, its cheapest point within ``tolerance`` of the full budget's perplexity (None when
    none is), beside the cheapest fixed budget within it."""
    within = [row for row in fixed if row["ppl_vs_full"] <= tolerance]
    cheapest_fixed = min(within, key=lambda row: row["stack_calls"]) if within else None
    rows = []
    for key in dict.fromkeys((p["policy"], p["target"]) for p in points):
        candidates = [p for p in points if (p["policy"], p["target"]) == key and p["ppl_vs_full"] <= tolerance]
        best = min(candidates, key=lambda p: (p["stack_calls"], p["ppl"])) if candidates else None
        row = {"policy": key[0], "target": key[1], "point": best, "fixed": cheapest_fixed}
        if best is not None and cheapest_fixed is not None:
            row["calls_vs_fixed"] = best["stack_calls"] / cheapest_fixed["stack_calls"]
        rows.append(row)
    return rows


def sweep_folder(config, given: dict[str, Any]) -> dict[str, Any]:
    """``rdepth sweep`` on an HRM-Text folder (``config``: a :class:`~rdepth.sweep.config.SweepConfig`); writes
    ``OUT/looped_sweep.json`` and the page section, returns the result."""
    from tqdm import tqdm

    from rdepth.io import environment_info, write_json
    from rdepth.run.device import resolve_device

    check_flags_apply("sweep", given, APPLICABLE)
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    text = read_text(config.data)
    adapter = open_looped(config.checkpoint, torch.float32)
    if not isinstance(adapter, HrmTextAdapter):
        raise RdepthError(f"sweep: per-token exits are offered for HRM-Text only; {adapter.model_type}'s passes have "
                          "none (a token leaving after pass k would need its later passes' cache copies settled, "
                          "and those hold the short convolutions' rolling states too)")
    adapter.model.to(device)
    windows = text_windows(adapter, folder_tokenizer(config.checkpoint), text, config.max_windows, config.block_size,
                           str(config.data))
    budgets = adapter.budgets()
    scorer = Scorer(windows, config.batch_size, device)
    full = scorer.score(_Exits(adapter, None, None))
    fixed = [_relative({"H": high, "L": low, **scorer.score(_fixed(adapter, high, low))}, full)
             for high in range(1, budgets["H"] + 1) for low in range(1, budgets["L"] + 1)]
    settings = [(name, value, target) for name in config.policies for value in config.values(name)
                for target in targets_of(name)]
    points = []
    for name, value, target in tqdm(settings, desc="looped sweep", disable=not config.progress, leave=False):
        options = config.policy_options(name)
        policies = {loop: build_policy(name, value, budgets[loop], adapter.readout, options) if loop in target
                    else None for loop in ("L", "H")}
        exits = _Exits(adapter, policies["L"], policies["H"])
        point = {"policy": name, "target": target, "value": value, **scorer.score(exits), **exits.steps()}
        points.append(_relative(point, full))
    result = {"model_type": adapter.model_type, "folder": str(config.checkpoint), "data": str(config.data),
              "budgets": budgets, "windows": int(windows.shape[0]), "block_size": int(windows.shape[1] - 1),
              "predictions": int(windows[:, 1:].numel()), "tolerance": config.tolerance,
              "full": {**full, "H": budgets["H"], "L": budgets["L"]}, "fixed": fixed, "points": points,
              "matched": matched(points, fixed, config.tolerance), "latest_kv_rule": LATEST_KV,
              "environment": environment_info()}
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / RESULT_FILE, result)
    result["paths"] = {"json": str(out / RESULT_FILE), "report": str(write_section(out, result))}
    return result


def _cells(point: dict[str, Any]) -> dict[str, Any]:
    return {"ppl vs full (%)": round(100 * point["ppl_vs_full"], 3), "argmax agrees (%)":
            round(100 * point["argmax_agreement"], 1), "stack calls / token": round(point["stack_calls"], 3),
            "compute saved (%)": round(100 * point["compute_saved"], 1)}


def write_section(out: Path, result: dict[str, Any]) -> Path:
    """The sweep's section of ``OUT/index.html`` (from the result only)."""
    from rdepth.report.html import Section, add_section

    budgets, full = result["budgets"], result["full"]
    section = Section(SECTION, f"Early exit on {result['model_type']}'s loops", order=30)
    section.note(
        f"Teacher-forced per-token exits over {result['windows']} windows of {result['block_size']} tokens of "
        f"{result['data']} ({result['predictions']:,} predictions), a position at a time over the cache. Targets: L "
        f"(the L loop of each of the {budgets['H']} H steps, k_max {budgets['L']}), H (the H loop, k_max "
        f"{budgets['H']}), L+H (both); rules that read the prediction run on H only. Full budget: perplexity "
        f"{full['ppl']:.4g}, {full['stack_calls']:g} stack calls per token. Skipped steps' KV slots: {LATEST_KV}. "
        "Cost is counted in stack calls, not timed.")
    tolerance = 100 * result["tolerance"]
    section.table([{"policy": row["policy"], "target": row["target"],
                    **({"value": row["point"]["value"], **_cells(row["point"])} if row["point"] else
                       {"value": f"none within {tolerance:g}%"}),
                    "cheapest fixed (H, L) within": (f"({row['fixed']['H']}, {row['fixed']['L']}): "
                                                     f"{row['fixed']['stack_calls']:g} calls") if row["fixed"] else "none"}
                   for row in result["matched"]],
                  caption=f"Each rule's cheapest point within {tolerance:g}% of the full budget's perplexity")
    section.table([{"H": row["H"], "L": row["L"], **_cells(row)} for row in result["fixed"]],
                  caption="Fixed budgets: the class's loops at H and L cycles")
    section.table([{"policy": p["policy"], "target": p["target"], "value": p["value"], **_cells(p),
                    "mean L steps": round(p["mean_low_steps"], 3), "mean H steps": round(p["mean_high_steps"], 3)}
                   for p in result["points"]], caption="Every point")
    return add_section(out, section, title=f"rdepth report: {Path(result['folder']).name} ({result['model_type']})")


def summary_lines(result: dict[str, Any]) -> list[str]:
    """What ``rdepth sweep`` prints for a looped folder."""
    full, tolerance = result["full"], f"{100 * result['tolerance']:g}%"
    lines = [f"{result['model_type']}: full budget H {full['H']} x L {full['L']}: ppl {full['ppl']:.4f}, "
             f"{full['stack_calls']:g} stack calls per token ({result['predictions']:,} predictions); cost in stack "
             "calls, not timed",
             f"each rule's cheapest point within {tolerance} of the full budget's perplexity:"]
    for row in result["matched"]:
        point = row["point"]
        label = f"{row['policy']} on {row['target']}"
        if point is None:
            lines.append(f"{label:>28}: no point within {tolerance}")
            continue
        lines.append(f"{label:>28}: value {point['value']:g}, ppl {point['ppl']:.4f} ({100 * point['ppl_vs_full']:+.2f}%), "
                     f"{point['stack_calls']:.2f} stack calls ({100 * point['compute_saved']:.1f}% saved), argmax "
                     f"agrees {100 * point['argmax_agreement']:.1f}%")
    cheapest = result["matched"][0]["fixed"] if result["matched"] else None
    if cheapest is not None:
        lines.append(f"cheapest fixed budget within {tolerance}: H {cheapest['H']} x L {cheapest['L']}, "
                     f"{cheapest['stack_calls']:g} stack calls")
    return lines
