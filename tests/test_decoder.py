"""The one decoder (rdepth.model.decoder over rdepth.model.kv's cache) equals the teacher-forced passes
(dense, packed rows under exits, warm start by definition), at fixed budgets and under every exit rule, in float64 on the CPU; it has no host
sync inside a token (one per chunk with exit checks); CUDA-graph replay equals eager (GPU only)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model

from bench.gpu.executors.compiled import Compiled
from bench.gpu.executors.graphs import Captured
from bench.gpu.executors.masked import Masked
from rdepth.errors import RdepthError
from rdepth.exits.controller import controller_factory as exit_controllers
from rdepth.exits.gate import random_gate
from rdepth.exits.policies import random_ouro_gate
from rdepth.exits.registry import POLICIES
from rdepth.model import FixedController, RecurrentLM
from rdepth.model.decoder import Decoder
from rdepth.model.executors.eager import Executor
from rdepth.model.generation import generate, teacher_forced
from rdepth.model.noise import StateNoise

BLOCKS = pytest.mark.parametrize("block", ["sandwich", "gpt2"])
BATCHES = pytest.mark.parametrize("batch", [1, 3])
# What a loop carries: Geiping et al.'s replaced state, or a residual stream (ModelConfig.loop_state).
LOOP_STATES = pytest.mark.parametrize("loop_state", ["sandwich", "residual"])
K_MAX = (6, 5)
PROMPT, LENGTH = 5, 12
# Where the host waits for the device: a read of one value (.item(), bool(), int()) and
# boolean-mask indexing (nonzero).
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")


def tokens(batch: int, length: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(batch))


def make(model: RecurrentLM, batch: int, *, check_every="default", prefix_reads: bool = True,
         span_buckets: int | None = None, dtype: torch.dtype | None = None, **options) -> Decoder:
    """A decoder at ``K_MAX`` unless given a budget; ``check_every``/``prefix_reads``/``span_buckets``
    applied as executors, ``dtype`` as a converted copy of the model."""
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype)
    if "controller_factory" not in options and "loop_counts" not in options:
        options["loop_counts"] = K_MAX
    decoder = Decoder(model, batch, **options)
    if check_every != "default" or not prefix_reads:
        every = decoder.executor.check_every if check_every == "default" else check_every
        decoder.use(Executor(every) if prefix_reads else Masked(every))
    if span_buckets is not None:
        decoder.use(Captured(decoder.executor, span_buckets))
    return decoder


def decode_all(decoder: Decoder, idx: torch.Tensor, prompt: int = PROMPT):
    """Prefill ``idx[:, :prompt]``, then step through the rest: logits [B, T, V], computed and used [G, B, T]."""
    logits = [decoder.prefill(idx[:, :prompt])]
    computed, used = [decoder.prompt_computed], [None]
    for t in range(prompt, idx.shape[1]):
        logits.append(decoder.step(idx[:, t : t + 1])[:, None])
        computed.append(decoder.computed.clone()[:, :, None])
        used.append(decoder.used.clone()[:, :, None])
    return torch.cat(logits, 1), torch.cat(computed, 2), torch.cat(used[1:], 2)


def step_through(decoder: Decoder, idx: torch.Tensor, prompt: int = PROMPT, forbid_syncs: bool = False):
    """Step a prefilled ``decoder`` through ``idx[:, prompt:]`` -> (logits, computed), one entry per token;
    with ``forbid_syncs`` a host synchronisation is an error (CUDA's sync debug mode)."""
    logits, computed = [], []
    if forbid_syncs:
        torch.cuda.set_sync_debug_mode("error")
    try:
        for t in range(prompt, idx.shape[1]):
            logits.append(decoder.step(idx[:, t : t + 1]))
            computed.append(decoder.computed.clone())
    finally:
        if forbid_syncs:
            torch.cuda.set_sync_debug_mode("default")
    return logits, computed


# ------------------------------------------------------------------ fixed budget
@BLOCKS
@BATCHES
@LOOP_STATES
def test_fixed_budget_equals_teacher_forced(block, batch, loop_state):
    model = tiny_model(block, loop_state=loop_state)
    idx = tokens(batch)
    noise = StateNoise(3, range(batch))
    counts = (4, 3)
    forced = model(idx, loop_counts=counts, noise=noise).logits
    decoder = make(model, batch, loop_counts=counts, noise=noise)
    static, computed, used = decode_all(decoder, idx)
    torch.testing.assert_close(static, forced, rtol=0, atol=1e-10)
    assert (computed == torch.tensor(counts)[:, None, None]).all() and torch.equal(used, computed[:, :, PROMPT:])
    assert (computed == torch.tensor(counts)[:, None, None]).all() and torch.equal(used, computed[:, :, PROMPT:])
    assert decoder.cache.steps == counts  # the cache keeps only the steps the budget runs


def test_full_budget_is_k_max_and_a_plain_model_decodes_too():
    model = tiny_model()
    idx = tokens(2)
    noise = StateNoise(0, [7, 8])
    static, _, _ = decode_all(make(model, 2, noise=noise), idx)
    torch.testing.assert_close(static, model(idx, loop_counts=K_MAX, noise=noise).logits, rtol=0, atol=1e-10)
    plain = tiny_model(groups="")
    static, _, _ = decode_all(Decoder(plain, 2), idx)
    torch.testing.assert_close(static, plain(idx).logits, rtol=0, atol=1e-10)


# ------------------------------------------------------------------ exits
def controller_factory(model: RecurrentLM, name: str, value: float | None):
    """Fresh controllers of rule ``name`` at threshold ``value`` (``argmax_stable``: patience)."""
    if name == "argmax_stable":
        return exit_controllers(name, None, list(K_MAX), lambda: model.readout, {"patience": int(value)})
    if not POLICIES[name].uses_tau:
        return exit_controllers(name, None, list(K_MAX))
    if name == "learned":  # a gate with random weights: the rule's mechanics, not its quality
        gate = random_gate(model.n_groups, model.config.d_model)
        return exit_controllers(name, value, list(K_MAX), None, {"gate": gate})
    if name == "ouro":  # Ouro's rule with a random gate: its mechanics on any model
        return exit_controllers(name, value, list(K_MAX), None, {"gate": random_ouro_gate(model.config.d_model)})
    return exit_controllers(name, value, list(K_MAX), lambda: model.readout)


# Thresholds of the rules whose signal is a probability's complement (tau in (0, 1]).
BOUNDED_GRID = [0.5, 0.8, 0.9, 0.93, 0.95, 0.96, 0.97, 0.98, 0.99, 0.995, 1.0]


def varied_setting(model: RecurrentLM, idx: torch.Tensor, noise: StateNoise, name: str):
    """The rule's setting (from a grid) under which the tokens' loop steps vary the most."""
    grid = [1, 2] if name == "argmax_stable" else [None] if not POLICIES[name].uses_tau else \
        BOUNDED_GRID if POLICIES[name].tau_max is not None else [10.0 ** (e / 2) for e in range(-12, 3)]
    best, spread = grid[0], -1
    for value in grid:
        out = model(idx, controller=controller_factory(model, name, value)(), noise=noise)
        distinct = sum(len(torch.unique(c)) for c in out.computed)
        if distinct > spread:
            best, spread = value, distinct
    return best


@pytest.mark.parametrize("name", sorted(POLICIES))
@BATCHES
def test_exits_equal_the_packed_path(name, batch):
    """Every exit rule: logits, steps computed and iterate handed on equal teacher-forced packed
    evaluation under the same controller (later tokens read exited tokens' latest keys)."""
    model = tiny_model()
    idx = tokens(batch)
    noise = StateNoise(1, range(batch))
    setting = varied_setting(model, idx, noise, name)
    factory = controller_factory(model, name, setting)
    forced = model(idx, controller=factory(), noise=noise)
    computed_forced = torch.stack(forced.computed)
    if name != "fixed":
        assert computed_forced.min() < computed_forced.max(), "the setting should make exits vary"
    decoder = make(model, batch, controller_factory=factory, noise=noise, check_every=2)
    static, computed, used = decode_all(decoder, idx)
    torch.testing.assert_close(static, forced.logits, rtol=0, atol=1e-10)
    assert torch.equal(computed, computed_forced)
    assert torch.equal(used, torch.stack(forced.used)[:, :, PROMPT:])


@BLOCKS
@BATCHES
@LOOP_STATES
def test_exits_hand_on_the_previous_state_and_equal_teacher_forced(block, batch, loop_state):
    """Algorithm 1's two-hit rule hands on x^(s-1): the decoder, token by token, hands on the same state
    as the teacher-forced packed pass with every position in lock-step (both block types, both loop
    states)."""
    model = tiny_model(block, loop_state=loop_state)
    idx = tokens(batch)
    noise = StateNoise(2, range(batch))
    setting = varied_setting(model, idx, noise, "acceleration")
    factory = controller_factory(model, "acceleration", setting)
    forced = model(idx, controller=factory(), noise=noise)
    forced_used, forced_computed = torch.stack(forced.used), torch.stack(forced.computed)
    assert (forced_used < forced_computed).any(), "some token should hand on the state before its last step"
    decoder = make(model, batch, controller_factory=factory, noise=noise)
    static, computed, used = decode_all(decoder, idx)
    torch.testing.assert_close(static, forced.logits, rtol=0, atol=1e-10)
    assert torch.equal(computed, forced_computed)
    assert torch.equal(used, forced_used[:, :, PROMPT:])


@pytest.mark.parametrize("name", ["step_norm", "acceleration", "kl"])
def test_check_every_changes_nothing_but_time(name):
    model = tiny_model()
    idx = tokens(3)
    noise = StateNoise(4, range(3))
    factory = controller_factory(model, name, varied_setting(model, idx, noise, name))
    results = [decode_all(make(model, 3, controller_factory=factory, noise=noise,
                                        check_every=every), idx) for every in (None, 1, 2, 4)]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=False))


@pytest.mark.parametrize("mode", ["fixed", "exits"])
def test_span_buckets_read_the_written_span_and_change_nothing(mode, monkeypatch):
    """Captured(span_buckets=n), nothing recorded: each token's attention reads the cache's first n, 2n, 4n ... positions
    (the smallest span holding what is written, at most the capacity) under the mask, as a captured
    graph of that span would; logits, steps and hand-offs equal the prefix reads and the whole-cache
    reads (float64)."""
    model = tiny_model()
    idx = tokens(3)
    noise = StateNoise(6, range(3))
    options = {"noise": noise}
    if mode != "fixed":
        factory = controller_factory(model, "acceleration", varied_setting(model, idx, noise, "acceleration"))
        options.update(controller_factory=factory, check_every=2)
    capacity = LENGTH + 2
    prefix = decode_all(make(model, 3, capacity=capacity, **options), idx)
    whole = decode_all(make(model, 3, capacity=capacity, prefix_reads=False, **options), idx)
    decoder = make(model, 3, capacity=capacity, span_buckets=3, **options)
    spans = decoder.executor.spans(decoder)
    assert spans == [3, 6, 12, capacity]
    decoder.prefill(idx[:, :PROMPT])  # Captured.record records only the spans that hold the next position
    assert [span for span in spans if span > decoder.length] == [6, 12, capacity]
    span_for = lambda n: decoder.executor.span_for(decoder, n)  # noqa: E731
    assert [span_for(n) for n in (1, 3, 4, 7, 12, 13, 14)] == [3, 3, 6, 12, 12, 14, 14]
    read = decoder.cache.read
    spans = []

    def reading(layer, step):
        keys, values = read(layer, step)
        spans.append((decoder.length + 1, keys.shape[2]))
        return keys, values

    monkeypatch.setattr(decoder.cache, "read", reading)
    spanned = decode_all(decoder, idx)
    for got, want in ((spanned, prefix), (spanned, whole)):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-10)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    decoded = {written: span for written, span in spans if written > PROMPT}  # the prompt runs in parallel
    assert decoded == {n: span_for(n) for n in range(PROMPT + 1, LENGTH + 1)}
    with pytest.raises(RdepthError, match="span_buckets must be an int >= 1"):
        Captured(Executor(), span_buckets=0)
    with pytest.raises(RdepthError, match="not with compile"):
        Captured(Compiled(), span_buckets=4)


# ------------------------------------------------------------------ generation
@BLOCKS
def test_greedy_equals_generate(block):
    model = tiny_model(block)
    prompt = tokens(2, 4)
    noise = StateNoise(9, [0, 1])
    expected = generate(model, prompt, 8, temperature=0, loop_counts=(3, 2), noise=noise)
    assert torch.equal(make(model, 2, loop_counts=(3, 2), noise=noise).generate(prompt, 8), expected)
    factory = controller_factory(model, "step_norm", 0.3)
    expected = generate(model, prompt, 8, temperature=0, controller_factory=factory, noise=noise)
    decoder = make(model, 2, controller_factory=factory, noise=noise, check_every=3)
    assert torch.equal(decoder.generate(prompt, 8), expected)
    # to the end of the block, as generate stops there
    long = generate(model, prompt, 40, temperature=0, loop_counts=(3, 2), noise=noise)
    assert torch.equal(make(model, 2, loop_counts=(3, 2), noise=noise).generate(prompt, 40), long)
    assert long.shape[1] == model.config.block_size + 1


# ------------------------------------------------------------------ no host syncs
def op_counts(call) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    counts: dict[str, int] = {}
    for event in prof.events():
        counts[event.name] = counts.get(event.name, 0) + 1
    return counts


@pytest.mark.parametrize("name, check_every", [(None, None), ("acceleration", None), ("kl", None),
                                               ("confidence", None), ("learned", None), ("step_norm", 2)])
def test_a_token_has_no_host_sync_but_one_per_chunk_check(name, check_every):
    model = tiny_model()
    idx = tokens(3)
    noise = StateNoise(5, range(3))
    if name is None:
        decoder = make(model, 3, noise=noise)
    else:
        factory = controller_factory(model, name, varied_setting(model, idx, noise, name))
        decoder = make(model, 3, controller_factory=factory, noise=noise, check_every=check_every)
    decoder.prefill(idx[:, :PROMPT])
    counts = op_counts(lambda: decoder.step(idx[:, PROMPT : PROMPT + 1]))
    syncs = sum(counts.get(op, 0) for op in SYNC_OPS if op != "aten::_local_scalar_dense")
    assert counts.get("aten::nonzero", 0) == 0  # no boolean-mask indexing
    # no tensor built from host data (torch.tensor(list)): on CUDA a pageable copy that syncs
    # (CUDA's sync debug mode caught one in the first token after a prefill, 2026-11-27)
    assert counts.get("aten::lift_fresh", 0) == 0
    checks = sum(1 for kind, _ in decoder.plan.pieces if kind == "check")
    assert syncs <= checks and (check_every is None) == (checks == 0)
    # the teacher-forced packed pass, for contrast (the counter sees syncs), syncs at every loop step
    packed = op_counts(lambda: model(idx[:, :PROMPT + 1], controller=FixedController(K_MAX), noise=noise))
    assert sum(packed.get(op, 0) for op in SYNC_OPS) >= sum(K_MAX)


@pytest.mark.parametrize("name", [None, "acceleration", "kl"])
def test_every_piece_of_a_token_traces_as_one_graph(name):
    """torch.compile(fullgraph=True) refuses a host read (.item(), bool()), boolean-mask indexing and
    Python branching on tensor values: every piece of the token plan (fixed budget, and the exit
    rules' per-step decisions with their bookkeeping) traces whole, and computes the same logits."""
    model = tiny_model()
    idx = tokens(3)
    noise = StateNoise(5, range(3))
    options = {"noise": noise}
    if name is not None:
        options.update(controller_factory=controller_factory(model, name, varied_setting(model, idx, noise, name)),
                       check_every=2)
    eager, traced = make(model, 3, **options), make(model, 3, **options)
    for decoder in (eager, traced):
        decoder.prefill(idx[:, :PROMPT])
    expected = eager.step(idx[:, PROMPT : PROMPT + 1])
    traced.tokens.copy_(idx[:, PROMPT : PROMPT + 1])
    traced.cache.limit = traced.length + 1  # what _advance sets before the pieces (eager: the written prefix)
    with torch.no_grad():
        for kind, piece in traced.plan.pieces:
            if kind == "run":
                torch._dynamo.reset()  # a fresh compile per piece (they share code objects)
                torch.compile(piece, fullgraph=True, backend="eager")()
    torch._dynamo.reset()
    torch.testing.assert_close(traced.logits, expected, rtol=0, atol=1e-10)
    assert torch.equal(traced.computed, eager.computed)


# ------------------------------------------------------------------ precision and errors
def test_bf16_decoder_is_close_to_fp32_and_picks_the_same_clear_tokens():
    """A constructed case: the tied embedding scaled up so that logits have clear winners."""
    model = tiny_model().float()
    with torch.no_grad():
        model.wte.weight.mul_(8)
    idx = tokens(2)
    noise = StateNoise(6, [0, 1])
    wide, _, _ = decode_all(make(model, 2, loop_counts=(3, 2), noise=noise), idx)
    narrow_model = copy.deepcopy(model)
    decoder = make(narrow_model, 2, dtype=torch.bfloat16, loop_counts=(3, 2), noise=noise)
    # the decoder decodes a converted copy: the caller's model stays float32
    assert decoder.cache.single[0][0].dtype == torch.bfloat16 and decoder.model.wte.weight.dtype == torch.bfloat16
    assert narrow_model.wte.weight.dtype == torch.float32
    narrow, _, _ = decode_all(decoder, idx)
    assert narrow.dtype == torch.bfloat16
    error = (narrow.float() - wide).abs().max()
    assert error < 0.05 * wide.abs().max()
    top2 = wide.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 4 * error
    assert clear.float().mean() > 0.5
    assert torch.equal(narrow.float().argmax(-1)[clear], wide.argmax(-1)[clear])
    # greedy decoding picks the same tokens
    prompt = idx[:, :4]
    assert torch.equal(make(model, 2, loop_counts=(3, 2), noise=noise).generate(prompt, 3),
                       decoder.generate(prompt, 3))


def test_errors_name_the_problem():
    model = tiny_model()
    with pytest.raises(RdepthError, match="noise must be a StateNoise"):
        make(model, 1, noise=torch.Generator())
    noise = StateNoise(0, [0])
    with pytest.raises(RdepthError, match="below the budget's steps"):
        make(model, 1, loop_counts=(7, 2), keep_steps=K_MAX, noise=noise)
    with pytest.raises(RdepthError, match="needs a CUDA device"):
        Captured.record(make(model, 1, noise=noise))
    decoder = make(model, 1, noise=noise, capacity=6)
    decoder.prefill(tokens(1, 6))
    with pytest.raises(RdepthError, match="cache is full"):
        decoder.step(tokens(1, 1))
    with pytest.raises(RdepthError, match="holds 1 rows"):
        decoder.prefill(tokens(2, 3))


# ------------------------------------------------------------------ CUDA graphs
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["fixed", "exits", "exits_chunked", "exits_spans"])
def test_cuda_graph_replay_equals_eager_without_syncs(mode):
    """Replayed graphs equal eager decoding; with ``exits_spans`` one set of graphs per read span
    (``span_buckets``), switched as the tokens grow."""
    model = tiny_model().cuda()
    idx = tokens(3).cuda()
    noise = StateNoise(8, range(3))
    options = {"noise": noise}
    if mode != "fixed":
        factory = controller_factory(model, "acceleration", varied_setting(model, idx, noise, "acceleration"))
        options.update(controller_factory=factory, check_every=2 if mode == "exits_chunked" else None)
    eager = decode_all(make(model, 3, **options), idx)
    decoder = make(model, 3, **options)
    decoder.prefill(idx[:, :PROMPT])
    Captured.record(decoder, span_buckets=4 if mode == "exits_spans" else None)
    assert isinstance(decoder.executor, Captured)
    logits, computed = step_through(decoder, idx, forbid_syncs=mode != "exits_chunked")
    torch.testing.assert_close(torch.stack(logits, 1), eager[0][:, PROMPT:], rtol=0, atol=1e-10)
    assert torch.equal(torch.stack(computed, 2), eager[1][:, :, PROMPT:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_span_graphs_captured_after_a_prompt_and_rolled_back_below_it_decode_as_eager():
    """With span_buckets=4 and a 5-token prompt, capture() records the spans 8, 16, ... only (the 4-span's
    cache view ends before the warm-up's write at position 5: a device-side assert on the card at
    b5dbf74); rolled back to 2 positions, the tokens in the 4-span run eagerly, then the graphs again, and
    every token equals an eager decoder's."""
    model = tiny_model().cuda()
    idx = tokens(3).cuda()
    noise = StateNoise(8, range(3))
    factory = controller_factory(model, "acceleration", varied_setting(model, idx, noise, "acceleration"))
    options = {"noise": noise, "controller_factory": factory, "check_every": None}
    eager = decode_all(make(model, 3, **options), idx, prompt=2)
    decoder = make(model, 3, **options)
    decoder.prefill(idx[:, :PROMPT])
    Captured.record(decoder, span_buckets=4)
    assert 4 not in decoder.executor.graphs and 8 in decoder.executor.graphs
    decoder.rollback(2)
    logits, computed = step_through(decoder, idx, prompt=2)
    torch.testing.assert_close(torch.stack(logits, 1), eager[0][:, 2:], rtol=0, atol=1e-10)
    assert torch.equal(torch.stack(computed, 2), eager[1][:, :, 2:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_captured_decoder_run_unreplayed_equals_its_replay():
    """``Captured.replay = False`` (how the GPU suite counts the kernels of a captured token) runs the
    pieces the graphs were recorded from: the same logits, steps and cache as replaying them."""
    model = tiny_model().cuda()
    idx = tokens(3).cuda()
    noise = StateNoise(8, range(3))
    factory = controller_factory(model, "acceleration", varied_setting(model, idx, noise, "acceleration"))
    runs = []
    for replay in (True, False):
        decoder = make(model, 3, noise=noise, controller_factory=factory, check_every=2)
        decoder.prefill(idx[:, :PROMPT])
        Captured.record(decoder).replay = replay
        logits = []
        for t in range(PROMPT, LENGTH):
            logits.append(decoder.step(idx[:, t : t + 1]))
        runs.append((torch.stack(logits), decoder.computed.clone(), decoder.cache.looped))
    (replayed, replayed_steps, replayed_kv), (direct, direct_steps, direct_kv) = runs
    torch.testing.assert_close(direct, replayed, rtol=0, atol=1e-10)
    assert torch.equal(direct_steps, replayed_steps)
    for layer, pair in replayed_kv.items():
        for a, b in zip(pair, direct_kv[layer], strict=False):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


def test_unreplayed_tokens_of_a_captured_decoder_touch_no_graph():
    """On the CPU, with stand-in graphs that fail when replayed: ``Captured.replay = False`` runs the plan's
    pieces, and decodes as eager does."""

    class NoReplay:
        def replay(self):
            raise AssertionError("replayed")

    model = tiny_model()
    idx = tokens(3)
    noise = StateNoise(8, range(3))
    factory = controller_factory(model, "acceleration", varied_setting(model, idx, noise, "acceleration"))
    options = dict(noise=noise, controller_factory=factory, check_every=1)
    expected = decode_all(make(model, 3, **options), idx)
    decoder = make(model, 3, **options)
    decoder.use(Captured(decoder.executor))
    decoder.executor.graphs[None] = [None if kind == "check" else NoReplay() for kind, _ in decoder.plan.pieces]
    decoder.executor.replay = False
    decoder.rollback(0)
    for t in range(PROMPT):  # the prompt unreplayed too
        decoder.step(idx[:, t : t + 1])
    logits, computed = [], []
    for t in range(PROMPT, LENGTH):
        logits.append(decoder.step(idx[:, t : t + 1]))
        computed.append(decoder.computed.clone())
    torch.testing.assert_close(torch.stack(logits, 1), expected[0][:, PROMPT:], rtol=0, atol=1e-10)
    assert torch.equal(torch.stack(computed, 2), expected[1][:, :, PROMPT:])
    decoder.executor.replay = True  # and the flag is what kept the graphs out
    decoder.rollback(PROMPT)
    with pytest.raises(AssertionError, match="replayed"):
        decoder.step(idx[:, PROMPT : PROMPT + 1])


# --------------------------------------------------------------- the one decoder's other duties
@pytest.mark.parametrize("name", [None, "acceleration", "kl"])
@LOOP_STATES
def test_warm_start_equals_teacher_forced_warm_start(name, loop_state):
    """Each group's loop starts from the state it handed on at the previous position: the decoder, token
    by token, equals the teacher-forced warm start (float64; at a fixed budget also a dense reference
    that recomputes every prefix from the hand-offs, :func:`dense_warm_start`), with exits too, and a
    rollback restarts from the right state."""
    model = tiny_model(loop_state=loop_state)
    idx = tokens(2)
    noise = StateNoise(4, range(2))
    options = {"loop_counts": (3, 2)}
    if name is not None:
        options = {"controller_factory": controller_factory(model, name, varied_setting(model, idx, noise, name))}
    reference = teacher_forced(model, idx, noise=noise, warm_start=True, **options)
    if name is None:
        torch.testing.assert_close(reference.logits, dense_warm_start(model, idx, (3, 2), noise), rtol=0, atol=1e-10)
    decoder = make(model, 2, noise=noise, warm_start=True, **options)
    logits = decoder.prefill(idx[:, :PROMPT])
    rest = torch.cat([decoder.step(idx[:, t:t + 1])[:, None] for t in range(PROMPT, LENGTH)], 1)
    torch.testing.assert_close(torch.cat([logits, rest], 1), reference.logits, rtol=0, atol=1e-10)
    if name is not None:  # the exits differ from a cold start, or the test would not tell warm from cold
        cold = model(idx, noise=noise, controller=options["controller_factory"]())
        assert not torch.equal(torch.stack(cold.computed), torch.stack(reference.computed))
    decoder.rollback(PROMPT + 2)
    again = decoder.extend(idx[:, PROMPT + 2:])
    torch.testing.assert_close(again, reference.logits[:, PROMPT + 2:], rtol=0, atol=1e-10)


def dense_warm_start(model: RecurrentLM, idx: torch.Tensor, counts, noise) -> torch.Tensor:
    """Warm start by definition, with no cache: position t's logits from a dense pass over positions
    0..t whose initial states are the noise at 0 and, at j > 0, the state each group handed on at j - 1
    (a causal pass leaves the earlier positions' trajectories as they were)."""
    batch, length = idx.shape
    blank = torch.zeros(batch, length, model.config.d_model, dtype=torch.float64)
    first = {group: model.init_state(group, blank, noise) for group in range(model.n_groups)}
    handed = {group: [] for group in range(model.n_groups)}
    logits = []

    def observe(group, step, state, active):
        if step == counts[group]:
            last[group] = state[:, -1]

    for t in range(length):
        starts = {group: torch.stack([first[group][:, 0], *handed[group]], 1) for group in range(model.n_groups)}
        last = {}
        original = model.init_state
        model.init_state = lambda group, inputs, noise=None, start=0, starts=starts: starts[group]
        try:
            logits.append(model(idx[:, :t + 1], loop_counts=counts, observer=observe).logits[:, -1])
        finally:
            model.init_state = original
        for group in range(model.n_groups):
            handed[group].append(last[group])
    return torch.stack(logits, 1)


def test_extend_at_another_budget_then_rollback_equals_the_budget_alone():
    """Drafting at a smaller budget writes keys the verifying budget must not read: after a rollback, the
    verifying budget's pass equals teacher-forced evaluation; the lock-step pass equals token by token."""
    model = tiny_model()
    idx = tokens(3)
    noise = StateNoise(1, range(3))
    forced = model(idx, loop_counts=(4, 3), noise=noise).logits
    decoder = make(model, 3, loop_counts=(4, 3), noise=noise)
    decoder.prefill(idx[:, :PROMPT])
    drafted = decoder.extend(idx[:, PROMPT:PROMPT + 4], loop_counts=(1, 1))
    assert decoder.length == PROMPT + 4 and torch.equal(decoder.prompt_computed[:, :, -1], torch.ones(2, 3).long())
    assert drafted.shape == (3, 4, 50)
    decoder.rollback(PROMPT)
    torch.testing.assert_close(decoder.extend(idx[:, PROMPT:]), forced[:, PROMPT:], rtol=0, atol=1e-10)
    one_by_one = make(model, 3, loop_counts=(4, 3), noise=noise)
    one_by_one.prefill(idx[:, :1])
    steps = torch.stack([one_by_one.step(idx[:, t:t + 1]) for t in range(1, LENGTH)], 1)
    torch.testing.assert_close(steps, forced[:, 1:], rtol=0, atol=1e-10)
    with pytest.raises(RdepthError, match="cannot roll back"):
        decoder.rollback(LENGTH + 1)
    with pytest.raises(RdepthError, match="exceed the capacity"):
        decoder.extend(torch.zeros(3, 40, dtype=torch.long))


def test_sampling_is_the_generators_draw_and_the_model_is_left_as_found():
    """Temperature / top-k draws on the device from the given generator: the same seed gives the same
    tokens, top_k=1 is greedy; the caller's model keeps its mode and dtype."""
    model = tiny_model().float().train()
    prompt = tokens(2)[:, :4]
    noise = StateNoise(0, range(2))

    def sample(seed, **options):
        decoder = make(model, 2, loop_counts=(2, 2), noise=noise)
        return decoder.generate(prompt, 8, rng=torch.Generator().manual_seed(seed), **options)

    hot = sample(1, temperature=5.0)
    assert torch.equal(hot, sample(1, temperature=5.0)) and not torch.equal(hot, sample(2, temperature=5.0))
    greedy = make(model, 2, loop_counts=(2, 2), noise=noise).generate(prompt, 8)
    assert torch.equal(sample(3, temperature=5.0, top_k=1), greedy)
    assert model.training and next(model.parameters()).dtype == torch.float32
    make(model, 2, dtype=torch.float64, loop_counts=(2, 2), noise=noise).generate(prompt, 2)
    assert model.training and next(model.parameters()).dtype == torch.float32
    with pytest.raises(RdepthError, match="temperature must be >= 0"):
        generate(model, prompt, 2, temperature=-1.0)


# ------------------------------------------------------------------ a model that is only its loop
@pytest.mark.parametrize("name", ["fixed", "step_norm_rel", "kl", "learned"])
@BATCHES
def test_a_model_that_is_only_its_loop_decodes_as_teacher_forced_and_row_by_row(name, batch):
    """Issue 38's regime: no single-pass layer before or after the group (``n_layer=1, groups="0"``), so
    the loop adapter reads the embedding and the head reads the hand-off. The decoder equals the
    teacher-forced pass at a fixed budget and under exits (steps and logits), and each row decoded alone
    equals its row of the batch."""
    from rdepth.model.walk import StageKind

    model = tiny_model(n_layer=1, groups="0")
    assert [stage.kind for stage in model.stages] == [StageKind.GROUP]
    idx = tokens(batch)

    def run(rows):
        noise = StateNoise(5, rows)
        if name == "fixed":
            return model(idx[rows], loop_counts=(4,), noise=noise), make(model, len(rows), loop_counts=(4,),
                                                                          noise=noise)
        factory = controller_factory(model, name, setting)
        return model(idx[rows], controller=factory(), noise=noise), make(model, len(rows),
                                                                         controller_factory=factory, noise=noise)

    rows = list(range(batch))
    setting = None if name == "fixed" else varied_setting(model, idx, StateNoise(5, rows), name)
    forced, decoder = run(rows)
    static, computed, _ = decode_all(decoder, idx)
    torch.testing.assert_close(static, forced.logits, rtol=0, atol=1e-10)
    if name != "fixed":
        assert torch.equal(computed, torch.stack(forced.computed))
        assert computed.min() < computed.max(), "the setting should make exits vary"
    for row in rows if batch > 1 else []:
        _, alone = run([row])
        alone_logits, alone_computed, _ = decode_all(alone, idx[[row]])
        torch.testing.assert_close(alone_logits, static[[row]], rtol=0, atol=1e-10)
        assert torch.equal(alone_computed, computed[:, [row]])
