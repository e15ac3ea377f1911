"""``rdepth import-hf``: a Hugging Face model folder as an rdepth run, where the architectures match.

An importer is chosen by ``config.json``'s ``model_type`` from :data:`IMPORTERS`:
folders written by ``rdepth export`` (the round trip is exact) and GPT-2 folders
(:mod:`rdepth.interop.hf_gpt2`: a plain model of ``block="gpt2"`` layers, logits equal
to ``transformers``' own GPT-2) and Huginn-0125 / raven folders (:mod:`rdepth.interop.hf_raven`: the
sandwich model with rotary positions, a gated MLP, a query/key bias and the final norm on the
hand-off) and Ouro / LoopLM folders (:mod:`rdepth.interop.hf_ouro`: every layer looped, peri-norm
blocks, the final norm after each step, an untied head and the exit gate). Architectures :class:`~rdepth.model.RecurrentLM`
cannot compute are refused with the mismatch named in :data:`MISMATCHES`, never
approximated.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from rdepth.config import ModelConfig, field_names
from rdepth.data.tokenizers import BPE_FILE, META_FILE, load_tokenizer
from rdepth.errors import RdepthError
from rdepth.interop.config import IMPORT_FORMATS, ImportConfig
from rdepth.interop.hf_gpt2 import import_gpt2
from rdepth.interop.hf_ouro import MODEL_TYPE as OURO
from rdepth.interop.hf_ouro import import_ouro
from rdepth.interop.hf_raven import MODEL_TYPE as RAVEN
from rdepth.interop.hf_raven import import_raven
from rdepth.interop.hf_tokenizer import PAD_TEXT
from rdepth.interop.hf_weights import read_hub_weights
from rdepth.interop.output import check_new_folder, staged_folder
from rdepth.io import read_json_object, write_json, write_text
from rdepth.model import RecurrentLM
from rdepth.run.checkpoint import save_checkpoint

log = logging.getLogger(__name__)

WEIGHT_PREFIX = "model."  # as rdepth.interop.export writes them

# model_type -> why RecurrentLM cannot hold it exactly
MISMATCHES: dict[str, str] = {
    "gpt_neo": "its attention alternates global and local (windowed) layers and is not scaled by "
               "1/sqrt(head_dim); rdepth's gpt2 block is global and scaled",
    "llama": "its blocks are pre-RMSNorm (an unnormalised residual stream) with rotate-half rotary positions; "
             "rdepth's sandwich blocks normalise after each residual sum and rotate adjacent channel pairs",
    # the looped models transformers ships: driven in place through rdepth.looped's adapter, never imported
    "hrm_text": "its loops are nested (an L loop inside each H step, every step with its own cache slots); rdepth "
                "analyze, sweep and generate drive the folder in place: give it as --checkpoint(s)",
    "inkling2_loop_text": "its looped layers mix attention residuals across passes, with sliding windows and experts; "
                          "rdepth analyze and generate drive the folder in place: give it as --checkpoint(s)",
}


def import_rdepth_export(folder: Path, hf_config: dict) -> tuple[RecurrentLM, dict]:
    """A folder written by ``rdepth export``: its model and the tokenizer files to save."""
    values = {name: hf_config[name] for name in field_names() if name in hf_config}
    if hf_config.get("extra_pad_token"):  # transformers' vocab_size counts the export's own pad token
        values["vocab_size"] = hf_config["vocab_size"] - 1
    if hf_config.get("loop_counts") is not None:  # the exported default budget becomes the eval budget
        values["eval_loops"] = hf_config["loop_counts"]
    config = ModelConfig.from_dict(values)
    model = RecurrentLM(config)
    weights = read_hub_weights(folder)
    stripped = {name[len(WEIGHT_PREFIX):]: tensor for name, tensor in weights.items()
                if name.startswith(WEIGHT_PREFIX)}
    expected = model.state_dict()
    if set(stripped) != set(expected) or len(stripped) != len(weights):
        missing = sorted(set(expected) - set(stripped))
        unexpected = sorted(set(weights) - {WEIGHT_PREFIX + name for name in expected})
        raise RdepthError(f"{folder}: weights do not match its config: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}")
    for name, tensor in stripped.items():
        if tensor.shape != expected[name].shape:
            raise RdepthError(f"{folder}: weight {name} has shape {tuple(tensor.shape)}, "
                              f"its config implies {tuple(expected[name].shape)}")
    model.load_state_dict(stripped)
    tokenizer_files = {META_FILE: None}
    if config.tokenizer.startswith("bpe"):
        if not (folder / "tokenizer.json").is_file():
            raise RdepthError(f"{folder} has no tokenizer.json for its {config.tokenizer!r} tokenizer")
        tokenizer_files[BPE_FILE] = without_pad_token((folder / "tokenizer.json").read_text(), config.vocab_size)
    return model.eval(), tokenizer_files


def without_pad_token(text: str, vocab_size: int) -> str:
    """An exported ``tokenizer.json`` less the export's own pad token (:data:`PAD_TEXT`, id ``vocab_size``,
    past the model's vocabulary): rdepth's tokenizer is the model's vocabulary."""
    data = json.loads(text)
    added = data.get("added_tokens") or []
    kept = [token for token in added if not (token.get("content") == PAD_TEXT and token.get("id") == vocab_size)]
    if len(kept) == len(added):
        return text
    return json.dumps({**data, "added_tokens": kept}, ensure_ascii=False)


# model_type -> importer(folder, config.json) -> (model, tokenizer files)
IMPORTERS: dict[str, Callable[[Path, dict], tuple[RecurrentLM, dict]]] = {
    "rdepth": import_rdepth_export,
    "gpt2": import_gpt2,
    RAVEN: import_raven,
    OURO: import_ouro,
}
# model_type -> the format's name in the refusal (``rdepth import-hf --help`` names the same formats)
FORMAT_NAMES: dict[str, str] = {kind: form.name for kind, form in IMPORT_FORMATS.items()}


def supported_formats() -> str:
    """Every format :data:`IMPORTERS` reads, by name and ``model_type``."""
    return "; ".join(f"{FORMAT_NAMES.get(kind, kind)} (model_type {kind})" for kind in IMPORTERS)


def load_hf_folder(folder: str | Path) -> tuple[RecurrentLM, dict]:
    """The rdepth model a Hugging Face folder holds, and its tokenizer files; a one-line
    error naming the mismatch when its architecture is not rdepth's."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RdepthError(f"Hugging Face folder not found: {folder}")
    hf_config = read_json_object(folder / "config.json", "Hugging Face config")
    model_type = hf_config.get("model_type")
    if model_type in MISMATCHES:
        raise RdepthError(f"cannot import {folder} ({model_type}) into rdepth's model: {MISMATCHES[model_type]}")
    if model_type not in IMPORTERS:
        raise RdepthError(f"cannot import {folder}: model_type {model_type!r} is not one rdepth's model holds "
                          f"(it reads {supported_formats()})")
    return IMPORTERS[model_type](folder, hf_config)


def import_hf(config: ImportConfig) -> Path:
    """Write the rdepth run ``config.out`` (checkpoint at step 0 + tokenizer) from ``config.hf``."""
    check_new_folder(config.out)
    model, tokenizer_files = load_hf_folder(config.hf)
    with staged_folder(config.out, "import-hf") as folder:
        save_checkpoint(folder, 0, model, model.config, state={"imported_from": str(Path(config.hf).resolve())})
        tokenizer_dir = folder / "tokenizer"
        tokenizer_dir.mkdir()
        write_json(tokenizer_dir / META_FILE, {"spec": model.config.tokenizer})
        for name, text in tokenizer_files.items():
            if text is not None:
                write_text(tokenizer_dir / name, text)
        tokenizer = load_tokenizer(tokenizer_dir)  # it must rebuild, and match the model
        if tokenizer.vocab_size != model.config.vocab_size:
            raise RdepthError(f"{config.hf}: tokenizer has {tokenizer.vocab_size} tokens, the model "
                              f"{model.config.vocab_size}")
    log.info("imported %s into %s", config.hf, config.out)
    return Path(config.out)
