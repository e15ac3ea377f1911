"""Import an Ouro folder at Ouro-1.4B's published size on the CPU: peak host memory and time.

``write``: random weights in the hub layout at :data:`~rdepth.interop.hf_ouro.OURO_1_4B` (bfloat16 as the
hub's, two shards and an index; no tokenizer: the real one is SmolLM2's 49,152-token BPE, which this
folder does not have). ``import``: in a fresh process, what ``rdepth import-hf`` does with the weights
(:func:`~rdepth.interop.hf_ouro.ouro_model`: read the shards, map them, the model on the meta device filled
with them) and the float32 checkpoint written (``save_checkpoint``), the time of each and the process's
peak resident memory (``ru_maxrss``); then the logits of 8 tokens at 1 and 4 steps, finite::

    python3 scripts/ouro_import_size.py write --out /tmp/ouro14
    python3 scripts/ouro_import_size.py import --folder /tmp/ouro14 --out /tmp/ouro14_run
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch


def write(args) -> None:
    from rdepth.interop.hf_ouro import OURO_1_4B, write_ouro_folder

    start = time.perf_counter()
    fields = {k: v for k, v in OURO_1_4B.items() if k not in ("model_type", "architectures", "torch_dtype")}
    write_ouro_folder(args.out, seed=0, shards=2, dtype=torch.bfloat16, **fields)
    size = sum(p.stat().st_size for p in Path(args.out).glob("*.safetensors"))
    print(json.dumps({"wrote": str(args.out), "bytes": size, "seconds": round(time.perf_counter() - start, 1)}))


def load(args) -> None:
    from rdepth.interop.hf_ouro import ouro_model
    from rdepth.run.checkpoint import save_checkpoint

    start = time.perf_counter()
    model = ouro_model(args.folder)
    loaded = time.perf_counter()
    peak_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    save_checkpoint(Path(args.out), 0, model, model.config)
    saved = time.perf_counter()
    ids = torch.arange(8)[None] * 997 % model.config.vocab_size
    with torch.no_grad():
        finite = all(bool(torch.isfinite(model(ids, loop_counts=k).logits).all()) for k in (1, 4))
    print(json.dumps({"parameters": model.num_parameters(), "load_s": round(loaded - start, 1),
                      "save_s": round(saved - loaded, 1), "logits_finite": finite,
                      "peak_rss_after_load_gib": round(peak_loaded, 2),
                      "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    steps = parser.add_subparsers(dest="step", required=True)
    step = steps.add_parser("write")
    step.add_argument("--out", required=True)
    step = steps.add_parser("import")
    step.add_argument("--folder", required=True)
    step.add_argument("--out", required=True)
    args = parser.parse_args()
    write(args) if args.step == "write" else load(args)


if __name__ == "__main__":
    main()
