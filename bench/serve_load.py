"""``rdepth serve`` under load: concurrent clients against the server, and the same workload through the
engine in-process (the server's own overhead per token), at a fixed budget and under an exit rule.

    python bench/serve_load.py --run runs/demo/train --data runs/demo/data --loops 6 \
        --exit step_norm_rel --tau 0.5 [--clients 32] [--batch-size 32] [--json out.json]

The workload: ``--requests`` held-out task problems of the mixed difficulties (equal shares), each request the
problem's first ``--prompt-tokens`` tokens as token ids, greedy, ``--max-tokens`` new tokens. For each
setting (the fixed budget ``--loops``, the rule ``--exit`` at ``--tau``): a server (``rdepth serve`` in a
subprocess on 127.0.0.1, one torch thread) and ``--clients`` asyncio clients that each send their share
of the requests one after another; ``--rounds`` rounds after a warm-up, the median round's tokens/s (new
tokens), p50 / p99 request latency; then the engine in-process on the same requests, all queued at once
(no HTTP). Settings interleaved per round. Prints the CPU, torch and revision; writes ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--difficulties", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--loops", type=int, required=True, help="the fixed budget (the cheapest of equal accuracy)")
    parser.add_argument("--exit", required=True, help="the exit rule")
    parser.add_argument("--tau", type=float, required=True)
    parser.add_argument("--k-max", type=int, default=12)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--tick", default="eager", help="the engine's tick for the rule (eager, static, compiled); "
                        "the fixed budget runs the eager one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "rdepth", "serve", "--checkpoint", args.run, "--port", str(port), "--threads",
               "1", "--batch-size", str(args.batch_size), "--device", "cpu", "--name", "bench", *flags]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.time() + 120
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"serve_load: the server exited: {process.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    raise SystemExit("serve_load: the server did not answer /health within 120 s")


async def load(url: str, prompts: list[list[int]], clients: int, max_tokens: int) -> dict:
    import httpx

    latencies, tokens = [], 0
    shares = [prompts[i::clients] for i in range(clients)]

    async def client(share, http):
        nonlocal tokens
        for prompt in share:
            start = time.perf_counter()
            response = await http.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                                     "temperature": 0})
            response.raise_for_status()
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


def in_process(args, prompts, budget) -> dict:
    import torch

    from rdepth.engine import Engine, Request
    from rdepth.run.checkpoint import load_model

    torch.set_num_threads(1)
    model = load_model(args.run, torch.device("cpu"))[0].eval()
    engine = Engine(model, args.batch_size, **budget(model))
    requests = [Request(p, max_tokens=args.max_tokens, sequence_id=i) for i, p in enumerate(prompts)]

    def call():
        start = time.perf_counter()
        for request in requests:
            engine.add_request(request)
        done = list(engine.run())
        wall = time.perf_counter() - start
        return {"wall_s": wall, "tokens": sum(len(d.tokens) for d in done),
                "tokens_per_s": sum(len(d.tokens) for d in done) / wall,
                "mean_loop_steps": engine.stats.as_dict(engine.batch)["mean_loop_steps"]}
    call()
    return call


def main(argv=None) -> int:
    args = parse_args(argv)
    from depth_batching import _cpu_name
    from exit_wall import revision
    from exit_workload import mixed_heldout

    from rdepth.exits.controller import controller_factory

    difficulties = [int(d) for d in args.difficulties.split(",") if d.strip()]
    per = max(1, args.requests // len(difficulties))
    heldout, _ = mixed_heldout(args.data, difficulties, per, 0)
    order = np.random.default_rng(0).permutation(heldout.tokens.shape[0])[: args.requests]
    prompts = [heldout.tokens[i, : args.prompt_tokens].astype(int).tolist() for i in order]
    settings = {
        f"fixed {args.loops}": (["--loops", str(args.loops)], lambda model: {"loop_counts": args.loops}),
        f"{args.exit} {args.tau:g}": (["--exit", args.exit, "--tau", str(args.tau), "--k-max", str(args.k_max),
                                       "--tick", args.tick],
                                      lambda model: {"tick": args.tick, "controller_factory": controller_factory(
                                          args.exit, args.tau, args.k_max, lambda: model.readout)}),
    }
    code = revision()
    print(f"serve_load: {_cpu_name()}, revision {code}; {len(prompts)} requests, {args.clients} clients, "
          f"{args.batch_size} slots", flush=True)
    servers = {label: start_server(args, flags) for label, (flags, _) in settings.items()}
    engines = {label: in_process(args, prompts, budget) for label, (_, budget) in settings.items()}
    rows: dict[str, dict[str, list]] = {label: {"server": [], "engine": []} for label in settings}
    try:
        for _label, (_, url) in servers.items():  # warm-up
            asyncio.run(load(url, prompts[: args.clients], args.clients, args.max_tokens))
        for round_ in range(args.rounds):
            for label in (list(settings) if round_ % 2 == 0 else list(settings)[::-1]):
                rows[label]["server"].append(asyncio.run(load(servers[label][1], prompts, args.clients,
                                                              args.max_tokens)))
                rows[label]["engine"].append(engines[label]())
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=30)
    report = {"cpu": _cpu_name(), "revision": code, "args": vars(args), "settings": {}}
    base = None
    for label, samples in rows.items():
        server = sorted(samples["server"], key=lambda r: r["tokens_per_s"])[len(samples["server"]) // 2]
        engine = sorted(samples["engine"], key=lambda r: r["tokens_per_s"])[len(samples["engine"]) // 2]
        base = base or server["tokens_per_s"]
        overhead = (server["wall_s"] - engine["wall_s"]) / server["tokens"]
        report["settings"][label] = {"server": server, "engine": engine, "server_overhead_ms_per_token": 1e3 * overhead,
                                     "vs_fixed": server["tokens_per_s"] / base,
                                     "server_rounds_tokens_per_s": [r["tokens_per_s"] for r in samples["server"]]}
        print(f"  {label:<22} server {server['tokens_per_s']:8.1f} tok/s (x{server['tokens_per_s'] / base:.3f}), "
              f"p50 {server['latency_p50_s']:.3f} s, p99 {server['latency_p99_s']:.3f} s; engine in-process "
              f"{engine['tokens_per_s']:8.1f} tok/s, mean steps {engine['mean_loop_steps']}; server overhead "
              f"{1e3 * overhead:.2f} ms/token", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/serve_load.py", main))
