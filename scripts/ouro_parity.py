"""Parity of rdepth's Ouro import against the reference implementation, run outside the project.

The reference (``modeling_ouro.py`` and ``configuration_ouro.py``: ByteDance's hub code as carried by
github.com/LoopedLMs/ouro_rl at 3bad4c1, ``ouro_rl/modeling/``, the hub file with its
``UniversalTransformerCache.get_mask_sizes`` fixed so that cached decoding of a padded batch masks
right) never enters the repository: ``--reference DIR`` names a folder outside it holding those two
files. The script runs in a Python where they run (transformers 4.57.6: tests/hf_venvs.py's ``tf4.57``
venv) with rdepth on the path::

    git -C OURO_RL show 3bad4c1:ouro_rl/modeling/modeling_ouro.py > /tmp/ouro_ref/modeling_ouro.py
    git -C OURO_RL show 3bad4c1:ouro_rl/modeling/configuration_ouro.py > /tmp/ouro_ref/configuration_ouro.py
    PYTHONPATH=$PWD .hf-venvs/tf4.57/bin/python scripts/ouro_parity.py --reference /tmp/ouro_ref --out tests/golden

For each tiny config of :data:`VARIANTS` it writes the folder with rdepth's own
:func:`~rdepth.interop.hf_ouro.write_ouro_folder` (its bytes' SHA-256 recorded), loads it into the
reference's ``OuroForCausalLM`` (``OuroConfig(**config.json)``, the safetensors loaded strictly, SDPA
attention) and into rdepth (``ouro_model``), and compares:

* logits at 1, 2, 3 and 4 steps (the reference's ``forward(ids, exit_at_step=k - 1)``; rdepth
  ``loop_counts=k``), float32 as released and float64 with the reference's RMSNorm computing in the
  input's dtype (released, it computes in float32 whatever the model's dtype: the one change, "widened");
* a left-padded batch of two prompts (the reference with its attention mask and positions counted from
  the first real token, as ``generate`` makes them; rdepth each prompt alone);
* the reference's own cached greedy generation (``generate`` on that padded batch, its per-token logits)
  against rdepth's decoder, each prompt alone;
* its adaptive exit: the reference's ``forward(ids, exit_threshold=q)`` picks a step per token; the step is
  read back as the one whose logits (``exit_at_step``) it returned, bit for bit, and rdepth's ``ouro`` exit
  rule on rdepth's own iterates must stop there; and on constructed trajectories (the reference's inner
  model replaced by one returning given gate scores, its rule run as written) against the rule alone;
* the parameter counts of the published configs (the reference's class built on the meta device).

With ``--out`` the results become the golden files ``ouro_tiny.json`` / ``ouro_tiny.safetensors`` that
tests/test_hf_ouro.py checks without the reference. The maximum differences are printed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

VARIANTS = {
    # untied head, the gate, 2 layers, rope_theta as released
    "A": dict(seed=11, overrides=dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, intermediate_size=24,
                                      num_hidden_layers=2, max_position_embeddings=16, vocab_size=32,
                                      rope_theta=1000000.0)),
    # tied embeddings, 3 layers of 3 heads, another base, a larger gate
    "B": dict(seed=12, gate_scale=4.0, overrides=dict(hidden_size=24, num_attention_heads=3, num_key_value_heads=3,
                                                      intermediate_size=40, num_hidden_layers=3,
                                                      max_position_embeddings=16, vocab_size=32, rope_theta=10000.0,
                                                      tie_word_embeddings=True)),
}
STEPS = (1, 2, 3, 4)
TOKENS = [[3, 14, 15, 29, 6, 22], [16, 9, 8, 4, 7, 30]]
PROMPTS = [[5, 17, 2, 9, 11], [21, 3]]  # the padded batch (left padding, pad id 0)
NEW_TOKENS = 6
THRESHOLDS = (0.3, 0.5, 0.7, 0.9, 0.99)  # the reference's exit_threshold q; rdepth's tau is 1 - q
CONSTRUCTED = 64  # constructed trajectories (gate scores) per dtype
REFERENCE_NOTE = {
    "code": "github.com/LoopedLMs/ouro_rl @ 3bad4c1891fa7a1c5e11f8eb4e59e7d1cec5502b, ouro_rl/modeling/"
            "modeling_ouro.py + configuration_ouro.py (ByteDance/Ouro's hub code, get_mask_sizes fixed)",
    "versions": f"transformers 4.57.6, torch {torch.__version__}, CPU",
    "call": "OuroForCausalLM(OuroConfig(**config.json), attn sdpa), weights loaded strictly; "
            "forward(ids, exit_at_step=k - 1).logits",
    "float32": "the file as released",
    "float64": "the file with OuroRMSNorm computing in its input's dtype (released: float32 always)",
}


def reference_module(source: Path):
    """The reference's modeling module, imported as a package from a copy of ``source``."""
    package = Path(tempfile.mkdtemp()) / "ouro_reference"
    package.mkdir()
    for name in ("modeling_ouro.py", "configuration_ouro.py"):
        shutil.copy(source / name, package / name)
    (package / "__init__.py").write_text("")
    sys.path.insert(0, str(package.parent))
    return importlib.import_module("ouro_reference.modeling_ouro")


def widen_norm(module) -> None:
    """OuroRMSNorm in its input's dtype (float64 stays float64); float32 inputs compute as released."""
    def forward(self, hidden_states):
        dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        wide = hidden_states.to(dtype)
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * wide.to(hidden_states.dtype)
    module.OuroRMSNorm.forward = forward


def reference_model(module, folder: Path, dtype: torch.dtype):
    from safetensors.torch import load_file

    config = module.OuroConfig(**json.loads((folder / "config.json").read_text()))
    config._attn_implementation = "sdpa"
    model = module.OuroForCausalLM(config)
    weights = {}
    index = folder / "model.safetensors.index.json"
    for name in (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
                 else ["model.safetensors"]):
        weights.update(load_file(str(folder / name)))
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(weights, strict=True)
    return model.to(dtype).eval()


def sha256(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def exit_steps_of(reference, ids: torch.Tensor, threshold: float) -> torch.Tensor:
    """[B, T] the 1-based step whose logits the reference's exit_threshold path returned, bit for bit."""
    with torch.no_grad():
        chosen = reference(ids, exit_threshold=threshold, use_cache=False).logits
        per_step = torch.stack([reference(ids, exit_at_step=k, use_cache=False).logits
                                for k in range(reference.config.total_ut_steps)])
    equal = (per_step == chosen[None]).all(-1)  # [K, B, T]
    if not bool(equal.any(0).all()):
        raise SystemExit("the reference returned logits of no single step")
    return equal.float().argmax(0) + 1


def rdepth_iterates(model, ids: torch.Tensor) -> torch.Tensor:
    """``[K + 1, B*T, d]`` rdepth's iterates at the fixed budget (every step of every token, as the reference
    computes them), recorded by an observer."""
    states = []
    with torch.no_grad():
        model(ids, observer=lambda group, step, state, active: states.append(state.reshape(-1, state.shape[-1])))
    return torch.stack(states)


def rdepth_exit_steps(model, ids: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] steps rdepth's ``ouro`` rule stops at: on the fixed-budget iterates (what the reference's rule
    reads), and online (the packed forward with exits, where a later token's deeper steps read an exited
    token's last keys: rdepth's latest-KV rule; the reference computes every step of every token)."""
    from rdepth.exits.controller import controller_factory
    from rdepth.exits.recorded import replay

    _, computed = replay("ouro", rdepth_iterates(model, ids), 1.0 - threshold, gate=model)
    factory = controller_factory("ouro", 1.0 - threshold, model.config.default_eval_loops, None, {"gate": model})
    with torch.no_grad():
        online = model(ids, controller=factory()).computed[0]
    return computed.view(ids.shape), online


def constructed(module, dtype: torch.dtype, generator: torch.Generator) -> dict:
    """The reference's exit rule on constructed gate scores ``z`` [N, K]: its inner model replaced by one
    returning them (and hidden states whose step the head reads back), its own forward choosing."""
    steps = 4
    config = module.OuroConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                               num_key_value_heads=1, vocab_size=8, max_position_embeddings=8, total_ut_steps=steps)
    config._attn_implementation = "sdpa"
    reference = module.OuroForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        reference.lm_head.weight.zero_()
        reference.lm_head.weight[0, 0] = 1.0  # logit 0 = channel 0 of the chosen state = its step
    n = CONSTRUCTED
    z = torch.randn(1, n, steps, generator=generator, dtype=torch.float64) * 3
    z[0, : n // 4] = torch.tensor([[-9.0, 0.0, 9.0, 0.0]]).double()  # saturated and even gates
    z[0, n // 4: n // 2] = torch.logit(torch.tensor([0.5, 0.4, 0.2, 0.6])).double()  # cdf 0.5, 0.7, 0.76 ...
    z = z.to(dtype)
    hidden = [torch.full((1, n, 8), float(k + 1), dtype=dtype) for k in range(steps)]
    gates = [z[..., k:k + 1] for k in range(steps)]
    base = module.BaseModelOutputWithPast(last_hidden_state=hidden[-1])
    reference.model.forward = lambda *a, **k: (base, hidden, gates)
    chosen = {}
    with torch.no_grad():
        for q in THRESHOLDS:
            logits = reference(torch.zeros(1, n, dtype=torch.long), exit_threshold=q, use_cache=False).logits
            chosen[str(q)] = logits[0, :, 0].round().long().tolist()
    return {"z": z[0], "steps": chosen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True, help="folder holding modeling_ouro.py and configuration_ouro.py")
    parser.add_argument("--out", type=Path, help="write ouro_tiny.json / ouro_tiny.safetensors here")
    args = parser.parse_args()
    from safetensors.torch import save_file

    from rdepth.interop.hf_ouro import OURO_1_4B, OURO_2_6B, ouro_model, write_ouro_folder
    from rdepth.model.decoder import Decoder

    module = reference_module(args.reference)
    widen_norm(module)  # float32 inputs compute exactly as released
    work = Path(tempfile.mkdtemp())
    tensors, meta = {}, {"about": "Tiny Ouro-layout checkpoints written by rdepth.interop.hf_ouro.write_ouro_folder "
                                  "from a seed, and the reference implementation's outputs for them "
                                  "(tests/test_hf_ouro.py; scripts/ouro_parity.py).", "reference": REFERENCE_NOTE,
                         "tokens": TOKENS, "steps": list(STEPS), "variants": {}}
    tokens = torch.tensor(TOKENS)
    worst = {}
    for name, spec in VARIANTS.items():
        folder = write_ouro_folder(work / name, spec["seed"], gate_scale=spec.get("gate_scale", 1.0), **spec["overrides"])
        meta["variants"][name] = {"seed": spec["seed"], "gate_scale": spec.get("gate_scale", 1.0),
                                  "overrides": spec["overrides"], "safetensors_sha256": sha256(folder)}
        for dtype in (torch.float32, torch.float64):
            label = str(dtype)[6:]
            reference = reference_model(module, folder, dtype)
            model = ouro_model(folder).to(dtype)
            for steps in STEPS:
                with torch.no_grad():
                    ref = reference(tokens, exit_at_step=steps - 1, use_cache=False).logits
                    ours = model(tokens, loop_counts=steps).logits
                tensors[f"{name}_logits_{label}_steps{steps}"] = ref.contiguous()
                worst[f"{name} {label} steps {steps}"] = (ours - ref).abs().max().item()
            if name != "A":
                continue
            # the padded batch and the reference's cached generation (left padding, positions from the mask)
            width = max(map(len, PROMPTS))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                padded = reference(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
                generated = reference.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                               output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                                               eos_token_id=None)
            gen_logits = torch.stack(generated.logits, 1)  # [B, new, V]
            for row, prompt in enumerate(PROMPTS):
                with torch.no_grad():
                    alone = model(torch.tensor([prompt])).logits[0]
                    decoder = Decoder(model, 1)
                    logits = [decoder.prefill(torch.tensor([prompt]))[0, -1]]
                    for token in generated.sequences[row, width:width + NEW_TOKENS - 1].tolist():
                        logits.append(decoder.step(torch.tensor([[token]]))[0])
                worst[f"padded {label} row {row}"] = (alone - padded[row, width - len(prompt):]).abs().max().item()
                worst[f"generate {label} row {row}"] = (torch.stack(logits) - gen_logits[row]).abs().max().item()
                tensors[f"padded_logits_{label}_row{row}"] = padded[row, width - len(prompt):].contiguous()
                tensors[f"generate_logits_{label}_row{row}"] = gen_logits[row].contiguous()
                same = torch.stack(logits).argmax(-1).tolist() == generated.sequences[row, width:].tolist()
                worst[f"generate {label} row {row} tokens differ"] = float(not same)
            meta["generate"] = {"prompts": PROMPTS, "new_tokens": NEW_TOKENS,
                                "tokens": generated.sequences[:, width:].tolist()}
            # the adaptive exit on the model's own trajectories
            exits = meta.setdefault("exits", {})
            for q in THRESHOLDS:
                ref_steps = exit_steps_of(reference, tokens, q)
                our_steps, online = rdepth_exit_steps(model, tokens, q)
                exits.setdefault(label, {})[str(q)] = ref_steps.tolist()
                worst[f"exit {label} q {q} disagreements"] = float((ref_steps != our_steps).sum())
                worst[f"exit {label} q {q} online (info)"] = float((ref_steps != online).sum())
        for dtype in (torch.float32, torch.float64):
            reference = reference_model(module, folder, dtype)
            with torch.no_grad():
                gates = reference(tokens, use_cache=False)  # warm: nothing kept
                _, _, gate_list = reference.model(tokens, use_cache=False)
            tensors[f"{name}_gate_{str(dtype)[6:]}"] = torch.cat(gate_list, -1).contiguous()
            del gates
    generator = torch.Generator().manual_seed(7)
    meta["constructed"] = {}
    for dtype in (torch.float32, torch.float64):
        made = constructed(module, dtype, generator)
        tensors[f"constructed_z_{str(dtype)[6:]}"] = made["z"].contiguous()
        meta["constructed"][str(dtype)[6:]] = made["steps"]
    meta["thresholds"] = list(THRESHOLDS)
    counts = {}
    for label, hf in (("Ouro-1.4B", OURO_1_4B), ("Ouro-2.6B", OURO_2_6B)):
        config = module.OuroConfig(**{k: v for k, v in hf.items() if k not in ("model_type", "architectures")})
        with torch.device("meta"):
            counts[label] = sum(p.numel() for p in module.OuroForCausalLM(config).parameters())
    meta["parameter_counts"] = counts
    for key, value in worst.items():
        print(f"{key:40s} {value:.3e}")
    print(json.dumps(counts))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(args.out / "ouro_tiny.safetensors"))
        (args.out / "ouro_tiny.json").write_text(json.dumps(meta, indent=1) + "\n")
        print(f"wrote {args.out / 'ouro_tiny.json'} and ouro_tiny.safetensors")


if __name__ == "__main__":
    main()
