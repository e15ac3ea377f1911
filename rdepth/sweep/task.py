"""Exit policies on a reasoning task: answer accuracy against loop steps, answer tokens apart from the rest.

``rdepth sweep`` on task data (``rdepth prepare --corpus task:NAME``) calls
:func:`sweep_task_checkpoint`. On each chosen held-out difficulty (default: the
top training difficulty) it measures, for every fixed budget 1..k_max and for
every policy at every value of its grid:

- exact-match accuracy on whole problems (:func:`rdepth.tasks.evaluate.heldout_accuracy`,
  the same initial-state noise as ``rdepth eval``);
- mean loop steps per token summed over groups, separately on answer tokens
  and on every other token, and overall;
- teacher-forced wall time per token (median and IQR of interleaved rounds);
- given the hops of each answer token (:mod:`rdepth.tasks.hops`), whether depth tracks
  difficulty (:mod:`rdepth.sweep.depth`): per setting and for the per-token oracle, the
  executed steps' Spearman correlation with hops and the mean steps per hop count, from the
  same evaluations (the per-token steps and predictions they already compute), saved as
  ``depth`` in ``task_sweep.json`` and as ``depth_vs_hops.csv``.

Fixed budgets and policies run through the *same* path: fixed budgets as
:class:`~rdepth.model.control.FixedController` controllers, policies as
:class:`~rdepth.exits.controller.PolicyController`, both on the packed loop,
for accuracy and for timing alike. The summary compares the cheapest policy
within ``accuracy_tolerance`` of the full budget (every group at k_max) with the
full budget and with the cheapest fixed budget of at least its accuracy, and
keeps the Pareto front of accuracy against steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from rdepth.errors import RdepthError
from rdepth.exitrun.profile import load_profile, profile_controller_factory
from rdepth.exits.controller import controller_factory
from rdepth.exits.registry import get_policy_class
from rdepth.io import environment_info, write_json
from rdepth.model import RecurrentLM
from rdepth.model.control import FixedController
from rdepth.run.device import device_name
from rdepth.run.opened import open_run
from rdepth.sweep.config import MeasureSettings, SweepConfig
from rdepth.sweep.depth import DEPTH_CSV, depth_csv, depth_summary, depth_vs_hops, oracle_steps
from rdepth.sweep.halves import half_scores, honest_selection, target_problems
from rdepth.sweep.measure import decode_factory
from rdepth.sweep.stats import spread
from rdepth.sweep.timing import forward_call, time_interleaved
from rdepth.tasks.data import HeldOut, load_heldout, task_manifest
from rdepth.tasks.evaluate import heldout_accuracy
from rdepth.tasks.hops import heldout_hops, manifest_tasks

log = logging.getLogger(__name__)

FORMAT = 1
TASK_SWEEP_FILE = "task_sweep.json"


def _measure(model: RecurrentLM, heldout: HeldOut, factory: Callable, settings: MeasureSettings, device,
             per_token: bool = False) -> dict:
    result = heldout_accuracy(model, heldout, controller_factory=factory, batch_size=settings.batch_size,
                              device=device, seed=settings.seed, per_token=per_token)
    answers = int(heldout.answer_mask[:, 1:].sum())
    others = int((~heldout.answer_mask[:, 1:]).sum())
    result["steps"] = (result["mean_steps_answer"] * answers + result["mean_steps_other"] * others) / max(
        answers + others, 1)
    return result


def pareto_front(entries: Sequence[dict]) -> list[dict]:
    """The entries no other entry beats on both counts (fewer or equal steps and higher or equal
    accuracy, one of them strictly), by ascending steps."""
    front = []
    for entry in sorted(entries, key=lambda e: (e["steps"], -e["accuracy"])):
        if not front or entry["accuracy"] > front[-1]["accuracy"]:
            front.append(entry)
    return front


def summarize_task_sweep(result: dict, tolerance: float) -> dict:
    """Per difficulty: the full budget, the cheapest policy point within ``tolerance`` (a fraction:
    0.01 = one point of accuracy) of it, the cheapest fixed budget at least as accurate as that point,
    the steps saved against each, the Pareto front (labels), and the honest selection (``halves``: chosen
    on one half of the problems, judged on the other, :func:`rdepth.sweep.halves.honest_selection`)."""
    out = {"tolerance": tolerance, "difficulties": []}
    for block in result["difficulties"]:
        full = block["fixed"][-1]
        floor = full["accuracy"] - tolerance
        matched = [p for p in block["points"] if p["accuracy"] >= floor - 1e-12]
        best = min(matched, key=lambda p: (p["steps"], -p["accuracy"])) if matched else None
        row: dict[str, Any] = {"difficulty": block["difficulty"], "full": _brief(full), "best": None}
        if best is not None:
            fixed_as_good = [f for f in block["fixed"] if f["accuracy"] >= best["accuracy"] - 1e-12]
            cheapest = min(fixed_as_good, key=lambda f: f["steps"]) if fixed_as_good else None
            row["best"] = _brief(best)
            row["steps_saved_vs_full"] = 1 - best["steps"] / full["steps"]
            row["cheapest_fixed_as_accurate"] = None if cheapest is None else _brief(cheapest)
            if cheapest is not None:
                row["steps_saved_vs_cheapest_fixed"] = 1 - best["steps"] / cheapest["steps"]
            if "ms_per_token" in best and "ms_per_token" in full:
                row["time_saved_vs_full"] = 1 - best["ms_per_token"] / full["ms_per_token"]
                if cheapest is not None and "ms_per_token" in cheapest:
                    row["time_saved_vs_cheapest_fixed"] = 1 - best["ms_per_token"] / cheapest["ms_per_token"]
            row["answer_over_other_steps"] = best["mean_steps_answer"] / max(best["mean_steps_other"], 1e-12)
        row["pareto"] = [e["label"] for e in pareto_front(block["fixed"] + block["points"])]
        if all("halves" in e for e in block["fixed"] + block["points"]):  # (sweeps saved before have none)
            row["halves"] = honest_selection(block["fixed"], block["points"], tolerance)
        out["difficulties"].append(row)
    return out


def _brief(entry: dict) -> dict:
    keys = ("label", "accuracy", "steps", "mean_steps_answer", "mean_steps_other", "ms_per_token", "budget",
            "policy", "value")
    return {k: entry[k] for k in keys if k in entry}


def _settings(model: RecurrentLM, config: SweepConfig, k_max: tuple[int, ...],
              new_decode: Callable) -> list[tuple[dict, Callable]]:
    """Every setting swept, as (labels, controller factory): each fixed budget 1..k_max (capped per group),
    each policy at each value of its grid, then the exit profile when one is given."""
    settings: list[tuple[dict, Callable]] = []
    for steps in range(1, max(k_max) + 1):
        budget = tuple(min(steps, cap) for cap in k_max)
        settings.append(({"label": f"fixed {','.join(map(str, budget))}", "budget": list(budget)},
                         lambda budget=budget: FixedController(budget)))
    for name in config.policies:
        parameter = get_policy_class(name).sweep_parameter
        for value in config.values(name):
            factory = controller_factory(name, value, k_max, new_decode, config.policy_options(name))
            settings.append(({"label": f"{name} {parameter}={value:g}", "policy": name, "parameter": parameter,
                              "value": value}, factory))
    if config.exit_profile is not None:
        profile = load_profile(config.exit_profile, model.n_groups, config.checkpoint, config.force_profile)
        values = ",".join(f"{v:g}" for v in profile["values"])
        settings.append(({"label": f"profile {profile['policy']} {values}", "policy": "profile",
                          "parameter": profile["parameter"], "value": profile["values"][0],
                          "values": profile["values"]},
                         profile_controller_factory(profile, lambda: model.readout)))
    return settings


class _HeldoutSweep(NamedTuple):
    """One held-out set swept: its result block; with hops, each policy point's steps per answer token
    (label, steps) and the per-token oracle; with timing, each setting's forward call and (entry, tokens)."""

    block: dict
    answer_steps: list[tuple[str, np.ndarray]]
    oracle: np.ndarray | None
    calls: dict[str, Callable[[], None]]
    work: dict[str, tuple[dict, int]]


def _sweep_heldout(model: RecurrentLM, heldout: HeldOut, config: SweepConfig, k_max: tuple[int, ...],
                   device: torch.device, progress: bool, per_token: bool) -> _HeldoutSweep:
    """Measure every setting on one held-out set (``per_token``: keep the answer tokens' steps and
    correctness for the depth measure), and prepare its timing calls when the sweep is timed."""
    seq_len = heldout.tokens.shape[1] - 1
    if seq_len > model.config.block_size:
        raise RdepthError(f"sweep: held-out windows of {seq_len} tokens exceed the model's block size "
                          f"{model.config.block_size}")
    timing_idx = torch.from_numpy(heldout.tokens[: config.timing_batch_size, :-1]).to(device)
    new_decode = decode_factory(model, config.measure_settings(), seq_len)
    settings = _settings(model, config, k_max, new_decode)
    fixed, points, fixed_right, answer_steps = [], [], [], []
    calls: dict[str, Callable[[], None]] = {}
    work: dict[str, tuple[dict, int]] = {}
    desc = f"task sweep d={heldout.difficulty}"
    problems = target_problems(heldout.answer_mask, heldout.problem_ids)
    for labels, factory in tqdm(settings, desc=desc, disable=not progress):
        entry = {**labels, **_measure(model, heldout, factory, config.measure_settings(), device, per_token=True)}
        right, steps = entry.pop("answer_right"), entry.pop("answer_steps")
        entry["halves"] = half_scores(right, steps, problems)  # for the honest selection (rdepth.sweep.halves)
        if "budget" in entry:
            fixed.append(entry)
            fixed_right.append(right)
        else:
            points.append(entry)
            answer_steps.append((entry["label"], steps))
        if config.timing:
            key = f"{heldout.difficulty}:{entry['label']}"
            calls[key] = forward_call(model, timing_idx, controller_factory=factory, seed=config.seed)
            work[key] = (entry, timing_idx.numel())
        log.debug("d=%d %s: accuracy %.3f, steps %.2f (answers %.2f, other %.2f)", heldout.difficulty,
                  entry["label"], entry["accuracy"], entry["steps"], entry["mean_steps_answer"],
                  entry["mean_steps_other"])
    oracle = oracle_steps(np.stack(fixed_right), [sum(f["budget"]) for f in fixed]) if per_token else None
    block = {"difficulty": heldout.difficulty, "problems": int(heldout.problem_ids.max()) + 1,
             "windows": int(heldout.tokens.shape[0]), "seq_len": seq_len, "fixed": fixed, "points": points}
    return _HeldoutSweep(block, answer_steps if per_token else [], oracle, calls, work)


def _time_settings(calls: dict[str, Callable[[], None]], work: dict[str, tuple[dict, int]], config: SweepConfig,
                   device: torch.device, progress: bool) -> None:
    """Time every setting's forward call in interleaved rounds; each entry gets its median ms/token and IQR."""
    with tqdm(total=config.repeats, desc=f"timing {len(calls)} settings", disable=not progress) as bar:
        samples = time_interleaved(calls, device, warmup=config.warmup, repeats=config.repeats, seed=config.seed,
                                   progress=lambda _: bar.update())
    for key, times in samples.items():
        entry, tokens = work[key]
        stats = spread([t / tokens for t in times])
        entry["ms_per_token"], entry["ms_per_token_iqr"] = stats["median"], stats["iqr"]
        entry["timing_batch_size"] = config.timing_batch_size


def _depth(blocks: list[dict], heldouts: Sequence[HeldOut], hops: Sequence[np.ndarray],
           steps_of: dict[str, list[np.ndarray]], oracle: list[np.ndarray]) -> dict:
    """Depth against hops (:func:`rdepth.sweep.depth.depth_vs_hops`) on every held-out set's answer tokens
    pooled: per policy setting (described by the first set's points) and for the oracle."""
    difficulty = np.concatenate([np.full(len(h), heldout.difficulty) for h, heldout in zip(hops, heldouts, strict=False)])
    keys = ("label", "policy", "parameter", "value")
    described = [{k: p[k] for k in keys if k in p} for p in blocks[0]["points"]]
    return depth_vs_hops(np.concatenate(hops), difficulty,
                         [{**d, "steps": np.concatenate(steps_of[d["label"]])} for d in described],
                         np.concatenate(oracle))


def run_task_sweep(model: RecurrentLM, heldouts: Sequence[HeldOut], config: SweepConfig, *,
                   device: str | torch.device = "cpu", tolerance: float = 0.01, progress: bool = False,
                   hops: Sequence[np.ndarray] | None = None) -> dict:
    """Measure every fixed budget and policy setting on each held-out set (see the module docstring).
    ``hops``: per held-out set, the hops of its answer targets (:func:`rdepth.tasks.hops.heldout_hops`);
    given, the result holds ``depth`` (:func:`rdepth.sweep.depth.depth_vs_hops`)."""
    if hops is not None and len(hops) != len(heldouts):
        raise RdepthError(f"sweep: hops for {len(hops)} held-out sets, {len(heldouts)} swept")
    steps_of: dict[str, list[np.ndarray]] = {}  # label -> per held-out set, steps per answer token
    oracle: list[np.ndarray] = []
    device = torch.device(device)
    model = model.to(device).eval()
    k_max = config.resolve_k_max(model.n_groups, model.config.default_eval_loops)
    calls: dict[str, Callable[[], None]] = {}
    work: dict[str, tuple[dict, int]] = {}
    blocks = []
    for heldout in heldouts:
        swept = _sweep_heldout(model, heldout, config, k_max, device, progress, per_token=hops is not None)
        for label, steps in swept.answer_steps:
            steps_of.setdefault(label, []).append(steps)
        if swept.oracle is not None:
            oracle.append(swept.oracle)
        calls.update(swept.calls)
        work.update(swept.work)
        blocks.append(swept.block)
    if calls:
        _time_settings(calls, work, config, device, progress)
    saved = asdict(config)
    saved.update(k_max=list(k_max), grids=config.grid, accuracy_tolerance=tolerance)
    result = {"format": FORMAT, "kind": "task", "config": saved,
              "environment": environment_info() | {"device": device_name(device)},
              "model": model.config.to_dict(), "k_max": list(k_max), "difficulties": blocks,
              "timing_path": "packed (fixed budgets and policies alike)"}
    result["summary"] = summarize_task_sweep(result, tolerance)
    if hops is not None:
        result["depth"] = _depth(blocks, heldouts, hops, steps_of, oracle)
        result["summary"]["depth"] = depth_summary(result, result["summary"])
    return result


def format_task_sweep(result: dict) -> list[str]:
    """Text lines: per difficulty, every setting's accuracy and steps, then the summary."""
    lines = []
    timed = any("ms_per_token" in e for b in result["difficulties"] for e in b["fixed"])
    for block, summary in zip(result["difficulties"], result["summary"]["difficulties"], strict=False):
        lines.append(f"difficulty {block['difficulty']} ({block['problems']} problems): accuracy %, mean loop steps "
                     "per token (all / answer tokens / other tokens)" + (", ms/token" if timed else ""))
        for entry in block["fixed"] + block["points"]:
            cells = (f"  {entry['label']:<28}{100 * entry['accuracy']:7.1f}{entry['steps']:8.2f}"
                     f"{entry['mean_steps_answer']:8.2f}{entry['mean_steps_other']:8.2f}")
            lines.append(cells + (f"{entry['ms_per_token']:9.4f}" if "ms_per_token" in entry else ""))
        best = summary.get("best")
        full = summary["full"]
        if best is None:
            lines.append(f"  no policy within {100 * result['summary']['tolerance']:g} points of the full budget")
            continue
        cheapest = summary.get("cheapest_fixed_as_accurate")
        lines.append(
            f"  best within {100 * result['summary']['tolerance']:g} point(s) of the full budget ({full['label']}, "
            f"{100 * full['accuracy']:.1f}%): {best['label']} at {100 * best['accuracy']:.1f}% with "
            f"{best['steps']:.2f} steps/token ({100 * summary['steps_saved_vs_full']:.0f}% fewer than the full "
            f"budget" + (f", {100 * summary['steps_saved_vs_cheapest_fixed']:.0f}% fewer than {cheapest['label']}, "
                         f"the cheapest fixed budget as accurate" if cheapest else "") + "); answer tokens get "
            f"{best['mean_steps_answer']:.2f} steps, the rest {best['mean_steps_other']:.2f}")
        lines += format_halves(summary.get("halves", []))
    if "depth" in result:
        lines += format_depth(result["depth"])
    return lines


def format_halves(rows: list[dict]) -> list[str]:
    """Text lines of the honest selection: per direction, the setting chosen on one half and how it does on
    the other (accuracy, answer-token steps, the bar), beside the cheapest fixed budget chosen alike."""
    lines = []
    for row in rows:
        head = f"  chosen on half {row['chosen_on']}, judged on {row['judged_on']}"
        point = row["point"]
        if point is None:
            lines.append(f"{head}: no policy within the tolerance on half {row['chosen_on']}")
            continue
        fixed = row.get("cheapest_fixed")
        lines.append(f"{head}: {point['label']} {100 * point['accuracy']:.1f}% (full budget "
                     f"{100 * row['full_accuracy']:.1f}%, {'meets' if point['meets_bar'] else 'misses'} the bar) at "
                     f"{point['answer_steps']:.2f} answer steps" + (
                         f"; {fixed['label']} {100 * fixed['accuracy']:.1f}% at {fixed['answer_steps']:.2f}"
                         if fixed else ""))
    return lines


def format_depth(depth: dict) -> list[str]:
    """Text lines of the depth-against-hops measure: per setting and the oracle, Spearman's rho and mean
    steps per hop count, on every swept difficulty's answer tokens pooled."""
    oracle = depth["oracle"]
    hops = sorted({h for row in depth["settings"] + [oracle] for h in row["hops"]})
    lines = [f"does depth track difficulty? answer tokens ({depth['tokens']}, difficulties pooled): Spearman "
             "rho of executed loop steps against hops, then mean steps at each hop count",
             f"  {'setting':<28}{'rho':>7}" + "".join(f"{'h=' + str(h):>7}" for h in hops)]
    for row in depth["settings"] + [oracle]:
        at = dict(zip(row["hops"], row["mean_steps_by_hops"], strict=False))
        rho = row["spearman"]
        lines.append(f"  {row['label']:<28}" + (f"{rho:7.2f}" if rho == rho else f"{'n/a':>7}")
                     + "".join(f"{at[h]:7.2f}" if h in at else f"{'':>7}" for h in hops))
    lines.append(f"  oracle: the fewest fixed-budget steps from which a token stays right up to the cap; "
                 f"{oracle['undefined']} token(s) wrong at the cap left out")
    return lines


def sweep_task_checkpoint(config: SweepConfig) -> dict:
    """``rdepth sweep`` on task data: open the run, load the first ``config.task_windows`` windows of
    the held-out sets of ``config.difficulties`` (default: the top training difficulty), count the hops of
    their answer tokens, sweep, write ``OUT/task_sweep.json``, ``OUT/depth_vs_hops.csv`` and the report
    section; returns the result with ``paths``."""
    from rdepth.io import REPORT_SEED, final_path, staged_output, write_text
    from rdepth.report.html import check_page_folder

    check_page_folder(config.out)  # before any work: someone's index.html is never replaced
    if config.threads:
        torch.set_num_threads(config.threads)
    run = open_run(config.checkpoint, config.data, config.device)
    manifest = task_manifest(config.data)
    chosen = config.difficulties or [int(manifest["train_difficulties"][1])]
    heldouts = [load_heldout(config.data, d).windows(0, config.task_windows) for d in chosen]
    tasks = manifest_tasks(config.data)
    hops = [heldout_hops(tasks, heldout) for heldout in heldouts]
    result = run_task_sweep(run.model, heldouts, config, device=run.device, tolerance=config.accuracy_tolerance,
                            progress=config.progress, hops=hops)
    result["checkpoint"], result["data"] = str(run.checkpoint), str(run.data)
    from rdepth.sweep.task_report import render_task_sweep

    with staged_output(config.out, seed=REPORT_SEED) as out:  # swapped in whole: old or new, never a mix
        paths = {"json": out / TASK_SWEEP_FILE}
        write_json(paths["json"], result)
        if "depth" in result:
            paths["depth_csv"] = out / DEPTH_CSV
            write_text(paths["depth_csv"], depth_csv(result["depth"]))
        paths.update(render_task_sweep(result, out))
        paths = {name: final_path(path) for name, path in paths.items()}
    return {**result, "paths": {name: str(path) for name, path in paths.items()}}
