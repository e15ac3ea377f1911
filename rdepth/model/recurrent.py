"""The group-recurrent language model: the one implementation every feature drives.

Layers run in *stages*: a single-pass run of layers, or a recurrence group
whose layers loop together. A group g with input ``e`` (the previous stage's
output) starts from a random state ``s_0`` and iterates (Geiping et al.)::

    s_k = layers_g(adapter_g(concat(s_{k-1}, e)))        k = 1 .. K_g

and hands ``s_K`` to the next stage. With ``loop_state="residual"`` the loop
carries a residual stream instead, pre-norm on the state::

    s_k = s_{k-1} + layers_g(adapter_g(concat(rmsnorm(s_{k-1}), e)))

(the same parameters; the norm has no weight). With ``loop_state="looplm"`` (Ouro) a group has no
adapter and the loop starts from its input, each step ending with the final norm::

    s_0 = e,  s_k = norm_f(layers_g(s_{k-1}))

and the head reads ``s_K`` as it is. Every driver starts a loop from a zero state there
(``init_state_scale`` 0); the first step reads the input ``e`` in its place (:meth:`loop_step`).
The pieces are public so that training,
loop geometry, early exit, generation and surrogate fitting all drive the
same code: :meth:`embed`, :meth:`run_layers`, :meth:`init_state`,
:meth:`group_input`, :meth:`loop_step`, :meth:`readout`. :meth:`forward` composes them in two
layouts (see :mod:`rdepth.model.layers`): dense ``[B, T, d]`` for training and
fixed-budget evaluation, and packed rows when a loop controller (per-token
exits) is given, both by the one stage walk (:mod:`rdepth.model.walk`). Token-by-token decoding (and so
teacher-forced warm start and the
exported model's ``forward(use_cache=True)``) is :class:`rdepth.model.decoder.Decoder`,
which drives these pieces over the one key/value cache (:meth:`new_cache`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rdepth.config import ModelConfig, parse_loop_counts
from rdepth.errors import RdepthError
from rdepth.model.control import LoopController
from rdepth.model.fused_loss import logits_cross_entropy, readout_loss
from rdepth.model.kv import AttentionContext, KVCache
from rdepth.model.layers import BLOCKS, Rotary, make_norm
from rdepth.model.noise import CounterNoise, StateNoise
from rdepth.model.schedule import sample_loop_counts
from rdepth.model.walk import DenseWalk, Noise, Observer, PackedWalk, StageKind, build_stages


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # (B, T, vocab_size); None when the loss head was fused
    loss: torch.Tensor | None
    loop_counts: tuple[int, ...] | None  # fixed counts used (dense path)
    computed: list[torch.Tensor] | None = None  # per group (B, T): loop steps computed
    used: list[torch.Tensor] | None = None  # per group (B, T): index of the state handed on


def adapter_matmul(adapter: nn.Linear, x: torch.Tensor, columns: slice) -> torch.Tensor:
    """One half of an adapter's matmul: ``x`` ``[..., d]`` times ``W[:, columns]^T`` -> ``[..., d]``, where
    ``W`` ``[d, 2d]`` is ``adapter.weight`` and ``columns`` the state's half (``:d``) or the input's (``d:``).
    :class:`RecurrentLM`'s default ``adapter_matmul``; the float8 one (:mod:`rdepth.train.fp8`) has this
    signature too."""
    return F.linear(x, adapter.weight[:, columns])


# adapter_matmul(adapter, x, columns) -> x W[:, columns]^T
AdapterMatmul = Callable[[nn.Linear, torch.Tensor, slice], torch.Tensor]


class RecurrentLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        d = config.d_model
        self.wte = nn.Embedding(config.padded_vocab_size, d)
        # Learned positions: an embedding per position; rotary ones: one angle table the layers share.
        self.wpe = nn.Embedding(config.block_size, d) if config.positions == "learned" else None
        self.rotary = (Rotary(config.head_dim, config.rope_base, config.block_size, config.rope_pairs)
                       if config.positions == "rotary" else None)
        block = BLOCKS[config.block]
        self.layers = nn.ModuleList(block(config, i, self.rotary) for i in range(config.n_layer))
        self.looplm = config.loop_state == "looplm"
        self.adapters = nn.ModuleList(nn.Linear(2 * d, d, bias=False)
                                      for _ in (() if self.looplm else config.group_specs))
        # An untied head (tie_head false: Ouro's lm_head), padded as the embedding; Ouro's exit gate.
        self.head = None if config.tie_head else nn.Linear(d, config.padded_vocab_size, bias=False)
        self.exit_gate = nn.Linear(d, 1) if config.exit_gate else None
        # How an adapter's halves are multiplied (:func:`adapter_matmul`): the one point every loop step's
        # adapter matmuls pass through, so that a training option can swap it (float8: rdepth.train.fp8).
        self.adapter_matmul: AdapterMatmul = adapter_matmul
        self.norm_f = make_norm(config)
        self.stages = build_stages(config)
        self.group_layers = [spec.layers for spec in config.group_specs]  # derived once
        # Sandwich blocks scale the token embedding by sqrt(d) (see embed); GPT-2 does not.
        self.embed_scale = math.sqrt(d) if config.block == "sandwich" else 1.0
        self.reset_parameters()

    # ------------------------------------------------------------------ setup
    @property
    def n_groups(self) -> int:
        return self.config.n_groups

    @property
    def looped_layers(self) -> set[int]:
        return {layer for spec in self.config.group_specs for layer in spec.layers}

    @property
    def base_std(self) -> float:
        return math.sqrt(2.0 / (5.0 * self.config.d_model))

    @property
    def init_state_std(self) -> float:
        """Per-coordinate std of the initial loop state at ``init_state_scale`` 1."""
        return self.base_std * math.sqrt(self.config.d_model)

    def reset_parameters(self) -> None:
        """Geiping et al.'s scaled init: every matrix ~ N(0, 2/(5d)), truncated at
        3 sigma; the output projections of attention and MLP further divided by
        sqrt(2 * unrolled depth at the mean loop count)."""
        std = self.base_std
        out_std = std / math.sqrt(2.0 * self.config.unrolled_depth)
        for name, param in self.named_parameters():
            if (param.dim() == 1 and name.endswith(".bias")) or name.endswith(".qk_bias"):
                nn.init.zeros_(param)  # gpt2 blocks' biases; the query/key bias (qk_bias)
            elif param.dim() == 1:
                nn.init.ones_(param)
            elif name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.trunc_normal_(param, 0.0, out_std, -3 * out_std, 3 * out_std)
            else:
                nn.init.trunc_normal_(param, 0.0, std, -3 * std, 3 * std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def new_cache(self, batch_size: int, capacity: int | None = None, steps: Sequence[int] | None = None,
                  dtype: torch.dtype | None = None, device: torch.device | None = None) -> KVCache:
        """The key/value cache for ``batch_size`` rows and ``capacity`` positions (default: the block size),
        keeping ``steps`` loop steps per group (default: one, the latest key); in the parameters' dtype
        and on their device unless given."""
        parameter = next(self.parameters())
        steps = tuple(steps) if steps is not None else (1,) * self.n_groups
        return KVCache(self.config.n_layer, self.group_layers, (self.config.n_head, self.config.head_dim),
                       batch_size, capacity or self.config.block_size, steps, dtype or parameter.dtype,
                       device or parameter.device)

    def resolve_loop_counts(
        self, loop_counts: Sequence[int] | str | int | None, generator: torch.Generator | None = None
    ) -> tuple[int, ...]:
        """Explicit counts, else a training draw (train mode) or the eval counts."""
        if loop_counts is not None:
            return parse_loop_counts(loop_counts, self.n_groups)
        if self.training:
            return sample_loop_counts(self.config, generator)
        return self.config.default_eval_loops

    # ----------------------------------------------------------------- pieces
    def embed(self, idx: torch.Tensor, start_pos: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token + learned position embeddings: idx ``[B, T]`` -> ``[B, T, d]`` (rotary positions: the
        token embedding alone; the layers rotate by position).

        ``positions``: the positions as a device tensor ``[T]`` instead of ``start_pos`` (static-shape
        decoding, where the position lives on the device; not checked against the block size).

        As Geiping et al., the (tied, small-init) token embedding of sandwich
        blocks is scaled by sqrt(d) on the way in, so that token identity is not
        swamped by the position embedding and the first sub-layer outputs under
        sandwich norms; without it the tiny preset stalls at the unigram loss.
        GPT-2 blocks take the embedding unscaled, as GPT-2 does.
        """
        if positions is not None:
            tokens = self.embed_scale * self.wte(idx)
            return tokens if self.wpe is None else tokens + self.wpe(positions)
        seq = idx.shape[-1]
        if start_pos + seq > self.config.block_size:
            raise RdepthError(
                f"sequence of {start_pos + seq} tokens exceeds the model's block size "
                f"{self.config.block_size}"
            )
        if self.wpe is None:
            return self.embed_scale * self.wte(idx)
        positions = torch.arange(start_pos, start_pos + seq, device=idx.device)
        return self.embed_scale * self.wte(idx) + self.wpe(positions)

    def run_layers(
        self, layers: Sequence[int], x: torch.Tensor, attn: AttentionContext | None = None
    ) -> torch.Tensor:
        """Apply ``layers`` once each, in order."""
        for index in layers:
            x = self.layers[index](x, attn)
        return x

    def init_state(
        self,
        group: int,
        inputs: torch.Tensor,
        noise: Noise = None,
        start: int = 0,
    ) -> torch.Tensor:
        """Random initial loop state, shaped like ``inputs`` ``[B, T, d]``.

        Truncated normal (3 sigma) with std ``init_state_scale * sqrt(2/(5d)) * sqrt(d)``
        (= ``init_state_scale * 0.632`` per coordinate): as Geiping et al.'s released
        code, the initial state gets the same sqrt(d) scale as the token embedding,
        so that it is not negligible against the hidden states (norm ~sqrt(d)).
        Exactly zero when the scale is 0. With a :class:`StateNoise` (or a
        :class:`CounterNoise`: the same keying, another draw) the state of the
        token at position ``start + t`` of sequence b is that sequence's own
        draw, whatever the batch; a ``torch.Generator`` draws the whole batch at
        once.
        """
        scale = self.config.init_state_scale
        if scale == 0:
            return torch.zeros_like(inputs)
        std = scale * self.init_state_std
        batch, length, width = inputs.shape
        if isinstance(noise, (StateNoise, CounterNoise)):
            state = noise.draw(group, batch, start, length, width, std, inputs.device, self.config.block_size)
        else:
            device = noise.device if noise is not None else inputs.device
            state = torch.empty(tuple(inputs.shape), device=device, dtype=torch.float32)
            nn.init.trunc_normal_(state, 0.0, std, -3 * std, 3 * std, generator=noise)
        return state.to(device=inputs.device, dtype=inputs.dtype)

    def group_input(self, group: int, inputs: torch.Tensor) -> torch.Tensor:
        """The loop-invariant half of ``group``'s adapter, ``W_e e``: ``inputs`` ``[..., d]`` -> ``[..., d]``.

        The adapter is one ``Linear(2d, d)`` on ``concat(state, e)``, i.e. ``W_s s + W_e e`` with
        ``W = [W_s | W_e]``; ``e`` does not change while the group loops, so its half is computed once
        per group and every loop step adds it (:meth:`loop_step`). The same parameters as ever:
        checkpoints load unchanged."""
        if self.looplm:  # no adapter: the input itself, read by the first step (loop_step)
            return inputs
        width = self.config.d_model
        return self.adapter_matmul(self.adapters[group], inputs, slice(width, None))

    def loop_step(
        self,
        group: int,
        state: torch.Tensor,
        projected: torch.Tensor,
        attn: AttentionContext | None = None,
    ) -> torch.Tensor:
        """One loop step of ``group`` given its input half ``projected`` (:meth:`group_input`):
        ``layers_g(W_s state + projected)`` (``loop_state`` "sandwich"), or
        ``state + layers_g(W_s rmsnorm(state) + projected)`` ("residual"). Every driver (training,
        the Decoder, exits, geometry, the export) steps a loop through here."""
        if self.looplm:
            return self._looplm_step(group, state, projected, attn)
        width = self.config.d_model
        residual = self.config.loop_state == "residual"
        carried = F.rms_norm(state, (width,), eps=self.config.norm_eps) if residual else state
        x = self.adapter_matmul(self.adapters[group], carried, slice(None, width)) + projected
        update = self.run_layers(self.group_layers[group], x, attn)
        return state + update if residual else update

    def _looplm_step(self, group: int, state: torch.Tensor, inputs: torch.Tensor,
                     attn: AttentionContext | None) -> torch.Tensor:
        """Ouro's step ``norm_f(layers_g(s))``; a row whose state is exactly zero (the drivers' start, as
        ``init_state_scale`` is 0) reads its input ``e`` instead: ``s_0 = e``. A later state is never the
        zero vector, as it leaves the final norm (zero only if the layers' output were exactly zero or the
        norm's weight all zero), so the choice is the step number's, per row, with no host read."""
        started = state.ne(0).any(dim=-1, keepdim=True)
        x = torch.where(started, state, inputs.to(state.dtype))
        return self.norm_f(self.run_layers(self.group_layers[group], x, attn))

    def hand_on(self, state: torch.Tensor) -> torch.Tensor:
        """What the next stage receives from a group whose loop ended at ``state`` ``[..., d]``: the state
        itself, or with ``handoff_norm`` the final norm of it (Huginn-0125: its ``ln_f``, used twice).
        Every path from a group's loop to the next stage passes through here."""
        return self.norm_f(state) if self.config.handoff_norm else state

    @property
    def head_weight(self) -> torch.Tensor:
        """The head ``[padded vocab, d]``: the token embedding (tied), or the head of its own (``tie_head``
        false)."""
        return self.wte.weight if self.head is None else self.head.weight

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """What the head reads: the final norm of ``x``, or ``x`` itself where the loop's last step ended
        with that norm (``loop_state="looplm"``)."""
        return x if self.looplm else self.norm_f(x)

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and the head; logits over the real vocabulary."""
        logits = F.linear(self.final_hidden(x), self.head_weight)
        return logits[..., : self.config.vocab_size]

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        loop_counts: Sequence[int] | str | int | None = None,
        *,
        noise: Noise = None,
        observer: Observer | None = None,
        controller: LoopController | None = None,
        shifted_warm_start: bool = False,
        loss_head: str = "logits",
    ) -> ModelOutput:
        """Run the model on ``idx`` ``[B, T]``.

        Without ``controller``: dense fixed-count loops (training, evaluation); in training mode
        gradients flow through the last ``backprop_depth`` steps of each loop only. With one: packed
        rows, every position in lock-step, per-token exits decided by ``controller``. A pass that
        keeps keys/values for later calls, or starts each loop from the previous position's state
        (warm start), runs positions one at a time: :class:`rdepth.model.decoder.Decoder`
        (:func:`rdepth.model.generation.teacher_forced` for a scored pass).
        ``targets`` ``[B, T]`` (-1 = ignore) adds the mean cross-entropy.
        ``noise``: where the initial loop states come from (:data:`Noise`);
        a ``torch.Generator`` also drives the training draw of loop counts.
        ``shifted_warm_start`` (dense path; for training): the parallel stand-in for
        the decoder's warm start. Each group first loops from noise without gradients; then
        every position but the first starts from the state the previous position
        handed on in that pass, and the loop runs again (truncated backprop as
        usual). Where the loop converges whatever its start, this is the state the
        sequential warm start would hand on, at twice the group's forward cost
        instead of one forward per position.
        ``loss_head`` (with ``targets``): ``logits`` computes the logits and the loss from them;
        ``fused`` (training) the loss and its gradients chunk by chunk from the final hidden states
        (:func:`rdepth.model.fused_loss.readout_loss`): no logits are made or returned (``logits`` None);
        ``fused_compiled`` the same with each chunk's softmax arithmetic compiled.
        """
        if loss_head not in LOSS_HEADS:
            raise ValueError(f"loss_head must be one of {', '.join(LOSS_HEADS)}, got {loss_head!r}")
        computed = used = None
        if controller is None:
            counts = self.resolve_loop_counts(loop_counts, _generator_of(noise))
            x = self._forward_dense(idx, counts, noise, observer, shifted_warm_start)
        else:
            counts = None
            x, computed, used = self._forward_packed(idx, controller, noise, observer)
        if targets is not None and loss_head != "logits":
            loss = readout_loss(self, x, targets, compiled=loss_head == "fused_compiled")
            return ModelOutput(None, loss, counts, computed, used)
        output = ModelOutput(self.readout(x), None, counts, computed, used)
        if targets is not None:
            output.loss = lm_loss(output.logits, targets)
        return output

    def run_after(self, group: int, x: torch.Tensor, counts: Sequence[int], noise: Noise = None) -> torch.Tensor:
        """The stages after ``group`` on its output ``x`` ``[B, T, d]``, dense and causal, each later
        group at ``counts[h]`` steps from its own initial state (``noise``); returns ``[B, T, d]``
        (before ``readout``). What the rest of the model makes of a group's hand-off."""
        index = next((i for i, stage in enumerate(self.stages)
                      if stage.kind is StageKind.GROUP and stage.group == group), None)
        if index is None:
            raise RdepthError(f"the model has no recurrence group {group}")
        return DenseWalk(self, counts, noise, stages=self.stages[index + 1:])(self.hand_on(x))

    def _forward_dense(self, idx, counts, noise, observer, shifted_warm_start=False) -> torch.Tensor:
        return DenseWalk(self, counts, noise, observer, shifted_warm_start)(self.embed(idx))

    def _forward_packed(self, idx, controller, noise, observer):
        """Every position of ``idx`` in lock-step, as packed rows under ``controller`` (:class:`PackedWalk`)."""
        batch, seq = idx.shape
        x = self.embed(idx).reshape(batch * seq, -1)  # (N, d), rows by batch then time
        walk = PackedWalk(self, batch, seq, controller, noise, observer, x.dtype, idx.device)
        x = walk(x)
        return x.view(batch, seq, -1), walk.computed, walk.used


# How forward turns final hidden states into the loss (``loss_head``).
LOSS_HEADS = ("logits", "fused", "fused_compiled")


def _generator_of(noise: Noise) -> torch.Generator | None:
    """The generator behind ``noise`` for the training draw of loop counts (None: global RNG)."""
    return noise if isinstance(noise, torch.Generator) else None


# fp32 elements per chunk of the low-precision loss: 2^25 (128 MiB), e.g. 667 rows of a 50,257-token vocabulary.
LOSS_CHUNK_ELEMENTS = 2**25


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``[B, T, V]`` against ``targets`` ``[B, T]`` (-1 = ignore), in fp32.

    float32/float64 logits: ``F.cross_entropy`` on ``logits.float()``, as always. Low-precision
    logits (bf16/fp16 under autocast): :func:`rdepth.model.fused_loss.logits_cross_entropy` (the one
    chunked cross-entropy, also behind the fused head), ``chunk_rows`` rows at a time
    (default: :data:`LOSS_CHUNK_ELEMENTS` / V), so no ``[B*T, V]`` fp32 copy is made, neither in the
    forward nor kept for the backward.
    """
    flat = logits.reshape(-1, logits.shape[-1])  # (B*T, V)
    flat_targets = targets.reshape(-1)
    if flat.dtype not in (torch.float16, torch.bfloat16):
        return F.cross_entropy(flat.float(), flat_targets, ignore_index=-1)
    rows = chunk_rows or max(1, LOSS_CHUNK_ELEMENTS // flat.shape[-1])
    return logits_cross_entropy(flat, flat_targets, rows)
