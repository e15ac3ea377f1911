"""Looped ``transformers`` models by ``model_type``: the adapter table, folder loading, and what the commands
share (recognising such a folder among the paths a command is given, its tokenizer, the flags that apply).

``rdepth analyze``, ``sweep`` and ``generate`` take a Hugging Face folder of a supported looped model where
they take an rdepth run (``--checkpoints`` / ``--checkpoint``): :func:`looped_source` tells the two apart by
``config.json``'s ``model_type`` (an rdepth run's or checkpoint's ``config.json`` has none), and the command
then drives the folder in place through its adapter (:mod:`rdepth.looped.analyze`, ``.sweep``, ``.generate``).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from rdepth.errors import RdepthError
from rdepth.looped.protocol import LoopedAdapter

# model_type -> (adapter module, adapter class)
ADAPTERS = {
    "hrm_text": ("rdepth.looped.hrm_text", "HrmTextAdapter"),
    "inkling2_loop_text": ("rdepth.looped.inkling2", "Inkling2Adapter"),
}
SUPPORTED = ", ".join(ADAPTERS)


def adapter_class(model_type: str | None) -> type[LoopedAdapter]:
    """The adapter for ``model_type``; a one-line error naming the supported types otherwise."""
    if model_type not in ADAPTERS:
        hint = " (load its text model, model_type inkling2_loop_text)" if model_type == "inkling2_loop" else ""
        raise RdepthError(f"no looped adapter for model_type {model_type!r}{hint}; supported: {SUPPORTED}")
    module, name = ADAPTERS[model_type]
    return getattr(importlib.import_module(module), name)


def adapter_for(model: Any) -> LoopedAdapter:
    """Wrap a loaded ``transformers`` model (``model.config.model_type`` picks the adapter)."""
    return adapter_class(getattr(model.config, "model_type", None))(model)


def open_looped(folder: str | Path, dtype: Any = None, **load: Any) -> LoopedAdapter:
    """Load a Hugging Face folder of a supported looped model (eval mode, ``dtype`` default float32) and wrap
    it; ``load`` goes to ``from_pretrained`` (in float64 with the adapter's ``float64_load`` first: Inkling-2's
    grouped expert matmul takes no float64, so its eager experts then).

    A folder without ``config.json``, of another ``model_type``, or whose weights do not load is a
    one-line error.
    """
    import torch

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise RdepthError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        raise RdepthError(f"{config_path}: not a JSON object") from None
    adapter = adapter_class(model_type)  # refuse before importing transformers' model code
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise RdepthError(f"{folder}: no weights (*.safetensors) beside config.json")
    from transformers import AutoModelForCausalLM

    if dtype == torch.float64:
        load = {**adapter.float64_load, **load}
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a tiny folder's bar would break a command's one-line error after it
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32,
                                                           output_loading_info=True, **load)
    except (OSError, ValueError) as error:
        raise RdepthError(f"{folder}: cannot load the model ({' '.join(str(error).split())[:200]})") from None
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise RdepthError(f"{folder}: {len(missing)} weight(s) missing from the folder, first {missing[0]}")
    return adapter_for(model.eval())


def hf_model_type(path: str | Path) -> str | None:
    """``config.json``'s ``model_type`` when ``path`` is a Hugging Face model folder, else None (a path that is
    no folder, or an rdepth run or checkpoint folder: their ``config.json`` carries no ``model_type``)."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return None
    try:
        kind = json.loads(config_path.read_text()).get("model_type")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None  # the run layer's own reading says what is wrong with it
    return kind if isinstance(kind, str) else None


def looped_source(paths: list[str] | tuple[str, ...], command: str) -> bool:
    """True when every path is a Hugging Face folder of a supported looped model (the command drives it in
    place), False when none is a Hugging Face folder (rdepth runs); a one-line error naming what is supported
    for a folder of another ``model_type``, or for a mix of the two kinds."""
    kinds = [hf_model_type(path) for path in paths]
    if all(kind is None for kind in kinds):
        return False
    for path, kind in zip(paths, kinds, strict=True):
        if kind is None:
            raise RdepthError(f"{command}: {path} is an rdepth run, given beside Hugging Face folders; give one kind")
        if kind not in ADAPTERS:
            raise RdepthError(f"{command}: {path} is a Hugging Face folder of model_type {kind!r}; {command} drives "
                              f"the looped models transformers ships in place (model_type {SUPPORTED.replace(', ', ' or ')}) "
                              "and reads rdepth runs: bring other architectures in with rdepth import-hf")
    if len(set(kinds)) > 1:
        raise RdepthError(f"{command}: the folders hold different models ({', '.join(sorted(set(kinds)))}); give one kind")
    return True


def check_flags_apply(command: str, given: dict[str, Any] | set[str], applicable: tuple[str, ...]) -> None:
    """A one-line error naming the flags in ``given`` (field names typed on the command line) that a looped
    folder does not read: never silently ignored."""
    ignored = sorted(name for name in given if name not in applicable)
    if ignored:
        flags = ", ".join("--" + name.replace("_", "-") for name in ignored)
        verb = "does" if len(ignored) == 1 else "do"
        raise RdepthError(f"{command}: {flags} {verb} not apply to a looped Hugging Face folder (it reads "
                          f"{', '.join('--' + name.replace('_', '-') for name in applicable)})")


def folder_tokenizer(folder: str | Path):
    """The tokenizer saved in a Hugging Face folder (``AutoTokenizer``); a one-line error when it has none."""
    from transformers import AutoTokenizer

    if not any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise RdepthError(f"{folder}: no tokenizer (tokenizer.json) beside the model; the commands read text with "
                          "the folder's own tokenizer")
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise RdepthError(f"{folder}: cannot load its tokenizer ({' '.join(str(error).split())[:200]})") from None


def check_token_ids(ids: Any, adapter: LoopedAdapter, what: str) -> None:
    """A one-line error when token ids reach past the model's embedding (a tokenizer of another model)."""
    rows = adapter.model.get_input_embeddings().num_embeddings
    largest = int(ids.max()) if ids.numel() else -1
    if largest >= rows:
        raise RdepthError(f"{what}: token id {largest} is past the model's {rows} embeddings (the folder's tokenizer "
                          "is not its model's)")


def save_byte_tokenizer(folder: str | Path) -> None:
    """Save a byte-level tokenizer into ``folder`` (256 ids, id = the UTF-8 byte): what a tiny model trained on
    bytes ships with (the tests', ``scripts/looped_hrm_exits.py``'s)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    # ASCII characters are their own tokens; any other character falls back to its UTF-8 bytes <0x80>..<0xFF>
    # (no merges), so decoding keeps the ASCII text even where sampled high bytes form no character.
    vocab = {(chr(byte) if byte < 128 else f"<0x{byte:02X}>"): byte for byte in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)


def read_text(data: str | Path) -> str:
    """The UTF-8 text file a command reads with a looped folder's tokenizer (a one-line error otherwise)."""
    path = Path(data)
    if not path.is_file():
        raise RdepthError(f"{data}: a looped Hugging Face folder reads a UTF-8 text file (not a prepared data folder: "
                          "its tokens are rdepth's tokenizer's, not the model's)")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RdepthError(f"{data} is not UTF-8 text") from None


def text_windows(adapter: LoopedAdapter, tokenizer: Any, text: str, sequences: int | None, seq_len: int | None,
                 what: str = "the text"):
    """Windows ``[S, T + 1]`` (int64) of ``text`` tokenised by the folder's tokenizer and cut by rdepth's one
    window maker (:func:`rdepth.run.heldout.held_out_windows`; ``sequences`` None: all); T defaults to the
    model's context."""
    import numpy as np

    from rdepth.run.heldout import held_out_windows

    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    length = seq_len or int(getattr(adapter.model.config, "max_position_embeddings", 0) or 0)
    if length < 2:
        raise RdepthError("the model's config names no context length: give the window length")
    windows = held_out_windows(ids, length, sequences)
    check_token_ids(windows, adapter, what)
    return windows
