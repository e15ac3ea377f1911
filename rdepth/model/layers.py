"""Transformer layers: causal attention, MLP, and the block types of :data:`BLOCKS`.

``sandwich`` (Geiping et al.'s, rdepth's own): RMSNorm before each sub-layer and
after each residual sum, no biases, SiLU MLP. ``gpt2``: GPT-2's pre-LayerNorm
block with biases and a GELU-tanh MLP, so that GPT-2 checkpoints import exactly.
``peri`` (Ouro's): RMSNorm before each sub-layer and on its output, before the residual sum.

Every layer accepts activations in one of two layouts:

* dense ``[B, T, d]`` with ``attn=None``: plain causal self-attention over the
  sequence (training and fixed-budget evaluation);
* packed rows ``[N, d]`` with an :class:`~rdepth.model.kv.AttentionContext`:
  only the N listed tokens are computed; their keys/values are written to a
  key/value store and each attends to every earlier position held there.
  This serves cached generation and per-token early exit, where tokens that
  left a loop are no longer computed.

Norms and MLPs act per token, so only attention needs to know the layout. With rotary
positions (``ModelConfig.positions``) attention rotates queries and keys by each token's
absolute position: ``0 .. T-1`` in the dense layout, the context's ``position`` per row in
the packed one, so that cached decoding computes what the dense pass does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rdepth.config import BLOCK_TYPES, ModelConfig
from rdepth.model.kv import AttentionContext


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == self.weight.dtype:
            # One fused op; for bf16/fp16 it accumulates in float32 and rounds once (the CPU kernel
            # upcasts, the CUDA one keeps a float32 accumulator): a bf16 model's norms, e.g. in bf16
            # decoding, without the three extra casts of the branch below.
            return F.rms_norm(x, shape, self.weight, self.eps)
        # Mixed precision (bf16 activations under autocast, float32 weights): normalise in float32.
        wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        normed = F.rms_norm(wide, shape, self.weight.to(wide.dtype), self.eps)
        return normed.type_as(x)


class Rotary:
    """Rotary positions over pairs of adjacent channels ``(2i, 2i+1)`` of each head (Huginn-0125's
    layout), or with ``pairs="half"`` over ``(i, i + hs/2)`` (rotate-half: Llama's, Ouro's): the pair
    ``i`` at position p turns by ``p * base^(-2i/hs)``.

    The angle table is computed once per device in float32, as the reference computes its buffer (the
    same ops, so the same values), and is no parameter or buffer: casting the model does not round it.
    Half-precision queries and keys are rotated in float32 and rounded back; float32 and float64 in their
    own dtype."""

    def __init__(self, head_dim: int, base: float, length: int, pairs: str = "adjacent"):
        self.head_dim, self.base, self.length, self.pairs = head_dim, float(base), length, pairs
        self._tables: dict[torch.device, torch.Tensor] = {}

    def table(self, device: torch.device) -> torch.Tensor:
        """``[length, hs/2, 2]`` float32: cos and sin of every position's angles."""
        if device not in self._tables:
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
            inverse = 1.0 / (self.base ** exponents)
            angles = torch.outer(torch.arange(self.length, dtype=torch.float32), inverse)  # (S, hs/2)
            self._tables[device] = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1).to(device)
        return self._tables[device]

    def rotate(self, x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., hs]`` rotated by ``turn`` ``[..., hs/2, 2]`` (rows of :meth:`table`, broadcast)."""
        wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        turn = turn.to(wide.dtype)
        cos, sin = turn[..., 0], turn[..., 1]
        if self.pairs == "half":  # channel i with i + hs/2
            real, imag = wide.chunk(2, dim=-1)
            return torch.cat([real * cos - imag * sin, imag * cos + real * sin], dim=-1).to(x.dtype)
        pairs = wide.unflatten(-1, (-1, 2))  # (..., hs/2, 2)
        real, imag = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack([real * cos - imag * sin, imag * cos + real * sin], dim=-1)
        return rotated.flatten(-2).to(x.dtype)


def has_bias(config: ModelConfig) -> bool:
    """Linear layers carry biases in GPT-2 blocks only."""
    return config.block == "gpt2"


def make_norm(config: ModelConfig) -> nn.Module:
    """The block type's norm: RMSNorm (sandwich) or LayerNorm with bias (gpt2); also the final norm."""
    if config.block == "gpt2":
        return nn.LayerNorm(config.d_model, eps=config.norm_eps)
    return RMSNorm(config.d_model, config.norm_eps)


class CausalSelfAttention(nn.Module):
    """Causal self-attention, scaled by 1/sqrt(head_dim); one fused ``qkv`` matrix (rows: queries, keys,
    values); optionally a learned bias on queries and keys (``qk_bias``) and rotary positions."""

    def __init__(self, config: ModelConfig, layer_index: int, rotary: Rotary | None = None):
        super().__init__()
        self.layer_index = layer_index
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=has_bias(config))
        self.proj = nn.Linear(config.d_model, config.d_model, bias=has_bias(config))
        # (2, nh, hs): added to queries (0) and keys (1) before their rotation
        self.qk_bias = nn.Parameter(torch.zeros(2, self.n_head, self.head_dim)) if config.qk_bias else None
        self.rotary = rotary

    def _position_qk(self, q: torch.Tensor, k: torch.Tensor, position: torch.Tensor | None):
        """Queries and keys with their bias and rotation: dense ``[B, nh, T, hs]`` (``position`` None: the
        positions ``0 .. T-1``), one row per batch row ``[B, nh, 1, hs]`` or packed rows ``[N, nh, hs]``
        (``position`` ``[B]`` / ``[N]``: each row's absolute position)."""
        if self.qk_bias is not None:
            q_bias, k_bias = self.qk_bias[0], self.qk_bias[1]  # (nh, hs)
            if position is None or q.dim() == 4:  # (B, nh, T or 1, hs): heads at -3
                q_bias, k_bias = q_bias[:, None], k_bias[:, None]
            q, k = (q + q_bias).to(q.dtype), (k + k_bias).to(k.dtype)  # under autocast: as the rotation, its dtype
        if self.rotary is None:
            return q, k
        table = self.rotary.table(q.device)
        if position is None:  # dense (B, nh, T, hs)
            turn = table[: q.shape[-2]]  # (T, hs/2, 2)
        elif q.dim() == 4:  # one row per batch row (B, nh, 1, hs)
            turn = table[position][:, None, None]  # (B, 1, 1, hs/2, 2)
        else:  # packed rows (N, nh, hs)
            turn = table[position][:, None]  # (N, 1, hs/2, 2)
        return self.rotary.rotate(q, turn), self.rotary.rotate(k, turn)

    def forward(self, x: torch.Tensor, attn: AttentionContext | None = None) -> torch.Tensor:
        positioned = self.qk_bias is not None or self.rotary is not None
        if attn is None:
            batch, seq, dim = x.shape
            qkv = self.qkv(x).view(batch, seq, 3, self.n_head, self.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, nh, T, hs)
            if positioned:
                q, k = self._position_qk(q, k, None)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))

        rows, dim = x.shape
        if attn.one_per_row:  # row i is batch row i's only query: views, no packing (same values)
            q, k, v = self.qkv(x).view(rows, 3, self.n_head, 1, self.head_dim).unbind(1)  # each (B, nh, 1, hs)
            if positioned:
                q, k = self._position_qk(q, k, attn.position)
            keys, values = attn.store.update(self.layer_index, attn, k, v)  # (B, nh, S, hs)
            if attn.elementwise:
                y = _attend_elementwise(q, keys, values, attn.mask)
            else:
                y = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn.mask)  # (B, nh, 1, hs)
            return self.proj(y.reshape(rows, dim))
        qkv = self.qkv(x).view(rows, 3, self.n_head, self.head_dim)
        q, k, v = qkv.unbind(1)  # each (N, nh, hs)
        if positioned:
            q, k = self._position_qk(q, k, attn.position)
        keys, values = attn.store.update(self.layer_index, attn, k, v)  # (B, nh, S, hs)
        # Pack each batch row's queries into (B, nh, A, hs); padding slots are masked.
        packed = q.new_zeros(attn.n_batch, attn.slots, self.n_head, self.head_dim)
        packed[attn.batch_index, attn.slot_index] = q
        y = F.scaled_dot_product_attention(
            packed.transpose(1, 2), keys, values, attn_mask=attn.mask
        )  # (B, nh, A, hs)
        y = y.transpose(1, 2)[attn.batch_index, attn.slot_index]  # (N, nh, hs)
        return self.proj(y.reshape(rows, dim))


class MLP(nn.Module):
    """``proj(act(fc(x)))``: SiLU without biases (sandwich), GELU-tanh with biases (gpt2); with
    ``mlp="swiglu"``, ``proj(silu(gate) * up)`` where ``fc(x)`` is ``[gate | up]``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = config.hidden_width
        self.gated = config.mlp == "swiglu"
        self.fc = nn.Linear(config.d_model, 2 * hidden if self.gated else hidden, bias=has_bias(config))
        self.proj = nn.Linear(hidden, config.d_model, bias=has_bias(config))
        self.gelu = config.block == "gpt2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(x)
        if self.gated:
            gate, up = hidden.chunk(2, dim=-1)
            return self.proj(F.silu(gate) * up)
        hidden = F.gelu(hidden, approximate="tanh") if self.gelu else F.silu(hidden)
        return self.proj(hidden)


class SandwichBlock(nn.Module):
    """Geiping et al.'s sandwich block: RMSNorm before each sub-layer and after
    each residual sum, which keeps the looped state's scale bounded::

        x = norm_2(x + attn(norm_1(x)))
        x = norm_4(x + mlp(norm_3(x)))
    """

    def __init__(self, config: ModelConfig, layer_index: int, rotary: Rotary | None = None):
        super().__init__()
        eps = config.norm_eps
        self.norm_1 = RMSNorm(config.d_model, eps)
        self.attn = CausalSelfAttention(config, layer_index, rotary)
        self.norm_2 = RMSNorm(config.d_model, eps)
        self.norm_3 = RMSNorm(config.d_model, eps)
        self.mlp = MLP(config)
        self.norm_4 = RMSNorm(config.d_model, eps)

    def forward(self, x: torch.Tensor, attn: AttentionContext | None = None) -> torch.Tensor:
        x = self.norm_2(x + self.attn(self.norm_1(x), attn))
        x = self.norm_4(x + self.mlp(self.norm_3(x)))
        return x


class GPT2Block(nn.Module):
    """GPT-2's block: LayerNorm before each sub-layer, an un-normalised residual stream::

        x = x + attn(norm_1(x))
        x = x + mlp(norm_2(x))
    """

    def __init__(self, config: ModelConfig, layer_index: int, rotary: Rotary | None = None):
        super().__init__()
        self.norm_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer_index, rotary)
        self.norm_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, attn: AttentionContext | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), attn)
        x = x + self.mlp(self.norm_2(x))
        return x


class PeriBlock(SandwichBlock):
    """Ouro's (LoopLM) block: RMSNorm before each sub-layer and on its output, before the residual sum
    (the same four norms as the sandwich block, in other places)::

        x = x + norm_2(attn(norm_1(x)))
        x = x + norm_4(mlp(norm_3(x)))
    """

    def forward(self, x: torch.Tensor, attn: AttentionContext | None = None) -> torch.Tensor:
        x = x + self.norm_2(self.attn(self.norm_1(x), attn))
        x = x + self.norm_4(self.mlp(self.norm_3(x)))
        return x


# ModelConfig.block -> the layer class RecurrentLM builds
BLOCKS: dict[str, type[nn.Module]] = {"sandwich": SandwichBlock, "gpt2": GPT2Block, "peri": PeriBlock}
assert set(BLOCKS) == set(BLOCK_TYPES)


def _attend_elementwise(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query per row ``q`` ``(B, nh, 1, hs)`` over ``keys``/``values`` ``(B, nh, S, hs)`` where the boolean
    ``mask`` ``(B, 1, 1, S)`` is True: softmax(q k / sqrt(hs)) v as broadcasts and sums (what SDPA computes,
    summed in another order), ``(B, nh, 1, hs)``. Written so because a compiler reads the keys and values
    where they lie (a gather from a cache) inside these sums, where SDPA needs them copied out first. A masked
    position adds nothing even where its key or value is not finite (a cache's stale rows): the mask replaces
    its score, and its product is left out of the sum, not multiplied by a zero weight."""
    keep = mask.transpose(-1, -2)  # (B, 1, S, 1)
    scores = (q * keys).sum(-1, keepdim=True) * q.shape[-1] ** -0.5  # (B, nh, S, 1)
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.where(keep, torch.softmax(scores, dim=2) * values, 0).sum(2, keepdim=True)
