"""The demo's task mode: a model whose loops matter, measured against baselines of the same data and steps.

1. generate the task data (``rdepth prepare --corpus task:chase``): training
   problems of difficulty LOW..HIGH, held-out sets at every training difficulty
   and at 1.5x and 2x the top;
2. train the looped model (a difficulty curriculum, answer-only loss) and, on
   the same data, steps and seed, each baseline: ``no_loop`` (the same layers
   once each) and optionally ``deep`` (a plain model as deep as the looped one
   unrolled at its training mean, Saunshi et al.'s comparison). Each run is
   trained by ``ranks`` data-parallel processes (:mod:`rdepth.train.ranks`),
   one run after the other;
3. exact-match accuracy per held-out difficulty at each test loop budget (the
   test-time-compute curve), each baseline at its own depth;
4. the exit policies on the top training difficulty: accuracy and loop steps on
   answer tokens and on the rest, against fixed budgets on the same path;
5. the loop geometry of the looped model's checkpoints;
6. the report's first screen (:mod:`rdepth.demo.task_report`).

Every stage calls the same pipeline function as its command; a re-run into the
same folder reuses what finished with the same settings.

Threads: every process of the demo computes with :data:`rdepth.threads.REPRODUCIBLE_THREADS`
torch thread (``--threads N`` overrides it), so its numbers are the same on any machine and under
any load: a matrix product split over another number of threads rounds differently, and training
amplifies that (losses part after a few dozen steps). The speed comes from a fixed number of
data-parallel processes per run instead (``--ranks``, 2 by default: both cores of a small machine
on one run): the split of a batch over ranks is part of the recipe, the machine's cores are not.
:func:`thread_plan_text` says so at the start.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rdepth.errors import RdepthError
from rdepth.io import StageTimer, write_json

# The stages take the demo's config (rdepth.demo.run.DemoConfig); rdepth.demo.run imports this module, not
# the reverse, so the type is named in words only.
DemoConfig = Any

log = logging.getLogger(__name__)

EXIT_POLICIES = ("acceleration", "step_norm", "kl", "argmax_stable")
# Wider than the text sweep's 1e-5..1e-2: the task model's steps stay above 1e-2 of the state for many steps.
EXIT_TAUS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def _prepared(config: DemoConfig) -> Path:
    from rdepth.tasks.data import prepare_task_data

    task_config = config.task_data_config()
    data = Path(task_config.out)
    manifest = data / "manifest.json"
    if manifest.exists():
        saved = json.loads(manifest.read_text()).get("config", {})
        wanted = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(task_config).items()}
        wanted = json.loads(json.dumps(wanted))  # tuples as lists, as saved
        # Where the data was written is not what it is: a copied or moved folder is the same data.
        changed = sorted(k for k in wanted if k != "out" and saved.get(k) != wanted[k])
        if changed:
            raise RdepthError(f"{data} holds other prepared data ({', '.join(changed[:3])} differ); "
                              "pass another --data folder")
        log.info("reusing the task data in %s", data)
        return data
    return prepare_task_data(task_config)


def unrolled_depth(model_config) -> int:
    """Layers a token passes through at the training mean loop count (rounded)."""
    looped = sum(group.end - group.start + 1 for group in model_config.group_specs)
    unrolled = sum((group.end - group.start + 1) * model_config.mean_loops for group in model_config.group_specs)
    return model_config.n_layer - looped + round(unrolled)


def baseline_model_config(model_config, name: str):
    """The model config of a baseline: the same layers without loops, or a plain model of the unrolled depth."""
    if name == "no_loop":
        return replace(model_config, groups="", eval_loops=None)
    if name == "deep":
        return replace(model_config, n_layer=unrolled_depth(model_config), groups="", eval_loops=None)
    raise RdepthError(f"unknown baseline {name!r}")


def run_threads(config: DemoConfig) -> int:
    """Torch threads of every process of the task demo: ``--threads``, else the fixed count."""
    from rdepth.threads import REPRODUCIBLE_THREADS

    return config.threads or REPRODUCIBLE_THREADS


def thread_plan_text(config: DemoConfig, at) -> str:
    """One line on the processes and threads, and whether the numbers may differ from a run at the
    defaults. ``at``: :class:`rdepth.threads.Machine`."""
    from rdepth.threads import REPRODUCIBLE_THREADS, describe, thread_plan

    ranks, threads = config.ranks, run_threads(config)
    runs = (f"each run trained by {ranks} data-parallel processes" if ranks > 1 else "each run trained by 1 process")
    text = f"threads: {describe(at)}; {runs}, {threads} torch thread{'s' if threads > 1 else ''} each"
    if config.threads and config.threads != REPRODUCIBLE_THREADS:
        return text + (f" (--threads {config.threads}: the numbers may differ from a run at the default "
                       f"{REPRODUCIBLE_THREADS}, such as the README's table)")
    text += " (fixed: the numbers do not depend on the machine's cores or load)"
    if ranks * threads > at.cores:
        text += f"; {at.cores} core{'s' if at.cores != 1 else ''} for {ranks} processes: slower, same numbers"
    elif at.load >= at.cores:
        text += "; the machine is busy (load at or above its cores): slower, same numbers"
    elif thread_plan(at.cores, 1, at.load) >= 2 * ranks * threads:
        more = thread_plan(at.cores, 1, at.load) // threads
        text += f"; --ranks {more} would use more cores, with other numbers"
    return text


def _runs(config: DemoConfig, data: Path) -> dict[str, tuple[Any, Any]]:
    """name -> (model config, train config) of the looped run and each baseline."""
    from rdepth.train.resume import data_model_config_for

    looped = data_model_config_for(config.model_config(), data)
    threads = run_threads(config)
    runs = {"looped": (looped, replace(config.train_config(data, "train"), threads=threads))}
    for name in config.baselines:
        runs[name] = (baseline_model_config(looped, name),
                      replace(config.train_config(data, f"baseline_{name}"), threads=threads))
    return runs


def _train_all(config: DemoConfig, data: Path) -> dict[str, Path]:
    """Train the looped run, then each baseline, each by ``config.ranks`` data-parallel processes."""
    from rdepth.train.ranks import train_ranks

    paths = {}
    for name, (model_config, train_config) in _runs(config, data).items():
        log.info("training %s (%s)", name, train_config.out)
        paths[name] = train_ranks(model_config, train_config, config.ranks, Path(config.out) / "logs")
    return paths


def _accuracy(config: DemoConfig, data: Path, runs: dict[str, Path]) -> dict[str, Any]:
    """The accuracy tables: the looped run at every test budget, each baseline at its own depth."""
    from rdepth.run.opened import open_run
    from rdepth.tasks.evaluate import format_accuracy_table, task_accuracy_table

    tables = {}
    for name, run in runs.items():
        opened = open_run(run, data, "cpu")
        budgets = list(config.loop_budgets) if name == "looped" else [None]
        tables[name] = task_accuracy_table(opened.model, data, budgets, batch_size=64)
        tables[name]["parameters"] = opened.model.num_parameters()
        tables[name]["model"] = opened.config.to_dict()
        for line in format_accuracy_table(tables[name]):  # the command prints them all at the end
            log.debug("%s: %s", name, line)
    return tables


def _sweep(config: DemoConfig, data: Path, run: Path) -> dict:
    from rdepth.sweep.config import SweepConfig
    from rdepth.sweep.task import sweep_task_checkpoint

    return sweep_task_checkpoint(SweepConfig(
        checkpoint=str(run), data=str(data), out=str(Path(config.out) / "report"), policies=EXIT_POLICIES,
        taus=EXIT_TAUS, repeats=3, timing_batch_size=16, batch_size=64, device="cpu", progress=False))


def _analyze(config: DemoConfig, data: Path, run: Path) -> Path:
    from rdepth.geometry.analyze import run_analysis
    from rdepth.geometry.config import AnalyzeConfig

    return run_analysis(AnalyzeConfig(checkpoints=[str(run)], data=str(data), out=str(Path(config.out) / "report"),
                                      sequences=config.analyze_sequences, long_loops=config.long_loops, device="cpu",
                                      progress=False,
                                      # the demos' reports read neither: keep their run time as documented
                                      dlr_curve_loops=0, jacobian_positions=0))


def run_task_demo(config: DemoConfig) -> dict:
    """Every stage of the task demo; returns (and writes to OUT/demo.json) the headline numbers."""
    import torch

    from rdepth.threads import machine

    at = machine()
    torch.set_num_threads(run_threads(config))  # every stage, this process and the baselines' alike
    log.info("%s", thread_plan_text(config, at))
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    stage = StageTimer(log)

    data = stage("prepare", _prepared, config)
    runs = stage("train", _train_all, config, data)
    tables = stage("accuracy", _accuracy, config, data, runs)
    outputs = {"data": str(data), **{f"run_{name}": str(path) for name, path in runs.items()}}
    sweep = None
    if config.sweep:
        sweep = stage("sweep", _sweep, config, data, runs["looped"])
        outputs["sweep"] = sweep["paths"]["json"]
    if config.analyze:
        outputs["analysis"] = str(stage("analyze", _analyze, config, data, runs["looped"]))
    training = {}
    for name, run in runs.items():
        summary_path = run / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        training[name] = {"steps": summary.get("step"), "tokens_per_second": summary.get("tokens_per_second"),
                          "wall_seconds": summary.get("wall_seconds")}
    result = {
        "mode": "task",
        "config": asdict(config),
        "outputs": outputs,
        "accuracy": tables,
        "training": training,
        "sweep_summary": None if sweep is None else sweep["summary"],
        "stage_seconds": stage.seconds,
        "wall_seconds": stage.wall,
        "threads": {"per_process": run_threads(config), "ranks": config.ranks,
                    "cores": at.cores, "load_at_start": round(at.load, 2)},
    }
    write_json(out / "demo.json", result)
    from rdepth.demo.task_report import write_task_first_screen

    write_task_first_screen(out)
    from rdepth.demo.task_report import summarize_task_demo

    return {**result, "overview": summarize_task_demo(out)}
