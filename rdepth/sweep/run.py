"""The latency-quality sweep of exit policies (paper §4, Figure 4, Appendix D).

For each policy and each value of its grid (``tau`` on a log scale, 1e-5 ...
1e-2 by default; ``patience`` for ``argmax_stable``) the sweep evaluates
held-out windows teacher-forced with per-token exits and records:
cross-entropy and perplexity, mean loop steps per group, histograms of the
steps computed and of the state handed on, and teacher-forced ms/token at
batch 1 and batched (a whole window per forward, time / tokens; not decode
latency), and the decode latency at batch 1 (greedy cached generation of
``generate_tokens`` tokens, ms per generated token; on by default). Every
point gets a baseline: the fixed budget at its mean steps (rounded per
group). The full budget (every group at ``k_max``) is the reference, and a
ladder of fixed budgets gives the fixed-budget latency-quality curve.

Quality is measured first, setting by setting; then every latency is timed
together, interleaved (:meth:`SweepMeasurer.time_all`): warm, synchronised,
``repeats`` rounds that each time every setting once in a shuffled order;
median and interquartile range saved. Policies and fixed budgets are timed on
the same (packed) path; fixed budgets also on the dense path as a reference.
Decoded rules read the state as ``config.decode`` says (:mod:`rdepth.exits.decode`).

:func:`sweep_checkpoint` is the whole command (``rdepth sweep``, the demo and
``bench/exit_speed.py`` call it): open the run, cut the held-out windows,
:func:`run_sweep` (measure, then summarise once), :func:`write_sweep` (save,
then draw and write the report section from the saved numbers).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from rdepth.errors import RdepthError
from rdepth.exitrun.profile import load_profile, profile_controller_factory
from rdepth.exits.controller import controller_factory
from rdepth.exits.registry import get_policy_class
from rdepth.io import environment_info, write_json, write_text
from rdepth.model import RecurrentLM
from rdepth.run.device import device_name
from rdepth.run.heldout import check_vocabulary
from rdepth.run.opened import open_run
from rdepth.sweep.config import SweepConfig
from rdepth.sweep.measure import SweepMeasurer, decode_factory
from rdepth.sweep.report import render_sweep
from rdepth.sweep.summary import summarize, summary_of, sweep_csv

log = logging.getLogger(__name__)


def run_sweep(
    model: RecurrentLM, windows: torch.Tensor, config: SweepConfig, *, device: str | torch.device = "cpu",
    progress: bool = False,
) -> dict:
    """Measure every setting on held-out ``windows`` (int64 ``[S, T + 1]``); returns the JSON-ready result.

    Keys: ``config``, ``environment``, ``model``, ``k_max``, ``reference`` (the
    full fixed budget), ``points``, ``fixed_ladder`` and ``summary`` (see
    :mod:`rdepth.sweep.summary`); each measured entry's keys are listed in
    :class:`rdepth.sweep.measure.SweepMeasurer`. Window i starts its loops from the run
    layer's noise for window i, so a fixed budget's cross-entropy equals
    :func:`rdepth.run.evaluate.evaluate` on the same windows. The model is put
    in eval mode on ``device``; ``config.checkpoint``, ``data``, ``out`` and
    ``device`` are not used here.
    """
    device = torch.device(device)
    model = model.to(device).eval()
    k_max = config.resolve_k_max(model.n_groups, model.config.default_eval_loops)
    seq_len = windows.shape[1] - 1
    if seq_len > model.config.block_size:
        raise RdepthError(f"sweep: windows of {seq_len} tokens exceed the model's block size {model.config.block_size}")
    check_vocabulary(windows, model.config.vocab_size)
    measurer = SweepMeasurer(model, windows, config.measure_settings(), device)
    log.info("sweep: %d windows of %d tokens; reference = full fixed budget %s", windows.shape[0], seq_len,
             list(k_max))
    reference = measurer.fixed(k_max)
    settings = [(name, value) for name in config.policies for value in config.values(name)]
    new_decode = decode_factory(model, config.measure_settings(), seq_len)
    points = []
    for name, value in tqdm(settings, desc="sweep", disable=not progress):
        factory = controller_factory(name, value, k_max, new_decode, config.policy_options(name))
        point = measurer.policy(
            factory, {"policy": name, "parameter": get_policy_class(name).sweep_parameter, "value": value},
        )
        budget = [max(1, min(cap, round(mean))) for mean, cap in zip(point["mean_steps"], k_max, strict=False)]
        point["baseline"] = measurer.fixed(budget)
        points.append(point)
        log.info(
            "%s %s=%g: steps %s ppl %.4f (fixed %s: %.4f)", name, point["parameter"], value,
            [round(m, 2) for m in point["mean_steps"]], point["ppl"], budget, point["baseline"]["ppl"],
        )
    if config.exit_profile is not None:  # a calibrated profile (rdepth calibrate): one more point
        profile = load_profile(config.exit_profile, model.n_groups, config.checkpoint, config.force_profile)
        point = measurer.policy(
            profile_controller_factory(profile, lambda: model.readout),
            {"policy": "profile", "parameter": profile["parameter"], "value": profile["values"][0],
             "values": list(profile["values"]), "profile_policy": profile["policy"],
             "profile": str(config.exit_profile)},
        )
        budget = [max(1, min(cap, round(mean))) for mean, cap in zip(point["mean_steps"], k_max, strict=False)]
        point["baseline"] = measurer.fixed(budget)
        points.append(point)
        log.info("profile %s %s: steps %s ppl %.4f", profile["policy"], profile["values"],
                 [round(m, 2) for m in point["mean_steps"]], point["ppl"])
    ladder = []
    if config.fixed_ladder:
        for steps in range(1, max(k_max) + 1):
            ladder.append(measurer.fixed([min(steps, cap) for cap in k_max]))
    measurer.time_all(progress=progress)
    saved_config = asdict(config)
    saved_config.update(k_max=list(k_max), block_size=seq_len, windows=int(windows.shape[0]), grids=config.grid,
                        generate_tokens=measurer.generate_tokens)
    result = {
        "config": saved_config,
        "environment": environment_info() | {"device": device_name(device)},
        "model": model.config.to_dict(),
        "k_max": list(k_max),
        "reference": reference,
        "points": points,
        "fixed_ladder": ladder,
    }
    result["summary"] = summarize(result, config.tolerance, config.noise_threshold)
    return result


def write_sweep(result: dict, out: str | Path, *, report: bool = True) -> dict[str, Path]:
    """Save ``sweep.json`` and ``sweep.csv``, then draw ``figures/`` and (``report``) the page section
    from the saved numbers; returns name -> path."""
    summary_of(result)
    out = Path(out)
    paths = {"json": out / "sweep.json", "csv": out / "sweep.csv"}
    write_json(paths["json"], result)
    write_text(paths["csv"], sweep_csv(result))
    paths.update(render_sweep(result, out, report=report))
    return paths


def sweep_checkpoint(config: SweepConfig) -> dict:
    """``rdepth sweep`` as one call: sweep ``config.checkpoint`` on ``config.data``, write ``config.out``.

    Opens the run (:func:`rdepth.run.opened.open_run`) on ``config.device``,
    evaluates ``config.max_windows`` held-out windows (spread over the split) of
    ``config.block_size`` tokens (default: the model's block size, at most the
    text), writes ``sweep.json`` (with ``checkpoint``, ``data`` and the
    ``summary``), ``sweep.csv``, ``figures/`` and the ``index.html`` section into
    ``config.out``, and returns the result with ``paths`` (name -> written file)
    added. Nothing is written if the run or the data cannot be opened.
    """
    from rdepth.io import REPORT_SEED, final_path, staged_output
    from rdepth.report.html import check_page_folder

    check_page_folder(config.out)  # before any work: someone's index.html is never replaced
    if config.threads:
        torch.set_num_threads(config.threads)
    run = open_run(config.checkpoint, config.data, config.device)
    windows = run.windows(config.max_windows, config.block_size)
    result = run_sweep(run.model, windows, config, device=run.device, progress=config.progress)
    result["checkpoint"] = str(run.checkpoint)
    result["data"] = str(run.data)
    with staged_output(config.out, seed=REPORT_SEED) as staging:  # swapped in whole: old or new, never a mix
        paths = {name: final_path(path) for name, path in write_sweep(result, staging).items()}
    log.info("wrote %s", ", ".join(str(p) for p in paths.values()))
    return {**result, "paths": {name: str(path) for name, path in paths.items()}}
