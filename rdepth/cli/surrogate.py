"""``rdepth surrogate``: fit a block-recurrent (Raptor) surrogate of a pretrained transformer.

Every flag is a field of :class:`rdepth.surrogate.config.SurrogateRunConfig`, and the
fitting flags of its nested :class:`rdepth.surrogate.config.FitConfig`; values are validated there.
"""

from __future__ import annotations

import argparse
import os

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.surrogate.config import FitConfig, SurrogateRunConfig, VisionConfig

    parser = subparsers.add_parser(
        "surrogate", help="fit a block-recurrent (Raptor) surrogate of a transformer",
        description="Fit a block-recurrent (Raptor) surrogate of a pretrained transformer and report "
        "its fidelity and retention beside the truncated and equal-split baselines.",
    )
    add_dataclass_flags(parser, SurrogateRunConfig, title="surrogate")
    add_dataclass_flags(parser, FitConfig, title="fitting")
    add_dataclass_flags(parser, VisionConfig, title="vision teacher (vit-fmnist)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rdepth.surrogate.config import FitConfig, SurrogateRunConfig, VisionConfig
    from rdepth.surrogate.run import run_surrogate

    config = build(SurrogateRunConfig, {"fit": build(FitConfig, {}, args), "vision": build(VisionConfig, {}, args)},
                   args)
    print(f"report: {run_surrogate(config)}")
    return 0
