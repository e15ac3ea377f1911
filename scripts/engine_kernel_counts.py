"""How many kernels each decoding path launches per batched loop step: the engine's and the lock-step
decoder's, at a fixed budget and with exit rules, on a trained task model (deterministic, whatever the load).

    python scripts/engine_kernel_counts.py --run runs/cdb/s0/train --data runs/cdb/s0/data [--batch 16]

Each path decodes the same ``--requests`` held-out windows of the mixed difficulties (half B, shuffled, as
bench/depth_batching.py times them) once to warm up, then once under ``torch.profiler``; printed: aten
events (nested calls included) and top-level aten events per batched loop step, a batched loop step being
``--batch`` loop steps the path pays (the lock-step decoder: every row of its batch until the slowest
stops).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

PATHS = (("lockstep", "fixed 6"), ("engine", "fixed 6"), ("lockstep", "kl 0.02"), ("engine", "step_norm_rel 0.5"),
         ("engine", "kl 0.02"))


def count(call, record, batch: int) -> tuple[float, float]:
    from torch.autograd.profiler_util import EventList
    from torch.profiler import profile

    call()  # warm-up
    with profile() as trace:
        call()
    events: EventList = trace.events()
    aten = [event for event in events if event.name.startswith("aten::")]
    top = [event for event in aten if event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::")]
    batched_steps = record["paid"] * record["positions"] / batch
    return len(aten) / batched_steps, len(top) / batched_steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args(argv)
    import torch
    from depth_timing import engine_call, lockstep_call
    from exit_workload import mixed_heldout

    from rdepth.exits.controller import controller_factory
    from rdepth.run.checkpoint import load_model

    torch.set_num_threads(1)
    model = load_model(args.run, "cpu")[0].eval().requires_grad_(False)
    heldout, labels = mixed_heldout(args.data, list(range(1, 9)), 256, 0)
    order = list(range(1, len(labels), 2))
    random.Random(0).shuffle(order)
    ids = np.array(order[:args.requests])
    windows = heldout.tokens[:, :-1].astype("int64")[ids]
    print(f"engine_kernel_counts: B = {args.batch}, {len(ids)} requests; aten events per batched loop step "
          "(all / top-level)")
    for path, label in PATHS:
        name, value = label.split()
        budget = ({"loop_counts": (int(value),)} if name == "fixed" else
                  {"controller_factory": controller_factory(name, float(value), 12, lambda: model.readout)})
        make = engine_call if path == "engine" else lockstep_call
        call, record = make(model, windows, ids, args.batch, budget, 0)
        record.setdefault("positions", windows.size)
        every, top = count(call, record, args.batch)
        print(f"  {path:8s} {label:18s} {every:6.0f} / {top:5.0f}   (paid steps a position {record['paid']:.2f})",
              flush=True)
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command

    raise SystemExit(run_command("scripts/engine_kernel_counts.py", main))
