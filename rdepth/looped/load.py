"""Looped ``transformers`` models by ``model_type``: the adapter table and folder loading."""

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
    it; ``load`` goes to ``from_pretrained`` (Inkling-2 in float64 on a CPU needs
    ``experts_implementation="eager"``: the grouped matmul takes no float64).

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
    adapter_class(model_type)  # refuse before importing transformers' model code
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise RdepthError(f"{folder}: no weights (*.safetensors) beside config.json")
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32,
                                                           output_loading_info=True, **load)
    except (OSError, ValueError) as error:
        raise RdepthError(f"{folder}: cannot load the model ({' '.join(str(error).split())[:200]})") from None
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise RdepthError(f"{folder}: {len(missing)} weight(s) missing from the folder, first {missing[0]}")
    return adapter_for(model.eval())
