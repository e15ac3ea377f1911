"""Benchmark: each exit policy at matched quality against the fixed loop budget.

Not a test. On one model and one held-out text, every policy runs over its
threshold grid (the same machinery as ``rdepth sweep``); for each policy the
fastest point whose perplexity is at most ``--tolerance`` (default 1%) above
the full budget's is compared with

* the full budget (every group at ``k_max``), and
* the cheapest fixed budget that reaches the same quality,

printing loop steps saved and latency ratios (batch 1 and batched; median of
warm, synchronised repeats) and the device. ``--from-sweep sweep.json``
re-reads a saved sweep instead of measuring again.

    python bench/exit_speed.py --checkpoint runs/tiny --data data/wiki --k-max 8
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="checkpoint or run folder")
    parser.add_argument("--data", help="prepared data folder or a text file")
    parser.add_argument("--from-sweep", help="a saved sweep.json to summarise instead of measuring")
    parser.add_argument("--policies", default=None, help="comma-separated (default: all but fixed)")
    parser.add_argument("--taus", default="1e-5,1e-4,1e-3,1e-2")
    parser.add_argument("--k-max", default=None, help="N or N,N,... per group (default: twice the eval loops)")
    parser.add_argument("--tolerance", type=float, default=0.01, help="allowed relative perplexity increase")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-batches", type=int, default=4)
    parser.add_argument("--timing-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--generate-tokens", type=int, default=32,
                        help="also time cached greedy generation of N tokens (0: skip)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--save", default=None, help="also write the sweep result to this JSON file")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    from rdepth.exits.sweep import SweepConfig, default_policies, run_sweep
    from rdepth.train.checkpoint import load_model
    from rdepth.train.data_source import held_out_tokens
    from rdepth.train.trainer import resolve_device

    device = resolve_device(args.device)
    model, config = load_model(args.checkpoint, device)
    tokens, _ = held_out_tokens(args.data, args.checkpoint, config)
    sweep = SweepConfig(
        policies=tuple(args.policies.split(",")) if args.policies else default_policies(),
        taus=tuple(float(t) for t in args.taus.split(",")),
        k_max=tuple(int(k) for k in args.k_max.split(",")) if args.k_max else None,
        batch_size=args.batch_size, max_batches=args.max_batches, timing_batch_size=args.timing_batch_size,
        repeats=args.repeats, warmup=args.warmup, generate_tokens=args.generate_tokens,
        block_size=min(config.block_size, len(tokens) - 1),
    )
    return run_sweep(model, tokens, sweep, device=device)


def summarise(result: dict, tolerance: float) -> None:
    from rdepth.exits.sweep import matched_quality

    env = result["environment"]
    reference = result["reference"]
    print(f"device: {env.get('device')}  torch {env.get('torch')}  git {env.get('git', '?')}")
    print(f"k_max {result['k_max']}; full budget: ppl {reference['ppl']:.4f}, "
          f"{reference['ms_per_token_b1']:.4f} ms/token (batch 1), "
          f"{reference['ms_per_token_batched']:.4f} ms/token (batch {reference.get('timing_batch_size')})")
    print(f"matched quality: perplexity <= {1 + tolerance:.2f} x full; each policy's fastest such point (batch-1 forward)")
    timings = [t for t in ("b1", "batched", "generate") if f"ms_per_token_{t}" in reference]
    if "generate" in timings:
        print(f"full budget, cached generation: {reference['ms_per_token_generate']:.4f} ms/token")
    rows = matched_quality(result, tolerance, timing="b1")
    header = f"{'policy':>20} {'setting':>10} {'ppl':>9} {'steps':>7} {'saved':>6}"
    for t in timings:
        header += f" {'x full ' + t:>16} {'x fixed ' + t:>17}"
    print(header)
    nan = float("nan")
    for row in rows:
        if row["value"] is None:
            print(f"{row['policy']:>20} {'-':>10}  no point within tolerance")
            continue
        line = (f"{row['policy']:>20} {row['value']:>10g} {row['ppl']:>9.4f} {row['steps']:>7.2f} "
                f"{100 * row['steps_saved']:>5.1f}%")
        for t in timings:
            line += f" {row.get('speedup_vs_full_' + t, nan):>16.3f} {row.get('speedup_vs_fixed_' + t, nan):>17.3f}"
        print(line)
    fixed = rows[0].get("matched_fixed_budget") if rows else None
    print(f"cheapest fixed budget within tolerance: {fixed}")
    print("ratios > 1: the policy is faster (x full: than the full budget; x fixed: than that fixed budget)")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from rdepth.errors import RdepthError
    from rdepth.io import write_json

    try:
        if args.from_sweep:
            result = json.loads(Path(args.from_sweep).read_text())
        else:
            if not args.checkpoint or not args.data:
                raise RdepthError("give --checkpoint and --data, or --from-sweep")
            result = measure(args)
            if args.save:
                write_json(args.save, result)
        if "ms_per_token_b1" not in result["reference"]:
            raise RdepthError("the sweep has no timing (it ran with --no-timing)")
        summarise(result, args.tolerance)
    except RdepthError as exc:
        print(f"exit_speed: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
