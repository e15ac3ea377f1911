"""Loop speculation at size on random weights with a constructed agreement rate (issue 64's prepared GPU call).

The hub is out of reach and no large looped model is trained here, so the weights are random and the agreement
between a D-step draft and the verifying budget is constructed: ``--state-scale S`` multiplies the state half of
every group's adapter (``s_k = layers(S W_s s_(k-1) + W_e e)``), so S = 0 makes every loop step after the first
the same function of the input (a 1-step draft equals the full budget: every draft kept) and S = 1 leaves the random
model as drawn (drafts kept at whatever rate it gives). The shapes: a preset's (``paper``: 12 layers, d 768, three
groups; ``tiny`` for a check on the CPU) or ``huginn`` (Huginn-0125's sizes in rdepth's own layout: a 2-layer
prelude, a 4-layer looped core, a 2-layer coda, d 5,280, 55 heads, a 65,536-word vocabulary; ``huginn-tiny``: that
layout at d 128 and 4,096 words, for the CPU).

At batch 1, ``--prompts`` random prompts of ``--prompt-tokens`` tokens, each generating ``--new-tokens`` greedy tokens
at the verifying budget (``--loops`` per group; default the config's eval loops): plain decoding
(:func:`rdepth.model.generation.generate`) and loop speculation (:func:`rdepth.model.loop_speculation.
speculative_decode`) at every draft budget D (``--draft-loops``) and length K (``--tokens``), interleaved rounds
(``bench/loop_speculation.py``'s timing), CUDA synchronised around each call. Reported per setting: the acceptance,
the mean accepted length, the median tokens/s and its ratio to plain decoding, and the share of generated tokens
equal to plain decoding's (1.0 in exact arithmetic; bf16 kernels over K positions may round a random model's
near-tied logits otherwise).

    PYTHONPATH=. python3 bench/gpu/speculation_scale.py --shape paper --state-scale 0.2 --device cuda \\
        --dtype bfloat16 [--draft-loops 1,2] [--tokens 4,8] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HUGINN = dict(n_layer=8, n_head=55, d_model=5280, block_size=4096, vocab_size=65536, groups="2-5", mean_loops=32.0,
              backprop_depth=8, tokenizer="gpt2")
HUGINN_TINY = dict(HUGINN, n_head=4, d_model=128, block_size=512, vocab_size=4096, tokenizer="bpe:4096")
SHAPES = ("paper", "tiny", "small", "huginn", "huginn-tiny")
DTYPES = ("float32", "bfloat16", "float64")


def parse(argv):
    from loop_speculation import int_list

    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/gpu/speculation_scale.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="paper", choices=SHAPES)
    parser.add_argument("--state-scale", type=float, default=0.2, help="S: the adapters' state half times S (0..1)")
    parser.add_argument("--loops", type=int, default=None, help="the verifying budget per group (default: eval loops)")
    parser.add_argument("--draft-loops", type=int_list, default=[1, 2])
    parser.add_argument("--tokens", type=int_list, default=[4, 8])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not 0.0 <= args.state_scale <= 1.0:
        parser.error(f"--state-scale must be in [0, 1], got {args.state_scale}")
    for name in ("prompts", "prompt_tokens", "new_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.loops is not None and args.loops < 2:
        parser.error(f"--loops must be >= 2 (a draft needs fewer), got {args.loops}")
    return args


def build(args):
    """The random model of ``--shape`` with its adapters' state half scaled, on the device in the dtype."""
    import torch

    from rdepth.config import PRESETS, ModelConfig
    from rdepth.model import RecurrentLM

    fields = dict({"huginn": HUGINN, "huginn-tiny": HUGINN_TINY}.get(args.shape) or PRESETS[args.shape])
    if args.loops is not None:
        fields["eval_loops"] = args.loops
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = RecurrentLM(ModelConfig.from_dict(fields))
    model = model.to(getattr(torch, args.dtype)).eval().requires_grad_(False)
    width = model.config.d_model
    with torch.no_grad():
        for adapter in model.adapters:
            adapter.weight[:, :width] *= args.state_scale
    return model


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    from loop_speculation import table_rows, timed

    from rdepth.errors import RdepthError
    from rdepth.model.generation import generate
    from rdepth.model.loop_speculation import SpeculativeStats, speculative_decode
    from rdepth.model.noise import StateNoise
    from rdepth.run.device import device_name

    if args.device == "cuda" and not torch.cuda.is_available():
        raise RdepthError("speculation_scale: --device cuda, but torch sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args)
    loops = tuple(model.config.default_eval_loops)
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens), generator=generator).to(args.device)
               for _ in range(args.prompts)]
    synchronize = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def call(setting, number):
        noise = StateNoise(args.seed, [number])
        if setting[0] == "plain":
            out = generate(model, prompts[number], args.new_tokens, noise=noise, loop_counts=loops)
        else:
            out = speculative_decode(model, prompts[number], args.new_tokens, tokens=setting[2],
                                     draft_loops=setting[1], noise=noise, loop_counts=loops)
        synchronize()
        return out

    settings = [("plain", None, None)] + [("speculative", d, k) for d in args.draft_loops for k in args.tokens]
    stats = {setting: SpeculativeStats() for setting in settings[1:]}
    equal = {setting: [0, 0] for setting in settings[1:]}
    for number in range(args.prompts):  # the warm-up, the agreement with plain decoding and the acceptance
        reference = call(settings[0], number)[0, args.prompt_tokens:]
        for setting in settings[1:]:
            out, counted = call(setting, number)
            equal[setting][0] += int((out[0, args.prompt_tokens:] == reference).sum())
            equal[setting][1] += reference.numel()
            stats[setting].add(counted)
    start = time.perf_counter()
    rates = timed(args, settings, args.prompts, call)
    rows = table_rows(settings, rates, stats)
    for row, setting in zip(rows[1:], settings[1:], strict=True):
        row["equal_to_plain"] = equal[setting][0] / max(equal[setting][1], 1)
    result = {"device": device_name(torch.device(args.device)), "torch": torch.__version__, "shape": args.shape,
              "parameters": sum(p.numel() for p in model.parameters()), "dtype": args.dtype, "loops": list(loops),
              "state_scale": args.state_scale, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
              "prompts": args.prompts, "rounds": args.rounds, "timed_s": time.perf_counter() - start, "rows": rows}
    print(f"{result['device']}, torch {result['torch']}, {args.shape} ({result['parameters'] / 1e6:.0f}M parameters, "
          f"{args.dtype}), verifying at {list(loops)}, state scale {args.state_scale:g}; {args.new_tokens} new tokens "
          f"after {args.prompt_tokens}-token prompts, {args.prompts} prompts x {args.rounds} rounds")
    print("| D | K | acceptance | mean accepted | tokens/s | vs plain | equal to plain |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if row["draft_loops"] is None:
            print(f"| plain | | - | - | {row['tokens_per_s']:.1f} | 1.00x | - |")
            continue
        print(f"| {row['draft_loops']} | {row['tokens']} | {row['acceptance']:.2f} | {row['mean_accepted']:.2f} | "
              f"{row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | {row['equal_to_plain']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/gpu/speculation_scale.py", main))
