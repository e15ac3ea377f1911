"""``rdepth analyze``: loop geometry of one or more checkpoints, as numbers, figures and a page."""

from __future__ import annotations

import argparse
import dataclasses

from rdepth.cli.options import add_dataclass_flags, build, overrides


def register(subparsers) -> None:
    from rdepth.geometry.config import AnalyzeConfig

    parser = subparsers.add_parser(
        "analyze",
        help="loop geometry (step sizes, step angles, cross-block drift, PCA) across checkpoints",
        description="Run held-out text through each checkpoint at its training loop count and at a "
        "long fixed budget, record step norms, consecutive-step cosines, drift-to-loop ratios, "
        "per-token convergence and PCA trajectories, and write OUT/geometry (JSON + NPZ), "
        "OUT/figures (PNG + SVG) and the report page OUT/index.html. --checkpoints may instead name Hugging Face "
        "folders of a looped model transformers ships (model_type hrm_text, inkling2_loop_text), driven in place "
        "at their own loop budget on a UTF-8 text file read with the folder's tokenizer; the page then also judges "
        "the two-scale paper's geometry claims on the model's loops (OUT/claims.json).",
    )
    # --checkpoints takes several paths after one flag (``--checkpoints runs/a runs/b/checkpoints/step_*``)
    # as well as repeated flags; its help and metavar still come from the field.
    field = next(f for f in dataclasses.fields(AnalyzeConfig) if f.name == "checkpoints")
    parser.add_argument("--checkpoints", dest="AnalyzeConfig.checkpoints", action="extend", nargs="+",
                        required=True, metavar=field.metadata["metavar"], help=field.metadata["help"] + " (required)")
    add_dataclass_flags(parser, AnalyzeConfig, title="analysis", skip=("checkpoints",))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.geometry.analyze import run_analysis
    from rdepth.geometry.config import AnalyzeConfig
    from rdepth.looped.load import looped_source

    config = build(AnalyzeConfig, {}, args)
    if looped_source(config.checkpoints, "analyze"):
        from rdepth.looped.analyze import run_looped_analysis

        print(run_looped_analysis(config, overrides(args, AnalyzeConfig, check=False)))
        return 0
    print(run_analysis(config))
    return 0
