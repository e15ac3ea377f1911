"""The main job on the embedded default data, end to end on a CPU.

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
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rdepth.errors import RdepthError
from rdepth.fields import option
from rdepth.io import write_json

log = logging.getLogger(__name__)


@dataclass
class DemoConfig:
    out: str = option("runs/demo", "output folder: data, training run, report and demo.json")
    data: str | None = option(None, "prepared data folder (reused when it holds the same corpus and tokenizer)",
                              default_text="OUT/data")
    corpus: str = option("wiki", "corpus to prepare: wiki, shakespeare or a text file/folder")
    tokenizer: str = option("bpe:4096", "tokenizer to prepare the corpus with: gpt2 or bpe:N")
    preset: str = option("tiny", "model preset")
    max_steps: int = option(500, "training steps")
    batch_size: int = option(16, "training sequences per step")
    lr: float = option(3e-3, "peak learning rate")
    checkpoint_every: int = option(125, "steps between checkpoints (the geometry series)")
    eval_batches: int = option(24, "held-out batches of 16 windows for validation and the loop budgets")
    analyze: bool = option(True, "analyse the loop geometry of every checkpoint")
    analyze_sequences: int = option(16, "held-out windows for the geometry analysis")
    long_loops: int = option(30, "the long loop budget of the geometry analysis")
    sweep: bool = option(True, "sweep the early-exit policies on the final checkpoint")
    sweep_sequences: int = option(8, "held-out windows for the exit sweep")
    max_documents: int | None = option(None, "prepare only the first N documents", default_text="all")
    model_overrides: str = option("", "JSON object of model fields, e.g. '{\"d_model\": 64}'")
    threads: int = option(0, "torch CPU threads (0: torch's default)")

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "checkpoint_every", "eval_batches", "analyze_sequences",
                     "long_loops", "sweep_sequences"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise RdepthError(f"demo config: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.threads, int) or self.threads < 0:
            raise RdepthError(f"demo config: threads must be >= 0, got {self.threads!r}")
        if not self.lr > 0:
            raise RdepthError(f"demo config: lr must be > 0, got {self.lr!r}")
        if self.data is None:
            self.data = str(Path(self.out) / "data")
        self.model_config()  # a bad preset or override fails here, before any work

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

    def train_config(self, data: Path):
        from rdepth.train.config import TrainConfig

        return TrainConfig(
            data=str(data), out=str(Path(self.out) / "train"), max_steps=self.max_steps,
            batch_size=self.batch_size, lr=self.lr, warmup_steps=max(1, self.max_steps // 15),
            eval_every=self.checkpoint_every, checkpoint_every=self.checkpoint_every,
            eval_batches=self.eval_batches, log_every=max(1, min(20, self.max_steps // 10)),
        )


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
    from rdepth.run.checkpoint import list_checkpoints
    from rdepth.train.trainer import data_model_config_for, train

    train_config = config.train_config(data)
    run = Path(train_config.out)
    model_config = data_model_config_for(config.model_config(), data)
    saved_path = run / "config.json"
    if saved_path.exists():
        saved = json.loads(saved_path.read_text())
        wanted = {"model": model_config.to_dict(), "train": train_config.to_dict()}
        changed = sorted(f"{part}.{key}" for part in wanted for key in wanted[part]
                         if saved.get(part, {}).get(key) != wanted[part][key])
        if changed:
            raise RdepthError(f"{run} was trained with other settings ({', '.join(changed[:4])}); "
                              "pass another --out")
        summary = run / "summary.json"
        if summary.exists() and json.loads(summary.read_text()).get("step") == config.max_steps:
            log.info("reusing the finished training run in %s", run)
            return run
    train(model_config, train_config, resume=bool(list_checkpoints(run)))
    return run


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
                                      device="cpu"))


def _sweep(run: Path, data: Path, config: DemoConfig) -> Path:
    from rdepth.exits.config import SweepConfig
    from rdepth.exits.sweep import sweep_checkpoint

    out = Path(config.out) / "report"
    sweep_checkpoint(SweepConfig(checkpoint=str(run), data=str(data), out=str(out),
                                 max_batches=max(1, config.sweep_sequences // 8), repeats=3, device="cpu"))
    return out / "index.html"


def run_demo(config: DemoConfig) -> dict:
    """Run every stage; returns (and writes to OUT/demo.json) the headline numbers."""
    import torch

    if config.threads:
        torch.set_num_threads(config.threads)
    started = time.perf_counter()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    def stage(name: str, fn, *args):
        begin = time.perf_counter()
        log.info("== %s", name)
        value = fn(*args)
        timings[name] = round(time.perf_counter() - begin, 1)
        return value

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
        "stage_seconds": timings,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    write_json(out / "demo.json", result)
    if config.analyze or config.sweep:
        from rdepth.demo_report import write_first_screen

        write_first_screen(config.out)  # the report's first screen, from the saved files
    return result
