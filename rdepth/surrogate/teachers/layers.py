"""Plain-PyTorch transformer layers and a layer-by-layer teacher wrapper.

One layer class covers the three layer styles this package reads or trains:

* BERT: post-norm (``x = LN(x + attn(x)); x = LN(x + mlp(x))``), exact GELU;
* GPT-2: pre-norm (``x = x + attn(LN(x)); x = x + mlp(LN(x))``), causal, tanh GELU;
* the small ViTs of :mod:`rdepth.surrogate.teachers.vit`: pre-norm, bidirectional, exact GELU,
  optionally with stochastic depth (drop-path on each residual branch).

rdepth's own language models (``norm_position="sandwich"``) keep their own layer class,
:class:`rdepth.model.layers.SandwichBlock`; :mod:`rdepth.surrogate.teachers.rdepth_teacher` wraps it
and hands the :class:`Teacher` a ``layer_factory`` for fresh layers of that style.

The surrogate (:mod:`rdepth.surrogate.model`) reuses the same class for its blocks, so a
block initialised from a teacher layer computes exactly what that layer computes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rdepth.errors import RdepthError

NORM_POSITIONS = ("post", "pre", "sandwich")
ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


@dataclass(frozen=True)
class LayerSpec:
    """Shape and style of one transformer layer."""

    d_model: int
    n_heads: int
    d_ff: int
    norm_position: str = "post"  # "post" (BERT), "pre" (GPT-2, ViT) or "sandwich" (rdepth)
    causal: bool = False
    activation: str = "gelu"
    norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads", "d_ff"):
            if getattr(self, name) < 1:
                raise RdepthError(f"layer spec: {name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise RdepthError(f"layer spec: d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.norm_position not in NORM_POSITIONS:
            raise RdepthError(f"layer spec: norm_position must be one of {NORM_POSITIONS}, got {self.norm_position!r}")
        if self.activation not in ACTIVATIONS:
            raise RdepthError(f"layer spec: activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def drop_path(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Stochastic depth: zero a residual branch per sample with probability ``rate``.

    Survivors are scaled by ``1/(1-rate)`` so the expectation is unchanged. x: (B, T, D).
    """
    if rate <= 0.0 or not training:
        return x
    keep = torch.rand(x.shape[0], 1, 1, device=x.device, dtype=x.dtype) >= rate
    return x * keep / (1.0 - rate)


class TransformerLayer(nn.Module):
    """One attention + MLP layer. Input and output: (B, T, D) residual states."""

    def __init__(self, spec: LayerSpec, drop_path_rate: float = 0.0) -> None:
        super().__init__()
        if spec.norm_position == "sandwich":
            raise RdepthError("sandwich layers are rdepth's own: build them with rdepth.model.layers.SandwichBlock")
        self.spec = spec
        self.drop_path_rate = drop_path_rate
        d = spec.d_model
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d)
        self.norm_attn = nn.LayerNorm(d, eps=spec.norm_eps)
        self.mlp_in = nn.Linear(d, spec.d_ff)
        self.mlp_out = nn.Linear(spec.d_ff, d)
        self.norm_mlp = nn.LayerNorm(d, eps=spec.norm_eps)
        self._act = ACTIVATIONS[spec.activation]

    def attention(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """Multi-head self-attention. x: (B, T, D); key_mask: (B, T) bool, True = real token."""
        batch, length, d = x.shape
        heads = self.spec.n_heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(batch, length, heads, d // heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        mask = None
        if key_mask is not None:
            mask = key_mask[:, None, None, :]  # (B, 1, 1, T)
        if self.spec.causal:
            causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            mask = causal if mask is None else (mask & causal)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(batch, length, d)
        return self.attn_out(y)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp_out(self._act(self.mlp_in(x)))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        rate, training = self.drop_path_rate, self.training
        if self.spec.norm_position == "post":
            x = self.norm_attn(x + drop_path(self.attention(x, key_mask), rate, training))
            return self.norm_mlp(x + drop_path(self.mlp(x), rate, training))
        x = x + drop_path(self.attention(self.norm_attn(x), key_mask), rate, training)
        return x + drop_path(self.mlp(self.norm_mlp(x)), rate, training)


class Teacher(nn.Module):
    """A pretrained transformer exposed piece by piece: embed, L layers, readout.

    ``embedding(inputs) -> (B, T, D)`` turns token ids (or images) into the first residual
    state; ``layers[i]`` maps state i to state i+1; ``readout`` (identity for BERT, the
    final LayerNorm for GPT-2 and ViT) is applied to the last state before any use.
    """

    def __init__(self, embedding: nn.Module, layers: list[nn.Module], readout: nn.Module | None,
                 spec: LayerSpec, name: str = "teacher", layer_factory: Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        self.embedding = embedding
        self.layers = nn.ModuleList(layers)
        self.readout = readout if readout is not None else nn.Identity()
        self.spec = spec
        self.name = name
        self._layer_factory = layer_factory

    def new_layer(self) -> nn.Module:
        """A freshly initialised layer of the teacher's style (``layers[i](state, key_mask)``)."""
        return self._layer_factory() if self._layer_factory is not None else TransformerLayer(self.spec)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def layer_states(self, inputs: torch.Tensor, key_mask: torch.Tensor | None = None,
                     n_layers: int | None = None) -> list[torch.Tensor]:
        """Residual states before and after every layer: a list of n_layers+1 tensors (B, T, D).

        The readout is *not* applied to the last state (use :meth:`readout`).
        """
        state = self.embedding(inputs)
        states = [state]
        for layer in self.layers[: self.n_layers if n_layers is None else n_layers]:
            state = layer(state, key_mask)
            states.append(state)
        return states

    def forward(self, inputs: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final output (B, T, D): every layer, then the readout."""
        return self.readout(self.layer_states(inputs, key_mask)[-1])

    def layer_copy(self, index: int) -> TransformerLayer:
        """A trainable deep copy of layer ``index``."""
        layer = copy.deepcopy(self.layers[index])
        layer.drop_path_rate = 0.0
        for param in layer.parameters():
            param.requires_grad_(True)
        return layer
