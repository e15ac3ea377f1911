"""Ouro-1.4B at its real size on a card, through the commands a user runs (issue 53, docs/ecosystem.md).

The hub is out of reach, so the weights are random; everything else is Ouro-1.4B's: its published
``config.json`` (:data:`rdepth.interop.hf_ouro.OURO_1_4B`: 24 layers looped 4 times, d 2,048, 16 heads,
SwiGLU 5,632, an untied head and the exit gate; 1,434,652,673 parameters), written as the hub ships it
(bfloat16 safetensors in two shards with an index, a ``tokenizer.json``), then ``rdepth import-hf`` and
``sweep`` (the loss at 1-4 steps and Ouro's gate, on 1,024-token windows: ``eval`` reads windows of the
block size, 65,536 here), ``generate`` (fixed budget, and Ouro's gate) and the continuous depth
batching engine (``generate --prompts-file``, with the gate), each timed (wall seconds, the process's peak
host memory) while ``nvidia-smi`` samples the card's used memory (:mod:`bench.gpu.huginn_scale`'s helpers).

    PYTHONPATH=. python3 bench/gpu/ouro_scale.py prepare --source /work/main/data/medium-gpt2 --out runs/ouro-carry
    PYTHONPATH=. python3 bench/gpu/ouro_scale.py run --carry runs/ouro-carry --work /tmp/ouro --out OUT [--size tiny]

``prepare`` (here, on the CPU): ``heldout.txt``, the first 400,000 tokens of a prepared data folder's
validation split decoded, and a byte-level BPE ``tokenizer.json`` trained on it and filled with reserved
tokens to Ouro's 49,152 (its SmolLM2 tokenizer is on the hub).

``--size tiny`` runs the same steps on a small Ouro config (a CPU check of the script itself).
Random weights give meaningless text and losses: the figures are time and memory, nothing else.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.gpu.huginn_scale import run_plan

STEPS = "import,sweep,generate,generate_gate,engine"


def prepare(source: Path, out: Path, tokens: int, vocab: int) -> None:
    import numpy as np

    from rdepth.data.shards import TokenShards
    from rdepth.data.tokenizers import load_tokenizer, train_bpe

    ids = np.asarray(TokenShards.open(source).val)[:tokens]
    text = load_tokenizer(source).decode(ids.tolist())
    out.mkdir(parents=True, exist_ok=True)
    (out / "heldout.txt").write_text(text)
    bpe = train_bpe([text[i:i + 10_000] for i in range(0, len(text), 10_000)], 8192, name=f"bpe:{vocab}")
    bpe._tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab - bpe.vocab_size)])
    bpe.save(out)
    print(f"{out}: heldout.txt {len(text):,} chars, tokenizer.json {load_tokenizer(out).vocab_size} tokens")


def ouro_config(size: str) -> dict:
    from rdepth.interop.hf_ouro import OURO_1_4B

    hf = dict(OURO_1_4B)
    if size == "tiny":
        hf.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16, intermediate_size=160,
                  num_hidden_layers=2, max_position_embeddings=512)
    return hf


def run(carry: Path, work: Path, out: Path, size: str, steps: list[str], budget: float) -> None:
    import torch

    from rdepth.interop.hf_ouro import write_ouro_folder

    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    hf = ouro_config(size)
    folder, ckpt, text = work / "ouro", work / "run", str(carry / "heldout.txt")
    result = {"size": size, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "rows": []}
    fields = {k: v for k, v in hf.items() if k not in ("model_type", "architectures", "torch_dtype")}
    write_ouro_folder(folder, seed=0, tokenizer_json=(carry / "tokenizer.json").read_text(), shards=2,
                      dtype=torch.bfloat16, **fields)
    result["write_folder_s"] = round(time.perf_counter() - start, 1)
    print(f"== wrote {folder} in {result['write_folder_s']} s", flush=True)
    prompts = work / "prompts.txt"
    prompts.write_text("".join(f"Question {i}: what comes after {i}?\n" for i in range(64)))
    gate = ["--exit", "ouro", "--tau", "0.5", "--k-max", "4"]
    plan = {
        "import": ["import-hf", "--hf", str(folder), "--out", str(ckpt)],
        "sweep": ["sweep", "--checkpoint", str(ckpt), "--data", text, "--out", str(work / "sweep"),
                  "--policies", "ouro", "--taus", "0.1,0.5,0.9", "--k-max", "4", "--block-size", "1024",
                  "--batch-size", "1", "--max-batches", "2", "--autocast", "bf16", "--no-timing", "--no-progress"],
        "generate": ["generate", "--checkpoint", str(ckpt), "--prompt", "The capital of France is", "--samples", "4",
                     "--max-new-tokens", "32", "--temperature", "0", "--autocast", "bf16"],
        "generate_gate": ["generate", "--checkpoint", str(ckpt), "--prompt", "The capital of France is",
                          "--samples", "4", "--max-new-tokens", "32", "--temperature", "0", "--autocast", "bf16", *gate],
        "engine": ["generate", "--checkpoint", str(ckpt), "--prompts-file", str(prompts), "--batch-size", "32",
                   "--max-new-tokens", "32", "--temperature", "0", "--autocast", "bf16", *gate],
    }
    run_plan(plan, steps, result, out / "ouro_scale.json", start + budget)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--source", type=Path, required=True, help="a prepared rdepth data folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=400_000)
    p.add_argument("--vocab", type=int, default=49_152)
    r = sub.add_parser("run")
    r.add_argument("--carry", type=Path, required=True)
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--size", choices=["ouro", "tiny"], default="ouro")
    r.add_argument("--steps", default=STEPS)
    r.add_argument("--budget-s", type=float, default=300)
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.source, args.out, args.tokens, args.vocab)
    else:
        run(args.carry, args.work, args.out, args.size, args.steps.split(","), args.budget_s)


if __name__ == "__main__":
    main()
