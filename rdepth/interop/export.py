"""``rdepth export``: an rdepth checkpoint as a Hugging Face folder.

The folder holds::

    config.json              RdepthConfig: the model config, default loop counts, state seed,
                             default exit policy, auto_map
    model.safetensors        the weights ("model." + rdepth's own names), float32
    modeling_rdepth.py       generated from rdepth's source (rdepth.interop.source)
    configuration_rdepth.py
    tokenizer.json, tokenizer_config.json
    generation_config.json
    README.md                how to load it, and what the loop settings mean

so that ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` and
``AutoTokenizer.from_pretrained(DIR)`` load it without rdepth installed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rdepth.config import parse_loop_counts
from rdepth.errors import RdepthError
from rdepth.interop.config import ExportConfig
from rdepth.interop.hf_tokenizer import write_tokenizer_files
from rdepth.interop.output import check_new_folder, staged_folder
from rdepth.interop.source import CONFIG_FILE, MODELING_FILE, write_modeling_files
from rdepth.io import ordinary_mode, write_json, write_text
from rdepth.run.checkpoint import is_rdepth_run, load_model, resolve_checkpoint
from rdepth.run.heldout import run_tokenizer

log = logging.getLogger(__name__)

WEIGHT_PREFIX = "model."  # RdepthForCausalLM holds the RecurrentLM as .model

MODEL_CARD = """# rdepth recurrent-depth model (exported)

Exported by `rdepth export` from `{checkpoint}`.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("path/to/{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("path/to/{name}")
ids = tokenizer("The", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=20, do_sample=False, loop_counts={loops})
```

- Layers `{groups}` loop as recurrence groups (0-based, `a-b` inclusive); each group
  runs `loop_counts` steps (one per group, default {loops}; pass `loop_counts=N`,
  `[N, N, ...]` or `"N:N:..."` to `forward`/`generate`, or set `config.loop_counts`).
- The initial loop state is random but deterministic: keyed by (`state_seed`,
  sequence id, group) and the token's position; `state_seed` (default {seed}) and
  `sequence_ids` are per-call arguments. `init_state_scale: 0` in config.json gives a
  zero state instead.
- Per-token early exit: `exit_policy` in config.json (default {exit_policy}) or per call,
  e.g. `model.generate(ids, exit_policy={{"name": "acceleration", "tau": 1e-3, "k_max": 12}})`;
  with a policy each token loops until its rule stops it (`loop_counts` unused).
- Right padding only; no beam search; `generate` uses rdepth's key/value cache, which
  is exact under recurrence.
- `modeling_rdepth.py` is generated from rdepth's own source; do not edit it.
"""


def check_exit_spec(spec: dict | None, n_groups: int) -> None:
    """Build the exit rule once, so a bad name, threshold or cap fails at export, not at load."""
    from rdepth.exits.controller import PolicyController

    if spec is None:
        return
    options = dict(spec)
    k_max = options.pop("k_max")
    if isinstance(k_max, list) and len(k_max) != n_groups:
        raise RdepthError(f"export: --exit-k-max has {len(k_max)} values for {n_groups} recurrence groups")
    PolicyController.from_name(options.pop("name"), tau=options.pop("tau", None),
                               k_max=tuple(k_max) if isinstance(k_max, list) else k_max, **options)


def export_config_dict(model_config, loop_counts, state_seed: int, eot_id: int,
                       exit_policy: dict | None = None) -> dict:
    """``config.json`` of an exported folder."""
    return {
        **model_config.to_dict(),
        "loop_counts": list(loop_counts) if loop_counts is not None else None,
        "state_seed": state_seed,
        "exit_policy": exit_policy,
        "model_type": "rdepth",
        "architectures": ["RdepthForCausalLM"],
        "auto_map": {
            "AutoConfig": f"{CONFIG_FILE[:-3]}.RdepthConfig",
            "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.RdepthForCausalLM",
        },
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": "float32",
    }


def export_run(config: ExportConfig) -> Path:
    """Write the Hugging Face folder ``config.out`` for ``config.checkpoint``; returns it."""
    from safetensors.torch import save_file

    source = Path(config.checkpoint)
    if not source.exists():
        raise RdepthError(f"checkpoint not found: {source}")
    if not (is_rdepth_run(source) or source.name == "checkpoints" and is_rdepth_run(source.parent)):
        raise RdepthError(f"{source} is not an rdepth run or checkpoint folder (no checkpoints/, "
                          "no model.safetensors + state.json)")
    check_new_folder(config.out)
    checkpoint = resolve_checkpoint(source)
    model, model_config = load_model(checkpoint)
    tokenizer = run_tokenizer(checkpoint)
    counts = parse_loop_counts(config.loops, model_config.n_groups) if config.loops else None
    exit_spec = config.exit_spec()
    check_exit_spec(exit_spec, model_config.n_groups)
    with staged_folder(config.out) as folder:
        weights = {WEIGHT_PREFIX + name: tensor.detach().float().contiguous().cpu()
                   for name, tensor in model.state_dict().items()}
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        ordinary_mode(folder / "model.safetensors")  # safetensors writes 0600; an export is shared
        write_json(folder / "config.json",
                   export_config_dict(model_config, counts, config.state_seed, tokenizer.eot_id, exit_spec))
        write_json(folder / "generation_config.json", {
            "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id, "pad_token_id": tokenizer.eot_id,
            "do_sample": False,
        })
        write_modeling_files(folder)
        write_tokenizer_files(tokenizer, folder, model_config.block_size)
        shown = list(counts or model_config.default_eval_loops)
        write_text(folder / "README.md", MODEL_CARD.format(
            checkpoint=checkpoint, name=Path(config.out).name, loops=shown, groups=model_config.groups,
            seed=config.state_seed, exit_policy=json.dumps(exit_spec)))
    log.info("exported %s to %s", checkpoint, config.out)
    return Path(config.out)
