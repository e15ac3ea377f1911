"""Raptor: a block-recurrent surrogate of an L-layer teacher.

k blocks (one per phase); block p is applied ``lengths[p]`` times in a row, so the surrogate
makes the same L layer applications as the teacher. Before every application the block is
told which iteration it is on: a learned iteration embedding ``iteration[depth]`` (D,) is
added to its input. The teacher's embedding and readout are reused, frozen.

Initialised from the teacher (``init="first"``: each block is a copy of the first layer of
its phase) with zero iteration embeddings, a surrogate with k = L is the teacher exactly.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from rdepth.errors import RdepthError
from rdepth.io import atomic_path, write_json
from rdepth.surrogate.config import INIT_CHOICES
from rdepth.surrogate.teachers.layers import LayerSpec, Teacher


@dataclass(frozen=True)
class SurrogateConfig:
    """Phase lengths (sum = teacher depth), block initialisation and the layer spec."""

    lengths: tuple[int, ...]
    init: str = "first"

    def __post_init__(self) -> None:
        if not self.lengths or any(n < 1 for n in self.lengths):
            raise RdepthError(f"surrogate: phase lengths must be positive, got {self.lengths}")
        if self.init not in INIT_CHOICES:
            raise RdepthError(f"surrogate: init must be one of {INIT_CHOICES}, got {self.init!r}")

    @property
    def k(self) -> int:
        return len(self.lengths)

    @property
    def depth(self) -> int:
        return sum(self.lengths)


class RaptorSurrogate(nn.Module):
    """k recurrent blocks standing in for the teacher's L layers; states are (B, T, D)."""

    def __init__(self, teacher: Teacher, config: SurrogateConfig) -> None:
        super().__init__()
        if config.depth != teacher.n_layers:
            raise RdepthError(f"surrogate: phase lengths {config.lengths} sum to {config.depth}, "
                              f"the teacher has {teacher.n_layers} layers")
        self.config = config
        self.teacher = teacher  # frozen: embedding and readout are borrowed from it
        starts = [sum(config.lengths[:p]) for p in range(config.k)]
        blocks = []
        for start, length in zip(starts, config.lengths, strict=False):
            if config.init == "random":
                blocks.append(teacher.new_layer())
            else:
                offset = 0 if config.init == "first" else length // 2
                blocks.append(teacher.layer_copy(start + offset))
        self.blocks = nn.ModuleList(blocks)
        self.iteration = nn.Parameter(torch.zeros(config.depth, teacher.spec.d_model))
        # block_of[depth] = index of the block applied at that depth
        self.block_of = [p for p, length in enumerate(config.lengths) for _ in range(length)]
        self.phase_start = starts

    @property
    def n_layers(self) -> int:
        return self.config.depth

    def train(self, mode: bool = True) -> RaptorSurrogate:
        """Train the blocks; the borrowed teacher (embedding, readout) always stays in eval mode."""
        super().train(mode)
        self.teacher.eval()
        return self

    def step(self, state: torch.Tensor, depth: int, key_mask: torch.Tensor | None) -> torch.Tensor:
        """One layer application: the block of ``depth``'s phase on state + iteration[depth]."""
        return self.blocks[self.block_of[depth]](state + self.iteration[depth], key_mask)

    def rollout(self, state: torch.Tensor, key_mask: torch.Tensor | None, start: int = 0,
                stop: int | None = None, teacher_states: list[torch.Tensor] | None = None,
                force_prob: float = 0.0, input_noise: float = 0.0) -> list[torch.Tensor]:
        """Run depths [start, stop) from ``state``; returns the (stop - start) output states.

        With ``teacher_states`` (the teacher's L+1 states) and ``force_prob`` > 0, each step's
        input is, per sequence with that probability, the teacher's state at that depth
        instead of the surrogate's own (teacher forcing; ``force_prob`` = 1 is one-step
        prediction from every teacher state). ``input_noise`` > 0 adds Gaussian noise of that
        std to every step's input, drawn afresh at each step (the reference code's sigma).
        """
        stop = self.n_layers if stop is None else stop
        outputs = []
        for depth in range(start, stop):
            if teacher_states is not None and force_prob > 0.0 and depth > start:
                forced = torch.rand(state.shape[0], 1, 1, device=state.device) < force_prob
                state = torch.where(forced, teacher_states[depth], state)
            if input_noise > 0.0:
                state = state + input_noise * torch.randn_like(state)
            state = self.step(state, depth, key_mask)
            outputs.append(state)
        return outputs

    def layer_states(self, inputs: torch.Tensor, key_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Free-running states: the teacher's embedding, then L surrogate steps (L+1 tensors)."""
        state = self.teacher.embedding(inputs)
        return [state, *self.rollout(state, key_mask)]

    def forward(self, inputs: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.teacher.readout(self.layer_states(inputs, key_mask)[-1])

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [*self.blocks.parameters(), self.iteration]

    def save(self, directory: str | Path) -> None:
        """Write ``surrogate.safetensors`` (blocks + iteration) and ``surrogate_config.json``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        tensors = {f"blocks.{name}": value.detach().contiguous() for name, value in self.blocks.state_dict().items()}
        tensors["iteration"] = self.iteration.detach().contiguous()
        with atomic_path(directory / "surrogate.safetensors") as tmp:
            save_file(tensors, str(tmp))
        write_json(directory / "surrogate_config.json",
                   {"surrogate": asdict(self.config), "layer_spec": self.teacher.spec.to_dict()})


def load_surrogate(directory: str | Path, teacher: Teacher) -> RaptorSurrogate:
    """Rebuild a saved surrogate around its teacher (same checkpoint the run was fitted on)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path, weights_path = directory / "surrogate_config.json", directory / "surrogate.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise RdepthError(f"{directory} holds no saved surrogate (surrogate_config.json + surrogate.safetensors)")
    saved = json.loads(config_path.read_text())
    if LayerSpec(**saved["layer_spec"]) != teacher.spec:
        raise RdepthError(f"{directory}: the surrogate was fitted on a teacher of another shape")
    surrogate = RaptorSurrogate(teacher, SurrogateConfig(tuple(saved["surrogate"]["lengths"]), saved["surrogate"]["init"]))
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:
        raise RdepthError(f"{weights_path} is not a readable safetensors file ({type(exc).__name__})") from None
    surrogate.iteration.data.copy_(tensors.pop("iteration"))
    surrogate.blocks.load_state_dict({name[len("blocks."):]: value for name, value in tensors.items()})
    return surrogate
