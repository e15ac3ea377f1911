"""The engine's static tick (rdepth.engine.static): every slot through one device function a tick, rows
predicated. Each request's tokens, logits, loop steps and predictions equal its batch-1 decode on the one
decoder (float64), for every rule it runs, any arrival order and width; sampled tokens, stop tokens, the
context's end and a failing row too; compiled, the same decisions as the eager tick; refusals are one line."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from conftest import tiny_model
from test_engine import assert_same, caps_for, factory, prompts, run_engine

from rdepth.engine import Engine, Request
from rdepth.errors import RdepthError
from rdepth.exits.controller import controller_factory
from rdepth.exits.registry import POLICIES


def one_call_rules(model) -> list[str]:
    """The rules the static tick runs: those deciding rows at any steps in one call."""
    names = []
    for name in sorted(POLICIES):
        policy = factory(model, name)().policy(0)
        if policy.one_call:
            names.append(name)
    return names


def single_group():
    return tiny_model(n_layer=1, groups="0")


def prelude_and_coda():
    """One looped layer between single-pass layers (the task preset's and Huginn's shape)."""
    return tiny_model(n_layer=4, groups="1-2")


def three_groups():
    """Three looped groups with single-pass layers before, between (one) and after (the text presets' shape)."""
    return tiny_model(n_layer=7, groups="1|3-4|5")


SHAPES = {"loop only": single_group, "prelude and coda": prelude_and_coda, "two groups": tiny_model,
          "three groups": three_groups}


def test_the_rules_it_runs_are_the_one_call_rules():
    """The step-free rules, kl (its head read at every step) and the two-hit rules (a row at step 1 never exits);
    not kl read every other step, nor entropy_diff."""
    rules = one_call_rules(single_group())
    assert {"step_norm_rel", "kl", "learned", "fixed", "confidence", "argmax_stable"} <= set(rules)
    assert {"acceleration", "acceleration_rel", "minp_kl"} <= set(rules) and "entropy_diff" not in rules
    model = single_group()
    assert not factory(model, "kl", {"every": 2})().policy(0).one_call


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", ["step_norm_rel", "kl", "learned", "argmax_stable", "acceleration_rel", "fixed"])
def test_every_request_equals_the_batch_1_decoder_in_any_arrival_order(name, shape):
    """The two-hit rule at a threshold where its exits vary on every shape (0.9: checked below)."""
    model = SHAPES[shape]()
    requests = [Request(p, max_tokens=3 + i % 4, keep_logits=True, sequence_id=i % 3, noise_seed=i)
                for i, p in enumerate(prompts(7, seed=1))]
    made = factory(model, name)
    if name == "acceleration_rel":
        made = controller_factory(name, 0.9, caps_for(model)[:model.n_groups])
    for batch, seed in ((3, 0), (8, 1), (1, 2)):
        order = list(range(len(requests)))
        random.Random(seed).shuffle(order)
        results, engine = run_engine(model, requests, batch, order, tick="static", controller_factory=made)
        assert_same(model, requests, results, controller_factory=made)
        assert engine.stats.positions == sum(len(r.prompt) + r.max_tokens - 1 for r in requests)
    if name != "fixed":
        distinct = {s for done in results.values() for position in done.steps for s in position}
        assert len(distinct) > 1, "the setting should make exits vary"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sampled_tokens_stop_tokens_and_the_contexts_end(shape):
    """A sampled token is not what the device entered (the argmax): the host enters it (through the layers
    before the group); a stop token and the context's end retire a row whose slot the next request takes."""
    model = SHAPES[shape]()
    budget = {"controller_factory": factory(model, "kl")}
    sampled = [Request(p, max_tokens=6, temperature=1.3, top_p=0.9, seed=10 + i, keep_logits=True)
               for i, p in enumerate(prompts(5, seed=4))]
    results, _ = run_engine(model, sampled, 3, tick="static", **budget)
    assert_same(model, sampled, results, **budget)
    eager, _ = run_engine(model, sampled, 3, **budget)
    assert [results[i].tokens for i in range(5)] == [eager[i].tokens for i in range(5)]
    first = results[0].tokens
    ending = [Request(sampled[0].prompt, max_tokens=6, temperature=1.3, top_p=0.9, seed=10, stop=[first[1]]),
              Request([4] * 30, max_tokens=10)]
    ended, engine = run_engine(model, ending, 1, tick="static", **budget)
    assert ended[0].tokens == first[:first.index(first[1]) + 1] and ended[0].finish_reason == "stop"
    assert ended[1].finish_reason == "context" and len(ended[1].tokens) == 3
    assert engine.live == [None]


def test_a_row_whose_output_goes_non_finite_fails_alone():
    model = single_group()
    with torch.no_grad():
        model.wpe.weight[10] = float("nan")  # only the long request reaches position 10
    requests = [Request([1, 2, 3], max_tokens=3, keep_logits=True), Request(list(range(12)), max_tokens=3),
                Request([4, 5], max_tokens=3, keep_logits=True)]
    budget = {"controller_factory": factory(model, "step_norm_rel")}
    results, _ = run_engine(model, requests, 3, tick="static", **budget)
    assert results[1].finish_reason == "error" and "not finite" in results[1].error
    assert len(results[1].predicted) == 10
    eager, _ = run_engine(model, requests, 3, **budget)
    for index in (0, 2):
        assert results[index].tokens == eager[index].tokens and results[index].steps == eager[index].steps


def test_what_it_cannot_run_is_a_one_line_error():
    model = single_group()
    with pytest.raises(RdepthError, match="tick must be one of"):
        Engine(model, 2, tick="fast")
    with pytest.raises(RdepthError, match="entropy_diff does not"):
        Engine(model, 2, tick="static", controller_factory=factory(model, "entropy_diff"))
    with pytest.raises(RdepthError, match="kv_layout"):
        Engine(model, 2, tick="static", kv_layout="shared", loop_counts=3)
    with pytest.raises(RdepthError, match="warm_start"):
        Engine(model, 2, tick="static", warm_start=True, loop_counts=3)


def test_compiled_without_a_compiler_is_a_one_line_error(monkeypatch):
    from rdepth.engine import static

    monkeypatch.setattr(static.shutil, "which", lambda name: None)
    with pytest.raises(RdepthError, match="needs a C\\+\\+ compiler"):
        Engine(single_group(), 2, tick="compiled", loop_counts=3)
    assert Engine(single_group(), 2, tick="static", loop_counts=3).tick.name == "static"


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.parametrize("shape", ["prelude and coda", "three groups"])
def test_compiled_decides_as_the_eager_tick(shape):
    """Inductor fuses the same arithmetic in another order: in float64 every decision and token is the
    eager tick's, the kept logits equal to rounding (single-pass layers before and after the loop, and
    between groups, too)."""
    model = SHAPES[shape]()
    requests = [Request(p, max_tokens=4, keep_logits=True, sequence_id=i) for i, p in enumerate(prompts(6, seed=6))]
    budget = {"controller_factory": factory(model, "kl")}
    compiled, _ = run_engine(model, requests, 4, tick="compiled", **budget)
    eager, _ = run_engine(model, requests, 4, **budget)
    for index in range(len(requests)):
        assert compiled[index].tokens == eager[index].tokens and compiled[index].steps == eager[index].steps
        assert compiled[index].predicted == eager[index].predicted
        torch.testing.assert_close(compiled[index].logits, eager[index].logits, rtol=0, atol=1e-9)


def test_elementwise_attention_is_sdpa_summed_in_another_order():
    """The compiled tick's attention (broadcasts and sums) against SDPA on the same rows, each row reading its
    own prefix; a row that reads a key the mask hides would differ."""
    import torch.nn.functional as F

    from rdepth.model.layers import _attend_elementwise

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 1, 8, generator=generator, dtype=torch.float64)
    keys, values = (torch.randn(5, 4, 12, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    positions = torch.tensor([0, 3, 11, 6, 1])
    mask = (torch.arange(12)[None, :] <= positions[:, None]).view(5, 1, 1, 12)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    torch.testing.assert_close(_attend_elementwise(q, keys, values, mask), expected, rtol=0, atol=1e-12)
    wider = mask.clone()
    wider[0, ..., 1] = True  # row 0 would read position 1 too
    assert (_attend_elementwise(q, keys, values, wider)[0] - expected[0]).abs().max() > 1e-3


def test_a_controller_of_its_own_starts_each_rows_loop_afresh():
    """A controller that is not an exit rule (here: each row stops at a step drawn when its loop begins) is
    told of every row that starts a loop, as in the eager tick: the same steps, position by position."""

    class Drawn:
        def __init__(self):
            self.generator = torch.Generator().manual_seed(5)
            self.target = torch.zeros(0, dtype=torch.long)

        def max_steps(self, group):
            return 4

        def begin(self, group, state):
            self.target = torch.randint(1, 5, (state.shape[0],), generator=self.generator)

        def begin_rows(self, group, rows, state):
            self.target[rows] = torch.randint(1, 5, (rows.shape[0],), generator=self.generator)

        def after_steps(self, group, steps, values, rows, prev, new):
            return self.target[rows] <= steps, new, steps

    model = single_group()
    requests = [Request(p, max_tokens=3) for p in prompts(1, seed=8)]
    runs = [run_engine(model, requests, 1, controller_factory=Drawn, tick=tick)[0][0].steps for tick in ("eager",
                                                                                                        "static")]
    assert runs[0] == runs[1] and len({s for position in runs[1] for s in position}) > 1


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_each_compiled_engine_keeps_its_own_graph():
    """Two engines of different widths compile one graph each, even where dynamo allows one compile per code
    object (a shared code object would run the second engine's ticks uncompiled), and touch no global
    setting of dynamo."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = single_group()
    engines = []
    # (torch's own patch: pytest's monkeypatch undoes a config option by deleting it, which hides the option
    # from every later test)
    with torch._dynamo.config.patch(recompile_limit=1):
        for width in (2, 3):
            results, engine = run_engine(model, [Request([1, 2, 3], max_tokens=2)], width, tick="compiled",
                                         controller_factory=factory(model, "step_norm_rel"))
            assert results[0].error is None
            engines.append(engine)
        codes = [engine.tick.code.__func__.__code__ for engine in engines]
        assert codes[0] is not codes[1] and all(len(_debug_get_cache_entry_list(code)) == 1 for code in codes)
        assert torch._dynamo.config.recompile_limit == 1
