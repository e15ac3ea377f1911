"""What the engine reaches of its bound as the model widens, with the exit rule's own cost taken out.

    python bench/engine_width.py --run runs/cdb/s0/train --data runs/cdb/s0/data [--widths-d 128,256,512,1024]

On the main job's model (one looped layer, d = 128) a tick of the engine launches about as many small kernels
as a loop step has arithmetic, so the engine's per-tick bookkeeping and the rule's own reading eat most of
what stopping early saves (docs/engine.md). This study asks where that changes:

1. **The exit steps of a real rule.** The trained run's engine decodes ``--requests`` held-out windows of the
   mixed difficulties with ``--exit`` at ``--tau``; the histogram of its steps per position is kept.
2. **A rule that costs nothing.** :class:`ScheduledController` stops each row, at each position, at a step
   drawn from that histogram when its loop begins (its own generator): the same distribution of depths as
   the rule, no reading of the head.
3. **Wider models.** The trained model's configuration with ``d_model`` in ``--widths-d`` (head width kept),
   weights drawn at random (the cost of a step does not depend on what the weights are), the same windows.
   At each width, interleaved rounds of (a) the engine at the fixed budget ``--fixed``, (b) the engine with
   the scheduled rule, (c) the lock-step decoder at ``--fixed`` and (d) with the scheduled rule, ``--batch``
   rows. Printed: tokens/s (median and range), the engine's ratio to its fixed budget, the bound its executed
   steps imply (fixed steps / steps) and the share of the bound reached; the lock-step decoder's the same.
   The engine runs each tick of ``--ticks`` (eager; static and compiled: every slot through one device
   function a tick, rdepth/engine/static.py), its ratios against the fastest engine at the fixed budget.

Prints the CPU, torch version, threads and git revision; ``--json`` keeps everything.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flags import positive_ints  # noqa: E402


def parse_args(argv):
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/engine_width.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a trained task run (its train/ folder)")
    parser.add_argument("--data", required=True, help="its prepared task data")
    parser.add_argument("--exit", default="kl", help="the rule whose exit steps are replayed")
    parser.add_argument("--tau", type=float, default=0.02)
    parser.add_argument("--k-max", type=int, default=12)
    parser.add_argument("--fixed", type=int, default=6, help="the fixed budget compared against")
    parser.add_argument("--widths-d", default="128,256,512,1024", help="model widths d_model")
    parser.add_argument("--head-dim", type=int, default=None, help="head width kept (default: the run's)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--ticks", default="eager,compiled",
                        help="the engine's ticks timed (the eager one always; static, compiled); every engine "
                             "row's ratio is against the fastest engine at the fixed budget among them")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where the wide models run (the trained run's "
                        "histogram is taken on the CPU; the GPU issue's call: bench/gpu/device_call.sh engine_graph)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for name in ("k_max", "fixed", "batch", "requests", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.fixed > args.k_max:
        parser.error("--fixed must be at most --k-max")
    args.widths = positive_ints("--widths-d", args.widths_d)
    if args.device not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    from depth_timing import tick_list

    args.tick_list = tick_list(args.ticks)
    return args


class ScheduledController:
    """Stops each row at a step drawn from ``probs`` (over steps 1..K) when its loop begins, from its own
    generator: a loop controller with a rule's distribution of depths and none of its cost. Serves the lock-step
    decoder (``begin`` / ``after_step``) and the engine (``begin_rows`` / ``after_steps``)."""

    def __init__(self, probs: np.ndarray, seed: int):
        import torch

        probs = np.asarray(probs, dtype=np.float64)
        if probs.ndim != 1 or probs.size < 1 or (probs < 0).any() or probs.sum() <= 0:
            raise ValueError("ScheduledController needs non-negative probabilities over steps 1..K")
        self.probs = probs / probs.sum()
        self.generator = np.random.default_rng(seed)
        self.target = torch.zeros(0, dtype=torch.long)

    def _draw(self, count: int):
        import torch

        return torch.from_numpy(self.generator.choice(self.probs.size, size=count, p=self.probs) + 1)

    def max_steps(self, group: int) -> int:
        return int(self.probs.size)

    def begin(self, group, state):
        self.target = self._draw(state.shape[0]).to(state.device)

    def begin_rows(self, group, rows, state):
        self.target[rows] = self._draw(rows.shape[0]).to(state.device)

    def after_step(self, group, step, rows, prev, new):
        import torch

        return self.target[rows] <= step, new, torch.full_like(rows, step)

    def after_steps(self, group, steps, values, rows, prev, new):
        return self.target[rows] <= steps, new, steps


def step_histogram(model, windows, ids, args) -> np.ndarray:
    """The share of positions that stop at each step 1..k_max when the engine decodes ``windows`` with the rule."""
    from rdepth.engine import Engine, Request
    from rdepth.exits.controller import controller_factory

    factory = controller_factory(args.exit, args.tau, args.k_max, lambda: model.readout)
    engine = Engine(model, args.batch, controller_factory=factory)
    for window, i in zip(windows, ids, strict=True):
        engine.add_request(Request(window.tolist(), max_tokens=1, noise_seed=args.seed, sequence_id=int(i)))
    counts = np.zeros(args.k_max, dtype=np.int64)
    for done in engine.run():
        for steps in done.steps:
            counts[steps[0] - 1] += 1
    return counts / counts.sum()


def wide_model(config, width: int, head_dim: int, seed: int):
    import torch

    from rdepth.config import ModelConfig
    from rdepth.model import RecurrentLM

    if width % head_dim:
        from rdepth.errors import RdepthError

        raise RdepthError(f"engine_width: d_model {width} is not a multiple of the head width {head_dim}")
    fields = {**config.to_dict(), "d_model": width, "n_head": width // head_dim}
    torch.manual_seed(seed)
    return RecurrentLM(ModelConfig.from_dict(fields)).eval().requires_grad_(False)


def width_rows(model, windows, ids, probs, args) -> dict:
    from depth_timing import engine_call, lockstep_call, timed_rounds

    fixed = {"loop_counts": (args.fixed,)}

    def scheduled():
        return ScheduledController(probs, args.seed)

    rule = {"controller_factory": scheduled}
    calls, records = {}, {}
    for name, budget in (("fixed", fixed), ("scheduled", rule)):
        for tick in args.tick_list:
            path = engine_path(tick)
            calls[f"{path} | {name}"], records[f"{path} | {name}"] = engine_call(
                model, windows, ids, args.batch, budget, args.seed, tick=tick)
        calls[f"lockstep | {name}"], records[f"lockstep | {name}"] = lockstep_call(model, windows, ids,
                                                                                  args.batch, budget, args.seed)
    samples = timed_rounds(calls, args, args.batch)
    positions = windows.size
    rows = {}
    for name, seconds in samples.items():
        rates = [positions / s for s in seconds]
        rows[name] = {"tokens_per_s": statistics.median(rates), "range": [min(rates), max(rates)],
                      "steps": records[name]["steps"], "paid": records[name]["paid"]}
    engines = [engine_path(tick) for tick in args.tick_list]
    fastest = max(rows[f"{path} | fixed"]["tokens_per_s"] for path in engines)
    for path in (*engines, "lockstep"):
        rule_row = rows[f"{path} | scheduled"]
        ratio = rule_row["tokens_per_s"] / (rows["lockstep | fixed"]["tokens_per_s"] if path == "lockstep" else fastest)
        bound = args.fixed / rule_row["paid"]
        rule_row.update(ratio=ratio, bound=bound, share=ratio / bound)
    rows["engine | fixed"]["vs_lockstep"] = rows["engine | fixed"]["tokens_per_s"] / rows["lockstep | fixed"]["tokens_per_s"]
    return rows


def engine_path(tick: str) -> str:
    """A row's path name for the engine with ``tick``: "engine" (eager) or e.g. "engine compiled"."""
    return "engine" if tick == "eager" else f"engine {tick}"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from depth_batching import _cpu_name
    from exit_wall import revision
    from exit_workload import mixed_heldout

    from rdepth.run.checkpoint import load_model

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        from rdepth.errors import RdepthError

        raise RdepthError("engine_width: --device cuda, but torch sees no CUDA device")
    trained = load_model(args.run, "cpu")[0].eval().requires_grad_(False)
    if trained.n_groups != 1:
        from rdepth.errors import RdepthError

        raise RdepthError(f"{args.run}: engine_width takes a model with one looped group (the task models), "
                          f"not {trained.n_groups}")
    heldout, labels = mixed_heldout(args.data, list(range(1, 9)), 256, 0)
    order = list(range(1, len(labels), 2))  # half B, as bench/depth_batching.py times
    random.Random(args.seed).shuffle(order)
    ids = np.array(order[:args.requests])
    windows = heldout.tokens[:, :-1].astype("int64")[ids]
    print(f"engine_width: {_cpu_name()} (models on {args.device}), torch {torch.__version__}, {args.threads} "
          f"thread(s), revision "
          f"{revision()}; {len(ids)} requests, {windows.size} positions, B = {args.batch}", flush=True)
    probs = step_histogram(trained, windows, ids, args)
    mean = float((np.arange(1, args.k_max + 1) * probs).sum())
    print(f"{args.exit} {args.tau:g} on the trained run: {mean:.2f} steps a position; histogram "
          f"{np.round(probs, 3).tolist()}", flush=True)
    head_dim = args.head_dim or trained.config.head_dim
    report = {"device": _cpu_name(), "torch": torch.__version__, "threads": args.threads, "revision": revision(),
              "args": {k: v for k, v in vars(args).items() if k != "widths"}, "histogram": probs.tolist(),
              "mean_steps": mean, "widths": {}}
    print("d_model  path             fixed tok/s   scheduled tok/s  ratio  bound  share  (engine rows: against the "
          "fastest engine at the fixed budget)", flush=True)
    if args.device == "cuda":
        report["device"] = torch.cuda.get_device_name(0)
    for width in args.widths:
        model = wide_model(trained.config, width, head_dim, args.seed).to(args.device)
        rows = width_rows(model, windows, ids, probs, args)
        report["widths"][str(width)] = rows
        for path in (*[engine_path(tick) for tick in args.tick_list], "lockstep"):
            fixed, rule = rows[f"{path} | fixed"], rows[f"{path} | scheduled"]
            print(f"{width:7d}  {path:15s}  {fixed['tokens_per_s']:11,.0f}  {rule['tokens_per_s']:15,.0f}  "
                  f"{rule['ratio']:5.2f}  {rule['bound']:5.2f}  {rule['share']:5.0%}", flush=True)
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(report, indent=1, default=float))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/engine_width.py", main))
