"""The main job on embedded default data, end to end on a CPU.

``--mode task`` (the default; :mod:`rdepth.demo.task`): a reasoning task whose
answers need sequential steps (pointer chasing), a looped model trained on it
beside its no-loop baseline, answer accuracy per difficulty per loop budget,
the exit policies on answer and other tokens, the loop geometry, a report page.

``--mode text``:

1. prepare the default corpus (Wikipedia lead sections, byte-level BPE);
2. train the ``tiny`` preset, keeping a series of checkpoints;
3. evaluate at several loop budgets beside the unigram baseline;
4. analyse the loop geometry of every checkpoint (report page);
5. sweep the early-exit policies on the final checkpoint (report section).

Every stage calls the same pipeline function as its own command (``rdepth
prepare``, ``train``, ``eval``, ``analyze``, ``sweep``). Re-running into the
same folder reuses finished stages (only when every setting matches) and
resumes an interrupted training run; nothing already written is overwritten.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rdepth.errors import RdepthError
from rdepth.fields import check_fields, option
from rdepth.io import StageTimer, write_json

log = logging.getLogger(__name__)


MODES = ("task", "text")
# Per mode: the defaults of the fields left at None.
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "task": dict(preset="task_loop", max_steps=2600, batch_size=32, checkpoint_every=650, weight_decay=0.01,
                 warmup_steps=50, curriculum_steps=1000, ranks=2, task="chase", task_params=None,
                 train_difficulties=(1, 8), train_tokens=5_000_000, loop_budgets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
                 baselines=("no_loop",)),
    "text": dict(preset="tiny", max_steps=500, batch_size=16, checkpoint_every=125, weight_decay=0.1,
                 warmup_steps=None, curriculum_steps=0, corpus="wiki", tokenizer="bpe:4096", sweep_sequences=8),
}
# The fields that apply to one mode only: given in the other, an error (never silently ignored).
MODE_ONLY: dict[str, tuple[str, ...]] = {
    "task": ("task", "task_params", "train_difficulties", "train_tokens", "curriculum_steps", "loop_budgets",
             "baselines", "ranks"),
    "text": ("corpus", "tokenizer", "sweep_sequences", "max_documents"),
}
# Pointer chasing to a fixed point with 16 nodes listed in order, every symbol queried and the
# distractor chains as long as the main one but for a shorter leftover chain: one problem fills a
# 64-token context.
DEFAULT_TASK_PARAMS = '{"chase": {"nodes": 16, "queries": 16, "ordered": true, "min_distractor_hops": 15}}'
MODE_DEFAULTS["task"]["task_params"] = DEFAULT_TASK_PARAMS
BASELINES = ("no_loop", "deep")


@dataclass
class DemoConfig:
    out: str = option("runs/demo", "output folder: data, training run, report and demo.json")
    mode: str = option("task", "task: a reasoning task whose answers need the loops, with its no-loop baseline; "
                               "text: the tiny preset on the Wikipedia corpus", choices=MODES)
    data: str | None = option(None, "prepared data folder (reused when it holds the same corpus and tokenizer)",
                              default_text="OUT/data")
    corpus: str | None = option(None, "text mode: corpus to prepare: wiki, shakespeare or a text file/folder "
                                      "(an error in task mode)", default_text="wiki")
    tokenizer: str | None = option(None, "text mode: tokenizer to prepare the corpus with: gpt2 or bpe:N "
                                         "(an error in task mode)", default_text="bpe:4096")
    task: str | None = option(None, "task mode: the task (or mixture) to train on", default_text="chase")
    task_params: str | None = option(None, "task mode: JSON of per-task parameters",
                                     default_text=DEFAULT_TASK_PARAMS)
    train_difficulties: tuple[int, ...] | None = option(None, "task mode: training difficulty range LOW,HIGH",
                                                        default_text="1,8")
    train_tokens: int | None = option(None, "task mode: training tokens to generate", default_text="5000000")
    curriculum_steps: int | None = option(
        None, "task mode: steps over which the top training difficulty rises from LOW + 1 to HIGH (0: off)",
        default_text="1000 in task mode", bounds="[0, inf)")
    loop_budgets: tuple[int, ...] | None = option(None, "task mode: test loop budgets of the accuracy table",
                                                  default_text="1,2,3,4,6,8,12,16,32", bounds="[1, 1024]")
    baselines: tuple[str, ...] | None = option(
        None, "task mode: baselines trained on the same data and steps: no_loop (the same layers, once "
        "each), deep (a plain model as deep as the looped one unrolled at its training mean); 'none' for none",
        default_text="no_loop")
    ranks: int | None = option(None, "task mode: data-parallel processes that train each run, one torch thread "
                                     "each (the numbers depend on this count, not on the machine's cores or load)",
                               default_text="2", bounds="[1, 64]")
    preset: str | None = option(None, "model preset", default_text="task_loop (task mode) or tiny (text mode)")
    max_steps: int | None = option(None, "training steps", default_text="2600 (task) or 500 (text)",
                                   bounds="[1, inf)")
    batch_size: int | None = option(None, "training sequences per step", default_text="32 (task) or 16 (text)",
                                    bounds="[1, inf)")
    lr: float = option(3e-3, "peak learning rate", bounds="(0, inf)")
    weight_decay: float | None = option(None, "AdamW weight decay", default_text="0.01 (task) or 0.1 (text)",
                                        bounds="[0, inf)")
    checkpoint_every: int | None = option(None, "steps between checkpoints (the geometry series)",
                                          default_text="650 (task) or 125 (text)", bounds="[1, inf)")
    eval_batches: int = option(24, "held-out batches of 16 windows for validation and the loop budgets",
                               bounds="[1, inf)")
    analyze: bool = option(True, "analyse the loop geometry of every checkpoint")
    analyze_sequences: int = option(16, "held-out windows for the geometry analysis", bounds="[1, inf)")
    long_loops: int = option(30, "the long loop budget of the geometry analysis", bounds="[1, inf)")
    sweep: bool = option(True, "sweep the early-exit policies on the final checkpoint")
    sweep_sequences: int | None = option(None, "text mode: held-out windows for the exit sweep", default_text="8",
                                         bounds="[1, inf)")
    max_documents: int | None = option(None, "text mode: prepare only the first N documents", default_text="all")
    model_overrides: str = option("", "JSON object of model fields, e.g. '{\"d_model\": 64}'")
    threads: int = option(0, "torch CPU threads per process (0: task mode 1, fixed so that the numbers do not "
                             "depend on the machine; text mode from the cores free at start)", bounds="[0, 4096]")
    seed: int = option(0, "training seed of every run (weights, batches, loop counts, loop-state noise)",
                       bounds=f"[0, {2**63})")

    def __post_init__(self) -> None:
        check_fields(self, "demo config")  # a field left at None takes its mode's default below
        other = "text" if self.mode == "task" else "task"
        given = [name for name in MODE_ONLY[other] if getattr(self, name) is not None]
        if given:  # a flag that does not apply is an error, never silently ignored
            flag = "--" + given[0].replace("_", "-")
            why = ("task mode generates its data with the task vocabulary" if other == "text"
                   else "text mode trains the tiny preset on a corpus, in one process")
            raise RdepthError(f"demo: {flag} applies to --mode {other} only ({why}): drop it or pass --mode {other}")
        for name, value in MODE_DEFAULTS[self.mode].items():
            if name != "warmup_steps" and getattr(self, name) is None:
                setattr(self, name, value)
        if self.mode == "task" and self.batch_size % self.ranks:
            raise RdepthError(f"demo config: --batch-size {self.batch_size} does not split evenly over --ranks "
                              f"{self.ranks}: choose a multiple of {self.ranks}")
        if self.mode == "task":
            self.baselines = tuple(b for b in self.baselines if b != "none")
            unknown = sorted(set(self.baselines) - set(BASELINES))
            if unknown:
                raise RdepthError(f"demo config: unknown baseline {unknown[0]!r} (choose from {', '.join(BASELINES)})")
        if self.data is None:
            self.data = str(Path(self.out) / "data")
        self.model_config()  # a bad preset or override fails here, before any work
        if self.mode == "task":
            self.task_data_config()  # a bad task, parameter or difficulty too

    def model_overrides_dict(self) -> dict[str, Any]:
        if not self.model_overrides:
            return {}
        try:
            parsed = json.loads(self.model_overrides)
        except json.JSONDecodeError:
            raise RdepthError("demo config: model_overrides must be a JSON object") from None
        if not isinstance(parsed, dict):
            raise RdepthError("demo config: model_overrides must be a JSON object")
        return parsed

    def model_config(self):
        from rdepth.config import get_preset

        return get_preset(self.preset, **self.model_overrides_dict())

    def train_config(self, data: Path, name: str = "train"):
        from rdepth.train.config import TrainConfig

        warmup = MODE_DEFAULTS[self.mode]["warmup_steps"] or max(1, self.max_steps // 15)
        return TrainConfig(
            data=str(data), out=str(Path(self.out) / name), max_steps=self.max_steps,
            batch_size=self.batch_size, lr=self.lr, warmup_steps=min(warmup, self.max_steps),
            weight_decay=self.weight_decay, eval_every=self.checkpoint_every,
            checkpoint_every=self.checkpoint_every, eval_batches=self.eval_batches,
            log_every=max(1, min(20, self.max_steps // 10)),
            curriculum_steps=self.curriculum_steps if self.mode == "task" else 0, seed=self.seed,
        )

    def task_data_config(self):
        from rdepth.tasks.data import TaskDataConfig

        return TaskDataConfig(task=self.task, train_difficulties=tuple(self.train_difficulties),
                              train_tokens=self.train_tokens, val_tokens=100_000,
                              block_size=self.model_config().block_size, task_params=self.task_params,
                              out=Path(self.data))


def _prepared(config: DemoConfig) -> Path:
    from rdepth.data.prepare import PrepareConfig, prepare

    data = Path(config.data)
    manifest = data / "manifest.json"
    if manifest.exists():
        info = json.loads(manifest.read_text())
        same = info.get("tokenizer") == config.tokenizer and info.get("corpus", {}).get("spec") == config.corpus
        if same and info.get("max_documents") == config.max_documents:
            log.info("reusing prepared data in %s", data)
            return data
        raise RdepthError(f"{data} holds other prepared data; pass another --data folder")
    return prepare(PrepareConfig(corpus=config.corpus, tokenizer=config.tokenizer, out=data,
                                 max_documents=config.max_documents))


def _trained(config: DemoConfig, data: Path) -> Path:
    from rdepth.train.launch import train_or_reuse
    from rdepth.train.resume import data_model_config_for

    return train_or_reuse(data_model_config_for(config.model_config(), data), config.train_config(data))


def _loop_budgets(run: Path, data: Path, config: DemoConfig) -> tuple[list[dict], dict | None]:
    """Validation perplexity at several loop budgets (does more test-time compute help?) and the
    unigram baseline on the same tokens."""
    from rdepth.run.evaluate import evaluate, unigram_baseline
    from rdepth.run.opened import open_run

    opened = open_run(run, data, "cpu")
    windows = opened.windows(config.eval_batches * 16)
    budgets = sorted({1, 2, *opened.config.default_eval_loops, 2 * max(opened.config.default_eval_loops)})
    results = []
    for budget in budgets:
        result = evaluate(opened.model, windows, loop_counts=budget, batch_size=16)
        results.append(result)
        log.info("loops %2d: val ppl %.2f", budget, result["ppl"])
    baseline = None if opened.unigram is None else unigram_baseline(windows, opened.unigram)
    return results, baseline


def _analyze(run: Path, data: Path, config: DemoConfig) -> Path:
    from rdepth.geometry.analyze import run_analysis
    from rdepth.geometry.config import AnalyzeConfig

    out = Path(config.out) / "report"
    return run_analysis(AnalyzeConfig(checkpoints=[str(run)], data=str(data), out=str(out),
                                      sequences=config.analyze_sequences, long_loops=config.long_loops,
                                      device="cpu", progress=False,
                                      # the demos' reports read neither: keep their run time as documented
                                      dlr_curve_loops=0, jacobian_positions=0))


def _sweep(run: Path, data: Path, config: DemoConfig) -> Path:
    from rdepth.sweep.config import SweepConfig
    from rdepth.sweep.run import sweep_checkpoint

    out = Path(config.out) / "report"
    sweep_checkpoint(SweepConfig(checkpoint=str(run), data=str(data), out=str(out),
                                 max_batches=max(1, config.sweep_sequences // 8), repeats=3, device="cpu",
                                 generate_tokens=8))
    return out / "index.html"


def run_demo(config: DemoConfig) -> dict:
    """Run every stage; returns (and writes to OUT/demo.json) the headline numbers."""
    if config.mode == "task":
        from rdepth.demo.task import run_task_demo

        return run_task_demo(config)
    from rdepth.threads import apply_plan

    apply_plan(config.threads)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    stage = StageTimer(log)

    data = stage("prepare", _prepared, config)
    run = stage("train", _trained, config, data)
    budgets, baseline = stage("loop budgets", _loop_budgets, run, data, config)
    outputs = {"data": str(data), "train": str(run)}
    if config.analyze:
        outputs["analysis"] = str(stage("analyze", _analyze, run, data, config))
    if config.sweep:
        outputs["sweep"] = str(stage("sweep", _sweep, run, data, config))
    summary_path = run / "summary.json"
    train_summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    result = {
        "config": asdict(config),
        "outputs": outputs,
        "final_val": train_summary.get("final_val"),
        "unigram_baseline": baseline,  # on the loop budgets' tokens
        "unigram_baseline_val_split": train_summary.get("unigram_baseline"),
        "tokens_per_second": train_summary.get("tokens_per_second"),
        "loop_budgets": [{"loops": r["loop_counts"], "ppl": r["ppl"], "ce": r["ce"], "tokens": r["tokens"]}
                         for r in budgets],
        "stage_seconds": stage.seconds,
        "wall_seconds": stage.wall,
    }
    write_json(out / "demo.json", result)
    if config.analyze or config.sweep:
        from rdepth.demo.report import write_first_screen

        write_first_screen(config.out)  # the report's first screen, from the saved files
    return result
