"""The main job on the embedded default data, end to end on a CPU.

1. prepare the default corpus (Wikipedia lead sections, byte-level BPE);
2. train the ``tiny`` preset, keeping a series of checkpoints;
3. evaluate at several loop budgets beside the unigram baseline;
4. analyse the loop geometry of every checkpoint (report page);
5. sweep the early-exit policies on the final checkpoint (report section).

Re-running into the same folder reuses finished stages and resumes an
interrupted training run; nothing already written is overwritten.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rdepth.errors import RdepthError
from rdepth.io import write_json

log = logging.getLogger(__name__)


@dataclass
class DemoConfig:
    out: str = "runs/demo"
    data: str = "data/wiki-bpe4096"
    corpus: str = "wiki"
    tokenizer: str = "bpe:4096"
    preset: str = "tiny"
    max_steps: int = 500
    batch_size: int = 16
    lr: float = 3e-3
    checkpoint_every: int = 125
    eval_batches: int = 24
    analyze: bool = True
    analyze_sequences: int = 16
    long_loops: int = 30
    sweep: bool = True
    sweep_sequences: int = 8
    max_documents: int | None = None
    model_overrides: str = ""  # JSON object of ModelConfig fields, e.g. '{"d_model": 64}'

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "checkpoint_every", "eval_batches", "analyze_sequences",
                     "long_loops", "sweep_sequences"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise RdepthError(f"demo config: {name} must be a positive integer, got {value!r}")
        if self.model_overrides:
            try:
                parsed = json.loads(self.model_overrides)
            except json.JSONDecodeError:
                raise RdepthError("demo config: model_overrides must be a JSON object") from None
            if not isinstance(parsed, dict):
                raise RdepthError("demo config: model_overrides must be a JSON object")


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
    from rdepth.config import get_preset
    from rdepth.train.checkpoint import list_checkpoints
    from rdepth.train.config import TrainConfig
    from rdepth.train.trainer import train

    run = Path(config.out) / "train"
    summary = run / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get("step") == config.max_steps:
        log.info("reusing the finished training run in %s", run)
        return run
    overrides = json.loads(config.model_overrides) if config.model_overrides else {}
    model_config = get_preset(config.preset, **overrides)
    train_config = TrainConfig(
        data=str(data), out=str(run), max_steps=config.max_steps, batch_size=config.batch_size,
        lr=config.lr, warmup_steps=max(1, config.max_steps // 15), eval_every=config.checkpoint_every,
        checkpoint_every=config.checkpoint_every, eval_batches=config.eval_batches,
        log_every=max(1, min(20, config.max_steps // 10)),
    )
    train(model_config, train_config, resume=bool(list_checkpoints(run)))
    return run


def _loop_scaling(run: Path, data: Path, config: DemoConfig) -> list[dict]:
    """Validation perplexity at several loop budgets: does more test-time compute help?"""
    from rdepth.train.checkpoint import load_model
    from rdepth.train.data_source import held_out_tokens
    from rdepth.train.evaluate import evaluate

    model, model_config = load_model(run)
    tokens, _ = held_out_tokens(data, run, model_config)
    budgets = sorted({1, 2, *model_config.default_eval_loops, 2 * max(model_config.default_eval_loops)})
    results = []
    for budget in budgets:
        result = evaluate(model, tokens, loop_counts=budget, max_batches=config.eval_batches)
        results.append(result)
        log.info("loops %2d: val ppl %.2f", budget, result["ppl"])
    return results


def run_demo(config: DemoConfig) -> dict:
    """Run every stage; returns (and writes to OUT/demo.json) the headline numbers."""
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
    scaling = stage("loop budgets", _loop_scaling, run, data, config)
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
        "unigram_baseline": train_summary.get("unigram_baseline"),
        "tokens_per_second": train_summary.get("tokens_per_second"),
        "loop_budgets": [{"loops": r["loop_counts"], "ppl": r["ppl"], "ce": r["ce"]} for r in scaling],
        "stage_seconds": timings,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    write_json(out / "demo.json", result)
    return result


def _analyze(run: Path, data: Path, config: DemoConfig) -> Path:
    from rdepth.geometry.analyze import run_analysis
    from rdepth.geometry.config import AnalyzeConfig

    out = Path(config.out) / "report"
    run_analysis([run], data, out, AnalyzeConfig(sequences=config.analyze_sequences, long_loops=config.long_loops))
    return out / "index.html"


def _sweep(run: Path, data: Path, config: DemoConfig) -> Path:
    from rdepth.exits.sweep import SweepConfig, run_sweep, write_sweep
    from rdepth.train.checkpoint import load_model
    from rdepth.train.data_source import held_out_tokens

    model, model_config = load_model(run)
    tokens, _ = held_out_tokens(data, run, model_config)
    out = Path(config.out) / "report"
    result = run_sweep(model, tokens, SweepConfig(max_batches=max(1, config.sweep_sequences // 8), repeats=3))
    write_sweep(result, out)
    return out / "index.html"
