"""TrainConfig.compile_scope = "step": one compiled region per loop step (adapter + the group's layers),
equal to the uncompiled model and with no recompiles when the drawn loop counts change (dynamo's own
graph counter; the ``eager`` backend keeps the test to seconds on the CPU: Inductor's code is not what
is tested, the graph boundaries and guards are)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from rdepth.errors import RdepthError
from rdepth.model.noise import StateNoise
from rdepth.train.config import TrainConfig
from rdepth.train.step import compile_loop_steps

sys.path.insert(0, str(Path(__file__).parent))
from test_decoder import tiny_model  # noqa: E402


def loss_and_grads(model, idx, counts):
    model.zero_grad()
    loss = model(idx, idx, counts, noise=StateNoise(0, range(idx.shape[0]))).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_few_graphs_per_group_and_none_for_new_loop_counts():
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model().float().train()
    reference = copy.deepcopy(model)
    compile_loop_steps(model, backend="eager")
    idx = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    backprop = model.config.backprop_depth
    warm = [(backprop + 2, backprop + 2)]  # every group runs steps without and with gradients
    for counts in warm + [(1, 1), (backprop + 5, 3), (2, backprop + 4)]:
        got, expected = loss_and_grads(model, idx, counts), loss_and_grads(reference, idx, counts)
        assert torch.equal(got[0], expected[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=False))
        if counts == warm[0]:
            graphs = counters["stats"]["unique_graphs"]
            # per group: the steps without gradients; the first step with them (its input state needs no
            # gradient: a guard on requires_grad); the later ones
            assert graphs == 3 * model.n_groups
    assert counters["stats"]["unique_graphs"] == graphs  # new loop counts: no recompile


def test_compile_scope_is_validated():
    assert TrainConfig(compile_scope="step").compile_scope == "step"
    with pytest.raises(RdepthError, match="compile_scope must be one of layer, step"):
        TrainConfig(compile_scope="group")


def test_more_groups_than_dynamo_recompile_limit_allows_still_compile():
    """Three looped groups (the ``paper`` preset's layout) need 9 graphs in training, past dynamo's default
    recompile limit of 8, which fullgraph=True turns into an error (seen on the H200: the trainer then fell
    back to eager); compile_loop_steps raises the limit around its calls, and the global setting stays."""
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(n_layer=5, groups="1|2|3").float().train()
    assert model.n_groups == 3
    reference = copy.deepcopy(model)
    compile_loop_steps(model, backend="eager")
    idx = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    backprop = model.config.backprop_depth
    counts = (backprop + 2,) * 3
    got, expected = loss_and_grads(model, idx, counts), loss_and_grads(reference, idx, counts)
    assert torch.equal(got[0], expected[0])
    assert counters["stats"]["unique_graphs"] == 3 * model.n_groups > torch._dynamo.config.recompile_limit == 8
