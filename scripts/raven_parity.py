"""Parity of rdepth's raven import against the reference implementation, run outside the project.

The reference (``recpre/raven_modeling_minimal.py`` and ``raven_config_minimal.py`` of
seal-rg/recurrent-pretraining) never enters the repository: ``--reference DIR`` names a folder
outside it holding those two files, and the steps that import them run in a Python where they run
(transformers 4.57.6). The other steps run with rdepth. One command per step::

    REF=/tmp/raven_src; VENV=/path/to/tf4.57/bin/python; W=/tmp/raven_parity
    $VENV   scripts/raven_parity.py build   --reference $REF --variant A --seed 0 --out $W/A
    python3 scripts/raven_parity.py cases   --folder $W/A --run $W/run_A --out $W/cases_A.pt
    $VENV   scripts/raven_parity.py logits  --reference $REF --folder $W/A --cases $W/cases_A.pt --impl released --out $W/ref_A_released.pt
    $VENV   scripts/raven_parity.py logits  --reference $REF --folder $W/A --cases $W/cases_A.pt --impl widened --out $W/ref_A_widened.pt
    python3 scripts/raven_parity.py compare --cases $W/cases_A.pt --logits $W/ref_A_released.pt

``build``: a tiny random ``RavenForCausalLM`` (the reference's own init, then norm gains and the
query/key bias moved off 1 and 0 so they matter), ``save_pretrained``. ``cases``: a 320-token
``tokenizer.json`` added, ``rdepth import-hf`` into ``--run``, token ids ``[2, 24]``, rdepth's initial
loop state (``StateNoise``) and rdepth's logits at 1, 4 and 32 recurrences in float32 and float64.
``logits``: the reference's ``forward(ids, input_states=state, num_steps=n)`` for every case, the same
initial state on both sides; ``--impl released`` is the file as it is (its RMSNorm, rotary and logits
compute in float32 whatever the model's dtype), ``widened`` the same file with those three casts made
``torch.promote_types(dtype, float32)``, so that a float64 model stays float64. ``compare``: the max
abs difference per case. ``cases --writer-seed N`` writes the folder with rdepth's own
:func:`~rdepth.interop.hf_raven.write_raven_folder` instead (the golden files: ``golden`` stores them).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

VARIANTS = {
    "A": dict(n_embd=64, n_heads=4, intermediate_size=160, n_layers_in_prelude=2, n_layers_in_recurrent_block=2,
              n_layers_in_coda=2, block_size=64, vocab_size=320, mean_recurrence=8, mean_backprop_depth=4,
              qk_bias=True, rope_base=50_000),
    "B": dict(n_embd=48, n_heads=3, intermediate_size=80, n_layers_in_prelude=1, n_layers_in_recurrent_block=3,
              n_layers_in_coda=1, block_size=64, vocab_size=320, mean_recurrence=6, mean_backprop_depth=2,
              qk_bias=False, rope_base=10_000),
    # Huginn's 2 + 4 layout (the reference's latest-m4 cache lookup is written for it), for the exits check
    "C": dict(n_embd=48, n_heads=4, intermediate_size=96, n_layers_in_prelude=2, n_layers_in_recurrent_block=4,
              n_layers_in_coda=2, block_size=64, vocab_size=320, mean_recurrence=8, mean_backprop_depth=4,
              qk_bias=True, rope_base=50_000),
}
EXIT_TAUS = (0.05, 0.1, 0.2, 0.3)  # latent_diff thresholds of the exits check (exits spread over the steps)
EXIT_TOKENS, EXIT_CAP = 24, 16
# The exits golden (tests/golden/raven_exits.json): rdepth's writer, Huginn's 2 + 4 layout, tiny
EXITS_GOLDEN = dict(seed=43, noise_seed=3, tokens=12, taus=(0.1, 0.3), overrides=dict(
    n_embd=16, n_heads=2, intermediate_size=24, n_layers_in_prelude=2, n_layers_in_recurrent_block=4,
    n_layers_in_coda=1, block_size=16, vocab_size=32, mean_recurrence=4, mean_backprop_depth=2, rope_base=50_000.0,
    qk_bias=True))
# The golden checkpoint's writer settings (tests/golden/raven_tiny.json records them too)
GOLDEN = dict(seed=42, noise_seed=5, overrides=dict(
    n_embd=16, n_heads=2, intermediate_size=24, n_layers_in_prelude=1, n_layers_in_recurrent_block=2,
    n_layers_in_coda=1, block_size=16, vocab_size=32, mean_recurrence=4, mean_backprop_depth=2, rope_base=50_000.0,
    qk_bias=True))
STEPS = (1, 4, 32)
# What the golden logits were computed with (recorded in tests/golden/raven_tiny.json)
REFERENCE_NOTE = {
    "code": "github.com/seal-rg/recurrent-pretraining @ 59e0b69b2d96a59cbbe79c9d5034d89ecb5ab6f6, "
            "recpre/raven_modeling_minimal.py + raven_config_minimal.py",
    "versions": "transformers 4.57.6, torch 2.13.0+cpu, CPU",
    "call": "RavenForCausalLM.from_pretrained(folder).to(dtype)(tokens, input_states=state, num_steps=steps).logits",
    "float32": "the file as released",
    "float64": "the file with its three casts to float32 (RMSNorm, rotary, logits) made "
               "torch.promote_types(dtype, float32), so that float64 stays float64",
}
# The reference's casts to float32, and what "widened" makes of them
WIDEN = (
    ("return self._norm(x.float()).type_as(x) * self.weight",
     "return self._norm(x.to(torch.promote_types(x.dtype, torch.float32))).type_as(x) * self.weight"),
    ("qk_r2 = torch.cat([q, k], dim=2).unflatten(dim=-1, sizes=(-1, 2)).float()",
     "qk_r2 = torch.cat([q, k], dim=2).unflatten(dim=-1, sizes=(-1, 2)).to(torch.promote_types(q.dtype, torch.float32))"),
    ("logits = self.lm_head(x).float()", "logits = self.lm_head(x).to(torch.promote_types(x.dtype, torch.float32))"),
)


def reference_classes(source: Path, impl: str):
    """(RavenConfig, RavenForCausalLM) from the two files in ``source``, as a package in a temporary folder."""
    package = Path(tempfile.mkdtemp()) / "raven"
    package.mkdir()
    (package / "__init__.py").write_text("")
    shutil.copy(source / "raven_config_minimal.py", package)
    text = (source / "raven_modeling_minimal.py").read_text()
    if impl == "widened":
        for old, new in WIDEN:
            if old not in text:
                raise SystemExit(f"the reference no longer has {old!r}")
            text = text.replace(old, new)
    (package / "raven_modeling_minimal.py").write_text(text)
    sys.path.insert(0, str(package.parent))
    config = importlib.import_module("raven.raven_config_minimal")
    modeling = importlib.import_module("raven.raven_modeling_minimal")
    return config.RavenConfig, modeling.RavenForCausalLM


def build(args) -> None:
    config_class, model_class = reference_classes(args.reference, "released")
    torch.manual_seed(args.seed)
    model = model_class(config_class(**VARIANTS[args.variant])).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(0.2 * torch.randn_like(param))
            elif name.endswith("qk_bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(args.out)
    print(f"saved {args.out}: {sum(p.numel() for p in model.parameters()):,} parameters")


def cases(args) -> None:
    from rdepth.data.tokenizers import train_bpe
    from rdepth.interop.hf_raven import raven_model, write_raven_folder
    from rdepth.model.noise import StateNoise
    from rdepth.run.checkpoint import load_model

    folder = Path(args.folder)
    if args.writer_seed is not None:  # the golden checkpoint: rdepth's writer, no tokenizer needed
        write_raven_folder(folder, args.writer_seed, **GOLDEN["overrides"])
        model, length, noise_seed, idx_seed = raven_model(folder), 6, GOLDEN["noise_seed"], GOLDEN["noise_seed"]
    else:
        text = [" ".join(f"w{(i * 7 + j * 13) % 97}x{j % 5}" for j in range(12)) for i in range(400)]
        tokenizer = train_bpe(text, 320, name="bpe:320")
        tokenizer.save(folder.parent / (folder.name + "_bpe"))
        shutil.copy(folder.parent / (folder.name + "_bpe") / "tokenizer.json", folder / "tokenizer.json")
        shutil.rmtree(args.run, ignore_errors=True)
        command = [sys.executable, "-m", "rdepth", "import-hf", "--hf", str(folder), "--out", str(args.run)]
        print(" ".join(command))
        subprocess.run(command, check=True)
        model, length, noise_seed, idx_seed = load_model(args.run)[0], 24, 7, 11
    vocab, width = model.config.vocab_size, model.config.d_model
    idx = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(idx_seed))
    noise = StateNoise(noise_seed, [0, 1])
    state = model.init_state(0, torch.zeros(2, length, width), noise)  # float32 [B, T, d]
    out = []
    for dtype in (torch.float32, torch.float64):
        typed = model.to(dtype)
        for steps in STEPS:
            with torch.no_grad():
                logits = typed(idx, loop_counts=steps, noise=noise).logits
            out.append(dict(idx=idx, state=state, steps=steps, dtype=dtype, rdepth=logits))
    torch.save(out, args.out)


def logits(args) -> None:
    _, model_class = reference_classes(args.reference, args.impl)
    cache_class = sys.modules[model_class.__module__].HuginnDynamicCache
    results = []
    for case in torch.load(args.cases):
        model = model_class.from_pretrained(args.folder).eval().to(case["dtype"])
        idx, state, steps = case["idx"], case["state"].to(case["dtype"]), case["steps"]
        with torch.no_grad():
            if not args.prefill:
                results.append(model(idx, input_states=state, num_steps=steps).logits)
                continue
            # the reference's own cache ("full" lookup): a prompt, then one token per call at its position
            cache, prompt, logits = cache_class("full"), args.prefill, []
            for start, end in [(0, prompt)] + [(t, t + 1) for t in range(prompt, idx.shape[1])]:
                output = model(idx[:, start:end], input_states=state[:, start:end], num_steps=steps,
                               past_key_values=cache, use_cache=True, cache_position=torch.arange(start, end))
                logits.append(output.logits)
            results.append(torch.cat(logits, dim=1))
    torch.save(results, args.out)


def exits_cases(args) -> None:
    """rdepth's greedy decoding of a raven run with per-token exits (``latent_diff``, the reference's
    ``latent-diff``; no head reading, so both sides decide on the same states) at batch 1: from a
    one-token prompt, EXIT_TOKENS tokens at each of EXIT_TAUS, cap EXIT_CAP; every token's loop steps and
    logits, and the initial loop states of every position (given to the reference)."""
    from rdepth.exits.controller import controller_factory
    from rdepth.model.decoder import Decoder
    from rdepth.model.noise import StateNoise
    from rdepth.run.checkpoint import load_model

    count, taus = EXIT_TOKENS, EXIT_TAUS
    if args.writer_seed is not None:  # the golden: rdepth's writer from a seed, no tokenizer needed
        from rdepth.interop.hf_raven import raven_model, write_raven_folder

        write_raven_folder(args.folder, args.writer_seed, **EXITS_GOLDEN["overrides"])
        model, count, taus = raven_model(args.folder), EXITS_GOLDEN["tokens"], EXITS_GOLDEN["taus"]
    else:
        model = load_model(args.run)[0].eval()
    length, width = 1 + count, model.config.d_model
    noise = StateNoise(3, [0])
    states = model.init_state(0, torch.zeros(1, length, width), noise)
    prompt = torch.tensor([[5]])
    out = {"prompt": prompt, "states": states, "cap": EXIT_CAP, "runs": []}
    for tau in taus:
        factory = controller_factory("latent_diff", tau, (EXIT_CAP,), None, {})
        decoder = Decoder(model, 1, controller_factory=factory, noise=noise)
        logits = [decoder.prefill(prompt)[:, -1]]
        steps, tokens = [int(decoder.computed[0, 0])], []
        for _ in range(count - 1):
            tokens.append(int(logits[-1].argmax(-1)))
            logits.append(decoder.step(torch.tensor([[tokens[-1]]])))
            steps.append(int(decoder.computed[0, 0]))
        tokens.append(int(logits[-1].argmax(-1)))
        out["runs"].append(dict(tau=tau, tokens=tokens, steps=steps, logits=torch.cat(logits)))
        print(f"rdepth latent_diff {tau}: steps {steps}")
    torch.save(out, args.out)


def exits_reference(args) -> None:
    """The reference's ``generate_with_adaptive_compute(criterion="latent-diff", cache_lookup_strategy=...)``
    on the same prompt, initial states and thresholds, greedy; each token's steps (its ``iterate_one_step``
    calls) and the logits it samples from."""
    from transformers import GenerationConfig

    _, model_class = reference_classes(args.reference, "released")
    case = torch.load(args.cases)
    results = []
    for run in case["runs"]:
        model = model_class.from_pretrained(args.folder).eval()
        table, offset, steps, logits = case["states"], [0], [], []

        # (the three patches below read this iteration's table, offset, steps and logits: each is called
        # only inside this iteration's generate, so a late binding cannot see another run's)
        def initialize_state(embeds, scale=1.0):
            part = table[:, offset[0]:offset[0] + embeds.shape[1]].to(embeds.dtype)  # noqa: B023
            offset[0] += embeds.shape[1]  # noqa: B023
            steps.append(0)  # noqa: B023
            return part

        iterate = model.iterate_one_step

        def counted(*a, **k):
            steps[-1] += 1  # noqa: B023
            return iterate(*a, **k)  # noqa: B023

        sample = model._sample_next_token

        def recorded(next_token_logits, *a, **k):
            logits.append(next_token_logits.clone())  # noqa: B023
            return sample(next_token_logits, *a, **k)  # noqa: B023

        model.initialize_state, model.iterate_one_step, model._sample_next_token = initialize_state, counted, recorded
        out = model.generate_with_adaptive_compute(
            case["prompt"], generation_config=GenerationConfig(do_sample=False, max_length=64),
            criterion="latent-diff", exit_threshold=run["tau"], cache_lookup_strategy=args.lookup,
            num_steps=case["cap"], max_new_tokens=len(run["tokens"]))
        results.append(dict(tau=run["tau"], tokens=out[0, case["prompt"].shape[1]:].tolist(), steps=steps,
                            logits=torch.cat(logits)))
        print(f"reference {args.lookup} latent-diff {run['tau']}: steps {steps}")
    torch.save(results, args.out)


def exits_compare(args) -> None:
    case, reference = torch.load(args.cases), torch.load(args.reference_out)
    for mine, theirs in zip(case["runs"], reference, strict=False):
        same_steps, same_tokens = mine["steps"] == theirs["steps"], mine["tokens"] == theirs["tokens"]
        n = min(len(mine["logits"]), len(theirs["logits"]))
        difference = (mine["logits"][:n] - theirs["logits"][:n]).abs().max().item()
        print(f"tau {mine['tau']}: steps equal {same_steps} (rdepth {sorted(set(mine['steps']))}), tokens equal "
              f"{same_tokens}, max |logits difference| {difference:.2e} over {n} tokens")


def exits_golden(args) -> None:
    """tests/golden/raven_exits.json from ``exits-cases --writer-seed`` and the reference's latest-m4 run."""
    import hashlib
    import json

    case, reference = torch.load(args.cases), torch.load(args.reference_out)
    digest = hashlib.sha256((Path(args.folder) / "model.safetensors").read_bytes()).hexdigest()
    meta = {
        "about": "The reference's generate_with_adaptive_compute(criterion='latent-diff', cache_lookup_strategy="
                 "'latest-m4') on a tiny raven checkpoint in Huginn's 2 + 4 layout, written by rdepth's "
                 "write_raven_folder from a seed: each token's loop steps, greedy tokens and logits "
                 "(tests/test_hf_raven.py; scripts/raven_parity.py exits-cases --writer-seed).",
        "writer": {"seed": EXITS_GOLDEN["seed"], "overrides": EXITS_GOLDEN["overrides"],
                   "model_safetensors_sha256": digest},
        "prompt": case["prompt"].tolist(), "state_noise": {"seed": EXITS_GOLDEN["noise_seed"], "sequence_ids": [0]},
        "cap": case["cap"], "reference": {**REFERENCE_NOTE, "call": "generate_with_adaptive_compute, greedy"},
        "runs": [{"tau": run["tau"], "steps": run["steps"], "tokens": run["tokens"],
                  "logits": [[round(v, 7) for v in row] for row in run["logits"].tolist()]} for run in reference],
    }
    Path(args.out).write_text(json.dumps(meta) + "\n")


def padded_cases(args) -> None:
    """A left-padded batch for the exported run: rows of 24 and 15 real tokens, and each row's initial state
    as the export draws it (``StateNoise(state_seed 0, [row])`` from the row's first real token)."""
    from rdepth.model.noise import StateNoise
    from rdepth.run.checkpoint import load_model

    model = load_model(args.run)[0]
    lengths, width = (24, 15), model.config.d_model
    rows = torch.randint(1, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(13))
    idx, mask = torch.zeros(2, 24, dtype=torch.long), torch.zeros(2, 24, dtype=torch.long)
    states = []
    for row, length in enumerate(lengths):
        idx[row, 24 - length:], mask[row, 24 - length:] = rows[row, :length], 1
        states.append(model.init_state(0, torch.zeros(1, length, width), StateNoise(0, [row]))[0])
    torch.save(dict(idx=idx, mask=mask, lengths=lengths, states=states), args.out)


def padded(args) -> None:
    """The exported folder's logits for the left-padded batch against the reference on each row alone."""
    import transformers

    _, model_class = reference_classes(args.reference, "widened")
    case = torch.load(args.cases)
    exported = transformers.AutoModelForCausalLM.from_pretrained(args.export, trust_remote_code=True).eval()
    reference = model_class.from_pretrained(args.folder).eval()
    for dtype in (torch.float32, torch.float64):
        exported, reference = exported.to(dtype), reference.to(dtype)
        for steps in STEPS:
            with torch.no_grad():
                batch = exported(case["idx"], attention_mask=case["mask"], loop_counts=[steps],
                                 sequence_ids=[0, 1]).logits
                worst = 0.0
                for row, length in enumerate(case["lengths"]):
                    alone = reference(case["idx"][row:row + 1, -length:], input_states=case["states"][row][None].to(dtype),
                                      num_steps=steps).logits[0]
                    worst = max(worst, (batch[row, -length:].double() - alone.double()).abs().max().item())
            print(f"exported, left-padded batch of 2, {str(dtype)[6:]:8s} {steps:2d} recurrences vs the reference "
                  f"(widened) on each row alone: max |diff| {worst:.3e}")


def compare(args) -> None:
    for case, reference in zip(torch.load(args.cases), torch.load(args.logits), strict=False):
        difference = (case["rdepth"].double() - reference.double()).abs().max().item()
        print(f"rdepth {str(case['dtype'])[6:]:8s} vs reference {str(reference.dtype)[6:]:8s} "
              f"{case['steps']:2d} recurrences: max |diff| {difference:.3e}")


def golden(args) -> None:
    """tests/golden/raven_tiny.{json,safetensors} from ``cases --writer-seed`` and both reference runs."""
    import hashlib
    import json

    from safetensors.torch import save_file

    out = Path(args.out)
    runs = list(zip(torch.load(args.cases), torch.load(args.released), torch.load(args.widened), strict=False))
    tensors = {"state": runs[0][0]["state"].contiguous()}
    for case, released, widened in runs:
        name = f"logits_{str(case['dtype'])[6:]}_steps{case['steps']}"
        tensors[name] = (released if case["dtype"] == torch.float32 else widened).contiguous()
    save_file(tensors, str(out.with_suffix(".safetensors")))
    digest = hashlib.sha256((Path(args.folder) / "model.safetensors").read_bytes()).hexdigest()
    meta = {
        "about": "A tiny raven-layout checkpoint written by rdepth.interop.hf_raven.write_raven_folder from a seed, "
                 "and the reference implementation's logits for it (tests/test_hf_raven.py; scripts/raven_parity.py).",
        "writer": {"seed": GOLDEN["seed"], "overrides": GOLDEN["overrides"], "model_safetensors_sha256": digest},
        "tokens": runs[0][0]["idx"].tolist(), "state_noise": {"seed": GOLDEN["noise_seed"], "sequence_ids": [0, 1]},
        "steps": list(STEPS), "reference": REFERENCE_NOTE,
    }
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    step = sub.add_parser("build")
    step.add_argument("--reference", type=Path, required=True)
    step.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    step.add_argument("--seed", type=int, default=0)
    step.add_argument("--out", required=True)
    step = sub.add_parser("cases")
    step.add_argument("--folder", required=True)
    step.add_argument("--run")
    step.add_argument("--writer-seed", type=int)
    step.add_argument("--out", required=True)
    step = sub.add_parser("logits")
    step.add_argument("--reference", type=Path, required=True)
    step.add_argument("--folder", required=True)
    step.add_argument("--cases", required=True)
    step.add_argument("--impl", choices=("released", "widened"), required=True)
    step.add_argument("--prefill", type=int, default=0,
                      help="through the reference's cache (HuginnDynamicCache 'full'): this many prompt tokens, "
                           "then one token per call (0: one uncached forward)")
    step.add_argument("--out", required=True)
    step = sub.add_parser("padded-cases")
    step.add_argument("--run", required=True)
    step.add_argument("--out", required=True)
    step = sub.add_parser("padded")
    for name in ("reference", "folder", "export", "cases"):
        step.add_argument(f"--{name}", type=Path if name == "reference" else str, required=True)
    step = sub.add_parser("exits-cases")
    step.add_argument("--run")
    step.add_argument("--folder")
    step.add_argument("--writer-seed", type=int)
    step.add_argument("--out", required=True)
    step = sub.add_parser("exits-reference")
    step.add_argument("--reference", type=Path, required=True)
    step.add_argument("--folder", required=True)
    step.add_argument("--cases", required=True)
    step.add_argument("--lookup", default="latest-m4", help="the reference's cache_lookup_strategy")
    step.add_argument("--out", required=True)
    step = sub.add_parser("exits-compare")
    step.add_argument("--cases", required=True)
    step.add_argument("--reference-out", required=True)
    step = sub.add_parser("exits-golden")
    for name in ("folder", "cases", "reference-out", "out"):
        step.add_argument(f"--{name}", required=True)
    step = sub.add_parser("compare")
    step.add_argument("--cases", required=True)
    step.add_argument("--logits", required=True)
    step = sub.add_parser("golden")
    for name in ("folder", "cases", "released", "widened", "out"):
        step.add_argument(f"--{name}", required=True)
    args = parser.parse_args()
    commands = {"exits-cases": exits_cases, "exits-reference": exits_reference, "exits-compare": exits_compare,
                "exits-golden": exits_golden,
                "build": build, "cases": cases, "logits": logits, "padded-cases": padded_cases, "padded": padded,
                "compare": compare, "golden": golden}
    commands[args.command](args)


if __name__ == "__main__":
    main()
