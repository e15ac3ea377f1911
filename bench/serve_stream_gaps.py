"""Streams under load: the longest gap between a stream's chunks with more streaming clients than slots.

    python bench/serve_stream_gaps.py --run runs/demo/train --data runs/demo/data --loops 6 \
        [--clients 32,128] [--batch-size 32] [--requests 256] [--max-tokens 16] [--json out.json] \
        [-- SERVER FLAGS...]

One ``rdepth serve`` (a subprocess on 127.0.0.1, one torch thread, ``--batch-size`` slots, ``--loops``, and any
server flags after ``--``); for each count of ``--clients``, that many asyncio clients each stream their share of
``--requests`` held-out task prompts (the first ``--prompt-tokens`` tokens of problems of mixed difficulty, as
``bench/serve_load.py`` sends them), greedy, ``--max-tokens`` new tokens, one after another. Per stream: the time to
its first chunk and its longest gap between two chunks after that; printed as the p50 / p99 over streams, and the
ratio of each count's p50 longest gap to the first count's (issue 63's target: 128 clients on 32 slots within 2x
of 32 clients). A warm-up round first. Prints the CPU and revision; writes ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flags import at_least, positive_ints  # noqa: E402


def parse_args(argv):
    from rdepth.cli.main import OneLineParser

    argv = list(sys.argv[1:] if argv is None else argv)
    server_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = OneLineParser(prog="bench/serve_stream_gaps.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--difficulties", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--loops", type=int, required=True)
    parser.add_argument("--clients", default="32,128")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.server_flags = server_flags
    at_least(args, 1, "loops", "batch_size", "requests", "prompt_tokens", "max_tokens")
    args.client_counts = positive_ints("--clients", args.clients)
    positive_ints("--difficulties", args.difficulties)
    return args


async def stream_load(url: str, prompts: list[list[int]], clients: int, max_tokens: int) -> dict:
    """``clients`` clients each streaming their share of ``prompts`` one after another: per stream, the time
    to its first chunk and its longest gap between chunks after it."""
    import httpx

    from rdepth.errors import RdepthError

    first, longest = [], []
    shares = [range(i, len(prompts), clients) for i in range(clients)]

    async def one(index, http):
        body = {"prompt": prompts[index], "max_tokens": max_tokens, "temperature": 0, "stream": True}
        start = last = time.perf_counter()
        gaps, seen = [], False
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RdepthError(f"the server answered {response.status_code}")
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if seen:
                    gaps.append(now - last)
                else:
                    first.append(now - start)
                    seen = True
                last = now
        longest.append(max(gaps) if gaps else 0.0)

    async def client(share, http):
        for index in share:
            await one(index, http)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(share, http) for share in shares))
        wall = time.perf_counter() - start
    return {"clients": clients, "streams": len(longest), "wall_s": wall,
            "first_chunk_p50_s": float(np.percentile(first, 50)), "first_chunk_p99_s": float(np.percentile(first, 99)),
            "longest_gap_p50_s": float(np.percentile(longest, 50)),
            "longest_gap_p99_s": float(np.percentile(longest, 99))}


def main(argv=None) -> int:
    from depth_batching import _cpu_name
    from exit_wall import revision
    from serve_load import heldout_prompts, running_servers

    from rdepth.cli.main import run_command

    def body() -> int:
        args = parse_args(argv)
        prompts = heldout_prompts(args)
        flags = ["--loops", str(args.loops), *args.server_flags]
        print(f"serve_stream_gaps: {_cpu_name()}, revision {revision()}; {len(prompts)} streamed requests, "
              f"{args.batch_size} slots, server flags {' '.join(flags)}", flush=True)
        rows = []
        with running_servers(args, {"server": (flags, None)}) as urls:
            url = urls["server"]
            asyncio.run(stream_load(url, prompts[: args.batch_size], args.batch_size, args.max_tokens))  # warm-up
            for clients in args.client_counts:
                row = asyncio.run(stream_load(url, prompts, clients, args.max_tokens))
                rows.append(row)
                ratio = row["longest_gap_p50_s"] / rows[0]["longest_gap_p50_s"] if rows[0]["longest_gap_p50_s"] else 0.0
                print(f"  {clients:4d} clients: longest gap between chunks p50 {row['longest_gap_p50_s']:.3f} s, "
                      f"p99 {row['longest_gap_p99_s']:.3f} s (x{ratio:.2f} the first count's p50); first chunk p50 "
                      f"{row['first_chunk_p50_s']:.3f} s, p99 {row['first_chunk_p99_s']:.3f} s", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"cpu": _cpu_name(), "flags": flags, "rows": rows}, indent=1))
            print(f"wrote {args.json}")
        return 0

    return run_command("bench/serve_stream_gaps.py", body)


if __name__ == "__main__":
    sys.exit(main())
