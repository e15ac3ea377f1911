"""What an exit rule costs per loop step, against the loop step itself, as the model grows (CPU, batch 1).

    PYTHONPATH=. python bench/exit_rule_cost.py [--shapes 128x1,256x2,512x4,1024x4] [--json out.json]

Each shape ``DxL`` is a model of width D whose one recurrence group loops L layers (one single-pass
layer before it, the task preset's layout, random weights: the time of a step does not depend on them).
The one decoder (:class:`rdepth.model.decoder.Decoder`, eager, one host check a step: the product's CPU
path) decodes ``--tokens`` positions one at a time at batch 1, at

* fixed ``K`` and fixed ``K/2`` loop steps (their difference gives a loop step's time), and
* each rule of ``--policies`` with a threshold that never fires, so that it, too, runs exactly ``K``
  steps (checked: the executed steps are reported): its time less fixed ``K``'s, over ``K``, is what the
  rule, its bookkeeping and the host check add to a loop step.

``--rounds`` interleaved rounds after a warm-up; medians and ranges. A rule's own cost does not grow with
the loop's layers (O(d) for ``learned``, O(dV) for the rules that decode), so its share of a step
falls as the loop gets wider and deeper: the issue-38 target (<= 10% of a loop step) is read off here
per shape. Prints the CPU (``lscpu``'s model name), threads and torch version; ``--json`` saves all.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys

from exit_wall import interleaved  # bench/: the same interleaved rounds as the exit wall-time bench

# Thresholds at which each rule never stops a token before K on random weights (its check still runs).
NEVER = {"learned": 1e-12, "kl": 1e-30, "confidence": 1e-30, "step_norm_rel": 1e-30, "cosine": 1e-30}


def parse_args(argv):
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/exit_rule_cost.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="128x1,256x2,512x4,1024x4",
                        help="comma list of WIDTHxLOOPED_LAYERS")
    parser.add_argument("--policies", default="learned,kl,step_norm_rel")
    parser.add_argument("--vocab", type=int, default=42, help="vocabulary (the task's 42; the decoded rules "
                        "read a head of d x vocab)")
    parser.add_argument("--steps", type=int, default=8, help="K: loop steps of every timed setting")
    parser.add_argument("--tokens", type=int, default=64, help="positions decoded per timed call")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        args.shapes = [tuple(int(v) for v in shape.lower().split("x")) for shape in args.shapes.split(",")]
    except ValueError:
        parser.error(f"--shapes: expected WIDTHxLAYERS,..., got {args.shapes!r}")
    if any(len(shape) != 2 or min(shape) < 1 for shape in args.shapes):
        parser.error("--shapes: every shape is WIDTHxLAYERS with both >= 1")
    unknown = [p for p in args.policies.split(",") if p and p not in NEVER]
    if unknown:
        parser.error(f"--policies: no never-firing threshold for {', '.join(unknown)} (known: {', '.join(NEVER)})")
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    return args


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def model_for(width: int, looped: int, vocab: int, seed: int):
    import torch

    from rdepth.config import ModelConfig
    from rdepth.model import RecurrentLM

    torch.manual_seed(seed)
    config = ModelConfig(n_layer=1 + looped, n_head=max(1, width // 64), d_model=width, block_size=128,
                         vocab_size=vocab, groups=f"1-{looped}" if looped > 1 else "1", mean_loops=4.0,
                         tokenizer="task:chase")
    return RecurrentLM(config).eval()


def shape_row(width: int, looped: int, args) -> dict:
    import torch

    from rdepth.exits.controller import controller_factory
    from rdepth.exits.gate import random_gate
    from rdepth.model.decoder import Decoder
    from rdepth.model.noise import StateNoise

    model = model_for(width, looped, args.vocab, args.seed)
    tokens = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(args.seed))
    k, half = args.steps, args.steps // 2
    settings = {f"fixed {k}": {"loop_counts": (k,)}, f"fixed {half}": {"loop_counts": (half,)}}
    for name in [p for p in args.policies.split(",") if p]:
        options = {"gate": random_gate(1, width, seed=args.seed)} if name == "learned" else {}
        settings[name] = {"controller_factory": controller_factory(name, NEVER[name], k, lambda: model.readout,
                                                                   options)}
    calls, executed = {}, {}
    for label, budget in settings.items():
        decoder = Decoder(model, 1, noise=StateNoise(args.seed, [0]), **budget)

        def call(decoder=decoder, label=label):
            steps = 0
            with torch.no_grad():
                decoder.reset()
                for t in range(tokens.shape[1]):
                    decoder.step(tokens[:, t:t + 1])
                    steps += int(decoder.computed.sum())
            executed[label] = steps / tokens.shape[1]
        calls[label] = call
    samples = interleaved(calls, args.rounds, 1, args.seed)  # one warm-up call each, shuffled rounds
    ms = {label: 1e3 * statistics.median(values) / args.tokens for label, values in samples.items()}
    ranges = {label: [1e3 * min(v) / args.tokens, 1e3 * max(v) / args.tokens] for label, v in samples.items()}
    step_ms = (ms[f"fixed {k}"] - ms[f"fixed {half}"]) / (k - half)
    row = {"width": width, "looped_layers": looped, "parameters": model.num_parameters(), "ms_per_token": ms,
           "range_ms_per_token": ranges, "executed_steps": executed, "ms_per_loop_step": step_ms,
           "ms_outside_loop": ms[f"fixed {k}"] - k * step_ms, "rules": {}}
    for name in settings:
        if name.startswith("fixed"):
            continue
        if abs(executed[name] - k) > 1e-9:
            from rdepth.errors import RdepthError

            raise RdepthError(f"{name} stopped before {k} steps at {width}x{looped} ({executed[name]:.2f}): "
                              "its never-firing threshold fired")
        per_step = (ms[name] - ms[f"fixed {k}"]) / k
        row["rules"][name] = {"ms_per_step": per_step, "share_of_loop_step": per_step / step_ms}
    return row


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    torch.set_num_threads(args.threads)
    header = {"cpu": cpu_name(), "threads": args.threads, "torch": torch.__version__, "argv": sys.argv[1:]}
    print(f"cpu: {header['cpu']} ({args.threads} threads)  torch {torch.__version__}  K = {args.steps}, "
          f"{args.tokens} positions a call, batch 1, vocabulary {args.vocab}", flush=True)
    rows = []
    for width, looped in args.shapes:
        row = shape_row(width, looped, args)
        rows.append(row)
        rules = "  ".join(f"{name} +{r['ms_per_step']:.3f} ms ({100 * r['share_of_loop_step']:.0f}%)"
                          for name, r in row["rules"].items())
        print(f"d={width:<5} looped layers {looped}: a loop step {row['ms_per_loop_step']:.3f} ms, outside "
              f"{row['ms_outside_loop']:.3f} ms; per step, each rule adds: {rules}", flush=True)
    if args.json:
        from rdepth.io import json_text
        with open(args.json, "w") as handle:
            handle.write(json_text({**header, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/exit_rule_cost.py", main))
