"""Train the learned exit gate (:mod:`rdepth.exits.gate`) on a frozen model from its own iterates.

``rdepth gate`` (:func:`train_gate_checkpoint`):

1. **Record.** Held-out windows of the data's val split run at the full budget (every group at
   ``k_max``, the run layer's initial-state noise); every group's iterates ``[k_max + 1, tokens, d]`` are
   kept (:func:`rdepth.calibrate.run.record_iterates`, as calibration records them).
2. **Label.** For group g and step s, the prediction is the greedy token of the model's output had g
   handed on ``x^(s)`` (the rest of the model reads it, later groups at their full budget:
   :func:`rdepth.calibrate.run.read_through_rest`). A token's target step is the first step from which
   its prediction no longer changes up to ``k_max`` (:func:`rdepth.exits.gate.stable_from`): on a token
   right at the cap, the per-token oracle of :mod:`rdepth.sweep.depth`. The row (token, s) is labelled 1
   when ``s`` >= that step ("the answer will not change from here"), else 0.
3. **Fit.** One linear head per group on :func:`rdepth.exits.gate.gate_features` of ``(x^(s-1), x^(s))``,
   logistic loss, full batch, Adam; the model stays frozen. Every position gives rows (the gate runs at
   every position), or with ``positions="answers"`` on task data the answer tokens only. A share of the
   windows is kept out of the fit, and the loss and accuracy on them are reported (and saved in the gate's
   metadata).
4. **Save** ``exit_gate.safetensors`` beside the checkpoint's weights, tied to them by their SHA-256.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from rdepth.calibrate.gate_config import GateConfig
from rdepth.calibrate.run import read_through_rest, record_iterates
from rdepth.errors import RdepthError
from rdepth.exitrun.gate_file import check_replaceable, save_gate
from rdepth.exits.gate import ExitGate, gate_features, stable_from
from rdepth.io import exclusive
from rdepth.model import RecurrentLM
from rdepth.run.checkpoint import resolve_checkpoint
from rdepth.run.opened import open_run

log = logging.getLogger(__name__)


def fit_head(features: torch.Tensor, labels: torch.Tensor, *, steps: int, lr: float,
             progress: bool = False, desc: str = "fit") -> tuple[torch.Tensor, torch.Tensor, float]:
    """A logistic probe: ``(weight [F], bias [], final loss)`` minimising the mean binary cross-entropy of
    ``sigmoid(features @ weight + bias)`` against ``labels`` (``features`` ``[R, F]``, ``labels`` ``[R]`` in
    {0, 1}); full batch, Adam from zero, ``steps`` steps, deterministic."""
    if features.dim() != 2 or labels.shape != (features.shape[0],) or features.shape[0] == 0:
        raise RdepthError(f"gate: features {tuple(features.shape)} and labels {tuple(labels.shape)} must be [R, F] "
                          "and [R], R >= 1")
    weight = torch.zeros(features.shape[1], dtype=features.dtype, device=features.device, requires_grad=True)
    bias = torch.zeros((), dtype=features.dtype, device=features.device, requires_grad=True)
    optimizer = torch.optim.Adam([weight, bias], lr=lr)
    targets = labels.to(features.dtype)
    loss = None
    with torch.enable_grad(), tqdm(range(steps), desc=desc, disable=not progress, leave=False) as bar:
        for step in bar:
            optimizer.zero_grad(set_to_none=True)
            loss = F.binary_cross_entropy_with_logits(features @ weight + bias, targets)
            loss.backward()
            optimizer.step()
            if step % 50 == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{loss.item():.4f}")
    return weight.detach(), bias.detach(), float(loss.detach())


def gate_rows(model: RecurrentLM, group: int, iterates: torch.Tensor, seq_len: int, k_max: Sequence[int], *,
              batch_size: int, seed: int, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group's training rows from its recorded ``iterates`` ``[K + 1, S*T, d]`` (window-major):
    ``features`` ``[K, S*T, d + 1]`` (after steps 1..K), ``labels`` bool ``[K, S*T]`` (the prediction no
    longer changes from that step on) and ``target`` long ``[S*T]`` (the first such step)."""
    steps, rows, width = iterates.shape[0] - 1, iterates.shape[1], iterates.shape[2]
    windows = rows // seq_len
    predictions = torch.stack([  # (K, S*T)
        read_through_rest(model, group, iterates[step].view(windows, seq_len, width), k_max, batch_size=batch_size,
                          seed=seed).argmax(-1).reshape(rows)
        for step in tqdm(range(1, steps + 1), desc=f"label group {group}", disable=not progress, leave=False)])
    target = stable_from(predictions)
    labels = torch.arange(1, steps + 1, device=target.device)[:, None] >= target[None, :]
    return gate_features(iterates[:-1], iterates[1:]), labels, target


def _accuracy(features: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> dict:
    scores = features @ weight + bias
    return {"loss": float(F.binary_cross_entropy_with_logits(scores, labels.to(scores.dtype))),
            "accuracy": float(((scores > 0) == labels).float().mean()), "positive_share": float(labels.float().mean()),
            "rows": int(labels.numel())}


def train_gate(model: RecurrentLM, windows: torch.Tensor, config: GateConfig,
               masks: torch.Tensor | None = None) -> tuple[ExitGate, dict]:
    """Record, label and fit on ``windows`` (int64 ``[S, T + 1]``): the gate and its training report (per
    group: the fit's loss, the kept-out windows' loss and accuracy, the mean target step). ``masks`` (bool
    ``[S, T + 1]``, aligned with ``windows``, as :func:`rdepth.run.evaluate.eval_outputs` takes them): only
    the positions whose target it marks give rows (a task's answers); None: every position."""
    model.eval()
    k_max = config.resolve_k_max(model.n_groups, model.config.default_eval_loops)
    total = windows.shape[0]
    kept_out = max(1, round(total * config.validation_share))
    if kept_out >= total:
        raise RdepthError(f"gate: {total} windows leave none to fit after keeping {kept_out} out; ask for more "
                          "--windows or a smaller --validation-share")
    seq_len = windows.shape[1] - 1
    log.info("gate: recording %d windows of %d tokens at k_max %s", total, seq_len, list(k_max))
    iterates, _ = record_iterates(model, windows, k_max, batch_size=config.batch_size, seed=config.seed)
    cut = (total - kept_out) * seq_len  # rows of the fitted windows (window-major)
    chosen = torch.ones(total * seq_len, dtype=torch.bool) if masks is None else masks[:, 1:].reshape(-1).bool()
    if masks is not None and masks.shape != windows.shape:
        raise RdepthError(f"gate: masks {tuple(masks.shape)} do not align with windows {tuple(windows.shape)}")
    fitted, held = chosen.clone(), chosen.clone()
    fitted[cut:], held[:cut] = False, False
    if not fitted.any() or not held.any():
        raise RdepthError("gate: the chosen positions leave no rows to fit or none to check; ask for more --windows")
    weights, biases, report = [], [], []
    for group in range(model.n_groups):
        with torch.no_grad():
            features, labels, target = gate_rows(model, group, iterates[group].float(), seq_len, k_max,
                                                 batch_size=config.batch_size, seed=config.seed,
                                                 progress=config.progress)
        width = features.shape[-1]
        fitted_on, held_on = fitted.to(features.device), held.to(features.device)
        fit_x, fit_y = features[:, fitted_on].reshape(-1, width), labels[:, fitted_on].reshape(-1)
        held_x, held_y = features[:, held_on].reshape(-1, width), labels[:, held_on].reshape(-1)
        weight, bias, loss = fit_head(fit_x, fit_y, steps=config.steps, lr=config.lr, progress=config.progress,
                                      desc=f"gate group {group}")
        weights.append(weight)
        biases.append(bias)
        report.append({"group": group, "k_max": k_max[group], "fit_loss": loss,
                       "fit": _accuracy(fit_x, fit_y, weight, bias), "kept_out": _accuracy(held_x, held_y, weight, bias),
                       "mean_target_step": float(target[chosen.to(target.device)].double().mean())})
    gate = ExitGate(torch.stack(weights).float().cpu(), torch.stack(biases).float().cpu())
    return gate, {"k_max": list(k_max), "windows": total, "kept_out_windows": kept_out, "seq_len": seq_len,
                  "positions": "all" if masks is None else "masked", "groups": report}


def train_gate_checkpoint(config: GateConfig) -> dict:
    """``rdepth gate``: open the run, train on the val split's first ``config.windows`` windows, save the gate
    beside the checkpoint (the run folder locked meanwhile). Returns the report with the gate's ``path``."""
    from rdepth.tasks.eval_checkpoint import is_task_data

    if config.threads:
        torch.set_num_threads(config.threads)
    task = is_task_data(config.data)
    if not task and config.positions == "answers":
        raise RdepthError(f"gate: --positions answers needs task data; {config.data} is text data: drop it")
    checkpoint = resolve_checkpoint(config.checkpoint)
    folder = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint
    with exclusive(folder, "gate"):  # (its recovery removes what an interrupted gate left: clean_debris)
        check_replaceable(checkpoint, config.overwrite)  # before minutes of work, not after
        _remove_debris(folder, checkpoint)
        run = open_run(checkpoint, config.data, config.device)
        windows = run.windows(config.windows)
        if windows.shape[0] < 2:
            raise RdepthError(f"gate: {config.data} holds fewer than two val windows")
        masks = _answer_windows(run, config.windows) if config.positions == "answers" else None
        gate, report = train_gate(run.model, windows, config, masks)
        report["data"] = str(Path(config.data))
        report["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()}
        path = save_gate(gate, checkpoint, {"training": json.dumps(report, sort_keys=True)},
                         overwrite=config.overwrite)
    report["path"] = str(path)
    return report


def _remove_debris(folder: Path, checkpoint: Path) -> None:
    """Remove the temporary files an interrupted gate (or consolidate) left beside the weights (the run
    folder's lock is held)."""
    from rdepth.run.checkpoint import clean_debris, weight_temp_files

    if folder != checkpoint:  # a checkpoint of a run
        removed = clean_debris(folder)
    else:
        removed = [temp.name for temp in weight_temp_files(checkpoint)]
        for temp in weight_temp_files(checkpoint):
            temp.unlink(missing_ok=True)
    if removed:
        log.info("removed what an interrupted gate or checkpoint left: %s", ", ".join(removed))


def _answer_windows(run, max_windows: int) -> torch.Tensor:
    """bool ``[S, T + 1]``: the val split's answer mask cut into the same problem windows as ``run.windows``
    (``positions="answers"``: the gate learns from the answer tokens, the ones the model was trained to predict)."""
    from rdepth.data.shards import TokenShards
    from rdepth.run.heldout import held_out_problem_windows
    from rdepth.tasks.data import answer_masks

    mask = np.asarray(answer_masks(TokenShards.open(run.data), "val"))
    return held_out_problem_windows(mask, run.starts, run.seq_len(), max_windows).bool()
