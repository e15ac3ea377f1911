"""How the decoded exit rules (``kl``, ``entropy_diff``, ``argmax_stable``) read a group's state.

Two readings, chosen by the sweep's ``decode`` (:data:`rdepth.exits.config.DECODE_MODES`):

* ``"head"`` (the default, cheap): the state straight through the final norm
  and head (``model.readout``). For the last group of a model whose group is
  followed by single-pass layers, and for every middle group, this is a
  logit-lens reading: it skips the layers the state would still pass through.
* ``"rest"`` (:class:`RestDecode`, Geiping et al.'s reading): the state
  through the *rest of the model*. After loop step s of group g, each token's
  reading is the model's output if group g stopped every token now:

  - the group's output is, per token, ``x^(s)`` for a token still looping and
    the state it handed on for a token that already stopped;
  - every stage after group g then runs once on the whole window, dense and
    causal, through the model's own pieces: single-pass layers
    (``run_layers``) once; each later group h for ``loops`` steps
    (``loop_step`` of ``group_input``) from its own initial state (``init_state``), drawn from a
    generator reseeded to ``seed`` for every reading, so that two readings of
    the same token differ only through group g's state;
  - then ``readout``.

  For the last group this is exactly the remaining single-pass layers and the
  head (Geiping et al.'s coda). For a middle group the later groups run a
  fixed small budget (``loops``, default 1), not their own exits: a reading
  must not depend on decisions not yet taken.

  Cost: one pass of the later stages over all ``B*T`` rows per loop step of
  group g (not only over the rows still looping, because later layers attend
  to every earlier position). Defined for teacher-forced windows only: with a
  key/value cache (generation) the later layers would have to read the earlier
  tokens' cached keys/values *without writing* the cache, and the model has no
  such hook (``rdepth.model`` would need e.g. a read-only attention context).

A :class:`RestDecode` needs the rows of the window that are still looping and
the states of the others: :class:`rdepth.exits.controller.PolicyController`
tells it (``begin``, ``observe``, ``settle``), so give it to the controller,
never to a policy alone.
"""

from __future__ import annotations

import torch

from rdepth.errors import RdepthError
from rdepth.exits.base import Decode
from rdepth.exits.config import DECODE_MODES
from rdepth.model import RecurrentLM


class RestDecode:
    """``decode(state [A, d]) -> logits [A, V]`` through the layers after the group (see the module).

    Args:
        model: the model whose later stages read the state.
        seq_len: tokens per window T (the loop's rows are ``B*T``, batch-major).
        loops: loop steps each later group runs per reading (>= 1).
        seed: seed of the later groups' initial states.
    """

    def __init__(self, model: RecurrentLM, seq_len: int, *, loops: int = 1, seed: int = 0) -> None:
        if seq_len < 1 or loops < 1:
            raise RdepthError(f"RestDecode: need seq_len >= 1 and loops >= 1, got {seq_len}, {loops}")
        self.model = model
        self.seq_len = seq_len
        self.loops = loops
        self.seed = seed
        self.group: int | None = None
        self.outputs: torch.Tensor | None = None  # [N, d] the group's output if it stopped now
        self.rows: torch.Tensor | None = None  # [A] rows being read

    def describe(self) -> dict:
        return {"decode": "rest", "decode_loops": self.loops}

    # -- told by the controller ---------------------------------------------------------

    def begin(self, group: int, state: torch.Tensor) -> None:
        """A loop of ``group`` starts from ``state`` ``[N, d]``."""
        if state.shape[0] % self.seq_len:
            raise RdepthError(f"RestDecode: {state.shape[0]} rows are not whole windows of {self.seq_len} tokens")
        self.group = group
        self.outputs = state.clone()
        self.rows = None

    def observe(self, group: int, rows: torch.Tensor, new: torch.Tensor) -> None:
        """After a loop step: ``rows`` ``[A]`` still loop and now hold ``new`` ``[A, d]``."""
        self._check(group)
        self.outputs[rows] = new.to(self.outputs.dtype)
        self.rows = rows

    def settle(self, group: int, rows: torch.Tensor, done: torch.Tensor, handoff: torch.Tensor) -> None:
        """The policy's decision: rows ``rows[done]`` stop and hand on ``handoff[done]``."""
        self._check(group)
        self.outputs[rows[done]] = handoff[done].to(self.outputs.dtype)
        self.rows = None

    def _check(self, group: int) -> None:
        if self.outputs is None or group != self.group:
            raise RdepthError(f"RestDecode: group {group} was not begun")

    # -- the reading ----------------------------------------------------------------------

    def __call__(self, state: torch.Tensor) -> torch.Tensor:
        """Logits ``[A, V]`` of the observed rows, whose states are ``state`` ``[A, d]``."""
        if self.rows is None or state.shape[0] != self.rows.numel():
            raise RdepthError(
                "RestDecode reads the rows the loop controller observed: give it to "
                "PolicyController(decode=...), not to a policy alone"
            )
        outputs = self.outputs.index_copy(0, self.rows, state.to(self.outputs.dtype))
        batch = outputs.shape[0] // self.seq_len
        x = self.rest(self.group, outputs.view(batch, self.seq_len, -1))  # (B, T, d)
        return self.model.readout(x.reshape(batch * self.seq_len, -1)[self.rows])

    def rest(self, group: int, x: torch.Tensor) -> torch.Tensor:
        """The stages after ``group`` on its output ``x`` ``[B, T, d]`` (dense, causal); ``[B, T, d]``."""
        noise = torch.Generator(device=x.device)
        noise.manual_seed(self.seed)
        return self.model.run_after(group, x, [self.loops] * self.model.n_groups, noise)


def make_decode(model: RecurrentLM, mode: str, *, seq_len: int, loops: int = 1, seed: int = 0) -> Decode:
    """A fresh reading for ``mode`` (``"head"``: ``model.readout``; ``"rest"``: a :class:`RestDecode`)."""
    if mode not in DECODE_MODES:
        raise RdepthError(f"decode must be one of {', '.join(DECODE_MODES)}, got {mode!r}")
    if mode == "head":
        return model.readout
    return RestDecode(model, seq_len, loops=loops, seed=seed)
