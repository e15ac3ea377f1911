"""The one stage walk (rdepth.model.walk): the order it takes a token through the stages, that the dense walk
equals the model's pieces composed by hand, and that every driver goes through it (the model's dense and
packed forwards, the decoder's prompt and its token plan, the engine's tick, the geometry's rebuild) and no
other module tells a stage's kind apart."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from rdepth.engine import Engine, Request
from rdepth.exits.controller import controller_factory
from rdepth.geometry.jacobian import group_fixed_points
from rdepth.model.decoder import Decoder
from rdepth.model.noise import StateNoise
from rdepth.model.walk import DenseWalk, StageKind, StageWalk, build_stages

ROOT = Path(__file__).resolve().parents[1]


class Recording(StageWalk):
    """A walk that records its phases and runs no layer: x is a label."""

    def __init__(self, model):
        super().__init__(model)
        self.log: list[tuple] = []

    def single(self, layers, x):
        self.log.append(("single", layers, x))
        return x

    def enter(self, group, inputs):
        self.log.append(("enter", group))
        return "state", "projected"

    def loop(self, group, state, projected):
        self.log.append(("loop", group, state, projected))
        return "last"

    def leave(self, group, state):
        self.log.append(("leave", group, state))
        return "handed"


def test_the_walk_visits_single_layers_and_groups_in_the_models_order():
    model = tiny_model()  # layers 0 | group 0: 1 | group 1: 2-3 | 4
    walk = Recording(model)
    assert walk("x") == "handed"  # the last layers see what group 1 handed on
    assert walk.log == [("single", (0,), "x"), ("enter", 0), ("loop", 0, "state", "projected"), ("leave", 0, "last"),
                        ("enter", 1), ("loop", 1, "state", "projected"), ("leave", 1, "last"),
                        ("single", (4,), "handed")]


def test_build_stages_splits_single_pass_runs_at_every_group():
    model = tiny_model(n_layer=7, groups="2|3-4")
    kinds = [(stage.kind, stage.layers, stage.group) for stage in build_stages(model.config)]
    assert kinds == [(StageKind.SINGLE, (0, 1), None), (StageKind.GROUP, (2,), 0), (StageKind.GROUP, (3, 4), 1),
                     (StageKind.SINGLE, (5, 6), None)]
    assert [stage.kind for stage in build_stages(tiny_model(n_layer=1, groups="0").config)] == [StageKind.GROUP]


def test_the_dense_walk_equals_the_pieces_composed_by_hand():
    model = tiny_model(handoff_norm=True)  # the hand-off norm, so that leave() matters
    idx = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    noise = StateNoise(4, [0, 1])
    x = model.embed(idx)
    x = model.run_layers((0,), x)
    for group, count in ((0, 3), (1, 2)):
        projected = model.group_input(group, x)
        state = model.init_state(group, x, noise)
        for _ in range(count):
            state = model.loop_step(group, state, projected)
        x = model.hand_on(state)
    expected = model.readout(model.run_layers((4,), x))
    assert torch.equal(model(idx, loop_counts=(3, 2), noise=noise).logits, expected)
    assert torch.equal(model.readout(DenseWalk(model, (3, 2), noise)(model.embed(idx))), expected)


@pytest.fixture
def counted(monkeypatch):
    """How many stages each driver visits through StageWalk.visit."""
    visits: list[str] = []
    original = StageWalk.visit

    def visit(self, stage, x):
        visits.append(type(self).__name__)
        return original(self, stage, x)

    monkeypatch.setattr(StageWalk, "visit", visit)
    return visits


def test_every_driver_walks_through_the_one_walk(counted):
    model = tiny_model()
    stages = len(model.stages)
    idx = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(2))
    model(idx, loop_counts=(2, 2))
    assert counted == ["DenseWalk"] * stages
    counted.clear()
    model(idx, controller=controller_factory("step_norm_rel", 0.3, [3, 3], lambda: model.readout)())
    assert counted == ["PackedWalk"] * stages
    counted.clear()
    decoder = Decoder(model, 2, loop_counts=(2, 2))
    decoder.prefill(idx)  # the prompt in lock-step
    assert counted == ["_PlanWalk"] * stages + ["_PromptWalk"] * stages
    counted.clear()
    decoder.step(idx[:, :1])  # a token replays the plan's pieces: no walk
    assert counted == []
    counted.clear()
    group_fixed_points(model, idx, (2, 2), StateNoise(0, [0, 1]))
    assert counted == ["DenseWalk"] * stages + ["_ObservedWalk"] * stages
    counted.clear()
    engine = Engine(model, 2, loop_counts=(2, 2))
    engine.add_request(Request([1, 2, 3], max_tokens=1))
    engine.step()  # the first tick: the token's single-pass layers, group 0 (both steps), group 1, the last layers
    assert counted == ["_EagerWalk"] * stages


def _kind_tests(source: str) -> list[int]:
    """Lines of ``source`` that tell a stage's kind apart (``StageKind.SINGLE`` / ``StageKind.GROUP``)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in ("SINGLE", "GROUP")
            and isinstance(node.value, ast.Name) and node.value.id == "StageKind"]


def test_kind_tests_are_found_in_a_constructed_source():
    assert _kind_tests("if stage.kind is StageKind.SINGLE:\n    pass\n") == [1]
    assert _kind_tests("x = stage.group\n") == []


def test_no_module_but_the_walk_tells_stage_kinds_apart():
    """A driver that branched on a stage's kind itself would be a second walk. The model's ``run_after`` looks
    a group up by kind (no walk); build_stages makes the stages."""
    found = {}
    for path in sorted((ROOT / "rdepth").rglob("*.py")):
        lines = _kind_tests(path.read_text())
        if lines:
            found[path.relative_to(ROOT).as_posix()] = len(lines)
    assert found == {"rdepth/model/walk.py": 4, "rdepth/model/recurrent.py": 1}
