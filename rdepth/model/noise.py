"""Initial loop-state noise keyed by sequence, position and group.

Each recurrence group starts its loop from a random state (Geiping et al.).
:class:`StateNoise` makes that state a function of *which* token it is, not of
how the work was batched: sequence ``s`` (a global id: a held-out window's
index, or a training row's place in the global batch) draws one
``[block_size, d]`` truncated-normal tensor per group from a generator seeded
with ``(seed, s, group)``, and the token at position ``t`` starts from row ``t``
of it. So

- evaluation gives the same numbers whatever the batch size (``rdepth eval``
  and ``rdepth analyze`` agree on the same windows);
- data-parallel ranks draw only their own rows and still reproduce the
  single-process run;
- cached decoding (one position at a time) starts every token from the same
  state as teacher-forced evaluation of the whole sequence.

:class:`CounterNoise` (below) keeps that keying with other values of the same distribution: an
integer hash computed on the device, one vectorised draw per group, no generator per row and no host
sync (training's opt-in ``TrainConfig.state_noise = "counter"``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn


def _mixed_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts (well mixed, so neighbouring ids are unrelated)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


class StateNoise:
    """Noise source for :meth:`rdepth.model.RecurrentLM.init_state`.

    ``sequence_ids``: one global id per batch row (``[B]`` ints). Draws are cached
    per (sequence, group), so a decoding loop that asks for one position at a
    time draws each sequence's tensor once.
    """

    def __init__(self, seed: int, sequence_ids: Sequence[int] | torch.Tensor):
        self.seed = int(seed)
        if isinstance(sequence_ids, torch.Tensor):
            sequence_ids = sequence_ids.tolist()
        self.sequence_ids = [int(s) for s in sequence_ids]
        self._cache: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def consecutive(cls, seed: int, first: int, count: int) -> StateNoise:
        """Rows ``first .. first + count - 1`` (a batch of consecutive windows)."""
        return cls(seed, range(first, first + count))

    def _sequence(self, sequence: int, group: int, length: int, width: int, std: float,
                  device: torch.device) -> torch.Tensor:
        key = (sequence, group)
        cached = self._cache.get(key)
        if cached is None or cached.shape[0] < length or cached.device != device:
            generator = torch.Generator(device=device).manual_seed(_mixed_seed(self.seed, sequence, group))
            cached = torch.empty(length, width, device=device, dtype=torch.float32)
            nn.init.trunc_normal_(cached, 0.0, std, -3 * std, 3 * std, generator=generator)
            self._cache[key] = cached
        return cached

    def draw(self, group: int, batch: int, start: int, length: int, width: int, std: float,
             device: torch.device, block_size: int) -> torch.Tensor:
        """Float32 ``[batch, length, width]``: positions ``start .. start + length - 1``."""
        if batch != len(self.sequence_ids):
            raise ValueError(f"StateNoise holds {len(self.sequence_ids)} sequence ids for a batch of {batch}")
        rows = [self._sequence(s, group, block_size, width, std, device)[start : start + length]
                for s in self.sequence_ids]
        return torch.stack(rows)


# ---------------------------------------------------------------------------------------------
# Counter-based noise: the same keying, computed as a hash on the device in one pass per group.
#
# Every value is a pure function of (seed, group, sequence id, position, channel): a 32-bit
# integer hash of those numbers, whose top 24 bits are a uniform on [0, 1), turned into the 3-sigma
# truncated normal by the inverse CDF. No rejection loop: torch's ``nn.init.trunc_normal_``, which
# StateNoise calls per row, resamples until ``mask.any()`` is false, a device sync per row on CUDA.
# Arithmetic is on int64 holding 32-bit values, never wrapping: every operand is below 2**32 and the
# multipliers are below 2**31, so the largest intermediate (a product) is below 2**63
# (tests/test_noise_counter.py checks the tensor hash against the same formula on Python's unbounded
# ints at extreme ids).

_MASK = 0xFFFFFFFF
# The two multiply-xorshift rounds of the widely used "splitmix32"-style finaliser (shifts 16, 15, 15).
# Both multipliers are below 2**31: x < 2**32 times either is < 2**63.
_MUL1, _MUL2 = 0x21F0AAAD, 0x735A2D97
_SPREAD = 0x61C88647  # odd, < 2**31 (2**32 minus the golden-ratio constant): spreads a counter's bits
# Salts: one per kind of word hashed, and one per lane of the 64-bit row key.
_SALT_SEED = (0x2545F491, 0x4F1BBCDC)
_SALT_LOW, _SALT_HIGH = 0x6C8E9CF5, 0x1B873593  # a sequence id's low and high 32-bit words
_SALT_GROUP = 0x3C6EF372
_SALT_ELEMENT = 0x27D4EB2F
_PHI_LOW = 0.5 * math.erfc(3 / math.sqrt(2))  # Phi(-3): the truncated normal's lower tail
_SQRT2 = math.sqrt(2.0)


def mix32(x):
    """A bijection of 32-bit values (an int, or an int64 tensor of values in ``[0, 2**32)``):
    xorshift 16, multiply, xorshift 15, multiply, xorshift 15, each product reduced mod 2**32."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK
    return x ^ (x >> 15)


def _word(value, salt: int):
    """A well-mixed 32-bit word of ``value`` in ``[0, 2**32)`` (a bijection)."""
    return mix32(((value * _SPREAD) & _MASK) ^ salt)


def _seed_key(seed: int, lane: int) -> int:
    """Lane ``lane`` of the seed's key (host ints; ``seed`` in ``[0, 2**63)`` as two words)."""
    return mix32(mix32((lane + 1) ^ _word(seed & _MASK, _SALT_SEED[lane])) ^ _word(seed >> 32, _SALT_SEED[lane]))


def _row_key_reference(seed: int, group: int, sequence: int, lane: int) -> int:
    """One lane of a row's key, on Python ints: the seed's key, then the sequence id's low and high
    words, then the group, each hashed in by ``mix32(key ^ word)`` (a bijection of the word)."""
    key = mix32(_seed_key(seed, lane) ^ _word(sequence & _MASK, _SALT_LOW))
    key = mix32(key ^ _word(sequence >> 32, _SALT_HIGH))
    return mix32(key ^ _word(group, _SALT_GROUP))


def _sequence_lanes(seed: int, ids: torch.Tensor) -> torch.Tensor:
    """``[2, B]``: both lanes of each sequence's key (before the group) for int64 ``ids`` in ``[0, 2**63)``,
    computed together: the lanes differ only in the seed's key, a ``[2, 1]`` column built on the device
    from an ``arange`` (no host data)."""
    first, second = _seed_key(seed, 0), _seed_key(seed, 1)
    keys = first + torch.arange(2, device=ids.device, dtype=torch.int64).view(2, 1) * (second - first)
    key = mix32(keys ^ _word(ids & _MASK, _SALT_LOW))
    return mix32(key ^ _word(ids >> 32, _SALT_HIGH))


def _group_lanes(lanes: torch.Tensor, group: int | torch.Tensor) -> torch.Tensor:
    """``[2, B]`` sequence lanes with ``group`` (an int, or a one-element int64 tensor) hashed in: the
    rows' keys for one group (64 bits, so two rows of a long run share a key with probability ~2**-64,
    not 2**-32)."""
    return mix32(lanes ^ _word(group, _SALT_GROUP))


def _element_keys(start: int, length: int, width: int, device) -> torch.Tensor:
    """``[length, width]`` 32-bit keys of positions ``start ..`` and channels ``0 .. width - 1``, from the
    flat index ``position * width + channel`` (a bijection: no two elements of a row share one)."""
    if (start + length) * width > 2**32:
        raise ValueError(f"CounterNoise: positions up to {start + length} x width {width} exceed 2**32 "
                         "elements per sequence")
    flat = torch.arange(start * width, (start + length) * width, device=device, dtype=torch.int64)
    return _word(flat, _SALT_ELEMENT).view(length, width)


def _bits(lane0, lane1, element):
    """The 32-bit hash of a row key's two lanes and an element key (broadcast together): ``mix32`` of
    ``lane0 ^ element`` with ``lane1`` xored in after its first multiply. Each step is a bijection, so a
    row's elements never share a hash, and two rows that share ``lane0`` (a 2**-32 chance) still differ
    everywhere unless ``lane1`` matches too; 12 integer ops per element where two whole rounds take 22."""
    x = lane0 ^ element
    x = x ^ (x >> 16)
    x = ((x * _MUL1) & _MASK) ^ lane1
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK
    return x ^ (x >> 15)


def counter_bits_reference(seed: int, group: int, sequence: int, position: int, channel: int, width: int) -> int:
    """The 32-bit hash of one element, written per lane on Python's unbounded ints (what the tensor code,
    both lanes at once in int64, must equal)."""
    lane0, lane1 = (_row_key_reference(seed, group, sequence, lane) for lane in (0, 1))
    return _bits(lane0, lane1, _word(position * width + channel, _SALT_ELEMENT))


def _bits_tensor(lane0: torch.Tensor, lane1: torch.Tensor, element: torch.Tensor) -> torch.Tensor:
    """:func:`_bits` on int64 tensors, in place after the first op: on a CPU, fresh full-size buffers
    (page faults) cost more than the arithmetic (about 3x the time of this form)."""
    x = torch.bitwise_xor(lane0, element)
    x.bitwise_xor_(x >> 16)
    x.mul_(_MUL1).bitwise_and_(_MASK).bitwise_xor_(lane1)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL2).bitwise_and_(_MASK)
    return x.bitwise_xor_(x >> 15)


def _truncated_normal(lane0: torch.Tensor, lane1: torch.Tensor, element: torch.Tensor, std: float) -> torch.Tensor:
    """Float32 ``[B, T, W]`` from row-key lanes ``[B, 1, 1]`` and element keys ``[T, W]``: the top 24 bits
    of each hash as a uniform u on [0, 1) -> ``erfinv`` of ``2 (Phi(-3) + u (Phi(3) - Phi(-3))) - 1`` times
    ``sqrt(2) std``, clamped to +-3 std (rounding could step just past it)."""
    low = 2 * _PHI_LOW - 1  # Phi(-3) and Phi(3) on erf's scale [-1, 1]
    state = _bits_tensor(lane0, lane1, element).bitwise_right_shift_(8).to(torch.float32)  # 24 bits: exact
    state.mul_(-2 * low * 2.0**-24).add_(low).erfinv_()
    return state.mul_(_SQRT2 * std).clamp_(-3 * std, 3 * std)


def counter_truncated_normal(ids: torch.Tensor, seed: int, group: int | torch.Tensor, start: int, length: int,
                             width: int, std: float) -> torch.Tensor:
    """Float32 ``[B, length, width]`` for sequence ids ``ids`` ``[B]`` (int64): the whole draw of one group
    in one pass (what :class:`CounterNoise` computes with its per-batch parts cached). ``group`` as a
    one-element tensor gives the same values."""
    return counter_draw(_sequence_lanes(seed, ids), group, _element_keys(start, length, width, ids.device), std)


def counter_draw(lanes: torch.Tensor, group: int | torch.Tensor, elements: torch.Tensor, std: float) -> torch.Tensor:
    """The group's part of the draw: sequence lanes ``[2, B]`` (:func:`_sequence_lanes`) and element keys
    ``[T, W]`` (:func:`_element_keys`) in, float32 ``[B, T, W]`` out. This is what is compiled: the lanes and
    keys come in as tensors, so Inductor sees no ``arange`` arithmetic to fold into its index expressions
    (on CUDA it folded the seed's 32-bit keys into an int32 index literal and failed to compile)."""
    lanes = _group_lanes(lanes, group).view(2, -1, 1, 1)
    return _truncated_normal(lanes[0], lanes[1], elements, std)


_compiled_draw = None


def _compiled():
    """``counter_draw`` compiled: dynamic=False, so one graph per shape (the group travels as a tensor:
    specialising on it would recompile per group, and fullgraph=True turns dynamo's recompile limit, 8 by
    default, into an error)."""
    global _compiled_draw
    if _compiled_draw is None:
        _compiled_draw = torch.compile(counter_draw, fullgraph=True, dynamic=False)
    return _compiled_draw


class CounterNoise:
    """Noise source for :meth:`rdepth.model.RecurrentLM.init_state` with :class:`StateNoise`'s keying,
    computed on the device as a counter-based hash: one vectorised draw per group for the whole
    ``[batch, length, width]``, no generator objects, no host work beyond a few ints, no host sync.

    A value depends only on (seed, group, sequence id, position, channel), so it is bit for bit the
    same whatever the batch composition or the position range drawn (data-parallel ranks, evaluation
    batch sizes, one position at a time). Its values are not :class:`StateNoise`'s (another generator),
    but they follow the same distribution, the 3-sigma truncated normal.

    ``sequence_ids``: one global id per row in ``[0, 2**63)``, or use :meth:`consecutive` (an ``arange``
    on the device). ``compile``: each group's whole draw through ``torch.compile`` (Inductor fuses it; the
    trainer's choice when it compiles). Compiled values may differ from eager ones in the last bit of
    ``erfinv``, but not with the batching (checked on the CPU). One graph per shape, for every group and
    step: meant for training's fixed shapes (each new ``start``/``length`` is another graph).
    """

    def __init__(self, seed: int, sequence_ids: Sequence[int] | torch.Tensor | range, compile: bool = False):
        self.seed = int(seed)
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"CounterNoise: seed must be in [0, 2**63), got {seed}")
        if isinstance(sequence_ids, range) and sequence_ids.step == 1:
            self._first, self._count, self._given = sequence_ids.start, len(sequence_ids), None
            if self._count and not (self._first >= 0 and self._first + self._count <= 2**63):
                raise ValueError(f"CounterNoise: sequence ids must be in [0, 2**63), got {sequence_ids}")
        else:
            ids = torch.as_tensor(sequence_ids, dtype=torch.int64).reshape(-1)
            if ids.numel() and bool((ids < 0).any()):
                raise ValueError("CounterNoise: sequence ids must be in [0, 2**63)")
            self._first, self._count, self._given = None, ids.numel(), ids
        self.compile = bool(compile)
        self._lanes: torch.Tensor | None = None
        self._elements: dict[tuple[int, int, int, torch.device], torch.Tensor] = {}

    @classmethod
    def consecutive(cls, seed: int, first: int, count: int, compile: bool = False) -> CounterNoise:
        """Rows ``first .. first + count - 1`` (a batch of consecutive windows or training rows)."""
        return cls(seed, range(first, first + count), compile=compile)

    @property
    def sequence_ids(self) -> list[int]:
        if self._given is None:
            return list(range(self._first, self._first + self._count))
        return self._given.tolist()

    def _ids(self, device: torch.device) -> torch.Tensor:
        if self._first is not None:
            return torch.arange(self._first, self._first + self._count, device=device, dtype=torch.int64)
        return self._given.to(device)

    def draw(self, group: int, batch: int, start: int, length: int, width: int, std: float,
             device: torch.device, block_size: int) -> torch.Tensor:
        """Float32 ``[batch, length, width]``: positions ``start .. start + length - 1`` (``block_size``
        is not needed: a position's values do not depend on how long its sequence is)."""
        if batch != self._count:
            raise ValueError(f"CounterNoise holds {self._count} sequence ids for a batch of {batch}")
        device = torch.device(device)
        group, start, length, width, std = int(group), int(start), int(length), int(width), float(std)
        # The group-free parts are computed once per batch (all groups, every position call), eagerly.
        if self._lanes is None or self._lanes.device != device:
            self._lanes = _sequence_lanes(self.seed, self._ids(device))
        key = (start, length, width, device)
        if key not in self._elements:
            self._elements[key] = _element_keys(start, length, width, device)
        if self.compile:  # the group as a device scalar (a fill, no copy from the host): one graph for all
            group_key = torch.full((1,), group, dtype=torch.int64, device=device)
            return _compiled()(self._lanes, group_key, self._elements[key], std)
        return counter_draw(self._lanes, group, self._elements[key], std)
