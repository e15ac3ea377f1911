"""vLLM with rdepth's plugin against ``rdepth serve``'s engine, at the same fixed loop budget (issue 65).

    python3 bench/gpu/vllm_vs_serve.py --out DIR [--preset paper] [--loops 4] [--batches 32,64,128,256]
        [--prompt-tokens 32] [--new-tokens 64] [--device cuda] [--dtype bfloat16]

The model: the preset's random weights (seed 0), written as an ``rdepth export`` folder (config.json and
model.safetensors: vLLM reads no tokenizer, ``skip_tokenizer_init``; the prompts are token ids). For each batch B:
B requests of ``--prompt-tokens`` random token ids (seed 0), each ``--new-tokens`` greedy tokens past any end token,
all queued at once, then run to the end, in process on both sides (no HTTP):

- rdepth: :class:`rdepth.engine.Engine` with B slots at ``loop_counts=--loops`` (what ``rdepth serve --loops``
  runs), the initial states of sequence 0 (its default);
- vLLM: its ``LLMEngine`` (``max_num_seqs`` B, the plugin's ``RdepthForCausalLM``, ``hf_overrides`` loop_counts),
  CUDA graphs and torch.compile as vLLM defaults on a GPU (eager on a CPU).

Per side and B: new tokens per second (all tokens over the wall time, after one warm-up round at B) and the p50 /
p99 of each request's completion time. Both sides' greedy tokens are compared (they agree in float32; in bfloat16
the two attention kernels round differently, so the count of equal requests is reported, not asserted). Writes
``DIR/vllm_vs_serve.json`` and prints one line per (side, B). Where vLLM is not installed it says so in one line
(the plugin's CPU build is ``.vllm-venv``: tests/vllm_venv.py; on a GPU ``pip install vllm`` beside rdepth).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="bench/gpu/vllm_vs_serve.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--loops", type=int, default=4, help="the fixed budget, every group")
    parser.add_argument("--batches", default="32,64,128,256")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds per (side, B), after the warm-up")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.batches = [int(b) for b in args.batches.split(",")]
    return args


def write_export(model, folder: Path, loops: int) -> None:
    """The model as an export folder vLLM loads (the config and weights ``rdepth export`` writes; no tokenizer)."""
    from safetensors.torch import save_file

    from rdepth.interop.export import WEIGHT_PREFIX, export_config_dict

    folder.mkdir(parents=True, exist_ok=True)
    config = export_config_dict(model.config, (loops,) * model.n_groups, 0, eot_id=0)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({WEIGHT_PREFIX + name: t.detach().float().contiguous().cpu() for name, t in model.state_dict().items()},
              str(folder / "model.safetensors"))


def summary(latencies: list[float], wall: float, tokens: int) -> dict:
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "p50_s": float(np.percentile(latencies, 50)), "p99_s": float(np.percentile(latencies, 99))}


def run_rdepth(model, prompts, args) -> tuple[dict, list]:
    from rdepth.engine import Engine, Request

    engine = Engine(model, len(prompts), loop_counts=args.loops)

    def once():
        start = time.perf_counter()
        for prompt in prompts:
            engine.add_request(Request(prompt, max_tokens=args.new_tokens, sequence_id=0))
        latencies, tokens, outputs = [], 0, {}
        for done in engine.run():
            latencies.append(time.perf_counter() - start)
            tokens += len(done.tokens)
            outputs[done.request_id] = list(done.tokens)
        return summary(latencies, time.perf_counter() - start, tokens), [outputs[k] for k in sorted(outputs)]

    once()  # warm-up
    return min((once() for _ in range(args.rounds)), key=lambda r: r[0]["wall_s"])


def run_vllm(folder: Path, prompts, args) -> tuple[dict, list]:
    from vllm import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(folder), skip_tokenizer_init=True, dtype=args.dtype, max_num_seqs=len(prompts),
        max_model_len=args.prompt_tokens + args.new_tokens, hf_overrides={"loop_counts": [args.loops]},
        enforce_eager=not args.device.startswith("cuda"), seed=0))
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)
    rounds = [0]

    def once():
        rounds[0] += 1
        start = time.perf_counter()
        for index, prompt in enumerate(prompts):
            engine.add_request(f"{rounds[0]}-{index}", {"prompt_token_ids": prompt}, params)
        latencies, tokens, outputs = [], 0, {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    latencies.append(time.perf_counter() - start)
                    tokens += len(output.outputs[0].token_ids)
                    outputs[int(output.request_id.split("-")[1])] = list(output.outputs[0].token_ids)
        return summary(latencies, time.perf_counter() - start, tokens), [outputs[k] for k in sorted(outputs)]

    once()  # warm-up
    return min((once() for _ in range(args.rounds)), key=lambda r: r[0]["wall_s"])


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm_vs_serve: vLLM is not installed here (pip install vllm beside rdepth; on a CPU the "
              "plugin's tests use .vllm-venv from tests/vllm_venv.py): nothing measured", file=sys.stderr)
        return 2
    from rdepth.config import get_preset
    from rdepth.model import RecurrentLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = get_preset(args.preset)
    model = RecurrentLM(config).eval()
    folder = out / "export"
    write_export(model, folder, args.loops)
    dtype = getattr(torch, args.dtype)
    model = model.to(device=args.device, dtype=dtype)
    generator = np.random.default_rng(0)
    report = {"args": {k: v for k, v in vars(args).items()}, "device": torch.cuda.get_device_name()
              if args.device.startswith("cuda") else "cpu", "torch": torch.__version__,
              "vllm": __import__("vllm").__version__, "rows": []}
    for batch in args.batches:
        prompts = generator.integers(0, config.vocab_size, (batch, args.prompt_tokens)).tolist()
        with torch.no_grad():
            ours, our_tokens = run_rdepth(model, prompts, args)
        theirs, their_tokens = run_vllm(folder, prompts, args)
        same = sum(a == b for a, b in zip(our_tokens, their_tokens, strict=True))
        for side, row in (("rdepth serve engine", ours), ("vLLM + plugin", theirs)):
            print(f"B={batch:4d} {side:<20} {row['tokens_per_s']:9.1f} tok/s  p50 {row['p50_s']:.3f} s  "
                  f"p99 {row['p99_s']:.3f} s", flush=True)
        print(f"B={batch:4d} greedy tokens equal in {same}/{batch} requests", flush=True)
        report["rows"].append({"batch": batch, "rdepth": ours, "vllm": theirs, "equal_requests": same})
        (out / "vllm_vs_serve.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":  # (vLLM starts processes that import this file)
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache where vLLM runs on the CPU
    raise SystemExit(main())
