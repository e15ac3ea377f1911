"""``rdepth consolidate``: a sharded (``--parallel fsdp``) checkpoint as the usual safetensors one."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.train.dcp import ConsolidateConfig

    parser = subparsers.add_parser(
        "consolidate",
        help="add model.safetensors to a sharded (--parallel fsdp) checkpoint",
        description="Gather the weights of a torch.distributed.checkpoint folder (rdepth train --parallel fsdp) "
        "into model.safetensors in the same checkpoint folder, in one process: rdepth eval, generate, export "
        "and analyze then read it like any other checkpoint. The sharded files stay (the run still resumes).",
    )
    add_dataclass_flags(parser, ConsolidateConfig, title="consolidate")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.train.dcp import ConsolidateConfig, consolidate

    config = build(ConsolidateConfig, {}, args)
    print(f"consolidated {consolidate(config.checkpoint, config.overwrite) / 'model.safetensors'}")
    return 0
