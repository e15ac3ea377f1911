"""``rdepth serve`` under load: concurrent clients against the server, and the same workload through the
engine in-process (the server's own overhead per token), at a fixed budget and under an exit rule.

    python bench/serve_load.py --run runs/demo/train --data runs/demo/data --loops 6 \
        --exit step_norm_rel --tau 0.5 [--clients 32] [--batch-size 32] [--json out.json] \
        [--tick compiled --fixed-tick compiled --ahead 4] \
        [--depth-mix loops=2,loops=6,exit=step_norm_rel:0.3]

The workload: ``--requests`` held-out task problems of the mixed difficulties (equal shares), each request the
problem's first ``--prompt-tokens`` tokens as token ids, greedy, ``--max-tokens`` new tokens. For each
setting (the fixed budget ``--loops``, the rule ``--exit`` at ``--tau``): a server (``rdepth serve`` in a
subprocess on 127.0.0.1, one torch thread) and ``--clients`` asyncio clients that each send their share
of the requests one after another; ``--rounds`` rounds after a warm-up, the median round's tokens/s (new
tokens), p50 / p99 request latency; then the engine in-process on the same requests, all queued at once
(no HTTP). Settings interleaved per round. Prints the CPU, torch and revision; writes ``--json``.

``--depth-mix`` adds a third setting, a mix of efforts: request ``i`` asks for the mix's entry ``i mod m`` as its
``rdepth`` object (``loops=N``: ``{"loops": N}``; ``exit=RULE:TAU[:K_MAX]``: ``{"exit": RULE, "tau": TAU,
"k_max": K_MAX}``, K_MAX default ``--k-max``), from a server at ``--loops`` whose ``--max-loops`` and
``--allow-exits`` admit them, and the same through the engine in-process. Its mean loop steps are printed: run
``--loops`` at that mean to see how close the mix comes to the throughput of its mean depth.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flags import at_least, positive_ints  # noqa: E402


def add_workload_flags(parser) -> None:
    """The workload's flags (what :func:`heldout_prompts` reads, and the new tokens a request asks for), shared with
    ``scripts/engine_arrivals.py``."""
    parser.add_argument("--run", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--difficulties", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=16)


def parse_args(argv):
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/serve_load.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(parser)
    parser.add_argument("--loops", type=int, required=True, help="the fixed budget (the cheapest of equal accuracy)")
    parser.add_argument("--exit", required=True, help="the exit rule")
    parser.add_argument("--tau", type=float, required=True)
    parser.add_argument("--k-max", type=int, default=12)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--tick", default="eager", help="the engine's tick for the rule (eager, token, static, compiled)")
    parser.add_argument("--fixed-tick", default="eager", help="the engine's tick for the fixed budget")
    parser.add_argument("--ahead", type=int, default=1,
                        help="ticks one call of a static or compiled tick runs (rdepth serve --ahead), each setting's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depth-mix", default=None, metavar="DEPTH,...",
                        help="a third setting: each request its own depth in turn, loops=N or exit=RULE:TAU[:K_MAX] "
                        "(K_MAX default --k-max), e.g. loops=2,loops=6,exit=step_norm_rel:0.3")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    check_args(args)
    return args


def parse_depth_mix(text: str, k_max: int) -> list[dict]:
    """``--depth-mix``: its entries as the requests' ``rdepth`` objects, in order (see the module); RdepthError
    (one line) for an entry that is not one, a rule that is none or takes no threshold per request, a threshold
    the rule refuses."""
    from rdepth.errors import RdepthError
    from rdepth.exits.registry import get_policy_class

    usage = "--depth-mix takes loops=N or exit=RULE:TAU[:K_MAX] separated by commas"

    def steps(value: str, item: str) -> int:
        if not value.strip().isdigit() or int(value) < 1:
            raise RdepthError(f"{usage} (N and K_MAX integers >= 1), got {item!r}")
        return int(value)

    mix = []
    for item in (entry.strip() for entry in str(text).split(",")):
        if not item:
            continue
        kind, sep, value = item.partition("=")
        if kind.strip() == "loops" and sep:
            mix.append({"loops": steps(value, item)})
            continue
        parts = value.split(":")
        if kind.strip() != "exit" or not sep or len(parts) not in (2, 3) or not parts[0].strip():
            raise RdepthError(f"{usage}, got {item!r}")
        rule = parts[0].strip()
        try:
            cls = get_policy_class(rule)
            if not (cls.uses_tau and cls.per_row_tau):
                raise RdepthError(f"the rule {rule} takes no threshold per request")
            tau = cls.checked_tau(parts[1])
        except RdepthError as exc:
            raise RdepthError(f"--depth-mix {item}: {exc}") from None
        mix.append({"exit": rule, "tau": tau, "k_max": steps(parts[2], item) if len(parts) == 3 else k_max})
    if not mix:
        raise RdepthError(f"{usage}, got {text!r}")
    return mix


def mix_server_flags(args, mix: list[dict]) -> list[str]:
    """The server flags of the mix's setting: the fixed budget ``--loops``, caps that hold every entry
    (``--max-loops``), the entries' rules allowed (each request gives its threshold), ``--tick``."""
    most = max([args.loops, *(entry.get("loops", 1) for entry in mix), *(entry.get("k_max", 1) for entry in mix)])
    rules = list(dict.fromkeys(entry["exit"] for entry in mix if "exit" in entry))
    flags = ["--loops", str(args.loops), "--max-loops", str(most), "--tick", args.tick, *ahead_flags(args, args.tick)]
    return flags + (["--allow-exits", ",".join(rules)] if rules else [])


def ahead_flags(args, tick: str) -> list[str]:
    """``--ahead N`` for a server on a tick that runs ahead (the eager and token ticks read after every tick)."""
    return ["--ahead", str(args.ahead)] if args.ahead > 1 and runs_ahead(tick) else []


def runs_ahead(tick: str) -> bool:
    from rdepth.engine.tick import runs_ahead as registered

    return registered(tick)


def mix_engine(args, flags: list[str], mix: list[dict], count: int):
    """``model -> (engine, depths)``: the engine the mix's server builds from ``flags`` and the depth of each of
    ``count`` requests (entry ``i mod m``), read as the server reads them."""
    from rdepth.cli.main import build_parser
    from rdepth.cli.options import build
    from rdepth.serve.config import ServeConfig
    from rdepth.serve.depth import build_engine, check_allowed

    config = build(ServeConfig, {}, build_parser().parse_args(["serve", "--checkpoint", args.run, "--batch-size",
                                                               str(args.batch_size), "--device", "cpu", *flags]))

    def make(model):
        engine, depths = build_engine(config, model, model.config.block_size, check_allowed(config, {}), {})
        return engine, [depths.read(mix[i % len(mix)])[0] for i in range(count)]
    return make


def check_args(args) -> None:
    """One-line errors (RdepthError) before any server starts: an empty workload, a difficulty list that is
    not one, an unknown rule or tick, a threshold the rule refuses."""
    import math

    from rdepth.engine import TICKS
    from rdepth.errors import RdepthError
    from rdepth.exits.controller import controller_factory

    at_least(args, 1, "requests", "prompt_tokens", "max_tokens", "loops", "k_max", "clients", "batch_size", "rounds",
             "ahead")
    positive_ints("--difficulties", args.difficulties)
    if args.depth_mix is not None:
        parse_depth_mix(args.depth_mix, args.k_max)
    for flag, tick in (("--tick", args.tick), ("--fixed-tick", args.fixed_tick)):
        if tick not in TICKS:
            raise RdepthError(f"{flag} takes {', '.join(TICKS)}, got {tick!r}")
    if not math.isfinite(args.tau):
        raise RdepthError(f"--tau must be a finite number, got {args.tau}")
    controller_factory(args.exit, args.tau, args.k_max)  # an unknown rule or a bad threshold: one line


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(args, port: int, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "rdepth", "serve", "--checkpoint", args.run, "--port", str(port), "--threads",
            "1", "--batch-size", str(args.batch_size), "--device", "cpu", "--name", "bench", *flags]


@contextlib.contextmanager
def running_servers(args, settings: dict) -> Iterator[dict[str, str]]:
    """A server per setting (``label: (flags, ...)``), answering /health; yields ``label: url``. Every server
    started is stopped on the way out, whatever ends the block (an error, a server that fails to start after
    another did, Ctrl-C, SIGTERM: ``run_command`` raises it like Ctrl-C)."""
    with tempfile.TemporaryDirectory(prefix="serve_load-") as logs:
        started: list[subprocess.Popen] = []
        try:
            urls = {}
            for index, (label, (flags, _)) in enumerate(settings.items()):
                port, log = free_port(), Path(logs) / f"server{index}.log"
                with open(log, "w") as handle:  # a file, not a pipe: a pipe nobody reads stalls the server
                    started.append(subprocess.Popen(server_command(args, port, flags), stdout=subprocess.DEVNULL,
                                                    stderr=handle))
                urls[label] = f"http://127.0.0.1:{port}"
                wait_until_healthy(started[-1], urls[label], log)
            yield urls
        finally:
            for process in started:
                stop(process)


def wait_until_healthy(process: subprocess.Popen, url: str, log: Path, seconds: float = 120) -> None:
    """Return when ``url`` answers /health; RdepthError (the server's last error line) if it exits first, or
    when ``seconds`` pass."""
    import httpx

    from rdepth.errors import RdepthError

    deadline = time.time() + seconds
    while time.time() < deadline:
        if process.poll() is not None:
            lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
            said = next((line for line in reversed(lines) if "error" in line.lower()), lines[-1] if lines else "")
            raise RdepthError(f"the server exited (status {process.returncode}): {said.strip() or 'no output'}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise RdepthError(f"the server did not answer /health within {seconds:g} s")


def stop(process: subprocess.Popen) -> None:
    """Stop a server: SIGTERM, then SIGKILL if it has not exited within 30 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def load(url: str, prompts: list[list[int]], clients: int, max_tokens: int,
               mix: list[dict] | None = None) -> dict:
    """``clients`` clients, each sending its share of ``prompts`` one after another (request ``i`` with the
    ``rdepth`` object ``mix[i mod m]`` where a mix is given)."""
    import httpx

    latencies, tokens = [], 0
    shares = [range(i, len(prompts), clients) for i in range(clients)]

    async def client(share, http):
        nonlocal tokens
        for index in share:
            start = time.perf_counter()
            body = {"prompt": prompts[index], "max_tokens": max_tokens, "temperature": 0}
            if mix:
                body["rdepth"] = mix[index % len(mix)]
            response = await http.post(f"{url}/v1/completions", json=body)
            if response.status_code != 200:  # one line naming the server's reason, not a traceback
                from rdepth.errors import RdepthError

                raise RdepthError(f"the server answered {response.status_code}: {response.text[:300]}")
            body = response.json()
            latencies.append(time.perf_counter() - start)
            tokens += body["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(share, http) for share in shares))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "latency_p50_s": float(np.percentile(latencies, 50)), "latency_p99_s": float(np.percentile(latencies, 99))}


def in_process(args, prompts, make) -> dict:
    """The workload through the engine in-process: ``make(model) -> (engine, depths)`` (``depths``: each
    request's, or None)."""
    import torch

    from rdepth.engine import Request
    from rdepth.run.checkpoint import load_model

    torch.set_num_threads(1)
    model = load_model(args.run, torch.device("cpu"))[0].eval()
    engine, depths = make(model)
    from rdepth.run.heldout import run_tokenizer

    # as the server decodes each: greedy from sequence 0 (its default seed), ended by the end-of-text token
    end = getattr(run_tokenizer(args.run), "eot_id", None)
    requests = [Request(p, max_tokens=args.max_tokens, sequence_id=0, stop=() if end is None else (end,),
                        depth=None if depths is None else depths[i]) for i, p in enumerate(prompts)]

    def call():
        start = time.perf_counter()
        for request in requests:
            engine.add_request(request)
        done = list(engine.run())
        wall = time.perf_counter() - start
        return {"wall_s": wall, "tokens": sum(len(d.tokens) for d in done),
                "tokens_per_s": sum(len(d.tokens) for d in done) / wall,
                "mean_loop_steps": engine.stats.as_dict(engine.batch)["mean_loop_steps"]}
    if call()["tokens"] == 0:  # (before any server starts) every completion ended at once: nothing to time
        from rdepth.errors import RdepthError

        raise RdepthError(f"{args.run} ends every completion at once (end of text first) on these prompts: no token "
                          "to time; try another --prompt-tokens or a trained run")
    return call


def heldout_prompts(args) -> list[list[int]]:
    """``--requests`` prompts: the first ``--prompt-tokens`` tokens of held-out problems of ``--difficulties`` in
    equal shares, in a fixed random order (seed 0); for a text corpus (a prepared folder without task problems:
    the text presets), ``--prompt-tokens``-token windows spread over its validation split, checked against the
    run's tokenizer (``--difficulties`` unused)."""
    from exit_workload import mixed_heldout

    if not any(Path(args.data).glob("heldout_d*.npz")):
        from rdepth.run.checkpoint import load_model_config, resolve_checkpoint
        from rdepth.run.heldout import held_out_tokens, held_out_windows

        config = load_model_config(resolve_checkpoint(args.run))  # (the tokenizer's name and vocabulary: no weights)
        tokens, _ = held_out_tokens(args.data, args.run, config)
        windows = held_out_windows(tokens, args.prompt_tokens - 1, args.requests)
        return windows.tolist()

    difficulties = positive_ints("--difficulties", args.difficulties)
    per = max(1, args.requests // len(difficulties))
    heldout, _ = mixed_heldout(args.data, difficulties, per, 0)
    order = np.random.default_rng(0).permutation(heldout.tokens.shape[0])[: args.requests]
    return [heldout.tokens[i, : args.prompt_tokens].astype(int).tolist() for i in order]


def main(argv=None) -> int:
    args = parse_args(argv)
    from depth_batching import _cpu_name
    from exit_wall import revision

    from rdepth.engine import Engine
    from rdepth.exits.controller import controller_factory

    prompts = heldout_prompts(args)
    fixed_ahead, rule_ahead = (int(args.ahead) if runs_ahead(tick) else 1 for tick in (args.fixed_tick, args.tick))
    settings = {
        f"fixed {args.loops}": (["--loops", str(args.loops), "--tick", args.fixed_tick,
                                 *ahead_flags(args, args.fixed_tick)],
                                lambda model: (Engine(model, args.batch_size, loop_counts=args.loops,
                                                      tick=args.fixed_tick, ahead=fixed_ahead), None)),
        f"{args.exit} {args.tau:g}": (["--exit", args.exit, "--tau", str(args.tau), "--k-max", str(args.k_max),
                                       "--tick", args.tick, *ahead_flags(args, args.tick)],
                                      lambda model: (Engine(model, args.batch_size, tick=args.tick, ahead=rule_ahead,
                                                            controller_factory=controller_factory(
                                                                args.exit, args.tau, args.k_max,
                                                                lambda: model.readout)), None)),
    }
    mixes = {}
    if args.depth_mix is not None:
        mix = parse_depth_mix(args.depth_mix, args.k_max)
        flags = mix_server_flags(args, mix)
        settings["mix"] = (flags, mix_engine(args, flags, mix, len(prompts)))
        mixes["mix"] = mix
    code = revision()
    print(f"serve_load: {_cpu_name()}, revision {code}; {len(prompts)} requests, {args.clients} clients, "
          f"{args.batch_size} slots", flush=True)
    # the engines first: a run, rule or workload the engine refuses fails here, before any server starts
    engines = {label: in_process(args, prompts, make) for label, (_, make) in settings.items()}
    rows: dict[str, dict[str, list]] = {label: {"server": [], "engine": []} for label in settings}
    with running_servers(args, settings) as servers:
        for label, url in servers.items():  # warm-up
            asyncio.run(load(url, prompts[: args.clients], args.clients, args.max_tokens, mixes.get(label)))
        for round_ in range(args.rounds):
            for label in (list(settings) if round_ % 2 == 0 else list(settings)[::-1]):
                rows[label]["server"].append(asyncio.run(load(servers[label], prompts, args.clients,
                                                              args.max_tokens, mixes.get(label))))
                rows[label]["engine"].append(engines[label]())
    report = {"cpu": _cpu_name(), "revision": code, "args": vars(args), "settings": {}}
    base = None
    for label, samples in rows.items():
        server = sorted(samples["server"], key=lambda r: r["tokens_per_s"])[len(samples["server"]) // 2]
        engine = sorted(samples["engine"], key=lambda r: r["tokens_per_s"])[len(samples["engine"]) // 2]
        if server["tokens"] == 0 or engine["tokens"] == 0:
            from rdepth.errors import RdepthError

            raise RdepthError(f"{label}: a timed round generated no token (every completion ended at once): no rate "
                              "to compare; try another --prompt-tokens or a trained run")
        base = base or server["tokens_per_s"]
        overhead = (server["wall_s"] - engine["wall_s"]) / server["tokens"]
        report["settings"][label] = {"server": server, "engine": engine, "server_overhead_ms_per_token": 1e3 * overhead,
                                     "vs_fixed": server["tokens_per_s"] / base,
                                     "server_rounds_tokens_per_s": [r["tokens_per_s"] for r in samples["server"]],
                                     **({"mix": mixes[label]} if label in mixes else {})}
        print(f"  {label:<22} server {server['tokens_per_s']:8.1f} tok/s (x{server['tokens_per_s'] / base:.3f}), "
              f"p50 {server['latency_p50_s']:.3f} s, p99 {server['latency_p99_s']:.3f} s; engine in-process "
              f"{engine['tokens_per_s']:8.1f} tok/s, mean steps {engine['mean_loop_steps']}; server overhead "
              f"{1e3 * overhead:.2f} ms/token", flush=True)
        if label in mixes:
            print(f"  {'':<22} the mix {args.depth_mix}: compare with --loops at its mean steps "
                  f"{engine['mean_loop_steps']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/serve_load.py", main))
