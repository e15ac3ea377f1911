"""``rdepth export``: an rdepth checkpoint as a Hugging Face folder.

The folder holds::

    config.json              RdepthConfig: the model config, default loop counts, state seed,
                             default exit policy, auto_map
    model.safetensors        the weights ("model." + rdepth's own names), float32
    modeling_rdepth.py       generated from rdepth's source (rdepth.interop.source)
    configuration_rdepth.py
    tokenizer.json, tokenizer_config.json
                             the pad token <|pad|> is its own, id vocab_size (rdepth.interop.hf_tokenizer)
    generation_config.json   bos = eos = the end token; pad_token_id = vocab_size; max_length = block_size
    README.md                the model card (rdepth.interop.model_card): front matter, training
                             record, loop counts, how to load, the transformers range

so that ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` and
``AutoTokenizer.from_pretrained(DIR)`` load it without rdepth installed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rdepth.config import parse_loop_counts
from rdepth.errors import RdepthError
from rdepth.interop.config import ExportConfig
from rdepth.interop.hf_tokenizer import write_tokenizer_files
from rdepth.interop.model_card import model_card
from rdepth.interop.output import check_new_folder, staged_folder
from rdepth.interop.source import CONFIG_FILE, MODELING_FILE, write_modeling_files
from rdepth.io import ordinary_mode, write_json, write_text
from rdepth.run.checkpoint import is_rdepth_run, load_model, resolve_checkpoint
from rdepth.run.heldout import run_tokenizer

log = logging.getLogger(__name__)

WEIGHT_PREFIX = "model."  # RdepthForCausalLM holds the RecurrentLM as .model
EXPORTED_GATE = "exit_gate.safetensors"  # the learned exit rule's gate, beside the weights


def _exported_gate(spec: dict | None, checkpoint):
    """The trained exit gate when the exported exit policy is ``learned``: the one its profile names (the one
    it was calibrated with), else the checkpoint's; bound to the checkpoint's model (one-line errors: no
    gate, a gate for other weights), else None."""
    if not spec or spec.get("name") != "learned":
        return None
    from rdepth.exitrun.gate_file import load_gate

    return load_gate(spec.get("gate") or checkpoint, drives=checkpoint)


def check_exit_spec(spec: dict | None, n_groups: int) -> None:
    """Build the exit rule once, so a bad name, threshold or cap fails at export, not at load."""
    from rdepth.exits.controller import controller_factory

    if spec is None:
        return
    options = dict(spec)
    k_max = options.pop("k_max")
    if isinstance(k_max, list) and len(k_max) != n_groups:
        raise RdepthError(f"export: --exit-k-max has {len(k_max)} values for {n_groups} recurrence groups")
    caps = tuple(k_max) if isinstance(k_max, list) else k_max
    controller_factory(options.pop("name"), options.pop("tau", None), caps, None, options)()  # checks every group


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
        # its own pad token, one past the model's vocabulary, counted by transformers' vocab_size (the
        # model reads it as the end token; its logit is -inf)
        "pad_token_id": model_config.vocab_size,
        "vocab_size": model_config.vocab_size + 1,
        "extra_pad_token": True,
        "tie_word_embeddings": True,  # the head is the token embedding
        "use_cache": True,
        "dtype": "float32",
    }


def _save_tensors(tensors: dict, path: Path) -> None:
    """``save_file`` with a full or read-only disk as a one-line error (safetensors wraps the OSError in its
    own SafetensorError), the file given the mode of every other file (safetensors writes 0600)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as exc:
        raise RdepthError(f"export: cannot write {path.name}: {' '.join(str(exc).split())[:200]} (disk full or not "
                          "writable?); nothing was exported") from None
    ordinary_mode(path)


def export_run(config: ExportConfig) -> Path:
    """Write the Hugging Face folder ``config.out`` for ``config.checkpoint``; returns it."""
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
    exit_spec = config.exit_spec(model_config.n_groups, checkpoint)
    gate = _exported_gate(exit_spec, checkpoint)
    check_exit_spec(exit_spec if gate is None else {**exit_spec, "gate": gate}, model_config.n_groups)
    with staged_folder(config.out, "export") as folder:
        if gate is not None:  # the learned rule's gate travels with the model (checked against it above)
            _save_tensors({"weight": gate.weight.float().contiguous(), "bias": gate.bias.float().contiguous()},
                          folder / EXPORTED_GATE)
            exit_spec = {**exit_spec, "gate": EXPORTED_GATE}
        weights = {WEIGHT_PREFIX + name: tensor.detach().float().contiguous().cpu()
                   for name, tensor in model.state_dict().items()}
        _save_tensors(weights, folder / "model.safetensors")
        write_json(folder / "config.json",
                   export_config_dict(model_config, counts, config.state_seed, tokenizer.eot_id, exit_spec),
                   strict=True)
        write_json(folder / "generation_config.json", {
            "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id, "pad_token_id": model_config.vocab_size,
            "do_sample": False,
            # generate() with no length: up to the block size (transformers' own default is 20 positions)
            "max_length": model_config.block_size,
        })
        write_modeling_files(folder)
        write_tokenizer_files(tokenizer, folder, model_config.block_size, pad_id=model_config.vocab_size)
        write_text(folder / "README.md", model_card(
            checkpoint=checkpoint, out=str(config.out), model_config=model_config,
            loops=counts or model_config.default_eval_loops, state_seed=config.state_seed, exit_policy=exit_spec,
            license=config.license, parameters=sum(p.numel() for p in model.parameters())))
    log.info("exported %s to %s", checkpoint, config.out)
    return Path(config.out)
