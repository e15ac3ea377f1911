"""rdepth's own non-recurrent language models as surrogate teachers.

A run trained with ``--groups ""`` is an ordinary L-layer causal transformer of sandwich
blocks (:class:`rdepth.model.layers.SandwichBlock`), or of GPT-2 blocks for a GPT-2 imported
with ``rdepth import-hf``. :func:`load_rdepth_teacher` exposes it
as a :class:`~rdepth.surrogate.teachers.layers.Teacher`: the model's own embedding (token embedding
scaled by sqrt(d) for sandwich blocks, plus positions), its layers unchanged, and its final norm as readout,
so the states the surrogate fits are exactly the ones :class:`rdepth.model.RecurrentLM`
computes. Sentences are encoded with the tokenizer saved with the run.

Attention is causal and batches are right-padded, so a real token never attends to
padding and the key mask is not needed inside the layers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rdepth.errors import RdepthError
from rdepth.model import RecurrentLM
from rdepth.model.layers import BLOCKS
from rdepth.run.checkpoint import load_model, load_model_config, resolve_checkpoint
from rdepth.run.heldout import run_tokenizer
from rdepth.surrogate.teachers.layers import LayerSpec, Teacher
from rdepth.surrogate.teachers.text import TextBatch, pad_batch


class SandwichLayer(nn.Module):
    """One of the model's blocks with the surrogate's layer signature ``(state, key_mask)``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.drop_path_rate = 0.0

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.block(x)


class RdepthEmbedding(nn.Module):
    """The model's own :meth:`RecurrentLM.embed` (ids (B, T) -> (B, T, d)), its tables registered here."""

    def __init__(self, model: RecurrentLM) -> None:
        super().__init__()
        self.wte, self.wpe = model.wte, model.wpe  # the same modules: moved and frozen with the teacher
        self._embed = model.embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embed(ids)


def load_rdepth_teacher(path: str | Path) -> Teacher:
    """A frozen teacher from an rdepth run or checkpoint folder whose model has no loop groups."""
    model, config = load_model(path)
    if config.group_specs:
        raise RdepthError(f"{path}: the model already loops (groups {config.groups!r}); a surrogate teacher "
                          "must be a plain transformer (trained with --groups '')")
    gpt2 = config.block == "gpt2"
    spec = LayerSpec(d_model=config.d_model, n_heads=config.n_head, d_ff=config.mlp_ratio * config.d_model,
                     norm_position="pre" if gpt2 else "sandwich", causal=True,
                     activation="gelu_tanh" if gpt2 else "silu", norm_eps=config.norm_eps)
    layers = [SandwichLayer(block) for block in model.layers]
    teacher = Teacher(RdepthEmbedding(model), layers, model.norm_f, spec, name="rdepth",
                      layer_factory=lambda: SandwichLayer(BLOCKS[config.block](config, 0)))
    teacher.block_size = config.block_size
    teacher.eval().requires_grad_(False)
    return teacher


class RdepthTextTokenizer:
    """Sentences -> right-padded :class:`~rdepth.surrogate.teachers.text.TextBatch` with a run's tokenizer."""

    def __init__(self, path: str | Path, max_length: int) -> None:
        self.tokenizer = run_tokenizer(path)
        self.max_length = min(max_length, load_model_config(resolve_checkpoint(path)).block_size)

    def token_counts(self, sentences: list[str]) -> list[int]:
        return [min(len(ids), self.max_length) for ids in self.tokenizer.encode_batch(sentences)]

    def encode(self, sentences: list[str]) -> TextBatch:
        return pad_batch([ids[: self.max_length] for ids in self.tokenizer.encode_batch(sentences)])
