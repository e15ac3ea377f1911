"""Benchmark: each exit policy at matched quality against the fixed loop budget, on the same path.

Not a test. On one model and one held-out text, every policy runs over its
threshold grid (the pipeline of ``rdepth sweep``, with the same flags and
defaults; the sweep is written to ``--out``); for each policy the fastest point
whose perplexity is at most ``--tolerance`` above the full budget's is compared
with

* the full budget (every group at ``k_max``), and
* the cheapest fixed budget that reaches the same quality,

both timed on the packed path the policies take (``x full``, ``x fixed``), and
with the full budget on the dense path as a separate reference (``x dense``).
It also prints the packed / dense time ratio of every fixed budget (identical
work on both paths). Latencies are teacher-forced ms/token (batch 1 and
batched; one window per forward, time / tokens) and, with
``--generate-tokens``, decode latency (cached generation). All are timed in
interleaved rounds (each round times every setting once, shuffled; warm,
synchronised), kept as median and IQR; a ratio marked ``~`` is within noise
(IQRs overlap, or an IQR above ``--noise-threshold`` of its median). Every
number printed is read from the sweep's saved summary; ``--from-sweep
OUT/sweep.json`` prints a saved sweep again without measuring.

    python bench/exit_speed.py --checkpoint runs/tiny --data data/wiki --out /tmp/exit_speed --k-max 8
"""

from __future__ import annotations

import logging
import sys

USAGE = __doc__.split("\n\n")[0]


def parse_args(argv: list[str] | None):
    """``(from_sweep, None)`` to re-read a saved sweep, else ``(None, SweepConfig)``."""
    from rdepth.cli.main import OneLineParser
    from rdepth.cli.options import add_dataclass_flags, build
    from rdepth.sweep.config import SweepConfig

    saved = OneLineParser(prog="bench/exit_speed.py", add_help=False)
    saved.add_argument("--from-sweep")
    known, rest = saved.parse_known_args(argv)
    parser = OneLineParser(prog="bench/exit_speed.py", description=USAGE)
    parser.add_argument("--from-sweep", metavar="SWEEP_JSON",
                        help="a saved sweep.json (or its folder) to print instead of measuring; takes no other flag")
    if known.from_sweep:
        if rest:
            parser.error(f"--from-sweep takes no other flag, got {' '.join(rest)}")
        return known.from_sweep, None
    add_dataclass_flags(parser, SweepConfig, title="sweep (the flags of rdepth sweep)")
    args = parser.parse_args(argv)
    return None, build(SweepConfig, {}, args)


def _ratio(row: dict, name: str) -> str:
    """``1.234`` or ``1.234~`` (within noise); ``-`` when not measured."""
    if name not in row:
        return "-"
    return f"{row[name]:.3f}" + ("~" if row.get(f"{name}_noise") else "")


def summarise(result: dict) -> None:
    """Print the matched-quality comparison, the packed/dense ratios and the noise warnings from
    ``result["summary"]``."""
    from rdepth.sweep.stats import format_ratio
    from rdepth.sweep.summary import summary_of

    summary = summary_of(result)
    env = result["environment"]
    reference = result["reference"]
    timings = summary["timings"]
    config = result["config"]
    print(f"device: {env.get('device')}  torch {env.get('torch')}  git {env.get('git', '?')}")
    print(f"timing: {config.get('warmup')} warm-up calls per setting, {config['repeats']} interleaved rounds; "
          f"median [IQR]; noise threshold {100 * summary['noise_threshold']:g}% of the median")
    print(f"decode for decoded rules: {summary['decode']['mode']} ({summary['decode']['description']})")
    print(f"k_max {result['k_max']}; full budget: ppl {summary['full_ppl']:.4f}")
    for key, text in summary["latency_definitions"].items():
        if key in reference:
            low, high = reference.get(f"{key}_iqr", (reference[key], reference[key]))
            print(f"  {key:>28}: {reference[key]:.4f} [{low:.4f}-{high:.4f}] ms/token  ({text})")
    print(f"matched quality: perplexity <= {1 + summary['tolerance']:.2f} x full; each policy's fastest such point "
          f"(teacher-forced, batch 1); x full / x fixed on the same {summary['timing_path']} path, x dense against "
          "the full budget on the dense path; ~ = within noise")
    header = f"{'policy':>20} {'setting':>10} {'ppl':>9} {'steps':>7} {'saved':>6}"
    for timing in timings:
        header += f" {'x full ' + timing:>16} {'x fixed ' + timing:>17}"
        if timing != "generate":
            header += f" {'x dense ' + timing:>17}"
    print(header)
    for row in summary["matched_quality"][summary["headline_ranking"]]:
        if row["value"] is None:
            print(f"{row['policy']:>20} {'-':>10}  no point within tolerance")
            continue
        line = (f"{row['policy']:>20} {row['value']:>10g} {row['ppl']:>9.4f} {row['steps']:>7.2f} "
                f"{100 * row['steps_saved']:>5.1f}%")
        for timing in timings:
            line += f" {_ratio(row, 'speedup_vs_full_' + timing):>16} {_ratio(row, 'speedup_vs_fixed_' + timing):>17}"
            if timing != "generate":
                line += f" {_ratio(row, 'speedup_vs_dense_full_' + timing):>17}"
        print(line)
    print(f"cheapest fixed budget within tolerance: {summary['matched_fixed_budget']}")
    print("ratios > 1: the policy is faster (x full: than the full budget; x fixed: than that fixed budget)")
    if summary["packed_over_dense"]:
        print("packed / dense time for identical work (fixed budgets; > 1: the packed path is slower):")
        for row in summary["packed_over_dense"]:
            cells = "  ".join(f"{timing}: {format_ratio(row[timing])}" for timing in ("b1", "batched") if timing in row)
            print(f"  {str(row['budget']):>14}  {cells}")
    for warning in summary["noise_warnings"]:
        print(f"WARNING (timing noise): {warning}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rdepth.errors import RdepthError

    try:
        from_sweep, config = parse_args(argv)
        if from_sweep:
            from rdepth.sweep.summary import load_sweep

            result = load_sweep(from_sweep)
        else:
            from rdepth.sweep.run import sweep_checkpoint

            if not config.timing:
                raise RdepthError("the benchmark compares latencies: leave timing on")
            result = sweep_checkpoint(config)
        if "b1" not in result["summary"]["timings"]:
            raise RdepthError("the sweep has no timing (it ran with --no-timing)")
        summarise(result)
    except RdepthError as exc:
        print(f"exit_speed: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/exit_speed.py", main))
