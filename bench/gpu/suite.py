"""The suite's flags and its one loop: each section in turn, within its share of the budget, its result
(or its error) written into the report as soon as it ends."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from bench.gpu import __doc__ as SUITE_DOC
from bench.gpu.batched import batched_section
from bench.gpu.ceiling import ceiling_section
from bench.gpu.common import DEFAULT_SECTIONS, SECTIONS, Budget, environment, error_text, free_memory
from bench.gpu.decode import decode_section
from bench.gpu.exits import exits_section
from bench.gpu.fp8 import fp8_section
from bench.gpu.loss import loss_section
from bench.gpu.report import markdown, write_report
from bench.gpu.spread import spread_section
from bench.gpu.train import train_section

RUNNERS = {"ceiling": ceiling_section, "train": train_section, "decode": decode_section, "exits": exits_section,
           "batched": batched_section, "spread": spread_section, "loss": loss_section, "fp8": fp8_section}


def parse_args(argv):
    parser = _parser()
    args = parser.parse_args(argv)
    _fill_defaults(args)
    _check_sizes(parser, args)
    from bench.gpu.train import train_overrides

    try:
        args.train_set = train_overrides(args.train_set)
    except ValueError as exc:
        parser.error(str(exc))
    _check_exit_rule(parser, args)
    return args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m bench.gpu_suite", description=SUITE_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_suite.json and gpu_suite.md")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny preset, 1-2 repeats, small batches: every section in seconds on a CPU")
    parser.add_argument("--preset", default=None, help="model preset (default: paper; tiny with --smoke)")
    parser.add_argument("--checkpoint", default=None,
                        help="a trained run or checkpoint whose weights the decode, exits and batched sections use")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-time budget (default 330; 60 with --smoke)")
    parser.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                        help="comma-separated subset of " + ",".join(SECTIONS) + " (default: all but fp8)")
    parser.add_argument("--train-batch", type=int, default=None,
                        help="sequences per training step (default 32; 2 smoke)")
    parser.add_argument("--train-steps", type=int, default=None, help="timed training steps (default 12; 2 smoke)")
    parser.add_argument("--train-compile-scope", choices=("layer", "step"), default="layer",
                        help="TrainConfig.compile_scope: each layer compiled, or each loop step one region")
    parser.add_argument("--train-set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a TrainConfig field for the train section's trainer (repeatable), e.g. fused_loss=true")
    parser.add_argument("--train-warmup", type=int, default=None, help="untimed steps first (default 3; 1 smoke)")
    parser.add_argument("--fp8-steps", type=int, default=None,
                        help="fp8 section: training steps of each run, bf16 and fp8 (default 60; 3 smoke)")
    parser.add_argument("--fp8-data", default=None,
                        help="fp8 section: a prepared data folder whose train split both runs train on "
                             "(default: random ids of the preset's vocabulary)")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="torch.compile each layer in training (auto: on CUDA, as the trainer)")
    parser.add_argument("--decode-compile-mode", choices=("default", "max-autotune-no-cudagraphs"), default="default",
                        help="Inductor's mode for the decoders with compiled pieces (the *_inductor rows)")
    parser.add_argument("--span-buckets", type=int, default=None, metavar="N",
                        help="the eager-piece decoders read the cache's written span in sizes N, 2N, ... (one set of "
                             "graphs per size; Captured(span_buckets=N)); default: the whole cache")
    parser.add_argument("--loops", type=int, default=12, help="the full decode budget per group")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 16; 8 smoke)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens decoded per timed round (default 64; 8 smoke)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per setting (default 5; 2 smoke)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds per setting (default 2; 1 smoke)")
    parser.add_argument("--batches", default=None, help="batched-decode sizes (default 8,32,128; 2,4 smoke)")
    parser.add_argument("--policy", default="step_norm",
                        help="the exit rule calibrated to --exit-fraction of the steps")
    parser.add_argument("--exit-fraction", type=float, default=0.5, help="target share of the full budget's steps")
    parser.add_argument("--check-every", default=None,
                        help="chunk sizes between host checks for exits (default 2,4; 2 smoke)")
    parser.add_argument("--capacity", type=int, default=None, help="decode cache positions (default: the block size)")
    parser.add_argument("--spread-batches", default=None, help="spread section batch sizes (default 32,128; 4 smoke)")
    parser.add_argument("--histogram", default=None,
                        help="exit-step histogram JSON of the spread section (default bench/exit_histogram.json)")
    parser.add_argument("--revision", default=None,
                        help="code revision to record (default: git rev-parse here; give it where .git is absent)")
    return parser


def _fill_defaults(args: argparse.Namespace) -> None:
    """The settings left out: the full suite's, or the smoke run's with --smoke."""
    smoke = args.smoke
    defaults = dict(preset="tiny" if smoke else "paper", budget_s=60.0 if smoke else 330.0,
                    train_batch=2 if smoke else 32, train_steps=2 if smoke else 12, train_warmup=1 if smoke else 3,
                    fp8_steps=3 if smoke else 60,
                    prompt=8 if smoke else 16, tokens=8 if smoke else 64, repeats=2 if smoke else 5,
                    warmup=1 if smoke else 2, batches="2,4" if smoke else "8,32,128",
                    check_every="2" if smoke else "2,4", spread_batches="4" if smoke else "32,128")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The sections known; the comma lists parsed into integers; every size and count >= 1."""
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")
    try:
        args.batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
        args.spread_batches = [int(b) for b in str(args.spread_batches).split(",") if b.strip()]
        args.check_every = [int(c) for c in str(args.check_every).split(",") if c.strip()]
    except ValueError:
        parser.error("--batches and --check-every take comma-separated integers")
    sizes = args.batches + args.spread_batches + args.check_every + [
        args.train_batch, args.train_steps, args.fp8_steps, args.prompt, args.tokens, args.repeats, args.loops]
    if args.span_buckets is not None:
        sizes.append(args.span_buckets)
    if min(sizes) < 1 or args.train_warmup < 0 or args.warmup < 0:
        parser.error("sizes, counts and repeats must be >= 1 (warm-ups >= 0)")


def _check_exit_rule(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A fraction in (0, 1) and a rule with a threshold to calibrate."""
    if not 0 < args.exit_fraction < 1:
        parser.error("--exit-fraction must be in (0, 1)")
    from rdepth.errors import RdepthError
    from rdepth.exits.registry import get_policy_class

    try:
        rule = get_policy_class(args.policy)
    except RdepthError as exc:
        parser.error(f"--policy: {exc}")
    if not rule.uses_tau:  # the calibration varies tau
        parser.error(f"--policy: {args.policy} takes no tau; choose a rule with a threshold")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget(args.budget_s, args.sections)
    import torch

    from rdepth.run.device import device_name, resolve_device

    device = resolve_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    context = {"device_name": device_name(device),
               "decode_dtype": torch.bfloat16 if device.type == "cuda" else torch.float32}
    report = {"suite": "rdepth bench/gpu_suite.py", "format": 1, "environment": environment(args, device),
              "settings": {key: value for key, value in vars(args).items() if key != "out"},
              "sections": {}, "elapsed_s": 0.0}
    report["settings"]["decode_dtype"] = str(context["decode_dtype"]).replace("torch.", "")
    env = report["environment"]
    print(f"gpu_suite: {env['device']}, torch {env['torch']}, CUDA {env['cuda']}, revision {env['revision']}, "
          f"budget {args.budget_s:.0f} s", flush=True)
    for name in args.sections:
        deadline = budget.deadline_for(name)
        print(f"[{budget.elapsed():6.1f} s] {name} (until +{deadline - time.perf_counter():.0f} s)", flush=True)
        started = time.perf_counter()
        try:
            result = RUNNERS[name](args, device, deadline, context)
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others
            result = {"status": "error", "error": error_text(exc), "traceback": traceback.format_exc()}
            print(f"  {name} failed: {error_text(exc)}", flush=True)
        result["section_s"] = time.perf_counter() - started
        report["sections"][name] = result
        report["elapsed_s"] = budget.elapsed()
        free_memory(device)
        write_report(report, out)
    report["elapsed_s"] = budget.elapsed()
    write_report(report, out)
    print(markdown(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

