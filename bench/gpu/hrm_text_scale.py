"""HRM-Text-1B-sized random weights on a card: the looped adapter's step against the class's own forward.

The hub is out of reach, so the weights are random; the shape is transformers' ``HrmTextConfig`` defaults, the
config it documents for ``sapientinc/HRM-Text-1B`` (d 1,536, 16 layers per stack, H 2 x L 3 cycles, 151,808
tokens, an untied head; about 1.4B parameters), in bfloat16. At batch 1 and 32 (``--batches``), each timed as the
median of ``--repeats`` rounds after ``--warmup`` (CUDA synchronised around every call; the card's peak memory
kept):

* ``prefill``: ``[B, T]`` tokens through the class's own forward and through the adapter's
  (:func:`rdepth.looped.protocol.forward`, the same modules in the same order), and their ratio;
* ``decode``: one new token at the full budget over a ``T``-token cache, the class's forward with its cache
  against the adapter's;
* ``step``: one L step and one H step of the adapter for that token alone (a stack of 16 layers each);
* ``exit_decode``: the token through :func:`rdepth.looped.exits.decode_with_exits` at the full budget and under
  ``step_norm_rel`` 0.1 on the L loop: the cost of the per-token exit machinery (its host reads and the latest-KV
  copies). Random weights exit arbitrarily, so its steps say nothing; the time is the machinery's;
* ``engine``: B requests of ``--engine-prompt`` tokens generating ``--engine-new`` greedy tokens each through
  :class:`rdepth.looped.engine.LoopedEngine` with B slots (its slot cache sized to fit), against the adapter's
  lock-step greedy decode of the same B prompts (all rows at the same positions: the prompt in one call, then a
  token a call): new tokens/s of each, their ratio, and whether every request's tokens agree.

Without CUDA the 1B size is skipped in one line (exit 0); ``--size tiny`` runs every timing on a small config on
whatever device there is, a check of the script itself.

    PYTHONPATH=. python3 bench/gpu/hrm_text_scale.py --out OUT [--size tiny] [--budget-s 240]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            head_dim=16, max_position_embeddings=512)


def hrm_config(size: str):
    import transformers

    return transformers.HrmTextConfig(**(TINY if size == "tiny" else {}), prefix_lm=False)


def timed(call, device, warmup: int, repeats: int, reset=None) -> dict:
    """Median and range of ``repeats`` timed calls (ms) after ``warmup`` untimed ones; ``reset`` runs untimed after
    every call (a cache cropped back)."""
    import statistics

    import torch

    times = []
    for index in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= warmup:
            times.append(1000 * (time.perf_counter() - start))
        if reset is not None:
            reset()
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "n": len(times)}


def measure_engine(adapter, batch: int, device, warmup: int, repeats: int, shape: tuple[int, int]) -> dict:
    """The looped engine against the adapter's lock-step greedy decode of the same prompts (module docstring)."""
    import torch

    from rdepth.engine.request import Request
    from rdepth.looped.engine import LoopedEngine
    from rdepth.looped.protocol import greedy

    length, new = shape
    generator = torch.Generator(device="cpu").manual_seed(1000 + batch)
    prompts = torch.randint(0, adapter.model.config.vocab_size, (batch, length), generator=generator)
    made: dict = {}

    def engine() -> None:
        engine = LoopedEngine(adapter, batch, capacity=length + new)
        for row in prompts.tolist():
            engine.add_request(Request(row, max_tokens=new))
        made["engine"] = [done.tokens for done in sorted(engine.run(), key=lambda done: done.request_id)]

    def lockstep() -> None:
        made["lockstep"] = greedy(adapter, prompts.to(device), new)[:, length:].tolist()

    with torch.no_grad():
        ours = timed(engine, device, warmup, repeats)
        theirs = timed(lockstep, device, warmup, repeats)
    tokens = batch * new
    return {"prompt_tokens": length, "new_tokens": new, "engine": ours, "lockstep": theirs,
            "engine_tokens_per_s": 1000 * tokens / ours["median_ms"],
            "lockstep_tokens_per_s": 1000 * tokens / theirs["median_ms"],
            "engine_over_lockstep": theirs["median_ms"] / ours["median_ms"],
            "requests_agreeing": sum(a == b for a, b in zip(made["engine"], made["lockstep"], strict=True))}


def measure_batch(adapter, batch: int, length: int, device, warmup: int, repeats: int,
                  engine_shape: tuple[int, int] = (8, 24)) -> dict:
    """The four timings at one batch size (module docstring)."""
    import torch

    from rdepth.exits.registry import make_policy
    from rdepth.looped.exits import decode_with_exits
    from rdepth.looped.protocol import forward

    model = adapter.model
    generator = torch.Generator(device="cpu").manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, length + 1), generator=generator).to(device)
    prompt, token = ids[:, :-1], ids[:, -1:]
    result: dict = {"batch": batch, "tokens": length}
    with torch.no_grad():
        own = timed(lambda: model(prompt, use_cache=False), device, warmup, repeats)
        ours = timed(lambda: forward(adapter, prompt), device, warmup, repeats)
        result["prefill"] = {"class": own, "adapter": ours, "adapter_over_class": ours["median_ms"] / own["median_ms"]}
        cache = adapter.new_cache()
        forward(adapter, prompt, cache)

        def crop() -> None:  # every cache layer back to the prompt's length (each step writes its own layers)
            for layer in cache.layers:
                extra = layer.get_seq_length() - length if layer.is_initialized else 0
                if extra > 0:
                    layer.crop(-extra)

        own = timed(lambda: model(token, cache=cache, use_cache=True), device, warmup, repeats, crop)
        ours = timed(lambda: forward(adapter, token, cache), device, warmup, repeats, crop)
        result["decode"] = {"class": own, "adapter": ours, "adapter_over_class": ours["median_ms"] / own["median_ms"]}
        ctx = adapter.embed(token, cache)
        carry = adapter.enter(ctx, "L", adapter.enter(ctx, "H", None))
        result["step"] = {"L": timed(lambda: adapter.step(ctx, "L", (0, 0), carry), device, warmup, repeats, crop),
                          "H": timed(lambda: adapter.step(ctx, "H", (0,), carry), device, warmup, repeats, crop)}
        rule = make_policy("step_norm_rel", tau=0.1, k_max=adapter.spec("L").budget)
        full = timed(lambda: decode_with_exits(adapter, token, cache=cache), device, warmup, repeats, crop)
        exits = timed(lambda: decode_with_exits(adapter, token, low=rule, cache=cache), device, warmup, repeats, crop)
        result["exit_decode"] = {"full_budget": full, "step_norm_rel_0.1_on_L": exits,
                                 "exit_decode_over_adapter_decode": full["median_ms"] / ours["median_ms"]}
    result["engine"] = measure_engine(adapter, batch, device, warmup, repeats, engine_shape)
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def line(result: dict) -> str:
    prefill, decode, step = result["prefill"], result["decode"], result["step"]
    exits = result["exit_decode"]
    return (f"batch {result['batch']}: prefill {result['tokens']} tokens class {prefill['class']['median_ms']:.1f} ms, "
            f"adapter {prefill['adapter']['median_ms']:.1f} ms ({prefill['adapter_over_class']:.3f}x); decode one token "
            f"class {decode['class']['median_ms']:.2f} ms, adapter {decode['adapter']['median_ms']:.2f} ms "
            f"({decode['adapter_over_class']:.3f}x); one L step {step['L']['median_ms']:.2f} ms, one H step "
            f"{step['H']['median_ms']:.2f} ms; exit decode full {exits['full_budget']['median_ms']:.2f} ms, under "
            f"step_norm_rel {exits['step_norm_rel_0.1_on_L']['median_ms']:.2f} ms"
            + f"; engine {result['engine']['engine_tokens_per_s']:.0f} tokens/s against lock-step "
            f"{result['engine']['lockstep_tokens_per_s']:.0f} ({result['engine']['engine_over_lockstep']:.2f}x, "
            f"{result['engine']['requests_agreeing']} of {result['batch']} requests' tokens agree)"
            + (f"; peak {result['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in result else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for hrm_text_scale.json")
    parser.add_argument("--size", choices=("1b", "tiny"), default="1b")
    parser.add_argument("--batches", default="1,32", help="batch sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=256, help="prompt tokens (the prefill, and the decode's cache)")
    parser.add_argument("--engine-prompt", type=int, default=8, help="the engine timing's prompt tokens a request")
    parser.add_argument("--engine-new", type=int, default=24, help="the engine timing's new tokens a request")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop before a batch size that would start past it")
    parser.add_argument("--revision", default=None, help="the code's revision, recorded with the numbers")
    args = parser.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if args.size == "1b" and not cuda:
        print("hrm_text_scale: skipped, no CUDA device (the 1B size runs on a card; --size tiny checks the script)")
        return 0
    import transformers

    from bench.gpu.common import environment
    from rdepth.looped.hrm_text import HrmTextAdapter

    started = time.perf_counter()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.HrmTextForCausalLM(hrm_config(args.size))
    model = model.to(torch.bfloat16 if cuda else torch.float32).eval()
    adapter = HrmTextAdapter(model)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"HRM-Text {args.size}: {parameters:,} parameters, H {model.config.H_cycles} x L {model.config.L_cycles}, "
          f"{model.config.num_layers_per_stack} layers per stack, on {device} in {next(model.parameters()).dtype} "
          f"(built in {time.perf_counter() - started:.0f} s)")
    report = {"size": args.size, "parameters": parameters, "config": model.config.to_dict(),
              "dtype": str(next(model.parameters()).dtype), "environment": environment(args, device), "batches": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for batch in (int(b) for b in args.batches.split(",")):
        if time.perf_counter() - started > args.budget_s:
            print(f"batch {batch}: skipped, past the {args.budget_s:g} s budget")
            continue
        result = measure_batch(adapter, batch, args.tokens, device, args.warmup, args.repeats,
                               (args.engine_prompt, args.engine_new))
        report["batches"].append(result)
        print(line(result), flush=True)
        (out / "hrm_text_scale.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/gpu/hrm_text_scale.py", main))
