"""``rdepth calibrate``: one exit threshold per group for a quality target, chosen by replay."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build, overrides


def register(subparsers) -> None:
    from rdepth.calibrate.config import CalibrateConfig

    parser = subparsers.add_parser(
        "calibrate",
        help="choose an exit policy's threshold per group for a quality target (an exit profile)",
        description="Record every group's loop iterates on held-out data once at the full budget, replay the "
        "policy over them for each candidate threshold (no loop re-run per candidate), choose one threshold per "
        "group that meets --max-quality-loss at the fewest loop steps (or the best quality within --mean-steps), "
        "then run the chosen profile and the best single shared threshold for real on the calibration data and "
        "on validation data not used to choose them. Writes the exit profile (JSON) that rdepth eval takes with "
        "--exit-profile. On task data quality is exact-match accuracy (loss in points / 100); on text, "
        "perplexity (loss as a relative increase).",
    )
    add_dataclass_flags(parser, CalibrateConfig, title="calibration")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.calibrate.config import CalibrateConfig
    from rdepth.calibrate.run import calibrate_checkpoint

    config = build(CalibrateConfig, {}, args)
    config.check_flags_apply(overrides(args, CalibrateConfig, check=False))  # given, even at its default
    profile = calibrate_checkpoint(config)
    quality = profile["quality"]
    unit = (lambda loss: f"{100 * loss:+.2f} points") if quality == "accuracy" else \
        (lambda loss: f"{100 * loss:+.2f}% perplexity")
    target = profile["target"]
    print(f"target: {', '.join(f'{k} {v}' for k, v in target.items())}; policy {profile['policy']}, "
          f"k_max {profile['k_max']}")
    for label, entry in (("per-group profile", profile["calibrated"]), ("best shared value", profile["shared_baseline"])):
        if entry is None:
            print(f"{label:>18}: none meets the target")
            continue
        values = ", ".join(f"{v:g}" for v in entry["values"])
        print(f"{label:>18}: {profile['parameter']} = {values}; predicted loss {unit(entry['predicted_loss'])}, "
              f"{entry['predicted_steps']:.2f} steps")
        if entry.get("from_shared"):
            print(f"{'':>20}(the best shared value did better on the calibration windows than the per-group "
                  "choices tried, so it is the profile)")
        history = entry.get("refinement", [])
        if len(history) > 1:
            tried = "; ".join(f"{', '.join(f'{v:g}' for v in h['values'])}: realised {unit(h['realised_loss'])}"
                              for h in history[:-1])
            print(f"{'':>20}refined after {len(history) - 1} real run(s) that missed the target ({tried})")
        for split, got in entry["realised"].items():
            print(f"{'':>20}{split}: realised loss {unit(got['loss'])} (quality {got['quality']:.4f} vs full "
                  f"{got['full_budget']['quality']:.4f}), {got['steps']:.2f} steps (full "
                  f"{got['full_budget']['steps']:.2f})")
    print(f"wrote {profile['path']}")
    return 0
