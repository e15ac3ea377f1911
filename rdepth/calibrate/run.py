"""Calibrated exits: one threshold per group, chosen by replaying recorded loop iterates.

``rdepth calibrate`` (:func:`calibrate_checkpoint`):

1. **Record once.** The calibration windows run at the full budget (every group
   at k_max, the dense path, the run layer's initial-state noise); an observer
   keeps every group's iterates ``[k_max + 1, tokens, d]``.
2. **Replay per group and candidate.** For group g and each candidate value of
   the policy's parameter, the policy is driven over g's recorded iterates with
   the model's own loop bookkeeping (:func:`rdepth.exits.recorded.drive_recorded`):
   the steps each token computes and the state it hands on, without running the
   loop again. That state is read through the rest of the model (the layers
   after g; later groups at their full budget, from the same noise) to score the
   quality: cross-entropy on text, exact-match answer accuracy on a task.
3. **Choose.** The quality loss of a profile is estimated as the sum of its
   groups' losses (each measured with the other groups at the full budget) and
   its steps as the sum of their mean steps; every combination of candidates is
   scored (a grid of V values and G groups is V^G combinations) and the one with
   the fewest steps within ``max_quality_loss`` (or the best quality within
   ``mean_steps``) wins. The best single value shared by all groups is chosen the
   same way, as the baseline a per-group profile must beat.
4. **Refine.** The chosen profile runs for real (the packed loop with exits) on
   the calibration windows. Groups interact (a group that exits early changes the
   inputs of the groups after it, which the additive estimate does not see), so
   it can miss the target there. While it does (at most ``refine_rounds`` times),
   the estimate's error is taken off the target, the profiles already tried are
   ruled out, and the choice is made again. The same for the shared value; a shared
   value is a per-group profile too, so if it did better for real on the calibration
   windows, it is the profile.
5. **Validate.** Both final profiles run for real on validation windows not used
   to choose them: the gap between target, predicted and realised quality and
   steps is reported.

The estimate is exact for the last group of a model whose later layers are
single-pass, up to one effect the replay cannot see: a looped layer attends to
other tokens' keys and values at the same step, so a token that stops early
changes what later tokens in the same group read. Step 4 measures what is left.

Quality loss: on text the relative perplexity increase over the full budget
(``max_quality_loss`` 0.01 = 1%); on a task the drop in exact-match accuracy
as a fraction (0.01 = one point).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from rdepth.calibrate.config import CalibrateConfig
from rdepth.errors import RdepthError
from rdepth.exitrun.evaluate import evaluate_with_exits
from rdepth.exitrun.profile import make_profile, profile_controller_factory
from rdepth.exits.controller import PolicyController, controller_factory
from rdepth.exits.recorded import drive_recorded
from rdepth.io import environment_info, exclusive, write_json
from rdepth.model import RecurrentLM
from rdepth.model.control import FixedController
from rdepth.model.noise import StateNoise
from rdepth.run.checkpoint import resolve_checkpoint, run_identity
from rdepth.run.opened import open_run

log = logging.getLogger(__name__)

MAX_COMBINATIONS = 2_000_000


# ------------------------------------------------------------------ what is scored


class Scorer:
    """Quality of logits ``[S, T, V]`` on held-out windows: ``quality`` (higher is better) and the loss of a
    candidate against the reference as the target counts it."""

    name = ""

    def quality(self, logits: torch.Tensor) -> float:
        raise NotImplementedError

    def loss(self, reference: float, quality: float) -> float:
        raise NotImplementedError


class TextScorer(Scorer):
    """Mean cross-entropy (quality = -CE); loss = relative perplexity increase."""

    name = "perplexity"

    def __init__(self, targets: torch.Tensor):
        self.targets = targets

    def quality(self, logits: torch.Tensor) -> float:
        ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                               self.targets.reshape(-1).to(logits.device))
        return -float(ce)

    def loss(self, reference: float, quality: float) -> float:
        return math.exp(reference - quality) - 1.0

    @staticmethod
    def realised(model, windows, factory, config) -> dict:
        result = evaluate_with_exits(model, windows, controller=factory, batch_size=config.batch_size,
                                     device=next(model.parameters()).device, seed=config.seed)
        return {"quality": -result.ce, "ppl": result.ppl, "steps": float(sum(result.mean_steps)),
                "mean_steps": [float(s) for s in result.mean_steps]}


class TaskScorer(Scorer):
    """Exact-match accuracy on whole problems; loss = accuracy drop (a fraction)."""

    name = "accuracy"

    def __init__(self, heldout):
        self.heldout = heldout

    def quality(self, logits: torch.Tensor) -> float:
        from rdepth.tasks.accuracy import problem_correct

        _, solved = problem_correct(logits.argmax(-1).cpu().numpy(), self.heldout.tokens[:, 1:],
                                    self.heldout.answer_mask[:, 1:], self.heldout.problem_ids[:, 1:])
        return float(solved.mean())

    def loss(self, reference: float, quality: float) -> float:
        return reference - quality

    @staticmethod
    def realised(model, heldout, factory, config) -> dict:
        from rdepth.tasks.evaluate import heldout_accuracy

        result = heldout_accuracy(model, heldout, controller_factory=factory, batch_size=config.batch_size,
                                  device=next(model.parameters()).device, seed=config.seed)
        answers = int(heldout.answer_mask[:, 1:].sum())
        others = int((~heldout.answer_mask[:, 1:]).sum())
        steps = (result["mean_steps_answer"] * answers + result["mean_steps_other"] * others) / max(answers + others, 1)
        return {"quality": result["accuracy"], "accuracy": result["accuracy"], "steps": steps,
                "mean_steps_answer": result["mean_steps_answer"], "mean_steps_other": result["mean_steps_other"]}


# ------------------------------------------------------------------ record and replay


@torch.no_grad()
def record_iterates(model: RecurrentLM, windows: torch.Tensor, k_max: Sequence[int], *, batch_size: int,
                    seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every group's iterates at the full budget, ``[k_max_g + 1, S*T, d]`` each (window-major rows), and
    the full-budget logits ``[S, T, V]``; window i starts from the run layer's noise for window i."""
    device = next(model.parameters()).device
    model.eval()
    per_group: list[list[torch.Tensor]] = [[] for _ in range(model.n_groups)]
    logits = []
    for first in range(0, windows.shape[0], batch_size):
        x = windows[first:first + batch_size, :-1].to(device)
        steps: dict[int, list[torch.Tensor]] = {g: [] for g in range(model.n_groups)}

        def observer(group, step, state, active, steps=steps):
            steps[group].append(state.reshape(-1, state.shape[-1]).clone())

        out = model(x, loop_counts=list(k_max), noise=StateNoise.consecutive(seed, first, x.shape[0]),
                    observer=observer)
        logits.append(out.logits)
        for group in range(model.n_groups):
            per_group[group].append(torch.stack(steps[group]))
    return [torch.cat(chunks, dim=1) for chunks in per_group], torch.cat(logits)


@torch.no_grad()
def read_through_rest(model: RecurrentLM, group: int, outputs: torch.Tensor, k_max: Sequence[int], *,
                      batch_size: int, seed: int) -> torch.Tensor:
    """Logits ``[S, T, V]`` when ``group`` hands on ``outputs`` ``[S, T, d]``: the model's own stages after
    it (:meth:`RecurrentLM.run_after`), later groups at their full budget from the same per-window noise
    as :func:`record_iterates`."""
    logits = []
    for first in range(0, outputs.shape[0], batch_size):
        x = outputs[first:first + batch_size]
        noise = StateNoise.consecutive(seed, first, x.shape[0])
        logits.append(model.readout(model.run_after(group, x, k_max, noise)))
    return torch.cat(logits)


def _controller_for(policy: str, value: float, k_max: int, options: dict, decode) -> PolicyController:
    return controller_factory(policy, value, k_max, lambda: decode, options)()


@torch.no_grad()
def replay_candidates(model: RecurrentLM, iterates: list[torch.Tensor], reference: float, scorer: Scorer,
                      config: CalibrateConfig, k_max: Sequence[int], seq_len: int) -> list[list[dict]]:
    """Per group, per candidate value: mean steps, estimated quality and loss (other groups at full budget)."""
    table = []
    options = config.policy_options()
    for group, states in enumerate(iterates):
        rows = []
        windows = states.shape[1] // seq_len
        for value in config.candidate_values():
            controller = _controller_for(config.policy, value, k_max[group], options, model.readout)
            used, computed = drive_recorded(controller, group, states)
            handed = states[used, torch.arange(states.shape[1], device=states.device)]
            logits = read_through_rest(model, group, handed.view(windows, seq_len, -1), k_max,
                                       batch_size=config.batch_size, seed=config.seed)
            quality = scorer.quality(logits)
            rows.append({"value": float(value), "steps": float(computed.double().mean()), "quality": quality,
                         "loss": scorer.loss(reference, quality)})
        table.append(rows)
        log.info("group %d: %s", group, ", ".join(f"{r['value']:g}: {r['steps']:.2f} steps, loss {r['loss']:+.4f}"
                                                   for r in rows))
    return table


# ------------------------------------------------------------------ choose


def _combinations(table: list[list[dict]], shared: bool):
    """Every combination of one row per group (``shared``: the same value in every group)."""
    if shared:
        values = [row["value"] for row in table[0]]
        return ([next(r for r in rows if r["value"] == v) for rows in table] for v in values)
    count = math.prod(len(rows) for rows in table)
    if count > MAX_COMBINATIONS:
        raise RdepthError(f"calibrate: {count:,} combinations of candidate values; use fewer --values")
    return itertools.product(*table)


def _rank(steps: float, loss: float, max_loss: float | None, mean_steps: float | None) -> tuple | None:
    """A combination's sort key under the target (lower is better), or None when it misses the target:
    fewest steps within ``max_loss``, else lowest loss within ``mean_steps``."""
    if max_loss is not None:
        return (steps, loss) if loss <= max_loss + 1e-12 else None
    return (loss, steps) if steps <= mean_steps + 1e-9 else None


def choose(table: list[list[dict]], *, max_loss: float | None = None, mean_steps: float | None = None,
           shared: bool = False, exclude: frozenset[tuple[float, ...]] = frozenset()) -> dict | None:
    """The best combination (one row per group) under the additive estimate, or None if none qualifies.

    ``max_loss``: fewest total steps with summed loss <= max_loss. ``mean_steps``: lowest summed
    loss with total steps <= mean_steps. ``shared``: only one value for every group. ``exclude``:
    value tuples not to choose (tried and found wanting)."""
    if (max_loss is None) == (mean_steps is None):
        raise RdepthError("calibrate: give exactly one of max_quality_loss and mean_steps")
    best, best_key = None, None
    for combination in _combinations(table, shared):
        if tuple(r["value"] for r in combination) in exclude:
            continue
        key = _rank(sum(r["steps"] for r in combination), sum(r["loss"] for r in combination), max_loss, mean_steps)
        if key is not None and (best_key is None or key < best_key):
            best, best_key = combination, key
    if best is None:
        return None
    return {"values": [r["value"] for r in best], "predicted_steps": sum(r["steps"] for r in best),
            "predicted_loss": sum(r["loss"] for r in best), "per_group": [dict(r) for r in best]}


def meets(realised: dict, limits: dict) -> bool:
    """Whether a real run's ``loss``/``steps`` meet the target in ``limits`` (max_loss or mean_steps)."""
    if limits["max_loss"] is not None:
        return realised["loss"] <= limits["max_loss"] + 1e-12
    return realised["steps"] <= limits["mean_steps"] + 1e-9


def better_on_calibration(a: dict, b: dict, limits: dict) -> bool:
    """Whether profile ``a`` did better than ``b`` on the real calibration run: meeting the target where
    ``b`` does not, else fewer steps (max_loss) or less loss (mean_steps), the other measure breaking ties."""
    got_a, got_b = a["realised"]["calibration"], b["realised"]["calibration"]
    meets_a, meets_b = meets(got_a, limits), meets(got_b, limits)
    if meets_a != meets_b:
        return meets_a
    first, second = ("steps", "loss") if limits["max_loss"] is not None else ("loss", "steps")
    return (got_a[first], got_a[second]) < (got_b[first], got_b[second])


def refine(table: list[list[dict]], limits: dict, run_calibration, rounds: int, shared: bool = False) -> dict | None:
    """:func:`choose`, then run the choice for real (``run_calibration(values)`` -> ``{loss, steps,
    ...}`` on the calibration windows) and, while it misses the target, choose again with the
    estimate's error taken off the target and the tried profiles excluded (at most ``rounds`` times).
    Returns the profile that met the target with the fewest real steps (max_loss) or the least real
    loss (mean_steps), else the last one tried; with ``realised.calibration`` and the ``refinement``
    history. None if nothing qualifies under the estimate."""
    limit_key = "max_loss" if limits["max_loss"] is not None else "mean_steps"
    measure_key = "loss" if limit_key == "max_loss" else "steps"
    predicted_key = "predicted_" + measure_key
    current = dict(limits)
    tried: set[tuple[float, ...]] = set()
    history, results = [], []
    choice = choose(table, shared=shared, **current)
    while choice is not None:
        realised = run_calibration(choice["values"])
        tried.add(tuple(choice["values"]))
        entry = {**choice, "realised": {"calibration": realised}}
        results.append(entry)
        history.append({"values": choice["values"], "predicted_loss": choice["predicted_loss"],
                        "predicted_steps": choice["predicted_steps"], "realised_loss": realised["loss"],
                        "realised_steps": realised["steps"], "limit": current[limit_key]})
        if meets(realised, limits) or len(history) > rounds:
            break
        error = realised[measure_key] - choice[predicted_key]  # what the estimate missed
        current[limit_key] = current[limit_key] - max(error, 0.0)
        choice = choose(table, shared=shared, exclude=frozenset(tried), **current)
    if not results:
        return None
    met = [r for r in results if meets(r["realised"]["calibration"], limits)]
    if met:
        key = (lambda r: r["realised"]["calibration"]["steps"]) if limit_key == "max_loss" else \
            (lambda r: r["realised"]["calibration"]["loss"])
        best = min(met, key=key)
    else:
        best = results[-1]
    return {**best, "refinement": history}


# ------------------------------------------------------------------ the command


def _split_text(run, config: CalibrateConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration, validation) windows: of ``windows + validation_windows`` held-out windows spread
    over the split (:func:`rdepth.run.heldout.held_out_windows`), the first ``windows`` in text order,
    then the rest (half and half when the text holds fewer)."""
    available = run.available_windows()
    wanted = config.windows + config.validation_windows
    if wanted > available:
        raise RdepthError(f"calibrate: --windows {config.windows} and --validation-windows {config.validation_windows} "
                          f"ask for {wanted} held-out windows; {run.data} holds {available} of "
                          f"{run.seq_len()} tokens: ask for at most {available} in all")
    windows = run.windows(wanted)
    if windows.shape[0] < 2:
        raise RdepthError("calibrate: the held-out text holds fewer than two windows")
    cut = config.windows if windows.shape[0] > config.windows else windows.shape[0] // 2
    return windows[:cut], windows[cut:]


def _split_task(config: CalibrateConfig):
    from rdepth.tasks.data import load_heldout, task_manifest

    difficulty = config.difficulty or int(task_manifest(config.data)["train_difficulties"][1])
    heldout = load_heldout(config.data, difficulty)
    total = heldout.tokens.shape[0]
    if total < 2:
        raise RdepthError(f"calibrate: the held-out set of difficulty {difficulty} has fewer than two windows")
    cut = min(config.windows, total // 2)
    end = min(total, cut + config.validation_windows)

    calibration, validation = heldout.windows(0, cut), heldout.windows(cut, end)
    return difficulty, calibration, validation


def calibrate_checkpoint(config: CalibrateConfig) -> dict:
    """Record, replay, choose, validate, save the profile (``config.out``); returns the saved profile.

    The folder the profile goes to is locked for the whole run (:func:`rdepth.io.exclusive`, the
    trainer's lock when it is the run folder), an existing profile is refused before any work, and the
    profile is put in place only if nobody wrote that name meanwhile (never overwritten)."""
    from rdepth.tasks.eval_checkpoint import is_task_data

    if config.threads:
        torch.set_num_threads(config.threads)
    task = is_task_data(config.data)
    if not task and config.difficulty is not None:
        raise RdepthError("calibrate: --difficulty chooses a held-out set of task data; "
                          f"{config.data} is text data: drop it")
    out = Path(config.out) if config.out else None
    if out is None:
        checkpoint = resolve_checkpoint(config.checkpoint)
        folder = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint
        out = folder / f"exit_profile_{config.policy}.json"
    if out.exists():
        raise RdepthError(f"{out} exists; pass another --out (nothing is overwritten)")
    with exclusive(out.parent, "calibrate"):
        return _calibrate(config, out, task)


def _calibrate(config: CalibrateConfig, out: Path, task: bool) -> dict:
    run = open_run(config.checkpoint, config.data, config.device)
    model = run.model.eval()
    k_max = config.resolve_k_max(model.n_groups, model.config.default_eval_loops)
    gate_record = {}
    if config.policy == "learned":  # the gate calibrated with: a profile refuses any other (trained again since)
        from rdepth.exitrun.gate_file import gate_sha256, load_gate

        gate_record["gate_sha256"] = gate_sha256(load_gate(run.checkpoint))
    if task:
        difficulty, calibration, validation = _split_task(config)
        windows = torch.from_numpy(np.asarray(calibration.tokens, dtype=np.int64))
        scorer: Scorer = TaskScorer(calibration)
        realise = lambda heldout, factory: TaskScorer.realised(model, heldout, factory, config)  # noqa: E731
        data_record = {"task": True, "difficulty": difficulty, "calibration_windows": [0, calibration.tokens.shape[0]],
                       "validation_windows": [calibration.tokens.shape[0],
                                              calibration.tokens.shape[0] + validation.tokens.shape[0]]}
        sets = {"calibration": calibration, "validation": validation}
    else:
        windows, validation_windows = _split_text(run, config)
        scorer = TextScorer(windows[:, 1:])
        realise = lambda data, factory: TextScorer.realised(model, data, factory, config)  # noqa: E731
        data_record = {"task": False, "calibration_windows": [0, windows.shape[0]],
                       "validation_windows": [windows.shape[0], windows.shape[0] + validation_windows.shape[0]],
                       "seq_len": windows.shape[1] - 1}
        sets = {"calibration": windows, "validation": validation_windows}
    seq_len = windows.shape[1] - 1
    iterates, logits = record_iterates(model, windows, k_max, batch_size=config.batch_size, seed=config.seed)
    reference = scorer.quality(logits)
    table = replay_candidates(model, iterates, reference, scorer, config, k_max, seq_len)
    target = {"max_quality_loss": config.max_quality_loss} if config.max_quality_loss is not None else \
        {"mean_steps": config.mean_steps}
    limits = dict(max_loss=config.max_quality_loss, mean_steps=config.mean_steps)
    full_budget = {name: realise(data, lambda: FixedController(k_max)) for name, data in sets.items()}

    def measured(values: list[float], names: Sequence[str]) -> dict:
        profile = make_profile(config.policy, values, k_max, config.policy_options())
        factory = profile_controller_factory(profile, lambda: model.readout)  # decoded rules read the head
        result = {}
        for name in names:
            got = realise(sets[name], factory)
            got["loss"] = scorer.loss(full_budget[name]["quality"], got["quality"])
            got["full_budget"] = full_budget[name]
            result[name] = got
        return result

    per_group = refine(table, limits, lambda values: measured(values, ["calibration"])["calibration"],
                       config.refine_rounds)
    shared = refine(table, limits, lambda values: measured(values, ["calibration"])["calibration"],
                    config.refine_rounds, shared=True)
    if per_group is None:
        raise RdepthError(f"calibrate: no candidate values meet {target} on the calibration data; widen --values")
    if shared is not None and better_on_calibration(shared, per_group, limits):
        # a shared value is a per-group profile too: keep whichever did better for real
        per_group = {**shared, "from_shared": True}
    chosen = {**per_group, "realised": {**per_group["realised"], **measured(per_group["values"], ["validation"])}}
    baseline = None if shared is None else \
        {**shared, "realised": {**shared["realised"], **measured(shared["values"], ["validation"])}}
    profile = make_profile(
        config.policy, per_group["values"], k_max, config.policy_options(),
        quality=scorer.name, target=target, calibrated=chosen, shared_baseline=baseline, candidates=table,
        checkpoint=str(run.checkpoint), run=run_identity(run.checkpoint), data={"path": str(run.data), **data_record},
        **gate_record,
        config=asdict(config), environment=environment_info(),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    write_json(out, profile, overwrite=False, strict=True)
    profile["path"] = str(out)
    return profile
