"""Every path that decodes token by token drives the one decoder (rdepth.model.decoder.Decoder), or, for many
requests at once, the engine (rdepth.engine, tests/test_engine.py: equal to the decoder request by request),
over the same cache class.

A token-by-token loop is a loop whose body feeds the model through a key/value cache: a call with a
``cache=`` keyword, a new cache (``new_cache``), or a decoder's position step (``_advance``). Only the
decoder itself may hold one (teacher-forced warm start and the exported model's cached forward run
the decoder too), and there is one cache class (issue 39 item 3).
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

PACKAGE = Path(__file__).resolve().parents[1] / "rdepth"
ALLOWED = {
    ("model/decoder.py", None),
    # the looped engine's tick over a transformers model (HRM-Text, Inkling-2), which rdepth's decoder cannot
    # drive: a cache of that model's own for each request admitted (tests/test_looped_engine.py: equal to the
    # adapter's batch-1 decode request by request)
    ("looped/engine.py", "__call__"),
}


def _feeds_a_cache(call: ast.Call) -> bool:
    if any(keyword.arg == "cache" for keyword in call.keywords):
        return True
    return isinstance(call.func, ast.Attribute) and call.func.attr in {"new_cache", "_advance"}


def token_loops() -> list[tuple[str, str | None, int]]:
    """(module, enclosing function, line) of every loop that feeds the model through a cache."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        relative = path.relative_to(PACKAGE).as_posix()

        def visit(node, function, relative=relative):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                function = node.name
            if isinstance(node, (ast.For, ast.While)):
                calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and _feeds_a_cache(n)]
                if calls:
                    found.append((relative, function, node.lineno))
            for child in ast.iter_child_nodes(node):
                visit(child, function)

        visit(tree, None)
    return found


def test_no_module_but_the_decoder_drives_a_token_by_token_loop():
    loops = token_loops()
    outside = [(module, function, line) for module, function, line in loops
               if (module, None) not in ALLOWED and (module, function) not in ALLOWED]
    assert outside == []
    assert any(module == "model/decoder.py" for module, _, _ in loops)  # the scan does see the decoder's loop


def test_one_cache_class_and_no_cache_in_the_model_forward():
    """``grep "class .*KV|KVStore" rdepth`` finds one cache (``KVCache``); the other stores are adapters over
    its tensors, each under 60 lines; ``RecurrentLM.forward`` takes no cache and no sequential warm start."""
    import inspect

    from rdepth.model.recurrent import RecurrentLM

    classes = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and ("KV" in node.name or "Cache" in node.name):
                classes[node.name] = (path.relative_to(PACKAGE).as_posix(), node.end_lineno - node.lineno + 1)
    assert "KVStore" not in classes and classes["KVCache"][0] == "model/kv.py"
    # a transformers model's cache for the looped engine's slots (rows of HRM-Text at their own positions), not
    # rdepth's model's: the one rdepth/looped/ holds
    looped = {name for name, (module, _) in classes.items() if module.startswith("looped/")}
    assert looped == {"LoopedSlotCache"} and classes["LoopedSlotCache"][0] == "looped/slot_cache.py"
    adapters = {name: lines for name, (module, lines) in classes.items()
                if name not in {"KVCache", "RdepthCache"} | looped}  # RdepthCache: transformers' handle on a Decoder
    # SlotCache: the engine's reads and writes of a KVCache made by the model (rows at their own steps)
    assert set(adapters) == {"ChunkKV", "RowsKV", "ThroughKV", "GivenKV", "SlotCache"} and max(adapters.values()) < 60
    parameters = inspect.signature(RecurrentLM.forward).parameters
    assert "cache" not in parameters and "warm_start" not in parameters


def test_every_decoding_entry_point_runs_the_decoder(monkeypatch):
    """generate, speculative decoding and greedy fills construct a Decoder (counted), and none of them
    calls the model's forward with a cache."""
    from rdepth.config import get_preset
    from rdepth.model import RecurrentLM, generation, speculative
    from rdepth.model import decoder as decoder_module
    from rdepth.model.noise import StateNoise

    made = []
    original = decoder_module.Decoder.__init__

    def counting(self, *args, **kwargs):
        made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(decoder_module.Decoder, "__init__", counting)
    torch.manual_seed(0)
    model = RecurrentLM(get_preset("tiny", n_layer=3, d_model=32, n_head=2, block_size=24, vocab_size=50,
                                   groups="1")).eval()

    def no_cache_forward(*args, **kwargs):
        assert kwargs.get("cache") is None, "a decoding path called forward with a cache"
        return RecurrentLM.forward(model, *args, **kwargs)

    monkeypatch.setattr(model, "forward", no_cache_forward)
    prompt = torch.randint(0, 50, (1, 4))
    plain = generation.generate(model, prompt, 6, temperature=0, loop_counts=(3,), noise=StateNoise(0, [0]))
    fast, _ = speculative.speculative_generate(model, prompt, 6, draft_loops=1, loop_counts=(3,),
                                               noise=StateNoise(0, [0]))
    assert torch.equal(plain, fast) and len(made) == 2


def test_every_decoder_option_is_used_by_the_product():
    """Each keyword option of ``Decoder.__init__`` is passed by some call in the package itself (not only by
    bench/ or tests/): the decoder holds what the product uses; GPU executors are applied from outside."""
    import inspect

    from rdepth.model.decoder import Decoder

    options = [name for name, parameter in inspect.signature(Decoder.__init__).parameters.items()
               if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
    passed = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Decoder":
                passed |= {keyword.arg for keyword in node.keywords}
    assert options and [name for name in options if name not in passed] == []



def bench_imports(path: Path) -> list[str]:
    """The bench/ modules ``path`` imports, at module level or inside functions (``import_module`` too)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == \
                "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            names.append(str(node.args[0].value))
    return [name for name in names if name == "bench" or name.startswith("bench.")]


def test_the_package_never_imports_the_benchmarks_executors(tmp_path):
    """The masked, compiled and captured executors and the batch-quantile exit live in bench/gpu/ (the
    product never applies them): no module of the package imports bench/, lazily either (an installed
    rdepth has no bench/). The scan sees a lazy import where one is planted."""
    found = [f"{path.relative_to(PACKAGE)}: {name}" for path in sorted(PACKAGE.rglob("*.py"))
             for name in bench_imports(path)]
    assert found == []
    planted = tmp_path / "planted.py"
    planted.write_text("def decode(decoder):\n    from bench.gpu.executors.graphs import Captured\n"
                       "    return Captured.record(decoder)\n")
    assert bench_imports(planted) == ["bench.gpu.executors.graphs"]


def test_one_default_temperature_greedy_in_both_generate_functions():
    """model.generation.generate defaulted to temperature 1.0 (sampling), Decoder.generate to 0.0 (greedy);
    both are greedy by default now (issue 39 item 4): the default equals temperature=0 bit for bit."""
    import inspect

    from conftest import tiny_model

    from rdepth.model.decoder import Decoder
    from rdepth.model.generation import generate
    from rdepth.model.noise import StateNoise

    assert inspect.signature(generate).parameters["temperature"].default == 0.0
    assert inspect.signature(Decoder.generate).parameters["temperature"].default == 0.0
    model = tiny_model()
    idx = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(3))
    default = generate(model, idx, 6, loop_counts=(2, 3), noise=StateNoise(0, [0, 1]))
    greedy = generate(model, idx, 6, temperature=0, loop_counts=(2, 3), noise=StateNoise(0, [0, 1]))
    assert torch.equal(default, greedy)
