"""``rdepth gate``: train the learned exit gate of a run (the ``learned`` exit policy reads it)."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.calibrate.gate_config import GateConfig

    parser = subparsers.add_parser(
        "gate",
        help="train a learned exit gate on a frozen run (for --policies learned / --exit learned)",
        description="Record the frozen model's loop iterates on windows of the data's val split at the full "
        "budget, label each token and step by whether the token's prediction still changes before k_max (on a "
        "token right at k_max: the per-token oracle, the fewest steps from which it is right and stays right), "
        "and fit one linear head per group on the rms-normed state and the log relative update (O(d) per "
        "step). Saves exit_gate.safetensors beside the checkpoint's weights, tied to them by their SHA-256; "
        "the learned policy stops a token when 1 - p < tau.",
    )
    add_dataclass_flags(parser, GateConfig, title="gate")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.calibrate.gate import train_gate_checkpoint
    from rdepth.calibrate.gate_config import GateConfig

    report = train_gate_checkpoint(build(GateConfig, {}, args))
    print(f"gate trained on {report['windows'] - report['kept_out_windows']} windows of {report['seq_len']} tokens "
          f"(k_max {report['k_max']}), checked on {report['kept_out_windows']} kept out")
    for group in report["groups"]:
        fit, held = group["fit"], group["kept_out"]
        print(f"  group {group['group']}: mean target step {group['mean_target_step']:.2f}; loss {fit['loss']:.4f} "
              f"fitted, {held['loss']:.4f} kept out; accuracy {100 * held['accuracy']:.1f}% kept out "
              f"({100 * held['positive_share']:.1f}% of its rows are 'will not change')")
    print(f"wrote {report['path']}")
    return 0
