"""``rdepth eval --exit-profile``: held-out quality and loop steps under a saved exit profile."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rdepth.exitrun.evaluate import evaluate_with_exits
from rdepth.exitrun.profile import load_profile, profile_controller_factory
from rdepth.io import write_json
from rdepth.run.config import EvalConfig
from rdepth.run.opened import open_run


def evaluate_profile_checkpoint(config: EvalConfig) -> dict[str, Any]:
    """Text: cross-entropy, perplexity and mean steps per group with exits; task data: exact-match
    accuracy and loop steps on answer and other tokens per held-out difficulty, beside the full budget
    (every group at the profile's k_max) on the same windows."""
    from rdepth.model.control import FixedController
    from rdepth.tasks.eval_checkpoint import is_task_data

    if config.threads:
        torch.set_num_threads(config.threads)
    run = open_run(config.checkpoint, config.data, config.device)
    profile = load_profile(config.exit_profile, run.model.n_groups, run.checkpoint, config.force_profile)
    factory = profile_controller_factory(profile, lambda: run.model.readout)
    full = lambda: FixedController(profile["k_max"])  # noqa: E731
    summary: dict[str, Any] = {"checkpoint": str(run.checkpoint), "data": str(run.data),
                               "exit_profile": str(config.exit_profile), "policy": profile["policy"],
                               "values": profile["values"], "k_max": profile["k_max"]}
    if is_task_data(config.data):
        from rdepth.tasks.data import load_heldout, task_manifest
        from rdepth.tasks.evaluate import heldout_accuracy

        summary["task"] = True
        summary["rows"] = []
        for difficulty in sorted(int(d) for d in task_manifest(config.data)["heldout"]):
            heldout = load_heldout(config.data, difficulty).first_problems(config.max_windows)
            row = {"difficulty": difficulty}
            for name, make in (("profile", factory), ("full", full)):
                result = heldout_accuracy(run.model, heldout, controller_factory=make, batch_size=config.batch_size,
                                          device=run.device, seed=config.seed, warm_start=config.warm_start)
                row[name] = {k: result[k] for k in ("accuracy", "mean_steps_answer", "mean_steps_other", "problems")}
            summary["rows"].append(row)
    else:
        windows = run.windows(config.max_windows)
        summary["windows"] = int(windows.shape[0])
        for name, make in (("profile", factory), ("full", full)):
            result = evaluate_with_exits(run.model, windows, controller=make, batch_size=config.batch_size,
                                         device=run.device, seed=config.seed, progress=config.progress,
                                         warm_start=config.warm_start)
            summary[name] = {"ce": result.ce, "ppl": result.ppl, "mean_steps": [float(s) for s in result.mean_steps]}
    if config.json:
        write_json(config.json, summary)
    return summary


def format_profile_eval(summary: dict[str, Any]) -> list[str]:
    values = ", ".join(f"{v:g}" for v in summary["values"])
    lines = [f"exit profile {summary['exit_profile']}: {summary['policy']} at {values} per group, k_max {summary['k_max']}"]
    if summary.get("task"):
        lines.append("difficulty  accuracy % (profile / full)  steps on answers / others (profile; full = k_max)")
        for row in summary["rows"]:
            p, f = row["profile"], row["full"]
            lines.append(f"{row['difficulty']:>10}  {100 * p['accuracy']:10.1f} / {100 * f['accuracy']:5.1f}"
                         f"           {p['mean_steps_answer']:.2f} / {p['mean_steps_other']:.2f}")
        return lines
    p, f = summary["profile"], summary["full"]
    lines.append(f"{summary['windows']} windows: ppl {p['ppl']:.3f} with exits ({np.sum(p['mean_steps']):.2f} steps per "
                 f"token: {', '.join(f'{s:.2f}' for s in p['mean_steps'])}) vs {f['ppl']:.3f} at the full budget "
                 f"({np.sum(f['mean_steps']):.0f} steps)")
    return lines
