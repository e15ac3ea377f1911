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


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
        args.taus = [float(t) for t in args.tau.split(",") if t.strip()]
        args.quantiles = [float(q) for q in args.quantile.split(",") if q.strip()]
    except ValueError:
        parser.error("--batches takes integers and --tau numbers, comma-separated")
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
    return args


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
        from rdepth.model.executors.graphs import Captured

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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from rdepth.config import get_preset, parse_loop_counts
    from rdepth.io import environment_info
    from rdepth.model import RecurrentLM
    from rdepth.model.noise import StateNoise
    from rdepth.exits.batch_quantile import BatchQuantile
    from rdepth.exits.controller import controller_factory
    from rdepth.model.decoder import Decoder
    from rdepth.model.executors.eager import Executor
    from rdepth.run.device import device_name, resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.graphs and device.type != "cuda":
        print("--graphs needs a CUDA device", file=sys.stderr)
        return 2
    if args.checkpoint:
        from rdepth.run.checkpoint import load_model

        model, config = load_model(args.checkpoint, device)
    else:
        config = get_preset(args.preset)
        torch.manual_seed(args.seed)
        model = RecurrentLM(config).to(device)
    model = model.to(dtype).eval()
    if not model.n_groups:
        print("the model has no recurrence group: nothing exits", file=sys.stderr)
        return 2
    k_max = parse_loop_counts(args.k_max, model.n_groups)
    length = args.prompt + args.tokens + 1
    if length > config.block_size:
        print(f"--prompt + --tokens + 1 must fit the block size {config.block_size}", file=sys.stderr)
        return 2

    def prompts(batch: int) -> torch.Tensor:
        if args.data:
            from rdepth.run.heldout import held_out_tokens, held_out_windows

            tokens, _ = held_out_tokens(args.data, args.checkpoint, config)
            windows = held_out_windows(tokens, args.prompt, batch)[:, : args.prompt]
            if windows.shape[0] < batch:
                raise SystemExit(f"{args.data} holds only {windows.shape[0]} prompts of {args.prompt} tokens")
            return windows.to(device)
        generator = torch.Generator().manual_seed(args.seed + batch)
        return torch.randint(0, config.vocab_size, (batch, args.prompt), generator=generator).to(device)

    answers = {}  # batch -> answer mask of the decoded targets [B, N] (task mode)

    def task_stream(batch: int) -> torch.Tensor:
        """Held-out problems of --task-difficulty, [B, prompt + tokens + 1], their answer mask kept."""
        import numpy as np

        from rdepth.tasks.data import load_heldout

        heldout = load_heldout(args.data, args.task_difficulty)
        if heldout.tokens.shape[0] < batch or heldout.tokens.shape[1] < length:
            raise SystemExit(f"{args.data}: difficulty {args.task_difficulty} holds {heldout.tokens.shape[0]} windows "
                             f"of {heldout.tokens.shape[1]} tokens; {batch} of {length} needed")
        answers[batch] = torch.from_numpy(np.asarray(heldout.answer_mask[:batch, args.prompt + 1:length], dtype=bool))
        return torch.from_numpy(np.asarray(heldout.tokens[:batch, :length], dtype=np.int64)).to(device)

    def factory(tau: float):
        return controller_factory(args.policy, tau, list(k_max), lambda: model.readout)

    def decoder(batch: int, noise, **options):
        return Decoder(model, batch, noise=noise, capacity=length, **options)

    def exits(batch: int, noise, tau: float, quantile: float | None = None):
        exit_rule = factory(tau)
        controllers = exit_rule if quantile is None else (lambda: BatchQuantile(exit_rule(), quantile))
        return decoder(batch, noise, controller_factory=controllers).use(Executor(args.check_every))

    def stream_of(batch: int, noise) -> torch.Tensor:
        """The prompts and the full budget's greedy continuation, [B, prompt + tokens + 1] (task mode: the
        held-out problems' own tokens)."""
        if args.task_difficulty is not None:
            return task_stream(batch)
        return decoder(batch, noise, loop_counts=k_max).generate(prompts(batch), args.tokens + 1)

    def agreement(chosen: torch.Tensor, reference: torch.Tensor) -> float:
        return float((chosen == reference).float().mean())

    def measured(chosen: torch.Tensor, steps: torch.Tensor, reference: torch.Tensor, targets=None) -> dict:
        """Agreement with the full budget, the mean loop steps per group, and the mean over tokens of
        the most steps any row computed (the steps a batch's loop runs; steps ``[G, B, N]``); task mode:
        the answer accuracy against ``targets`` (the stream's next tokens)."""
        row = {"agreement": agreement(chosen, reference), "mean_steps": steps.float().mean(dim=(1, 2)).tolist(),
               "slowest_row_steps": steps.max(dim=1).values.float().mean(dim=1).tolist()}
        if targets is not None:
            mask = answers[chosen.shape[0]].to(chosen.device)
            row["answer_accuracy"] = float((chosen == targets)[mask].float().mean())
            row["answer_tokens"] = int(mask.sum())
        return row

    def full_reference(batch: int, noise, stream: torch.Tensor) -> torch.Tensor:
        """The full budget's argmax at every decoded position (task mode; else the greedy stream is it)."""
        if args.task_difficulty is None:
            return stream[:, args.prompt + 1:]
        full = Setting("reference", decoder(batch, noise, loop_counts=k_max), stream, args.prompt, False)
        full.prefill()
        return full.decode(record=True)[0]

    # Choose the threshold on the first batch size's prompts.
    tau_trials = []
    first = args.batches[0]
    noise = StateNoise(args.seed, range(first))
    stream = stream_of(first, noise)
    reference = full_reference(first, noise, stream)
    for tau in args.taus:
        trial = Setting("trial", exits(first, noise, tau), stream, args.prompt, False)
        trial.prefill()
        chosen, steps = trial.decode(record=True)
        tau_trials.append({"tau": tau, "agreement": agreement(chosen, reference),
                           "mean_steps": steps.float().mean(dim=(1, 2)).tolist()})
    good = [trial for trial in tau_trials if trial["agreement"] >= args.agreement] or \
        [max(tau_trials, key=lambda trial: trial["agreement"])]
    tau = min(good, key=lambda trial: sum(trial["mean_steps"]))["tau"]

    results = []
    for batch in args.batches:
        noise = StateNoise(args.seed, range(batch))
        stream = stream_of(batch, noise)
        reference = full_reference(batch, noise, stream)
        targets = stream[:, args.prompt + 1:] if args.task_difficulty is not None else None
        settings = {
            "a_full": Setting("a_full", decoder(batch, noise, loop_counts=k_max), stream, args.prompt, args.graphs),
            "b_predicated": Setting("b_predicated", exits(batch, noise, tau), stream, args.prompt, args.graphs),
        }
        for q in args.quantiles:
            settings[f"f_quantile_{q:g}"] = Setting(f"f_quantile_{q:g}", exits(batch, noise, tau, q), stream,
                                                    args.prompt, args.graphs)
        quality = {}
        for name, setting in settings.items():
            setting.prefill()
            quality[name] = measured(*setting.decode(record=True), reference, targets)
        for q in args.quantiles:  # each quantile exit's own matched fixed budget
            counts = tuple(min(max(round(mean), 1), cap) for mean, cap in
                           zip(quality[f"f_quantile_{q:g}"]["mean_steps"], k_max))
            name = f"g_matched_{q:g}"
            settings[name] = Setting(name, decoder(batch, noise, loop_counts=counts), stream, args.prompt, args.graphs)
            settings[name].prefill()
            chosen, steps = settings[name].decode(record=True)
            quality[name] = measured(chosen, steps, reference, targets)
            quality[name]["budget"] = list(counts)
        matched = tuple(min(max(round(mean), 1), cap) for mean, cap in
                        zip(quality["b_predicated"]["mean_steps"], k_max))
        settings["d_matched"] = Setting("d_matched", decoder(batch, noise, loop_counts=matched), stream, args.prompt,
                                        args.graphs)
        settings["d_matched"].prefill()
        chosen, steps = settings["d_matched"].decode(record=True)
        quality["d_matched"] = measured(chosen, steps, reference, targets)
        for n in range(1, max(k_max) + 1):  # untimed: the smallest uniform budget as good as the exits
            same = tuple(min(n, cap) for cap in k_max)
            trial = Setting("e_same_quality", decoder(batch, noise, loop_counts=same), stream, args.prompt,
                            args.graphs)
            trial.prefill()
            chosen, steps = trial.decode(record=True)
            if measured(chosen, steps, reference, targets)["agreement"] >= quality["b_predicated"]["agreement"] or \
                    same == tuple(k_max):
                settings["e_same_quality"] = trial
                quality["e_same_quality"] = measured(chosen, steps, reference, targets)
                break
        times: dict[str, list[float]] = {name: [] for name in settings}
        decoded = stream.shape[1] - 1 - args.prompt
        for round_number in range(args.warmup + args.repeats):
            for name, setting in settings.items():  # interleaved: drift hits every setting alike
                setting.prefill()
                elapsed = timed_ms(setting.decode, device)
                if round_number >= args.warmup:
                    times[name].append(elapsed / decoded)
        row = {"batch": batch, "matched_budget": list(matched), "same_quality_budget": list(same), "settings": {}}
        for name in settings:
            stats = summary(times[name])
            stats["tokens_per_s"] = batch * 1000 / stats["ms_per_token"]
            row["settings"][name] = {**stats, **quality[name]}
        full, match, same_quality = (row["settings"][name]["ms_per_token"]
                                     for name in ("a_full", "d_matched", "e_same_quality"))
        for stats in row["settings"].values():
            stats["speedup_vs_full"] = full / stats["ms_per_token"]
            stats["speedup_vs_matched"] = match / stats["ms_per_token"]
            stats["speedup_vs_same_quality"] = same_quality / stats["ms_per_token"]
        results.append(row)
        print_batch(row)

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
    return 0


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
