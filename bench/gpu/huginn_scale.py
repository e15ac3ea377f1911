"""Huginn-0125 at its real size on a card, through the commands a user runs (issue 42, docs/ecosystem.md).

The hub is out of reach, so the weights are random; everything else is Huginn-0125's: its published
``config.json`` (:data:`rdepth.interop.hf_raven.HUGINN_0125`: prelude 2, core 4 at a mean of 32
recurrences, coda 2, d 5,280, 3,564,976,800 parameters), written as the hub ships it (sharded
safetensors with an index, a ``tokenizer.json``), then ``rdepth import-hf`` and the commands of
docs/ecosystem.md's GPU recipe, each timed (wall seconds, the process's peak host memory) while
``nvidia-smi`` samples the card's used memory. Beside each: what rdepth's own checks predict
(``check_fits_memory``: float32 weights; ``estimate_step_bytes``: a training step).

    python3 bench/gpu/huginn_scale.py prepare --out runs/huginn-carry     # here, on the CPU: text + tokenizer
    python3 bench/gpu/huginn_scale.py run --carry runs/huginn-carry --work /tmp/huginn --out OUT [--size tiny]

``--size tiny`` runs the same steps on a small raven config (a CPU check of the script itself).
Random weights give meaningless text and losses: the figures are time and memory, nothing else.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

STEPS_HELP = "import,eval,generate,analyze,sweep"


def prepare(out: Path, tokens: int, vocab: int) -> None:
    """heldout.txt (the wiki corpus's validation split, decoded from its GPT-2 tokens) and a byte-level
    BPE ``tokenizer.json`` trained on it, filled with reserved tokens to ``vocab`` (Huginn's own
    tokenizer is on the hub)."""
    import numpy as np

    from rdepth.data.tokenizers import load_tokenizer, train_bpe

    source = Path("shared/data/wiki-gpt2")
    ids = np.fromfile(source / "val.bin", dtype=np.uint16)[:tokens]
    text = load_tokenizer(source).decode(ids.tolist())
    out.mkdir(parents=True, exist_ok=True)
    (out / "heldout.txt").write_text(text)
    bpe = train_bpe([text[i:i + 10_000] for i in range(0, len(text), 10_000)], vocab, name=f"bpe:{vocab}")
    # the text is too short for 65,536 merges: reserved tokens fill the vocabulary to Huginn's size
    bpe._tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab - bpe.vocab_size)])
    bpe.save(out)
    print(f"{out}: heldout.txt {len(text):,} chars, tokenizer.json {bpe.vocab_size} tokens")


def huginn_config(size: str) -> dict:
    """Huginn-0125's published config.json (``n_heads`` and ``rope_base`` spelt out: the weight writer reads
    them), or the same layout at a tiny width."""
    from rdepth.interop.hf_raven import DEFAULTS, HUGINN_0125

    hf = {**HUGINN_0125, "n_heads": HUGINN_0125["num_attention_heads"], "rope_base": DEFAULTS["rope_base"]}
    if size == "tiny":
        hf.update(n_embd=64, num_attention_heads=4, num_key_value_heads=4, n_heads=4, intermediate_size=160,
                  block_size=512)
    return hf


def write_folder(folder: Path, hf: dict, tokenizer_json: str, shards: int = 4) -> float:
    """Random weights in Huginn's layout (drawn on the card when there is one), in the config's
    ``torch_dtype``, as sharded safetensors with an index; returns the seconds it took."""
    import torch
    from safetensors.torch import save_file

    from rdepth.interop.hf_raven import raven_weight_shapes
    from rdepth.model.layers import Rotary

    start = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, hf.get("torch_dtype", "float32"))  # as the hub ships them: bfloat16 for Huginn-0125
    shapes = list(raven_weight_shapes(hf).items())
    per_shard = -(-len(shapes) // shards)
    weight_map = {}
    for shard in range(shards):
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for key, shape in shapes[shard * per_shard:(shard + 1) * per_shard]:
            noise = torch.randn(shape, generator=generator, device=device)
            if len(shape) == 1:
                value = 1.0 + 0.2 * noise
            elif key.endswith("qk_bias"):
                value = 0.2 * noise
            else:
                value = noise / shape[-1] ** 0.5
            tensors[key] = value.to(dtype).cpu()
            weight_map[key] = name
        if shard == shards - 1:
            head_dim = hf["n_embd"] // hf["n_heads"]
            table = Rotary(head_dim, hf["rope_base"], hf["block_size"]).table(torch.device("cpu"))
            tensors["freqs_cis"] = table.view(1, hf["block_size"], 1, head_dim // 2, 2).float().contiguous()
            weight_map["freqs_cis"] = name
        save_file(tensors, str(folder / name))
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (folder / "tokenizer.json").write_text(tokenizer_json)
    return time.perf_counter() - start


class CardMemory:
    """Peak used memory of GPU 0 (MiB) while a command runs, from ``nvidia-smi`` every 0.2 s."""

    def __init__(self):
        self.peak, self._stop, self._thread = 0, threading.Event(), None

    def _sample(self):
        while not self._stop.is_set():
            try:
                text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                       "-i", "0"], capture_output=True, text=True, timeout=5).stdout
                self.peak = max(self.peak, int(text.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                return
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_command(name: str, argv: list[str], log: Path, timeout: float) -> dict:
    """One rdepth command: rc, wall seconds, peak host RSS (GiB), peak card memory (GiB), the log's tail."""
    start = time.perf_counter()
    with CardMemory() as card, open(log, "w") as handle:
        try:
            rc = subprocess.run([sys.executable, "-m", "rdepth", *argv], stdout=handle, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB; the largest child so far
    tail = log.read_text().strip().splitlines()[-6:]
    row = {"step": name, "rc": rc, "wall_s": round(wall, 1), "peak_host_gib_so_far": round(rss, 2),
           "peak_card_gib": round(card.peak / 1024, 2), "argv": argv, "tail": tail}
    print(f"== {name}: rc {rc}, {wall:.1f} s, card peak {card.peak / 1024:.2f} GiB, host peak so far {rss:.2f} GiB",
          flush=True)
    for line in tail:
        print("   " + line[:200], flush=True)
    return row


def run_plan(plan: dict[str, list[str]], steps: list[str], result: dict, report: Path, deadline: float) -> None:
    """Run ``steps`` of ``plan`` (name -> rdepth argv) in order, each under what is left until ``deadline``
    (perf_counter seconds; a step with under 20 s left is skipped), each row appended to ``result["rows"]`` and
    ``report`` rewritten after each; nothing after a failed import."""
    out = report.parent
    for name in steps:
        left = deadline - time.perf_counter()
        if left < 20:
            print(f"== {name} skipped: {left:.0f} s left", flush=True)
            continue
        row = run_command(name, plan[name], out / f"{name}.log", timeout=left)
        result["rows"].append(row)
        report.write_text(json.dumps(result, indent=2) + "\n")
        if name == "import" and row["rc"] != 0:
            break


def predictions(hf: dict) -> dict:
    from rdepth.config import ModelConfig
    from rdepth.interop.hf_raven import raven_model_config
    from rdepth.train.memory import estimate_step_bytes

    config = ModelConfig.from_dict({**raven_model_config(Path("huginn"), hf), "tokenizer": "bpe:65536"})
    gib = 2**30
    return {"weights": config.weight_count, "float32_weights_gib": round(4 * config.weight_count / gib, 2),
            "train_4_copies_gib": round(16 * config.weight_count / gib, 2),
            "train_step_estimate_gib_rows1": round(estimate_step_bytes(config, 1) / gib, 1)}


def run(carry: Path, work: Path, out: Path, size: str, steps: list[str], budget: float) -> None:
    import torch

    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    hf = huginn_config(size)
    folder, ckpt, text = work / "huginn", work / "run", str(carry / "heldout.txt")
    result = {"size": size, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "predicted": predictions(hf), "rows": []}
    print(f"== predicted: {result['predicted']}", flush=True)
    seconds = write_folder(folder, hf, (carry / "tokenizer.json").read_text())
    result["write_folder_s"] = round(seconds, 1)
    print(f"== wrote {folder} in {seconds:.1f} s", flush=True)
    plan = {
        "import": ["import-hf", "--hf", str(folder), "--out", str(ckpt)],
        "eval": ["eval", "--checkpoint", str(ckpt), "--data", text, "--loops", "4", "--loops", "32",
                 "--batch-size", "1", "--max-batches", "1", "--no-progress", "--json", str(out / "eval.json")],
        "generate": ["generate", "--checkpoint", str(ckpt), "--prompt", "The capital of France is", "--samples", "4",
                     "--max-new-tokens", "32", "--temperature", "0", "--exit", "kl", "--tau", "5e-4",
                     "--k-max", "64", "--autocast", "bf16"],
        "analyze": ["analyze", "--checkpoints", str(ckpt), "--data", text, "--out", str(work / "analyze"),
                    "--sequences", "2", "--seq-len", "256", "--batch-size", "1", "--long-loops", "64",
                    "--precision", "float32", "--no-rank", "--no-progress"],
        "sweep": ["sweep", "--checkpoint", str(ckpt), "--data", text, "--out", str(work / "sweep"),
                  "--policies", "kl,entropy_diff,argmax_stable", "--k-max", "32", "--block-size", "256",
                  "--batch-size", "2", "--max-batches", "1", "--autocast", "bf16", "--no-timing"],
    }
    run_plan(plan, steps, result, out / "huginn_scale.json", start + budget)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=400_000)
    p.add_argument("--vocab", type=int, default=65_536)
    r = sub.add_parser("run")
    r.add_argument("--carry", type=Path, required=True)
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--size", choices=["huginn", "tiny"], default="huginn")
    r.add_argument("--steps", default=STEPS_HELP)
    r.add_argument("--budget-s", type=float, default=300)
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.out, args.tokens, args.vocab)
    else:
        run(args.carry, args.work, args.out, args.size, args.steps.split(","), args.budget_s)


if __name__ == "__main__":
    main()
