"""``rdepth reproduce two-scale`` as one call: prepare, time, plan, train, measure, judge, report.

Stages (each logged as it starts, its wall time kept in ``reproduce.json``):

1. **prepare**: use ``--data`` if it is prepared, else prepare ``--corpus`` into it
   (:func:`rdepth.data.prepare.prepare`, whatever corpus ``rdepth prepare`` accepts);
2. **probe**: time a few real training steps of the first size on the device (the
   trainer itself, in ``OUT/probe/<size>``, removed afterwards) and, when the plan
   picks another size, of that size too;
3. **plan**: :func:`rdepth.reproduce.plan.plan_run` sizes the run to the time left
   (saved in ``OUT/plan.json``; a rerun into the same folder reuses it, so that an
   interrupted training run resumes and a finished one is reused);
4. **train**: :func:`rdepth.train.launch.train_or_reuse` with checkpoints spread
   evenly over training (bf16 autocast on CUDA, ``torch.compile`` when asked);
5. **loop budgets**: validation perplexity at 1, the training mean and twice it,
   beside the unigram baseline on the same tokens;
6. **analyze**: :func:`rdepth.geometry.analyze.run_analysis` on every checkpoint;
7. **sweep**: :func:`rdepth.sweep.run.sweep_checkpoint` with the paper's tau grid on
   the final checkpoint (every policy on the same packed path; latency at batch 1,
   throughput at ``timing_batch``);
8. **claims**: :mod:`rdepth.reproduce.claims` on the saved summaries, then the
   claims table on the report page, ``claims.json`` and a self-contained
   ``report.html`` (:mod:`rdepth.reproduce.report`), and the export.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rdepth.errors import RdepthError
from rdepth.io import StageTimer, exclusive, read_json_if_present, read_jsonl, write_json
from rdepth.reproduce.config import ReproduceConfig
from rdepth.reproduce.plan import (
    SAFETY_SECONDS,
    SIZES,
    VAL_BATCH_SIZE,
    VAL_BATCHES,
    Plan,
    Probe,
    Workload,
    plan_run,
    probe_from_steps,
)

log = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
RESULT_FILE = "reproduce.json"
PROBE_WARMUP = {"cuda": 3, "cpu": 1}  # untimed first steps (compilation, allocator, caches)
# Fields that may change when a run is continued into the same folder (they change nothing measured).
FREE_ON_RERUN = ("export_dir", "minutes", "threads")
SWEEP_BATCH = 8
GENERATE_PROMPT = 16


def _prepared(config: ReproduceConfig) -> Path:
    from rdepth.data.prepare import PrepareConfig, prepare

    data = Path(config.data)
    if (data / "manifest.json").is_file():
        log.info("using the prepared data in %s", data)
        return data
    if config.corpus is None:
        raise RdepthError(f"{data} holds no prepared data (no manifest.json): prepare it with rdepth prepare, or "
                          "pass --corpus NAME to prepare it here")
    import os

    return prepare(PrepareConfig(corpus=config.corpus, tokenizer=config.tokenizer, out=data,
                                 max_documents=config.max_documents,
                                 workers=config.workers or max(1, len(os.sched_getaffinity(0)))))


def loop_overrides(config: ReproduceConfig) -> dict:
    """The loop-schedule fields ``config`` sets for every size (mean loops, backprop depth, loop state)."""
    values = {name: getattr(config, name) for name in ("mean_loops", "backprop_depth", "loop_state")}
    return {name: value for name, value in values.items() if value is not None}


def _model_config(size: str, data: Path, config: ReproduceConfig):
    from rdepth.config import get_preset
    from rdepth.train.resume import data_model_config_for

    spec = SIZES[size]
    return data_model_config_for(get_preset(spec.preset, **{**spec.overrides, **loop_overrides(config)}), data)


def _train_config(config: ReproduceConfig, data: Path, out: Path, *, steps: int, batch: int, lr: float,
                  warmup: int, every: int, log_every: int, eval_batches: int, eval_batch_size: int,
                  time_limit: float | None = None):
    from rdepth.train.config import TrainConfig

    return TrainConfig(data=str(data), out=str(out), max_steps=steps, batch_size=batch, lr=lr, warmup_steps=warmup,
                       eval_every=every, checkpoint_every=every, eval_batches=eval_batches,
                       eval_batch_size=eval_batch_size, log_every=log_every, seed=config.seed, device=config.device,
                       compile=bool(config.compile), threads=config.threads, time_limit=time_limit)


def _probe(size: str, config: ReproduceConfig, data: Path, kind: str) -> Probe:
    """Time ``config.probe_steps`` training steps of ``size`` after its warm-up steps, with the trainer."""
    from rdepth.train.trainer import train

    model_config = _model_config(size, data, config)
    spec = SIZES[size]
    warm = PROBE_WARMUP[kind]
    steps = warm + config.probe_steps
    folder = Path(config.out) / "probe" / size
    if folder.exists():  # an interrupted probe of ours
        shutil.rmtree(folder)
    started = time.perf_counter()
    train(model_config, _train_config(config, data, folder, steps=steps, batch=spec.batch_size, lr=spec.lr,
                                      warmup=1, every=steps, log_every=1, eval_batches=1, eval_batch_size=1))
    wall = time.perf_counter() - started
    tokens = spec.batch_size * model_config.block_size
    timed = [(tokens / record["tokens_per_s"], record["loop_counts"])
             for record in read_jsonl(folder / "metrics.jsonl")
             if "tokens_per_s" in record and record["step"] > warm]
    shutil.rmtree(folder)
    if not any(folder.parent.iterdir()):
        folder.parent.rmdir()
    probe = probe_from_steps(size, model_config, spec.batch_size, timed, wall)
    log.info("probe %s: %.0f tokens/s at the schedule's mean loop counts (%d timed steps, %.1f s in all)",
             size, probe.tokens_per_second, probe.steps, wall)
    return probe


def _workload(config: ReproduceConfig) -> Workload:
    return Workload(checkpoints=config.checkpoints, analyze_sequences=config.analyze_sequences,
                    long_loops=config.long_loops, sweep_windows=_sweep_windows(config),
                    sweep_settings=config.sweep_settings(), timing_batch=config.timing_batch,
                    generate_tokens=config.generate_tokens, repeats=config.repeats, val_windows=config.val_windows)


def _sweep_windows(config: ReproduceConfig) -> int:
    return SWEEP_BATCH * math.ceil(config.sweep_windows / SWEEP_BATCH)


def _planned(config: ReproduceConfig, data: Path, kind: str, stage: StageTimer) -> dict[str, Any]:
    """The saved plan of this folder (the same settings), else a new one from one or two probes."""
    path = Path(config.out) / PLAN_FILE
    saved = read_json_if_present(path)
    if saved is not None:
        wanted = {k: v for k, v in json.loads(json.dumps(config.to_dict())).items() if k not in FREE_ON_RERUN}
        had = {k: v for k, v in saved.get("config", {}).items() if k not in FREE_ON_RERUN}
        if had != wanted:
            changed = sorted(k for k in set(had) | set(wanted) if had.get(k) != wanted.get(k))
            raise RdepthError(f"{config.out} was planned with other settings ({', '.join(changed[:4])}); "
                              "pass another --out")
        log.info("reusing the plan in %s", path)
        return saved
    configs = {name: _model_config(name, data, config) for name in config.sizes}
    probes = [_probe(config.sizes[0], config, data, kind)]
    work = _workload(config)

    def plan_now(candidates: dict) -> Plan:
        return plan_run(candidates, probes[-1], config.budget_seconds - stage.wall, min_tokens=config.min_tokens,
                        train_share=config.train_share, work=work, kind=kind)

    plan = plan_now(configs)
    names = list(configs)
    while plan.size != probes[-1].size:
        # Time the chosen size itself and plan again among it and the smaller sizes from its own
        # speed: a larger size's seconds per FLOP flatter a smaller one, so the new plan may step
        # down (and time that size too). Each pass times a smaller size than the last: it ends.
        probes.append(_probe(plan.size, config, data, kind))
        names = names[names.index(plan.size):]
        plan = plan_now({name: configs[name] for name in names})
    log.info("plan: size %s, %d steps of %d windows (%s tokens), checkpoint every %d steps; training about %.0f s, "
             "the rest about %.0f s", plan.size, plan.max_steps, plan.batch_size, f"{plan.tokens:,}",
             plan.checkpoint_every, plan.train_seconds, plan.after_training["total"])
    if not plan.reaches_min_tokens:
        log.warning("no size reaches %s training tokens in this budget; %s trains on %s", f"{config.min_tokens:,}",
                    plan.size, f"{plan.tokens:,}")
    saved = {"config": config.to_dict(), "device_kind": kind, "plan": plan.to_dict(),
             "probes": [asdict(p) for p in probes]}
    write_json(path, saved)
    return saved


def training_time_limit(config: ReproduceConfig, plan: Plan, elapsed: float, kind: str) -> float:
    """Seconds the training loop may take so that the whole command ends inside its budget: what is
    left after ``elapsed``, less the safety margin and the stages after training as planned. The
    trainer shortens its schedule to fit (``TrainConfig.time_limit``) when it runs slower than the probe."""
    return max(1.0, config.budget_seconds - elapsed - SAFETY_SECONDS[kind] - plan.after_training["total"])


def _trained(config: ReproduceConfig, data: Path, plan: Plan, time_limit: float) -> Path:
    from rdepth.train.launch import train_or_reuse

    log.info("training may take %.0f s (planned %.0f s)", time_limit, plan.train_seconds)
    train_config = _train_config(
        config, data, Path(config.out) / "train", steps=plan.max_steps, batch=plan.batch_size, lr=plan.lr,
        warmup=plan.warmup_steps, every=plan.checkpoint_every, log_every=max(1, min(50, plan.max_steps // 20)),
        eval_batches=VAL_BATCHES, eval_batch_size=VAL_BATCH_SIZE, time_limit=round(time_limit, 1))
    return train_or_reuse(_model_config(plan.size, data, config), train_config)


def _loop_budgets(run: Path, data: Path, config: ReproduceConfig) -> dict[str, Any]:
    """Validation perplexity at 1 loop, the training mean and twice it, and the unigram baseline, on the
    same held-out windows."""
    from rdepth.run.evaluate import evaluate, unigram_baseline
    from rdepth.run.opened import open_run

    opened = open_run(run, data, config.device)
    windows = opened.windows(config.val_windows)
    mean = max(opened.config.default_eval_loops)
    rows = []
    for loops in sorted({1, mean, 2 * mean}):
        result = evaluate(opened.model, windows, loop_counts=loops, batch_size=VAL_BATCH_SIZE, device=opened.device,
                          seed=config.seed)
        rows.append({"loops": result["loop_counts"], "ce": result["ce"], "ppl": result["ppl"],
                     "tokens": result["tokens"]})
        log.info("loops %2d: validation perplexity %.2f", loops, result["ppl"])
    baseline = None if opened.unigram is None else unigram_baseline(windows, opened.unigram)
    if baseline is not None:
        log.info("unigram baseline on the same tokens: perplexity %.2f", baseline["ppl"])
    return {"loop_budgets": rows, "unigram": baseline, "train_loops": mean}


def _analyzed(run: Path, data: Path, config: ReproduceConfig) -> Path:
    from rdepth.geometry.analyze import run_analysis
    from rdepth.geometry.config import AnalyzeConfig

    return run_analysis(AnalyzeConfig(checkpoints=[str(run)], data=str(data), out=str(Path(config.out) / "report"),
                                      sequences=config.analyze_sequences, long_loops=config.long_loops,
                                      device=config.device, seed=config.seed, threads=config.threads))


def _swept(run: Path, data: Path, config: ReproduceConfig, block_size: int) -> Path:
    from rdepth.sweep.config import SweepConfig
    from rdepth.sweep.run import sweep_checkpoint

    windows = _sweep_windows(config)
    generate = min(config.generate_tokens, max(0, block_size - GENERATE_PROMPT))
    result = sweep_checkpoint(SweepConfig(
        checkpoint=str(run), data=str(data), out=str(Path(config.out) / "report"), policies=config.policies,
        taus=config.taus, grid=config.grid(), batch_size=SWEEP_BATCH, max_batches=windows // SWEEP_BATCH,
        timing_batch_size=min(config.timing_batch, windows), warmup=1, repeats=config.repeats,
        generate_tokens=generate, generate_prompt=GENERATE_PROMPT, fixed_ladder=False, seed=config.seed,
        device=config.device, threads=config.threads))
    return Path(result["paths"]["json"])


def run_reproduce(config: ReproduceConfig) -> dict[str, Any]:
    """Every stage, inside ``config.minutes``; returns (and writes to ``OUT/reproduce.json``) the headline."""
    import torch

    from rdepth.run.device import device_name, resolve_device

    device = resolve_device(config.device)
    config = config.for_device(device.type)
    if config.threads:
        torch.set_num_threads(config.threads)
    out = Path(config.out)
    with exclusive(out, "reproduce"):
        stage = StageTimer(log)
        data = stage("prepare", _prepared, config)
        saved = stage("probe and plan", _planned, config, data, device.type, stage)
        plan = Plan.from_dict(saved["plan"])
        run = stage("train", _trained, config, data, plan, training_time_limit(config, plan, stage.wall, device.type))
        quality = stage("loop budgets", _loop_budgets, run, data, config)
        stage("analyze", _analyzed, run, data, config)
        block_size = _model_config(plan.size, data, config).block_size
        sweep_path = stage("sweep", _swept, run, data, config, block_size)
        result = stage("claims and report", _judged, config, run, sweep_path, saved, quality, device_name(device),
                       data)
        result.update(stage_seconds=dict(stage.seconds), wall_seconds=stage.wall)
        write_json(out / RESULT_FILE, result)
        if config.export_dir:
            from rdepth.reproduce.report import export

            result["exported"] = export(out, config.export_dir)
    log.info("done in %.0f s of a %.0f s budget", result["wall_seconds"], config.budget_seconds)
    return result


def _epochs(tokens: int, data: Path) -> float | None:
    """Passes over the training split that ``tokens`` training tokens make (windows are drawn at random)."""
    from rdepth.data.shards import TokenShards

    split = TokenShards.open(data).manifest["splits"]["train"]["tokens"]
    return round(tokens / split, 3) if split else None


def _judged(config: ReproduceConfig, run: Path, sweep_path: Path, saved: dict[str, Any], quality: dict[str, Any],
            device: str, data: Path) -> dict[str, Any]:
    from rdepth.geometry.summary import load_summary
    from rdepth.reproduce.claims import judge_all
    from rdepth.reproduce.report import write_claims, write_claims_page, write_standalone
    from rdepth.sweep.summary import load_sweep

    out = Path(config.out)
    report_dir = out / "report"
    claims = judge_all(load_summary(report_dir), load_sweep(sweep_path), quality, {"training": config.seed})
    train_summary = read_json_if_present(run / "summary.json") or {}
    plan = saved["plan"]
    # What the run trained: its time limit may have ended the schedule before the plan's steps.
    steps = int(train_summary.get("step", plan["max_steps"]))
    tokens = int(train_summary.get("tokens", plan["tokens"]))
    fits = train_summary.get("schedule_fits") or []
    context = {
        "device": device, "size": plan["size"], "parameters": train_summary.get("parameters"),
        "training_tokens": tokens, "training_steps": steps, "planned_steps": plan["max_steps"],
        "tokens_per_second": train_summary.get("tokens_per_second"),
        "checkpoint_every": fits[0]["checkpoint_every"][1] if fits and "checkpoint_every" in fits[0]
        else plan["checkpoint_every"],
        "final_val": train_summary.get("final_val"), **quality, "epochs": _epochs(tokens, data),
    }
    claims_doc = write_claims(out, claims, context, report_dir)
    write_claims_page(report_dir, claims_doc)
    write_standalone(report_dir, out / "report.html")
    return {
        "config": config.to_dict(), "plan": plan, "probes": saved["probes"], "context": context,
        "verdicts": {claim["id"]: claim["verdict"] for claim in claims},
        "estimated_seconds": {"train": plan["train_seconds"], **plan["after_training"]},
        "budget_seconds": config.budget_seconds,
        "outputs": {"claims": str(out / "claims.json"), "report": str(report_dir / "index.html"),
                    "standalone_report": str(out / "report.html"), "train": str(run)},
    }
