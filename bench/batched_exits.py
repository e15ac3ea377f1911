"""Batched decoding with exits: tokens/s of predicated exits against the fixed budgets of the same quality.

    python bench/batched_exits.py --checkpoint RUN --data DATA --batches 8,32,128 [--policy kl --tau 1e-3,1e-2]
    python bench/batched_exits.py --preset tiny --batches 8,32        # random weights: speed only
    python bench/batched_exits.py ... --device cuda --dtype bfloat16 [--graphs]

Per batch size B, B prompts (held-out windows of --data with a checkpoint, else random ids) are
extended by --tokens tokens greedily at the full budget (k_max per group); that token stream is
then decoded, teacher-forced (every setting reads the same tokens), by the static decode path
(:class:`rdepth.model.decoder.Decoder`) in these settings:

  (a) full:       the fixed budget k_max per group
  (b) predicated: exits (--policy at --tau), every row computes every step of a chunk of
                  --check-every steps, stopped rows predicated away; one host sync per chunk
  (d) matched:    a fixed budget per group equal to (b)'s realised mean steps, rounded
  (e) same quality: the smallest fixed budget min(n, k_max) per group (n = 1, 2, ...) whose agreement
                  is at least (b)'s (the full budget when none is smaller)
  (f) quantile q: (b) with the batch-quantile exit (``BatchQuantile(controller, q)``, one setting per
                  --quantile value): a group stops for the whole batch once at most (1 - q) of its rows
                  still loop, the stragglers handing on their newest state
  (g) matched to f: a fixed budget per group equal to each (f)'s realised mean steps, rounded

(c) compacted exits and (h)-(j) conditional steps were removed with the decoder's ``compact`` and
``conditional`` options: compaction was slower than predication at every batch on an H200, and no torch
this project uses has CUDA-graph conditional nodes (docs/results.md, docs/gpu.md).

With --task-difficulty D (--data a prepared task): the rows are held-out problems of difficulty D, decoded
teacher-forced on their own tokens (not a greedy stream), and each setting also reports its answer
accuracy (the share of answer tokens among the decoded positions whose argmax is right).

Quality is the agreement of each setting's greedy token (argmax) with the full budget's, over every
decoded position of every row. With several --tau values the threshold is chosen first, on the
prompts of the first batch size, as the one with the fewest mean steps whose agreement is at least
--agreement; the chosen one serves every batch size. Timing: --warmup untimed then --repeats timed
rounds of the whole stream (prefill untimed), the settings interleaved round by round; the median
ms per decoded token (one per row) with its interquartile range, tokens/s = B / that, and ratios
to (a), (d) and (e). Prints the device, torch version and git revision, and writes all to --json.
On CUDA, --graphs replays every setting as CUDA graphs (``Captured.record``).
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

    parser = OneLineParser(prog="bench/batched_exits.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="a run or checkpoint (default: random weights)")
    parser.add_argument("--data", default=None, help="held-out data for the prompts (with --checkpoint)")
    parser.add_argument("--preset", default="tiny", help="model preset when no --checkpoint is given")
    parser.add_argument("--k-max", default="8", help="the full budget: N or N,N,... per group")
    parser.add_argument("--policy", default="kl")
    parser.add_argument("--tau", default="1e-3", help="threshold(s), comma-separated (see the module)")
    parser.add_argument("--agreement", type=float, default=0.95, help="least agreement when choosing --tau")
    parser.add_argument("--check-every", type=int, default=2)
    parser.add_argument("--quantile", default="", help="batch-quantile exits to add, comma-separated q in (0, 1]")
    parser.add_argument("--task-difficulty", type=int, default=None,
                        help="rows are held-out problems of this difficulty of a task --data (answer accuracy)")
    parser.add_argument("--batches", default="8,32,128")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs (CUDA only)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        args.batches = _numbers(args.batches, int)
        args.taus = _numbers(args.tau, float)
        args.quantiles = _numbers(args.quantile, float)
    except ValueError:
        parser.error("--batches takes integers and --tau numbers, comma-separated")
    _check_args(parser, args)
    return args


def _numbers(text: str, kind) -> list:
    """The comma-separated numbers of ``text`` (empty items skipped)."""
    return [kind(item) for item in text.split(",") if item.strip()]


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.batches or min(args.batches) < 1 or not args.taus:
        parser.error("--batches needs sizes >= 1 and --tau at least one value")
    if args.prompt < 1 or args.tokens < 1 or args.repeats < 1 or args.warmup < 0 or args.check_every < 1:
        parser.error("--prompt, --tokens, --repeats and --check-every must be >= 1, --warmup >= 0")
    if args.data and not args.checkpoint:
        parser.error("--data needs --checkpoint")
    if any(not 0 < q <= 1 for q in args.quantiles):
        parser.error("--quantile values must be in (0, 1]")
    if args.task_difficulty is not None and not args.data:
        parser.error("--task-difficulty needs --data (a prepared task)")


def summary(times: list[float]) -> dict:
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"ms_per_token": statistics.median(times), "iqr": [quartiles[0], quartiles[2]], "rounds": times}


def timed_ms(call, device) -> float:
    """Milliseconds ``call()`` takes, the device drained before and after (CUDA events on CUDA)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start_s = time.perf_counter()
    call()
    return 1000 * (time.perf_counter() - start_s)


class Setting:
    """One decoder setting over the token stream: prefill, then the stream teacher-forced."""

    def __init__(self, name: str, decoder, stream, prompt_length: int, graphs: bool):
        self.name, self.decoder, self.stream, self.prompt_length = name, decoder, stream, prompt_length
        self.graphs = graphs

    def prefill(self) -> None:
        self.decoder.prefill(self.stream[:, : self.prompt_length])
        from bench.gpu.executors.graphs import Captured

        if self.graphs and not isinstance(self.decoder.executor, Captured):
            Captured.record(self.decoder)

    def decode(self, record: bool = False):
        """Feed the stream's tokens after the prompt; with ``record``: argmax [B, N] and steps [G, B, N]."""
        import torch

        decoder, chosen, steps = self.decoder, [], []
        for t in range(self.prompt_length, self.stream.shape[1] - 1):
            decoder.step(self.stream[:, t : t + 1])
            if record:
                chosen.append(decoder.logits.float().argmax(-1))
                steps.append(decoder.computed.clone())
        if record:
            return torch.stack(chosen, 1), torch.stack(steps, 2)
        return None


def rounded_budget(mean_steps, k_max) -> tuple[int, ...]:
    """A fixed budget per group equal to realised mean steps, rounded, within 1..k_max."""
    return tuple(min(max(round(mean), 1), cap) for mean, cap in zip(mean_steps, k_max, strict=False))


class Bench:
    """One run's model and settings: the rows (prompts and their greedy stream, or a task's held-out
    problems), the decoders at a fixed budget or with exits, and each setting's quality."""

    def __init__(self, args, model, config, device, k_max):
        self.args, self.model, self.config, self.device, self.k_max = args, model, config, device, k_max
        self.length = args.prompt + args.tokens + 1
        self.answers = {}  # batch -> answer mask of the decoded targets [B, N] (task mode)

    def prompts(self, batch: int):
        import torch

        args = self.args
        if args.data:
            from rdepth.run.heldout import held_out_tokens, held_out_windows

            tokens, _ = held_out_tokens(args.data, args.checkpoint, self.config)
            windows = held_out_windows(tokens, args.prompt, batch)[:, : args.prompt]
            if windows.shape[0] < batch:
                from rdepth.errors import RdepthError

                raise RdepthError(f"{args.data} holds only {windows.shape[0]} prompts of {args.prompt} tokens")
            return windows.to(self.device)
        generator = torch.Generator().manual_seed(args.seed + batch)
        return torch.randint(0, self.config.vocab_size, (batch, args.prompt), generator=generator).to(self.device)

    def task_stream(self, batch: int):
        """Held-out problems of --task-difficulty, [B, prompt + tokens + 1], their answer mask kept."""
        import numpy as np
        import torch

        from rdepth.tasks.data import load_heldout

        args, length = self.args, self.length
        heldout = load_heldout(args.data, args.task_difficulty)
        if heldout.tokens.shape[0] < batch or heldout.tokens.shape[1] < length:
            from rdepth.errors import RdepthError

            raise RdepthError(f"{args.data}: difficulty {args.task_difficulty} holds {heldout.tokens.shape[0]} windows "
                              f"of {heldout.tokens.shape[1]} tokens; {batch} of {length} needed")
        self.answers[batch] = torch.from_numpy(np.asarray(heldout.answer_mask[:batch, args.prompt + 1:length],
                                                          dtype=bool))
        return torch.from_numpy(np.asarray(heldout.tokens[:batch, :length], dtype=np.int64)).to(self.device)

    def decoder(self, batch: int, noise, **options):
        from rdepth.model.decoder import Decoder

        return Decoder(self.model, batch, noise=noise, capacity=self.length, **options)

    def fixed(self, batch: int, noise, counts):
        return self.decoder(batch, noise, loop_counts=counts)

    def exits(self, batch: int, noise, tau: float, quantile: float | None = None):
        from bench.gpu.batch_quantile import BatchQuantile
        from rdepth.exits.controller import controller_factory
        from rdepth.model.executors.eager import Executor

        exit_rule = controller_factory(self.args.policy, tau, list(self.k_max), lambda: self.model.readout)
        controllers = exit_rule if quantile is None else (lambda: BatchQuantile(exit_rule(), quantile))
        return self.decoder(batch, noise, controller_factory=controllers).use(Executor(self.args.check_every))

    def setting(self, name: str, decoder, stream, graphs: bool | None = None) -> Setting:
        return Setting(name, decoder, stream, self.args.prompt, self.args.graphs if graphs is None else graphs)

    def stream_of(self, batch: int, noise):
        """The prompts and the full budget's greedy continuation, [B, prompt + tokens + 1] (task mode: the
        held-out problems' own tokens)."""
        if self.args.task_difficulty is not None:
            return self.task_stream(batch)
        return self.fixed(batch, noise, self.k_max).generate(self.prompts(batch), self.args.tokens + 1)

    def measured(self, chosen, steps, reference, targets=None) -> dict:
        """Agreement with the full budget, the mean loop steps per group, and the mean over tokens of
        the most steps any row computed (the steps a batch's loop runs; steps ``[G, B, N]``); task mode:
        the answer accuracy against ``targets`` (the stream's next tokens)."""
        row = {"agreement": agreement(chosen, reference), "mean_steps": steps.float().mean(dim=(1, 2)).tolist(),
               "slowest_row_steps": steps.max(dim=1).values.float().mean(dim=1).tolist()}
        if targets is not None:
            mask = self.answers[chosen.shape[0]].to(chosen.device)
            row["answer_accuracy"] = float((chosen == targets)[mask].float().mean())
            row["answer_tokens"] = int(mask.sum())
        return row

    def full_reference(self, batch: int, noise, stream):
        """The full budget's argmax at every decoded position (task mode; else the greedy stream is it)."""
        if self.args.task_difficulty is None:
            return stream[:, self.args.prompt + 1:]
        return recorded(self.setting("reference", self.fixed(batch, noise, self.k_max), stream, False))[0]

    def choose_tau(self) -> tuple[float, list[dict]]:
        """The threshold, chosen on the first batch size's prompts: the fewest mean steps among those with
        at least --agreement (else the best agreement); and every trial."""
        from rdepth.model.noise import StateNoise

        first = self.args.batches[0]
        noise = StateNoise(self.args.seed, range(first))
        stream = self.stream_of(first, noise)
        reference = self.full_reference(first, noise, stream)
        trials = []
        for tau in self.args.taus:
            chosen, steps = recorded(self.setting("trial", self.exits(first, noise, tau), stream, False))
            trials.append({"tau": tau, "agreement": agreement(chosen, reference),
                           "mean_steps": steps.float().mean(dim=(1, 2)).tolist()})
        good = [trial for trial in trials if trial["agreement"] >= self.args.agreement] or \
            [max(trials, key=lambda trial: trial["agreement"])]
        return min(good, key=lambda trial: sum(trial["mean_steps"]))["tau"], trials

    def batch_row(self, batch: int, tau: float) -> dict:
        """Every setting of one batch size: its quality, then its timing (interleaved rounds), and the
        ratios to (a), (d) and (e)."""
        from rdepth.model.noise import StateNoise

        noise = StateNoise(self.args.seed, range(batch))
        stream = self.stream_of(batch, noise)
        reference = self.full_reference(batch, noise, stream)
        targets = stream[:, self.args.prompt + 1:] if self.args.task_difficulty is not None else None
        rows = Rows(self, reference, targets)
        settings = {
            "a_full": self.setting("a_full", self.fixed(batch, noise, self.k_max), stream),
            "b_predicated": self.setting("b_predicated", self.exits(batch, noise, tau), stream),
        }
        for q in self.args.quantiles:
            settings[f"f_quantile_{q:g}"] = self.setting(f"f_quantile_{q:g}", self.exits(batch, noise, tau, q), stream)
        for name, setting in settings.items():
            rows.measure(name, setting)
        for q in self.args.quantiles:  # each quantile exit's own matched fixed budget
            counts = rounded_budget(rows.quality[f"f_quantile_{q:g}"]["mean_steps"], self.k_max)
            name = f"g_matched_{q:g}"
            settings[name] = self.setting(name, self.fixed(batch, noise, counts), stream)
            rows.measure(name, settings[name])["budget"] = list(counts)
        matched = rounded_budget(rows.quality["b_predicated"]["mean_steps"], self.k_max)
        settings["d_matched"] = self.setting("d_matched", self.fixed(batch, noise, matched), stream)
        rows.measure("d_matched", settings["d_matched"])
        same = self.same_quality(batch, noise, stream, rows, settings)
        times = self.timed(settings, stream.shape[1] - 1 - self.args.prompt)
        return batch_row(batch, matched, same, times, rows.quality)

    def same_quality(self, batch: int, noise, stream, rows: Rows, settings: dict) -> tuple[int, ...]:
        """Untimed: the smallest uniform budget min(n, k_max) as good as the exits (the full budget when none
        is), added to ``settings`` as (e); returns it."""
        for n in range(1, max(self.k_max) + 1):
            same = tuple(min(n, cap) for cap in self.k_max)
            trial = self.setting("e_same_quality", self.fixed(batch, noise, same), stream)
            chosen, steps = recorded(trial)
            if rows.measured(chosen, steps)["agreement"] >= rows.quality["b_predicated"]["agreement"] or \
                    same == tuple(self.k_max):
                settings["e_same_quality"] = trial
                rows.quality["e_same_quality"] = rows.measured(chosen, steps)
                return same
        return same

    def timed(self, settings: dict, decoded: int) -> dict[str, list[float]]:
        """--warmup untimed then --repeats timed rounds of every setting, interleaved: ms per decoded token."""
        times: dict[str, list[float]] = {name: [] for name in settings}
        for round_number in range(self.args.warmup + self.args.repeats):
            for name, setting in settings.items():  # interleaved: drift hits every setting alike
                setting.prefill()
                elapsed = timed_ms(setting.decode, self.device)
                if round_number >= self.args.warmup:
                    times[name].append(elapsed / decoded)
        return times


class Rows:
    """The quality of each setting of one batch, measured on its recorded argmax and steps."""

    def __init__(self, bench: Bench, reference, targets):
        self.bench, self.reference, self.targets = bench, reference, targets
        self.quality: dict[str, dict] = {}

    def measured(self, chosen, steps) -> dict:
        return self.bench.measured(chosen, steps, self.reference, self.targets)

    def measure(self, name: str, setting: Setting) -> dict:
        self.quality[name] = self.measured(*recorded(setting))
        return self.quality[name]


def agreement(chosen, reference) -> float:
    return float((chosen == reference).float().mean())


def recorded(setting: Setting):
    """The setting prefilled, then decoded with its argmax [B, N] and steps [G, B, N] recorded."""
    setting.prefill()
    return setting.decode(record=True)


def batch_row(batch: int, matched, same, times: dict[str, list[float]], quality: dict[str, dict]) -> dict:
    """One batch's row: each setting's timing summary, tokens/s, quality and ratios to (a), (d) and (e)."""
    row = {"batch": batch, "matched_budget": list(matched), "same_quality_budget": list(same), "settings": {}}
    for name in times:
        stats = summary(times[name])
        stats["tokens_per_s"] = batch * 1000 / stats["ms_per_token"]
        row["settings"][name] = {**stats, **quality[name]}
    full, match, same_quality = (row["settings"][name]["ms_per_token"]
                                 for name in ("a_full", "d_matched", "e_same_quality"))
    for stats in row["settings"].values():
        stats["speedup_vs_full"] = full / stats["ms_per_token"]
        stats["speedup_vs_matched"] = match / stats["ms_per_token"]
        stats["speedup_vs_same_quality"] = same_quality / stats["ms_per_token"]
    return row


def load(args, device):
    """The model (a checkpoint's, else the preset's with seeded random weights) in --dtype, eval mode, and
    its config."""
    import torch

    from rdepth.config import get_preset
    from rdepth.model import RecurrentLM

    if args.checkpoint:
        from rdepth.run.checkpoint import load_model

        model, config = load_model(args.checkpoint, device)
    else:
        config = get_preset(args.preset)
        torch.manual_seed(args.seed)
        model = RecurrentLM(config).to(device)
    return model.to(getattr(torch, args.dtype)).eval(), config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from rdepth.config import parse_loop_counts
    from rdepth.run.device import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if args.graphs and device.type != "cuda":
        print("--graphs needs a CUDA device", file=sys.stderr)
        return 2
    model, config = load(args, device)
    if not model.n_groups:
        print("the model has no recurrence group: nothing exits", file=sys.stderr)
        return 2
    k_max = parse_loop_counts(args.k_max, model.n_groups)
    if args.prompt + args.tokens + 1 > config.block_size:
        print(f"--prompt + --tokens + 1 must fit the block size {config.block_size}", file=sys.stderr)
        return 2
    bench = Bench(args, model, config, device, k_max)
    tau, tau_trials = bench.choose_tau()
    results = []
    for batch in args.batches:
        results.append(bench.batch_row(batch, tau))
        print_batch(results[-1])
    write_report(args, device, k_max, tau, tau_trials, results)
    return 0


def write_report(args, device, k_max, tau: float, tau_trials: list[dict], results: list[dict]) -> None:
    """Print the device and the chosen threshold; write everything to --json."""
    import torch

    from rdepth.io import environment_info
    from rdepth.run.device import device_name

    info = environment_info()
    report = {"environment": {**info, "device": device_name(device)},
              "settings": {"checkpoint": args.checkpoint, "data": args.data,
                           "preset": None if args.checkpoint else args.preset, "k_max": list(k_max),
                           "policy": args.policy, "tau": tau, "tau_trials": tau_trials,
                           "agreement_target": args.agreement, "check_every": args.check_every,
                           "quantiles": args.quantiles, "task_difficulty": args.task_difficulty,
                           "prompt": args.prompt, "tokens": args.tokens, "warmup": args.warmup,
                           "repeats": args.repeats, "dtype": args.dtype, "graphs": args.graphs,
                           "threads": torch.get_num_threads()},
              "results": results}
    env = report["environment"]
    print(f"device: {env['device']}  torch {env['torch']}  git {env.get('git', '?')}  dtype {args.dtype}  "
          f"threads {torch.get_num_threads()}")
    print(f"policy {args.policy} tau {tau:g} (trials: " + ", ".join(
        f"{t['tau']:g}: agreement {t['agreement']:.3f}, steps {sum(t['mean_steps']):.2f}" for t in tau_trials) + ")")
    if args.json:
        from rdepth.io import json_text  # standard JSON: a NaN or infinity is null
        Path(args.json).write_text(json_text(report, indent=2) + "\n")


def print_batch(row: dict) -> None:
    print(f"batch {row['batch']} (matched budget {row['matched_budget']}, same-quality budget "
          f"{row['same_quality_budget']}): median [IQR] ms per decoded token-step")
    for name, stats in row["settings"].items():
        low, high = stats["iqr"]
        steps = "|".join(f"{s:.2f}" for s in stats["mean_steps"])
        slowest = "|".join(f"{s:.2f}" for s in stats["slowest_row_steps"])
        print(f"  {name:<16} {stats['ms_per_token']:9.3f} [{low:.3f}-{high:.3f}]  {stats['tokens_per_s']:9.1f} tok/s  "
              f"x{stats['speedup_vs_full']:.2f} of (a)  x{stats['speedup_vs_matched']:.2f} of (d)  "
              f"x{stats['speedup_vs_same_quality']:.2f} of (e)  "
              f"steps {steps} (slowest row {slowest})  agreement {stats['agreement']:.3f}"
              + (f"  answers {stats['answer_accuracy']:.3f}" if "answer_accuracy" in stats else ""))


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/batched_exits.py", main))
