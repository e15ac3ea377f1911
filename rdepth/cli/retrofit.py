"""``rdepth retrofit``: loop chosen layers of a plain model, starting from the model itself."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.interop.config import RetrofitConfig

    parser = subparsers.add_parser(
        "retrofit",
        help="turn a plain model into a recurrent one (one loop = the original)",
        description="Write a new run whose chosen layers loop as recurrence groups, with adapters "
        "initialised to [0 | I] so that one loop per group reproduces the plain source model exactly; "
        "train it further with rdepth train --init-from (McLeish et al. 2025).",
    )
    add_dataclass_flags(parser, RetrofitConfig, title="retrofit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.interop.config import RetrofitConfig
    from rdepth.interop.retrofit import retrofit_run

    out = retrofit_run(build(RetrofitConfig, {}, args))
    print(f"retrofitted run: {out}")
    return 0
