"""``rdepth analyze`` on looped Hugging Face folders: rdepth's loop geometry, judges and page over the adapter's loops.

The adapter's forward (:func:`rdepth.looped.protocol.forward`) reports every iterate of every loop; each loop
gets one :class:`~rdepth.geometry.stream.GeometryObserver`, the one that watches rdepth's own models, and the
runs of a loop within one forward are that observer's groups. HRM-Text's H loop is one group (``H``); its L loop
runs once per H step, so ``L@h0``, ``L@h1``, ... are consecutive groups whose boundaries are the fast loop
restarting where it stopped after the slow state moved: the drift-to-loop ratios, the hand-off ratio and its
zero-drift control (:func:`rdepth.geometry.summary.handoff_control`) are read there. Inkling-2 has one group,
its passes. The results are saved in ``rdepth analyze``'s format (:mod:`rdepth.geometry.summary`), drawn and
paged by the same code, and the two-scale paper's geometry claims are judged on it by the same judges
(:mod:`rdepth.reproduce.claims`), into ``OUT/claims.json`` and a section of the page.

What differs from rdepth's own models (said on the page): one budget, the model's own (the adapter runs no
step the model does not have, so there is no long budget); no initial-state noise (a loop's x^(0) is the state
it enters with: HRM's ``z_L_init`` or where the previous L run stopped, the scaled embedding for H, the
pre-loop state for Inkling-2's passes); Eq. 2 as written is 0 between L runs by construction; loops shorter
than :data:`JUDGED_MIN_STEPS` steps are left out of the per-loop claims.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from rdepth.errors import RdepthError
from rdepth.geometry.config import AnalyzeConfig
from rdepth.geometry.stream import GeometryObserver, StreamResult
from rdepth.looped.geometry import trajectory_name
from rdepth.looped.load import check_flags_apply, folder_tokenizer, open_looped, read_text, text_windows
from rdepth.looped.protocol import LoopedAdapter, forward

log = logging.getLogger(__name__)

# The flags of rdepth analyze a looped folder reads; the others (a long budget, noise seeds, the DLR budget
# curve, Jacobians, the slowest-token table) need loops longer than the model's own or rdepth's model.
APPLICABLE = ("checkpoints", "data", "out", "sequences", "seq_len", "batch_size", "threshold", "keep_sequence",
              "rank", "device", "threads", "progress", "precision")
BUDGET = "train"  # the model's own budget, the only one measured
# A loop of fewer steps has no Δ(2) to measure a decay from Δ(1), and no settled cosine: not judged per loop.
JUDGED_MIN_STEPS = 3
# The per-loop claims (the step decay, the plateau, the settled cosine); claim 3 is judged at the boundaries.
PER_LOOP_CLAIMS = ("step_decay", "plateau", "cosine")
DTYPES = {"float64": torch.float64, "float32": torch.float32}

SOURCE_NOTE = (
    "A looped model that ships in transformers ({model_type}), driven in place through rdepth's adapter: its own "
    "modules, at its own loop budget ({budgets}; there is no longer budget to run), on {sequences} windows of "
    "{seq_len} tokens of {data} read with the folder's own tokenizer, in {precision}. Each run of a loop is a group: "
    "{groups}. Step 0 of a loop is the state it enters with, not random noise: {starts}. So Δ(0) is the loop's first "
    "real update (the judges' 'jump from the random start' reads here as that first update), there is no noise seed, "
    "and Eq. 2 as written ('literal') is 0 where a loop restarts from where its previous run stopped. Loops of fewer "
    "than {judged} steps are not judged per loop. The validation loss is the class's own forward. Bands are 1 sigma "
    "over tokens; all numbers are in geometry/summary.json and geometry/<folder>/train.npz."
)
STARTS = {
    "hrm_text": "the L loop of H step 0 starts from the learned z_L_init and each later one where the previous stopped "
                "(a boundary L@h(k) -> L@h(k+1) is the fast loop after one slow H step); the H loop starts from the "
                "scaled token embedding",
    "inkling2_loop_text": "the passes start from the pre-loop state, where every pass restarts",
}


class LoopStreams:
    """The adapter's observer: every loop streamed into its own :class:`GeometryObserver`, each run of the loop
    in one forward a group of that observer. Call :meth:`new_forward` before each forward."""

    def __init__(self, adapter: LoopedAdapter, threshold: float, keep_sequence: int | None, rank: bool) -> None:
        self.adapter = adapter
        self.observers = {spec.name: GeometryObserver(threshold, keep_sequence, rank) for spec in adapter.loops}
        self.runs: dict[str, list[tuple[int, ...]]] = {spec.name: [] for spec in adapter.loops}
        self._count = dict.fromkeys(self.observers, 0)

    def new_forward(self) -> None:
        self._count = dict.fromkeys(self.observers, 0)

    def __call__(self, loop: str, outer: tuple[int, ...], step: int, state: torch.Tensor) -> None:
        if step == 0:
            runs = self.runs[loop]
            if self._count[loop] == len(runs):
                runs.append(outer)
            elif runs[self._count[loop]] != outer:
                raise RdepthError(f"internal: loop {loop} ran at {outer}, earlier forwards at {runs[self._count[loop]]}")
            self._count[loop] += 1
        self.observers[loop](self._count[loop] - 1, step, state, None)

    def group_names(self) -> list[str]:
        """One name per group, outermost loop first: ``H``; ``L@h0``, ``L@h1``, ... (a loop run once: its name)."""
        return [name if len(runs) == 1 else trajectory_name(name, outer)
                for name, runs in self.runs.items() for outer in runs]

    def loop_counts(self) -> list[int]:
        """Each group's steps: its loop's budget."""
        return [self.adapter.spec(name).budget for name, runs in self.runs.items() for _ in runs]

    def result(self) -> StreamResult:
        """The observers' results as one, groups in :meth:`group_names` order (boundaries only inside a loop)."""
        return merge_results([observer.result() for observer in self.observers.values()])


def merge_results(results: list[StreamResult]) -> StreamResult:
    """Several observers' results as one: groups concatenated, boundary indices shifted to match."""
    groups, kept, boundaries, parts, offset = [], [], {}, {}, 0
    for result in results:
        for source, target in ((result.boundaries, boundaries), (result.handoff_parts, parts)):
            for key, value in source.items():
                first, second = (int(index) + offset for index in key.split("->"))
                target[f"{first}->{second}"] = value
        groups += result.groups
        kept += result.kept_states
        offset += len(result.groups)
    if len(kept) != len(groups):
        kept = []  # the kept sequence seen by some loops only: no PCA (never a partial one)
    return StreamResult(groups=groups, boundaries=boundaries, kept_states=kept, tokens=results[0].tokens,
                        handoff_parts=parts, eps=max(result.eps for result in results))


def measure(adapter: LoopedAdapter, windows: torch.Tensor, config: AnalyzeConfig,
            device: torch.device) -> tuple[StreamResult, float, list[str], list[int]]:
    """Every window through the adapter at the model's own budget, streamed: the observers' result, the mean
    next-token cross-entropy (nats/token), the group names and their loop counts."""
    from tqdm import tqdm

    streams = LoopStreams(adapter, config.threshold, config.keep_sequence, config.rank)
    total, tokens = 0.0, 0
    starts = range(0, windows.shape[0], config.batch_size)
    with torch.no_grad():
        for start in tqdm(starts, desc=f"{adapter.model_type} loops", disable=not config.progress, leave=False):
            batch = windows[start:start + config.batch_size].to(device)
            streams.new_forward()
            logits = forward(adapter, batch[:, :-1], observe=streams)
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                                             batch[:, 1:].reshape(-1), reduction="sum"))
            tokens += batch[:, 1:].numel()
    return streams.result(), total / max(tokens, 1), streams.group_names(), streams.loop_counts()


def _labels(folders: list[Path]) -> list[str]:
    """Each folder's name, with its parent's where two share one."""
    names = [folder.name for folder in folders]
    return [f"{folder.parent.name}-{folder.name}" if names.count(folder.name) > 1 else folder.name
            for folder in folders]


def _settings(config: AnalyzeConfig, adapter: LoopedAdapter, windows: torch.Tensor, names: list[str]) -> dict:
    """The summary's settings: the command's, no noise seed, the model type and the page's note on the source."""
    note = SOURCE_NOTE.format(
        model_type=adapter.model_type, budgets=", ".join(f"{k} {v}" for k, v in adapter.budgets().items()),
        sequences=windows.shape[0], seq_len=windows.shape[1] - 1, data=config.data, precision=config.precision,
        groups=", ".join(names), starts=STARTS.get(adapter.model_type, "the state each loop enters with"),
        judged=JUDGED_MIN_STEPS)
    return {**asdict(config), "seed": None, "model_type": adapter.model_type, "source_note": note}


def analyze_folders(config: AnalyzeConfig) -> dict[str, Any]:
    """Measure every folder of ``config.checkpoints`` (each a "checkpoint" of one model) into ``OUT/geometry``
    in rdepth's format; returns the summary."""
    from rdepth.geometry.summary import NOISE_FLOORS, checkpoint_entry, new_summary, save_budget, write_summary
    from rdepth.run.device import resolve_device

    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    text = read_text(config.data)
    folders = [Path(path) for path in config.checkpoints]
    out = Path(config.out)
    summary: dict[str, Any] | None = None
    windows = reference = None
    for folder, label in zip(folders, _labels(folders), strict=True):
        adapter = open_looped(folder, DTYPES[config.precision])
        adapter.model.to(device)
        budgets = adapter.budgets()
        if reference is None:
            reference = budgets
            windows = text_windows(adapter, folder_tokenizer(folder), text, config.sequences, config.seq_len,
                                   str(config.data))
        elif budgets != reference:
            raise RdepthError(f"{folder} loops {budgets}, {folders[0]} {reference}: analyze one model's folders together")
        result, loss, names, counts = measure(adapter, windows, config, device)
        if summary is None:
            summary = new_summary(_settings(config, adapter, windows, names), names, windows.shape[0],
                                  windows.shape[1] - 1, {BUDGET: counts})
        saved = save_budget(out, label, BUDGET, result, names, counts, loss, NOISE_FLOORS[config.precision])
        summary["checkpoints"].append(checkpoint_entry(label, -1, str(folder), {BUDGET: saved}))
        log.info("%s: %s, loss %.4f at its own budget", label, adapter.model_type, loss)
        del adapter
    write_summary(out, summary)
    return summary


def judgeable(claim_id: str, group: dict[str, Any]) -> str | None:
    """Why a loop is left out of a per-loop claim (None: judged): fewer than :data:`JUDGED_MIN_STEPS` steps; for
    the step decay, a loop that ends before the paper's window (step DECAY_BY_STEP) without decaying in it."""
    from rdepth.reproduce.claims import DECAY_BY_STEP, decay_step

    if group["steps"] < JUDGED_MIN_STEPS:
        return f"{group['steps']} steps"
    if claim_id == "step_decay" and group["steps"] <= DECAY_BY_STEP and decay_step(group["step_size"]["mean"]) is None:
        return f"{group['steps']} steps without the decay, ending before step {DECAY_BY_STEP}"
    return None


def judge_claims(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The two-scale paper's geometry claims (step decay, plateau, settled cosine, hand-off drift) judged on the
    summary by rdepth's own judges. A per-loop claim leaves out the loops it cannot read (:func:`judgeable`),
    naming them in its reasons, and is not tested when that leaves none; claim 3 reads the boundaries."""
    from rdepth.reproduce.claims import claim_cosine, claim_dlr, claim_plateau, claim_step_decay
    from rdepth.reproduce.claims.verdict import untested

    claims = []
    for judge in (claim_step_decay, claim_plateau, claim_cosine, claim_dlr):
        claim_id = judge.__name__.removeprefix("claim_")
        if claim_id not in PER_LOOP_CLAIMS:
            claims.append(judge(summary))
            continue
        judged = copy.deepcopy(summary)
        left_out: dict[str, str] = {}
        for entry in judged["checkpoints"]:
            kept = []
            for group in entry["budgets"][BUDGET]["groups"]:
                reason = judgeable(claim_id, group)
                if reason is None:
                    kept.append(group)
                else:
                    left_out.setdefault(group["name"], reason)
            entry["budgets"][BUDGET]["groups"] = kept
        named = "; ".join(f"{name}: {reason}" for name, reason in left_out.items())
        if not judged["checkpoints"][-1]["budgets"][BUDGET]["groups"]:
            claim = untested(judge(summary), f"no loop this claim can read ({named})")
        else:
            claim = judge(judged)
            if left_out:
                claim["why"].append(f"Not judged: {named}.")
        claims.append(claim)
    return claims


def claims_section(doc: dict[str, Any], model_type: str):
    """The page's claims section: which claims the model's loops show, why, and how each verdict is decided."""
    from rdepth.report.html import Section
    from rdepth.reproduce.report import table_rows

    verdicts = list(doc["verdicts"].values())
    counts = ", ".join(f"{verdicts.count(v)} {v}" for v in dict.fromkeys(verdicts))
    section = Section("claims", "The two-scale paper's geometry claims on this model's loops", order=-10)
    section.headline(f"{len(verdicts)} geometry claims judged on {model_type}'s loops: {counts}.")
    rows = table_rows(doc)
    section.table([{key: value for key, value in row.items() if key != "why"} for row in rows],
                  caption="Each claim, the paper's figure and numbers, this model's, and the verdict (the exit-rule "
                          "claim is rdepth sweep's, not judged here)")
    section.bullets([f"Claim {row['#']} ({row['verdict']}): {row['why']}" for row in rows if row["why"]],
                    caption="Why each verdict")
    section.bullets([f"Claim {row['#']}: {claim['criteria']}." for row, claim in zip(rows, doc["claims"], strict=True)],
                    caption="How each verdict is decided (the judges of rdepth reproduce)")
    return section


def run_looped_analysis(config: AnalyzeConfig, given: dict[str, Any]) -> Path:
    """The whole of ``rdepth analyze`` on looped folders: measure, draw, page, judge. Returns ``OUT/index.html``."""
    from rdepth.geometry.plots import draw_all
    from rdepth.geometry.report_page import geometry_section
    from rdepth.geometry.summary import write_summary
    from rdepth.io import REPORT_SEED, final_path, staged_output
    from rdepth.report.html import add_section, check_page_folder
    from rdepth.reproduce.report import write_claims

    check_flags_apply("analyze", given, APPLICABLE)
    check_page_folder(config.out)
    with staged_output(config.out, seed=REPORT_SEED) as staging:
        summary = analyze_folders(replace(config, out=str(staging)))
        summary["settings"]["out"] = str(config.out)
        write_summary(staging, summary)
        figures = draw_all(staging, summary)
        model_type = summary["settings"]["model_type"]
        title = f"rdepth report: {Path(config.checkpoints[-1]).name} ({model_type})"
        add_section(staging, geometry_section(staging, summary, figures,
                                              title=f"Loop geometry of {model_type}'s loops"), title=title)
        context = {"model_type": model_type, "folders": list(config.checkpoints), "budget": summary["budgets"][BUDGET]}
        doc = write_claims(staging, judge_claims(summary), context, staging)
        page = add_section(staging, claims_section(doc, model_type), title=title)
    return final_path(page)
