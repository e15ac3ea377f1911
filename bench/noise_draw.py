"""One micro-batch's initial loop states: StateNoise (``--state-noise sequence``) against CounterNoise
(``counter``), as the trainer draws them.

    python bench/noise_draw.py [--batch 32 --length 512 --width 768 --groups 3] [--device cpu|cuda]
                               [--compile] [--repeats 5] [--threads 1] [--json OUT]

Each scheme builds a fresh noise object for ``--batch`` consecutive training rows and draws every
group's ``[batch, length, width]`` state (``RecurrentLM.init_state``'s call), as ``TrainStep._micro_batches``
does once per micro-batch. Prints per scheme: the median wall time over ``--repeats`` (after a warm-up;
the schemes timed in turn; CUDA synchronised around each), the aten ops the host dispatches (top-level,
from ``torch.profiler``), the host branches on tensor data (``nn.init.trunc_normal_``'s rejection loop
asks ``mask.any()``: a device sync each on CUDA) and, on CUDA, the kernels launched; then the ratio
against ``sequence``.
``--compile``: also the counter draw through ``torch.compile`` (the trainer's choice when it compiles:
on CUDA by default; Inductor fuses each group's draw).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/noise_draw.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--length", type=int, default=512, help="positions per row")
    parser.add_argument("--width", type=int, default=768, help="d_model")
    parser.add_argument("--groups", type=int, default=3, help="recurrence groups (one draw each)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true", help="also time the compiled counter draw")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch

    from rdepth.model.noise import CounterNoise, StateNoise
    from rdepth.run.device import device_name

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    std = (2 / 5) ** 0.5  # RecurrentLM.init_state_std at init_state_scale 1
    first = 7 * args.batch  # the rows of step 7 of a run

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    schemes = {
        "sequence": lambda: StateNoise.consecutive(0, first, args.batch),
        "counter": lambda: CounterNoise.consecutive(0, first, args.batch),
    }
    if args.compile:
        schemes["counter, compiled"] = lambda: CounterNoise.consecutive(0, first, args.batch, compile=True)

    def micro_batch(make):
        noise = make()
        return [noise.draw(group, args.batch, 0, args.length, args.width, std, device, args.length)
                for group in range(args.groups)]

    for make in schemes.values():
        micro_batch(make)  # warm-up (and the compile)
        sync()
    times = {name: [] for name in schemes}
    for _ in range(args.repeats):  # the schemes in turn, so a change in the machine's load hits each alike
        for name, make in schemes.items():
            started = time.perf_counter()
            micro_batch(make)
            sync()
            times[name].append(time.perf_counter() - started)
    rows = []
    for name, make in schemes.items():
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profile:
            micro_batch(make)
            sync()
        events = profile.events()
        ops = sum(1 for event in events if event.name.startswith("aten::") and event.cpu_parent is None)
        kernels = sum(1 for event in events if event.device_type == torch.autograd.DeviceType.CUDA)
        # a tensor's truth value read on the host (torch's trunc_normal_ rejection loop: `mask.any()`):
        # on CUDA each one waits for the device
        branches = sum(1 for event in events if event.name == "aten::is_nonzero")
        rows.append({"scheme": name, "median_ms": 1000 * statistics.median(times[name]),
                     "min_ms": 1000 * min(times[name]), "max_ms": 1000 * max(times[name]), "aten_ops": ops,
                     "host_branches_on_data": branches,
                     "cuda_kernels": kernels if device.type == "cuda" else None})
    base = rows[0]["median_ms"]
    for row in rows:
        row["time_ratio_vs_sequence"] = row["median_ms"] / base
    result = {"device": device_name(device), "torch": torch.__version__, "python": platform.python_version(),
              "batch": args.batch, "length": args.length, "width": args.width, "groups": args.groups,
              "repeats": args.repeats, "rows": rows}
    print(f"{result['device']}, torch {torch.__version__}: one micro-batch, {args.groups} groups x "
          f"[{args.batch}, {args.length}, {args.width}], median of {args.repeats}")
    for row in rows:
        kernels = f", {row['cuda_kernels']} kernels" if row["cuda_kernels"] is not None else ""
        print(f"  {row['scheme']:<18} {row['median_ms']:9.2f} ms (min {row['min_ms']:.2f}, max {row['max_ms']:.2f})"
              f"  {row['aten_ops']:5d} aten ops{kernels}, {row['host_branches_on_data']} host branches on data"
              f"  x{row['time_ratio_vs_sequence']:.2f} of sequence")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/noise_draw.py", main))
