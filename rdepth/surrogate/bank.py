"""Teacher layer states computed once and kept in memory for fitting and evaluation.

A :class:`StateBank` is a list of batches; each holds the model inputs (token ids or images),
the key mask (B, T) bool and the teacher's L+1 states, stacked as (L+1, B, T, D) float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from rdepth.surrogate.teachers.layers import Teacher


@dataclass
class BankBatch:
    inputs: torch.Tensor
    mask: torch.Tensor  # (B, T) bool
    states: torch.Tensor  # (L+1, B, T, D)
    labels: torch.Tensor | None = None  # (B,) class labels (vision), else None

    def state_list(self) -> list[torch.Tensor]:
        return list(self.states.unbind(0))


class StateBank:
    """Batches of teacher states. ``len(bank)`` is the number of batches."""

    def __init__(self, batches: list[BankBatch]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)

    @property
    def n_examples(self) -> int:
        return sum(b.mask.shape[0] for b in self.batches)

    def depth_scale(self) -> torch.Tensor:
        """Mean squared entry of the teacher state at every depth over real tokens: (L+1,)."""
        total = torch.zeros(self.batches[0].states.shape[0], dtype=torch.float64)
        count = 0
        for batch in self.batches:
            total += batch.states[:, batch.mask].double().square().mean(-1).sum(-1)
            count += int(batch.mask.sum())
        return (total / max(count, 1)).float()

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All batches as one padded (L+1, N, T_max, D) tensor and its (N, T_max) mask."""
        length = max(b.mask.shape[1] for b in self.batches)
        states, masks = [], []
        for b in self.batches:
            pad = length - b.mask.shape[1]
            states.append(torch.nn.functional.pad(b.states, (0, 0, 0, pad)))
            masks.append(torch.nn.functional.pad(b.mask, (0, pad)))
        return torch.cat(states, 1), torch.cat(masks, 0)


@torch.no_grad()
def build_bank(teacher: Teacher, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
               desc: str = "teacher states") -> StateBank:
    """Run the teacher over (inputs, mask, labels) batches and keep every layer's states."""
    teacher.eval()
    result = []
    for inputs, mask, labels in tqdm(batches, desc=desc, leave=False):
        states = torch.stack(teacher.layer_states(inputs, mask))
        result.append(BankBatch(inputs, mask, states, labels))
    return StateBank(result)
