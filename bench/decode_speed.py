"""Batch decode latency (ms/token) of the one decoder: eager, as CUDA graphs, compiled, against a plain model.

    python bench/decode_speed.py --preset paper --loops 12 [--device cuda] [--dtype bfloat16] [--json out.json]

Random weights (speed does not need trained ones). After a prompt, each setting decodes --tokens
tokens, one forward per token (teacher-forced: the same token ids for every setting), timed
--repeats times after --warmup untimed rounds; the median ms/token is reported with its
interquartile range, and every setting's ratio to (b) measured in the same run ((a), the packed cached
path, went with issue 39's one cache: the decoder is the one token-at-a-time path):

  (b) static eager:  Decoder.step at the fixed budget
  (c) static graph:  the same, replayed as one CUDA graph per token (CUDA only)
  (d) plain:         a model of the same width and depth without loops, static path (graph on CUDA)
  (e) exit check:    the static path with an exit rule that never fires (step_norm, tiny tau), on the
                     path of (c) on CUDA, else (b); its extra time per loop step against a loop step's
                     time (from the budget-1 run, (f)), the issue's "< 3% of a loop step"
  (f) budget 1:      the static path at 1 loop per group (to get one loop step's time)

--compile adds (b)-(f) again with ``decoder.use(Compiled())`` (Inductor-compiled loop steps, single-pass
layers and exit check; the CUDA graphs stay the decoder's own), as rows ``*_inductor`` of the same run,
with their own exit-check share. Compilation happens before a setting's rounds, untimed.

--profile counts, for one token, host syncs and kernel launches (CUDA: launch calls, kernels run on the
device and synchronising runtime calls; CPU: leaf aten ops and single-value reads, which would be launches and syncs on a
GPU) of (b) (and of (b) compiled, with --compile; on the CPU Inductor's fused C++ kernels are
no aten ops: only the calls it leaves to aten, matmuls and attention, are counted there). Prints the
device, torch version and git revision, and writes them with the numbers to --json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a file: this checkout's root for bench.gpu's executors
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv):
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/decode_speed.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=["paper", "small", "tiny"])
    parser.add_argument("--loops", default=None,
                        help="budget per group: N or N,N,... (default: the preset's eval loops)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens before decoding")
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per timed round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and keys/values of every setting")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--skip", default="", help="settings to leave out, e.g. 'e,f' (a is always run)")
    parser.add_argument("--profile", action="store_true", help="count syncs and launches per token of (a) and (b)")
    parser.add_argument("--compile", action="store_true",
                        help="also time (b)-(f) with Inductor-compiled pieces (Compiled), rows *_inductor")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.prompt < 1 or args.tokens < 1 or args.repeats < 1 or args.warmup < 0 or args.batch < 1:
        parser.error("--prompt, --tokens, --repeats and --batch must be >= 1, --warmup >= 0")
    return args


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_rounds(setup, decode, args, device, deadline: float | None = None) -> list[float]:
    """ms/token of ``decode()`` (``args.tokens`` tokens) after an untimed ``setup()`` (the prompt), per round.

    Synchronised before and after each round; on CUDA the round is timed with device events, elsewhere
    with the host clock. ``deadline`` (a ``time.perf_counter()`` value): no timed round starts after it,
    but at least one is always timed."""
    times: list[float] = []
    for round_number in range(args.warmup + args.repeats):
        if times and deadline is not None and time.perf_counter() > deadline:
            break
        setup()
        sync(device)
        elapsed_ms = _timed(decode, device)
        if round_number >= args.warmup:
            times.append(elapsed_ms / args.tokens)
    return times


def _timed(call, device) -> float:
    """Milliseconds ``call()`` takes, the device drained before and after (CUDA events on CUDA)."""
    import torch

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start_s = time.perf_counter()
    call()
    return 1000 * (time.perf_counter() - start_s)


def summary(times: list[float]) -> dict:
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"ms_per_token": statistics.median(times), "iqr": [quartiles[0], quartiles[2]], "rounds": times}


def count_per_token(call, device) -> dict:
    """Host syncs and kernel launches of ``call()`` (one token), from the profiler.

    CUDA: ``kernel_launches`` (runtime and driver launch calls, and graph launches), ``kernels`` (kernels
    the device ran, from its own activity records: a replayed graph's kernels too) and
    ``copies`` (device memcpy/memset) apart."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
        sync(device)
    events = list(prof.events())
    names = [event.name for event in events]
    if device.type == "cuda":
        launches = sum(1 for name in names if "LaunchKernel" in name or name == "cudaGraphLaunch")
        syncs = sum(1 for name in names if name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                      "cudaEventSynchronize"))
        reads = names.count("aten::_local_scalar_dense") + names.count("aten::nonzero")
        on_device = [event.name for event in events if event.device_type == DeviceType.CUDA]
        copies = sum(1 for name in on_device if name.startswith(("Memcpy", "Memset")))
        return {"kernel_launches": launches, "kernels": len(on_device) - copies, "copies": copies,
                "host_syncs": syncs, "value_reads": reads}
    work = [event for event in events if _is_work(event.name)
            and not any(_is_work(child.name) for child in _descendants(event))]
    reads = names.count("aten::_local_scalar_dense") + names.count("aten::nonzero")
    compiled = sum(1 for name in names if name.startswith("Torch-Compiled Region"))
    return {"aten_ops": len(work), "value_reads": reads, "compiled_region_calls": compiled,
            "note": "CPU: lowest-level aten ops that are not views or allocations (~ kernel launches on a GPU); "
                    "value reads (.item(), bool(), nonzero) are host syncs on a GPU"}


# aten ops that launch no kernel: views, metadata, allocation
NO_WORK = {"as_strided", "view", "reshape", "_reshape_alias", "transpose", "t", "permute", "select", "slice",
           "unsqueeze", "squeeze", "expand", "alias", "unbind", "split", "resolve_conj", "resolve_neg",
           "result_type", "empty", "empty_strided", "empty_like", "new_empty", "detach", "contiguous", "to",
           "type_as", "lift_fresh", "_unsafe_view", "narrow", "chunk"}


def _is_work(name: str) -> bool:
    return name.startswith("aten::") and name[len("aten::"):] not in NO_WORK


def _descendants(event):
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


class Run:
    """One run's model, plain model, prompt and teacher-forced tokens, and how a setting is built and timed."""

    def __init__(self, args, device, config, loops, skip: set[str]):
        import torch

        from rdepth.config import get_preset
        from rdepth.model import RecurrentLM
        from rdepth.model.noise import StateNoise

        dtype = getattr(torch, args.dtype)
        self.args, self.device, self.loops = args, device, loops
        torch.manual_seed(0)
        self.model = RecurrentLM(config).to(device=device, dtype=dtype).eval()
        self.noise = StateNoise(0, range(args.batch))
        ids = torch.randint(0, config.vocab_size, (args.batch, args.prompt + args.tokens),
                            generator=torch.Generator().manual_seed(1)).to(device)
        self.prompt = ids[:, : args.prompt]
        self.steps = [ids[:, t : t + 1] for t in range(args.prompt, ids.shape[1])]
        self.graphs = device.type == "cuda"
        self.plain = RecurrentLM(get_preset(args.preset, groups="")).to(device=device, dtype=dtype).eval() \
            if "d" not in skip else None

    def static_rounds(self, decoder, graph: bool) -> dict:
        from bench.gpu.executors.compiled import Compiled
        from bench.gpu.executors.graphs import Captured

        decoder.prefill(self.prompt)
        if graph:
            Captured.record(decoder)  # compiles first, when compiled
        elif isinstance(decoder.executor, Compiled):
            decoder.step(self.steps[0])  # compiles, untimed
        return summary(time_rounds(lambda: decoder.prefill(self.prompt),
                                   lambda: [decoder.step(t) for t in self.steps], self.args, self.device))

    def static(self, budget=None, factory=None, on=None, compiled=False):
        from bench.gpu.executors.compiled import Compiled
        from rdepth.model.decoder import Decoder

        budget = self.loops if budget is None else budget
        options = {"controller_factory": factory} if factory else {"loop_counts": budget}
        decoder = Decoder(self.model if on is None else on, self.args.batch, noise=self.noise, **options)
        return decoder.use(Compiled(check_every=decoder.executor.check_every)) if compiled else decoder

    def settings(self, results: dict, skip: set[str], suffix: str, compiled: bool) -> None:
        """(b)-(f) on one path (eager pieces, or Inductor-compiled with ``suffix`` _inductor) into ``results``."""
        graphs = self.graphs
        if "b" not in skip:
            results["b_static_eager" + suffix] = self.static_rounds(self.static(compiled=compiled), graph=False)
        if graphs and "c" not in skip:
            results["c_static_graph" + suffix] = self.static_rounds(self.static(compiled=compiled), graph=True)
        if self.plain is not None:
            results["d_plain_static" + suffix] = self.static_rounds(self.static((), on=self.plain, compiled=compiled),
                                                                    graph=graphs)
            results["d_plain_static" + suffix]["path"] = "graph" if graphs else "eager"
        if "e" not in skip and "f" not in skip and self.loops:
            self.exit_check(results, suffix, compiled)

    def exit_check(self, results: dict, suffix: str, compiled: bool) -> None:
        """(e) and (f), and the exit check's time per loop step against a loop step's."""
        from rdepth.exits.controller import controller_factory

        loops, graphs = self.loops, self.graphs
        never = lambda: controller_factory("step_norm", 1e-30, list(loops))()  # noqa: E731
        results["e_exit_check" + suffix] = self.static_rounds(self.static(factory=never, compiled=compiled),
                                                              graph=graphs)
        results["f_budget_1" + suffix] = self.static_rounds(self.static((1,) * len(loops), compiled=compiled),
                                                            graph=graphs)
        fixed = results.get(("c_static_graph" if graphs else "b_static_eager") + suffix, {}).get("ms_per_token")
        if fixed is not None:
            step_ms = (fixed - results["f_budget_1" + suffix]["ms_per_token"]) / max(sum(loops) - len(loops), 1)
            check_ms = (results["e_exit_check" + suffix]["ms_per_token"] - fixed) / sum(loops)
            results["exit_check_per_step" + suffix] = {
                "loop_step_ms": step_ms, "check_ms": check_ms,
                "check_over_step": check_ms / step_ms if step_ms > 0 else None}

    def profile(self) -> dict:
        """Syncs and launches of one token of (b), and of (b) compiled with --compile."""
        import torch

        decoder = self.static()
        decoder.prefill(self.prompt)
        with torch.no_grad():
            counts = {"b_static_eager": count_per_token(lambda: decoder.step(self.steps[0]), self.device)}
        if self.args.compile:
            decoder = self.static(compiled=True)
            decoder.prefill(self.prompt)
            decoder.step(self.steps[0])  # compiles
            decoder.prefill(self.prompt)
            counts["b_static_eager_inductor"] = count_per_token(lambda: decoder.step(self.steps[0]), self.device)
        return counts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from rdepth.config import get_preset, parse_loop_counts
    from rdepth.io import environment_info
    from rdepth.run.device import device_name, resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    config = get_preset(args.preset)
    loops = parse_loop_counts(args.loops, config.n_groups) if args.loops else config.default_eval_loops
    if args.prompt + args.tokens > config.block_size:
        print(f"--prompt + --tokens must fit the block size {config.block_size}", file=sys.stderr)
        return 2
    run = Run(args, device, config, loops, skip)
    results: dict = {}
    for suffix, compiled in [("", False)] + ([("_inductor", True)] if args.compile else []):
        run.settings(results, skip, suffix, compiled)
    run.plain = None
    add_ratios(results)
    if args.profile:
        results["profile_per_token"] = run.profile()

    info = environment_info()
    report = {"environment": {**info, "device": device_name(device)},
              "settings": {"preset": args.preset, "loops": list(loops), "batch": args.batch, "prompt": args.prompt,
                           "tokens": args.tokens, "warmup": args.warmup, "repeats": args.repeats,
                           "dtype": args.dtype, "threads": torch.get_num_threads(), "compile": args.compile},
              "results": results}
    print_report(report, args, loops)
    if args.json:
        from rdepth.io import json_text  # standard JSON: a NaN or infinity is null
        Path(args.json).write_text(json_text(report, indent=2) + "\n")
    return 0


def add_ratios(results: dict) -> None:
    """Every timed setting's ratio to (b) of the same run."""
    reference = results.get("b_static_eager", {}).get("ms_per_token")
    for value in results.values():
        if "ms_per_token" in value and reference:
            value["ratio_vs_b"] = value["ms_per_token"] / reference


def print_report(report: dict, args, loops) -> None:
    env, results = report["environment"], report["results"]
    print(f"device: {env['device']}  torch {env['torch']}  git {env.get('git', '?')}  dtype {args.dtype}")
    print(f"preset {args.preset}, loops {list(loops)}, batch {args.batch}, prompt {args.prompt}, "
          f"{args.tokens} tokens x {args.repeats} rounds (median [IQR] ms/token)")
    for key, value in results.items():
        if "ms_per_token" in value:
            low, high = value["iqr"]
            print(f"  {key:<27} {value['ms_per_token']:10.3f} [{low:.3f}-{high:.3f}]  x{value.get('ratio_vs_b', float('nan')):.3f} "
                  f"of (b)")
    for suffix in ("", "_inductor"):
        check = results.get("exit_check_per_step" + suffix)
        if check is None:
            continue
        share = check["check_over_step"]
        print(f"  exit check per loop step{suffix and ' (inductor)'}: {check['check_ms']:.4f} ms against a loop "
              f"step of {check['loop_step_ms']:.4f} ms ({'-' if share is None else f'{100 * share:.1f}%'})")
    for key, counts in results.get("profile_per_token", {}).items():
        print(f"  per token, {key}: " + ", ".join(f"{k} {v}" for k, v in counts.items() if k != "note"))


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/decode_speed.py", main))
