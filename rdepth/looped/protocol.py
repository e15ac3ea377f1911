"""The looped-model adapter protocol: a foreign looped model's pieces, for rdepth's drivers to walk.

rdepth's own :class:`~rdepth.model.RecurrentLM` exposes its pieces (embed, a group's loop step, readout);
a looped model that ships in ``transformers`` (HRM-Text, Inkling-2) has its loops written inline in
its ``forward``. An adapter names that model's loops and lets a driver run them one step at a time by
calling the model's own modules (never a copy of their code):

* ``embed(input_ids, cache)`` -> a context: the token embedding plus what every later call of the
  same forward shares (attention masks, rotary tables, positions, the cache);
* ``enter(ctx, loop, carry)`` -> the carry at the start of ``loop`` (the outermost loop gets
  ``carry=None``);
* ``step(ctx, loop, index, carry)`` -> the carry after one step; ``index`` is the tuple of step
  numbers from the outermost loop down (HRM: ``(h,)`` for the H loop, ``(h, l)`` for the L loop);
* ``state(loop, carry)`` -> the iterate ``[B, T, d]`` the geometry and the exit rules read;
* ``leave(ctx, loop, carry)`` -> the carry after the loop (the outermost loop: the final hidden state);
* ``readout(hidden)`` -> logits ``[B, T, V]``;
* ``kv_slots(loop, index)`` -> the cache layers the step writes (one key/value slot per layer and step).

A loop may hold another inside each of its steps (``LoopSpec.inner``): HRM's L loop runs inside every H
step, before the H stack's own update. :func:`forward` walks the loops at any budget; at the model's own
budgets it is the model's forward (``tests/test_looped_*.py`` check logits and cached greedy decoding).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rdepth.errors import RdepthError

# observe(loop, outer_index, step, state [B, T, d]): step 0 is the state a loop starts from.
Observer = Callable[[str, tuple[int, ...], int, torch.Tensor], None]


@dataclass(frozen=True)
class LoopSpec:
    """One loop of a looped model: its name, the model's own step count, and the loop run inside each
    of its steps (None: none)."""

    name: str
    budget: int
    inner: str | None = None

    def __post_init__(self) -> None:
        if not self.name or self.budget < 1:
            raise RdepthError(f"loop {self.name!r}: needs a name and a budget >= 1, got {self.budget}")


class LoopedAdapter(ABC):
    """A looped ``transformers`` causal LM driven piece by piece (see the module docstring).

    ``model`` is the ``transformers`` model itself (in eval mode for parity); ``loops`` lists its loops,
    outermost first.
    """

    model_type: ClassVar[str] = ""
    loops: tuple[LoopSpec, ...] = ()
    # ``from_pretrained`` options the model needs to load in float64 (e.g. eager kernels where a fused one has none)
    float64_load: ClassVar[dict[str, Any]] = {}
    # whether ``embed`` takes a :class:`~rdepth.looped.slot_cache.LoopedSlotCache` (rows at their own positions in one
    # call: the engine batches its slots); else the engine runs a cache of the model's own per slot
    slot_cache: ClassVar[bool] = False

    def __init__(self, model: Any) -> None:
        self.model = model

    # -- the pieces --------------------------------------------------------------------------------------

    @abstractmethod
    def new_cache(self) -> Any:
        """An empty cache laid out as the model's own forward lays it out."""

    @abstractmethod
    def embed(self, input_ids: torch.Tensor, cache: Any = None, **extra: Any) -> Any:
        """Embed ``input_ids`` ``[B, T]`` (positions after what ``cache`` holds) -> the call's context."""

    @abstractmethod
    def enter(self, ctx: Any, loop: str, carry: Any) -> Any:
        """The carry at the start of ``loop``."""

    @abstractmethod
    def step(self, ctx: Any, loop: str, index: tuple[int, ...], carry: Any) -> Any:
        """One step of ``loop`` (``index[-1]`` counts from 0) -> the new carry."""

    @abstractmethod
    def state(self, loop: str, carry: Any) -> torch.Tensor:
        """The iterate of ``loop`` held in ``carry``, ``[B, T, d]``."""

    @abstractmethod
    def leave(self, ctx: Any, loop: str, carry: Any) -> Any:
        """The carry after ``loop``; after the outermost loop, the final hidden state ``[B, T, d]``."""

    @abstractmethod
    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` of the final hidden state."""

    @abstractmethod
    def kv_slots(self, loop: str, index: tuple[int, ...]) -> tuple[int, ...]:
        """Cache layer indices the step ``index`` of ``loop`` writes, one per attention layer it runs."""

    # -- shared ------------------------------------------------------------------------------------------

    def spec(self, loop: str) -> LoopSpec:
        """The :class:`LoopSpec` named ``loop`` (a one-line error naming the loops otherwise)."""
        for spec in self.loops:
            if spec.name == loop:
                return spec
        raise RdepthError(f"{self.model_type}: no loop {loop!r} (loops: {', '.join(s.name for s in self.loops)})")

    def budgets(self, given: dict[str, int] | None = None) -> dict[str, int]:
        """Each loop's step count: the model's own, with ``given`` overriding (1..the model's own)."""
        budgets = {spec.name: spec.budget for spec in self.loops}
        for name, value in (given or {}).items():
            limit = self.spec(name).budget
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise RdepthError(f"{self.model_type}: budget of loop {name!r} must be in 1..{limit}, got {value!r}")
            budgets[name] = value
        return budgets


def walk_loop(adapter: LoopedAdapter, ctx: Any, loop: str, outer: tuple[int, ...], carry: Any,
              budgets: dict[str, int], observe: Observer | None = None) -> Any:
    """Run ``loop`` (already entered) for its budget, each step preceded by its inner loop's whole run."""
    spec = adapter.spec(loop)
    if observe is not None:
        observe(loop, outer, 0, adapter.state(loop, carry))
    for step in range(budgets[loop]):
        index = outer + (step,)
        if spec.inner is not None:
            carry = adapter.enter(ctx, spec.inner, carry)
            carry = walk_loop(adapter, ctx, spec.inner, index, carry, budgets, observe)
            carry = adapter.leave(ctx, spec.inner, carry)
        carry = adapter.step(ctx, loop, index, carry)
        if observe is not None:
            observe(loop, outer, step + 1, adapter.state(loop, carry))
    return carry


def forward(adapter: LoopedAdapter, input_ids: torch.Tensor, cache: Any = None,
            budgets: dict[str, int] | None = None, observe: Observer | None = None, **extra: Any) -> torch.Tensor:
    """Logits ``[B, T, V]`` of ``input_ids`` ``[B, T]`` with every loop at ``budgets`` (default: the model's
    own), appending to ``cache`` when one is given; ``observe`` sees every iterate of every loop."""
    steps = adapter.budgets(budgets)
    ctx = adapter.embed(input_ids, cache, **extra)
    outer = adapter.loops[0].name
    carry = adapter.enter(ctx, outer, None)
    carry = walk_loop(adapter, ctx, outer, (), carry, steps, observe)
    return adapter.readout(adapter.leave(ctx, outer, carry))


def greedy(adapter: LoopedAdapter, prompt: torch.Tensor, new_tokens: int,
           budgets: dict[str, int] | None = None) -> torch.Tensor:
    """Greedy continuation of ``prompt`` ``[B, T]`` by ``new_tokens`` tokens over the adapter's cache (the
    prompt in one call, then a token per call) -> ``[B, T + new_tokens]``."""
    cache = adapter.new_cache()
    tokens = prompt
    following = prompt
    for _ in range(new_tokens):
        logits = forward(adapter, following, cache, budgets)
        following = logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens = torch.cat([tokens, following], dim=1)
    return tokens
