"""The opt-in batch-quantile exit of the static decoder (``Decoder(batch_quantile=q)``): on constructed
exits (each row stops at a step the test sets) the batch's loop stops at the known step, stragglers hand
on their newest state, and everything equals a per-row decoder whose exits are cut at that step (float64);
q = 1.0 is the per-row behaviour; compacted equals predicated."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rdepth.errors import RdepthError
from rdepth.model.decoder import Decoder
from rdepth.model.noise import StateNoise

from conftest import tiny_model
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
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("check_every", [1, 2])
def test_quantile_stop_equals_per_row_exits_cut_at_the_known_step(q, compact, check_every):
    model = tiny_model()
    batch = 8
    idx = tokens(batch)
    noise = StateNoise(4, range(batch))
    cut = [torch.clamp(exits, max=quantile_stop(exits, q, k)) for exits, k in zip(EXITS, K_MAX)]
    options = dict(noise=noise, check_every=check_every, compact=compact)
    quantile = Decoder(model, batch, K_MAX, controller_factory=lambda: ScriptedExits(EXITS), batch_quantile=q,
                       **options)
    logits, computed, used = decode_all(quantile, idx)
    reference = decode_all(Decoder(model, batch, K_MAX, controller_factory=lambda: ScriptedExits(cut), **options),
                           idx)
    decoded = computed[:, :, PROMPT:]
    for group in range(2):
        expected = cut[group][:, None].expand_as(decoded[group])
        assert torch.equal(decoded[group], expected)
        assert torch.equal(used[group], expected)  # stragglers hand on their newest state
    assert torch.equal(computed, reference[1]) and torch.equal(used, reference[2])
    torch.testing.assert_close(logits, reference[0], rtol=0, atol=0 if not compact else 1e-12)
    assert any((c < e).any() for c, e in zip(cut, EXITS))  # the quantile did cut someone


@pytest.mark.parametrize("compact", [False, True])
def test_quantile_one_is_the_per_row_exit(compact):
    model = tiny_model()
    batch = 8
    idx = tokens(batch)
    noise = StateNoise(5, range(batch))
    options = dict(noise=noise, check_every=2, compact=compact, controller_factory=lambda: ScriptedExits(EXITS))
    per_row = decode_all(Decoder(model, batch, K_MAX, **options), idx)
    full = decode_all(Decoder(model, batch, K_MAX, batch_quantile=1.0, **options), idx)
    for a, b in zip(per_row, full):
        assert torch.equal(a, b)
    assert torch.equal(per_row[1][:, :, PROMPT:].amax(dim=1), torch.tensor([[6] * 7, [5] * 7]))


def test_quantile_needs_exits_and_a_fraction():
    model = tiny_model()
    with pytest.raises(RdepthError, match="batch_quantile needs exits"):
        Decoder(model, 2, K_MAX, batch_quantile=0.9)
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(RdepthError, match="batch_quantile must be"):
            Decoder(model, 2, K_MAX, controller_factory=lambda: ScriptedExits(EXITS), batch_quantile=bad)
