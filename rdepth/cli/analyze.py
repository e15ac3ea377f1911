"""``rdepth analyze``: loop geometry of one or more checkpoints, as numbers, figures and a page."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    from rdepth.cli.options import add_dataclass_flags
    from rdepth.geometry.config import AnalyzeConfig

    parser = subparsers.add_parser(
        "analyze",
        help="loop geometry (step sizes, step angles, cross-block drift, PCA) across checkpoints",
        description="Run held-out text through each checkpoint at its training loop count and at a "
        "long fixed budget, record step norms, consecutive-step cosines, drift-to-loop ratios, "
        "per-token convergence and PCA trajectories, and write OUT/geometry (JSON + NPZ), "
        "OUT/figures (PNG + SVG) and the report page OUT/index.html.",
    )
    parser.add_argument("--checkpoints", nargs="+", required=True, metavar="PATH",
                        help="run folders (every checkpoint in RUN/checkpoints) and/or checkpoint folders")
    parser.add_argument("--data", required=True, help="prepared data folder (its val split) or a text file")
    parser.add_argument("--out", required=True, help="output folder (may be the run folder itself)")
    add_dataclass_flags(parser, AnalyzeConfig, title="analysis", help_overrides={
        "sequences": "held-out windows to analyse (default 64)",
        "seq_len": "tokens per window (default: the model's block size)",
        "batch_size": "windows per forward pass (default 4); lower it to save memory",
        "long_loops": "the long fixed loop budget for every group (default 30, the paper's Fig. 5)",
        "train_loops": "loop counts of the 'train' budget, N or N,N,... (default: the config's eval loops)",
        "threshold": "relative step size under which a token counts as converged (default 0.01)",
        "keep_sequence": "index of the window whose iterates are drawn in the PCA figure (default 0)",
        "seed": "seed of the initial-state noise (default 0)",
        "rank": "compute the effective rank of the updates (default on)",
        "top_tokens": "rows in the slowest-converging-token table (default 20)",
        "device": "auto, cpu or cuda[:N] (default auto)",
    })
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from rdepth.cli.options import build
    from rdepth.geometry.analyze import run_analysis
    from rdepth.geometry.config import AnalyzeConfig

    config = build(AnalyzeConfig, {}, args)
    page = run_analysis(args.checkpoints, args.data, args.out, config)
    logging.getLogger("rdepth.analyze").info("report written to %s", page)
    print(page)
    return 0
