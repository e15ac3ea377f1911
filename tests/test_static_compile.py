"""The Compiled executor (``decoder.use(Compiled())``): the Inductor-compiled pieces decode as eager does (float32 on the CPU,
within 1e-5), every loop step of a group runs one compiled function, and every graph is compiled by
the end of the first token: decoding more tokens compiles nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from bench.gpu.executors.compiled import Compiled
from bench.gpu.executors.graphs import Captured
from rdepth.model.decoder import Decoder
from rdepth.model.executors.eager import Executor
from rdepth.model.noise import StateNoise

sys.path.insert(0, str(Path(__file__).parent))
from test_decoder import controller_factory, step_through, tokens, varied_setting  # noqa: E402

PROMPT, LENGTH = 4, 10
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # float32: Inductor fuses and reorders reductions


def graphs(function) -> int:
    """Graphs dynamo holds for ``function``'s code (one per compiled specialisation)."""
    return len(_debug_get_cache_entry_list(function.__code__))


def decoders(model, **options) -> tuple[Decoder, Decoder]:
    """An eager decoder and a compiled one, both without host checks (``check_every=None``)."""
    eager = Decoder(model, 1, **options).use(Executor(check_every=None))
    return eager, Decoder(model, 1, **options).use(Compiled(check_every=None))


@pytest.mark.parametrize("rule", [None, "step_norm"])
def test_compiled_decoding_equals_eager_and_compiles_only_on_the_first_token(rule):
    torch._dynamo.reset()  # count this test's graphs only
    model = tiny_model(n_layer=3, groups="1").float()  # layers 0 and 2 single-pass, layer 1 looped
    idx = tokens(1, LENGTH)
    noise = StateNoise(0, [0])
    options = {"noise": noise}
    if rule is None:
        options["loop_counts"] = (4,)
    else:
        setting = varied_setting(model, idx, noise, rule)
        # no host check: every step runs predicated, the step and the rule in one compiled call
        options.update(controller_factory=controller_factory(model, rule, setting))
    eager, compiled = decoders(model, **options)
    expected, got, computed = [eager.prefill(idx[:, :PROMPT])[:, -1]], [compiled.prefill(idx[:, :PROMPT])[:, -1]], []
    counts = []
    for t in range(PROMPT, LENGTH):
        token = idx[:, t : t + 1]
        expected.append(eager.step(token))
        got.append(compiled.step(token))
        assert torch.equal(compiled.computed, eager.computed) and torch.equal(compiled.used, eager.used)
        computed.append(eager.computed.clone())
        counts.append(tuple(graphs(f) for f in (Compiled._layers_given, Compiled._step_given,
                                                Compiled._step_check_given)))
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), **TOLERANCE)
    assert torch.equal(torch.stack(got).argmax(-1), torch.stack(expected).argmax(-1))
    # two single-pass stages, one function for all loop steps; with exits the step and its rule are one
    # compiled region (the step inlined into it): steps 1, middle, last
    assert counts[0] == ((2, 1, 0) if rule is None else (2, 0, 3))
    assert all(count == counts[0] for count in counts), "a later token compiled again"
    if rule is not None:
        assert len(torch.unique(torch.cat(computed))) > 1, "the exits should vary"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rule", [None, "step_norm"])
def test_compiled_pieces_capture_as_cuda_graphs_and_replay_as_eager_decodes(rule):
    """Compiled composes with Captured.record: the warm-up compiles, the capture records the compiled
    kernels, and replay equals eager decoding (float32, the tolerance above) with no host sync."""
    model = tiny_model(n_layer=3, groups="1").float().cuda()
    idx = tokens(1, LENGTH).cuda()
    noise = StateNoise(0, [0])
    options = {"noise": noise}
    if rule is None:
        options["loop_counts"] = (4,)
    else:
        options.update(controller_factory=controller_factory(model, rule, varied_setting(model, idx, noise, rule)))
    eager, compiled = decoders(model, **options)
    for decoder in (eager, compiled):
        decoder.prefill(idx[:, :PROMPT])
    Captured.record(compiled)
    assert isinstance(compiled.executor, Captured) and isinstance(compiled.executor.inner, Compiled)
    expected, computed = step_through(eager, idx, PROMPT)
    got, got_computed = step_through(compiled, idx, PROMPT, forbid_syncs=True)
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), **TOLERANCE)
    assert torch.equal(torch.stack(got_computed), torch.stack(computed))


def test_the_compile_mode_reaches_every_compiled_piece(monkeypatch):
    """Compiled(mode=...) hands Inductor's mode to each compiled piece (a spy in place of
    torch.compile: nothing compiles); the default passes none; a mode with CUDA graphs of its own, or
    an unknown one, is refused (the Decoder captures its graphs itself)."""
    from rdepth.errors import RdepthError

    modes = []

    def spy(fn, **kwargs):
        modes.append(kwargs.get("mode"))
        return fn

    monkeypatch.setattr(torch, "compile", spy)
    model = tiny_model(n_layer=3, groups="1").float()
    Decoder(model, 1, loop_counts=(4,)).use(Compiled("max-autotune-no-cudagraphs"))
    assert modes == ["max-autotune-no-cudagraphs"] * 3  # single-pass layers, loop step, loop step + rule
    modes.clear()
    Decoder(model, 1, loop_counts=(4,)).use(Compiled())
    assert modes == [None] * 3
    for mode in ("reduce-overhead", "max-autotune", "fast"):
        with pytest.raises(RdepthError, match="compile_mode must be one of default, max-autotune-no-cudagraphs"):
            Compiled(mode)
