"""The opt-in batch-quantile exit (:class:`BatchQuantile`, a controller around the exits): on constructed
exits (each row stops at a step the test sets) the batch's loop stops at the known step, stragglers hand
on their newest state, and everything equals a per-row decoder whose exits are cut at that step (float64);
q = 1.0 is the per-row behaviour."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from bench.gpu.batch_quantile import BatchQuantile
from rdepth.errors import RdepthError
from rdepth.model.decoder import Decoder
from rdepth.model.executors.eager import Executor
from rdepth.model.noise import StateNoise

sys.path.insert(0, str(Path(__file__).parent))
from test_decoder import K_MAX, PROMPT, decode_all, tokens  # noqa: E402

# Exit step per row (batch 8) of group 0 and group 1 (k_max 6 and 5), the same at every position.
EXITS = (torch.tensor([1, 2, 2, 3, 4, 5, 6, 6]), torch.tensor([5, 1, 1, 1, 2, 2, 3, 4]))


class ScriptedExits:
    """A loop controller that stops row b of group g after step ``exits[g][b]``, handing on its newest
    state (the built-in rules' states play no part: the test knows every exit)."""

    def __init__(self, exits):
        self.exits = exits

    def max_steps(self, group):
        return K_MAX[group]

    def begin(self, group, state):
        pass

    def after_step(self, group, step, rows, prev, new):
        return self.exits[group].index_select(0, rows) <= step, new, torch.full_like(rows, step)


def quantile_stop(exits: torch.Tensor, q: float, k_max: int) -> int:
    """The step after which at most floor((1 - q) B) rows still loop (by the definition, by hand)."""
    allowed = int((1 - q) * exits.numel() + 1e-9)
    for step in range(1, k_max + 1):
        if int((exits > step).sum()) <= allowed:
            return step
    return k_max


def test_hand_computed_stop_steps():
    assert quantile_stop(EXITS[0], 0.75, 6) == 5  # after step 5 two rows (exit 6) still loop; 2 <= 2
    assert quantile_stop(EXITS[1], 0.75, 5) == 3  # after step 2 rows with 3, 4, 5 loop (3 > 2); after 3: 2
    assert quantile_stop(EXITS[1], 0.75, 5) != quantile_stop(EXITS[1], 0.9, 5)


@pytest.mark.parametrize("q", [0.75, 0.85, 0.6])
@pytest.mark.parametrize("check_every", [1, 2])
def test_quantile_stop_equals_per_row_exits_cut_at_the_known_step(q, check_every):
    model = tiny_model()
    batch = 8
    idx = tokens(batch)
    noise = StateNoise(4, range(batch))
    cut = [torch.clamp(exits, max=quantile_stop(exits, q, k)) for exits, k in zip(EXITS, K_MAX, strict=False)]
    quantile = Decoder(model, batch, controller_factory=lambda: BatchQuantile(ScriptedExits(EXITS), q), noise=noise)
    logits, computed, used = decode_all(quantile.use(Executor(check_every)), idx)
    reference = decode_all(Decoder(model, batch, controller_factory=lambda: ScriptedExits(cut), noise=noise)
                           .use(Executor(check_every)), idx)
    decoded = computed[:, :, PROMPT:]
    for group in range(2):
        expected = cut[group][:, None].expand_as(decoded[group])
        assert torch.equal(decoded[group], expected)
        assert torch.equal(used[group], expected)  # stragglers hand on their newest state
    assert torch.equal(computed, reference[1]) and torch.equal(used, reference[2])
    assert torch.equal(logits, reference[0])
    assert any((c < e).any() for c, e in zip(cut, EXITS, strict=False))  # the quantile did cut someone


def test_quantile_one_is_the_per_row_exit():
    model = tiny_model()
    batch = 8
    idx = tokens(batch)
    noise = StateNoise(5, range(batch))
    per_row = decode_all(Decoder(model, batch, controller_factory=lambda: ScriptedExits(EXITS), noise=noise)
                         .use(Executor(check_every=2)), idx)
    full = decode_all(Decoder(model, batch, controller_factory=lambda: BatchQuantile(ScriptedExits(EXITS), 1.0),
                              noise=noise).use(Executor(check_every=2)), idx)
    for a, b in zip(per_row, full, strict=False):
        assert torch.equal(a, b)
    assert torch.equal(per_row[1][:, :, PROMPT:].amax(dim=1), torch.tensor([[6] * 7, [5] * 7]))


def test_quantile_needs_a_fraction():
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(RdepthError, match="batch_quantile must be"):
            BatchQuantile(ScriptedExits(EXITS), bad)
