"""Shared fixtures: one torch thread for every test, a small real corpus prepared once per session; and the
tiny test model (``from conftest import tiny_model``)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

# The tiny test model: 5 layers, two recurrence groups (layer 1; layers 2-3), 3 loops on average.
TINY_MODEL = dict(n_layer=5, n_head=2, d_model=16, block_size=32, vocab_size=50, groups="1|2-3", mean_loops=3.0,
                  backprop_depth=2, init_state_scale=1.0, tokenizer="bpe:512")


def tiny_config(**overrides):
    """:data:`TINY_MODEL` as a ``ModelConfig``, ``overrides`` replacing its fields."""
    from rdepth.config import ModelConfig

    return ModelConfig(**{**TINY_MODEL, **overrides})


def tiny_model(block: str = "sandwich", **overrides):
    """A ``RecurrentLM`` of :func:`tiny_config` in float64, eval mode, its weights drawn after seed 0. A
    ``gpt2`` block's init leaves biases at 0 and norm gains at 1: they are moved off so that they matter."""
    from rdepth.model import RecurrentLM

    torch.manual_seed(0)
    model = RecurrentLM(tiny_config(block=block, **overrides)).double().eval()
    if block == "gpt2":
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 1:
                    param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.fixture(scope="session")
def wiki_small(tmp_path_factory):
    """The default wiki corpus (first 400 articles) with a 512-token BPE."""
    from rdepth.data.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("data") / "wiki512"
    return prepare(PrepareConfig(corpus="wiki", tokenizer="bpe:512", out=out, max_documents=400))



@pytest.fixture(scope="session")
def tiny_text_run(wiki_small, tmp_path_factory):
    """A run of 8 training steps on :func:`wiki_small` (3 layers, groups 1|2, width 32): a checkpoint and a
    tokenizer for the generation and serving commands' tests."""
    from rdepth.cli.main import main

    out = tmp_path_factory.mktemp("gen") / "run"
    assert main(["train", "--data", str(wiki_small), "--out", str(out), "--max-steps", "8", "--batch-size", "4",
                 "--eval-every", "8", "--eval-batches", "1", "--checkpoint-every", "8", "--warmup-steps", "2",
                 "--n-layer", "3", "--n-head", "2", "--d-model", "32", "--block-size", "32", "--groups", "1|2",
                 "--mean-loops", "2", "--threads", "1", "--lr", "3e-3"]) == 0
    return out


def _global_state() -> dict:
    """What a test must leave as it found it: the environment, the logging configuration (every logger's
    level, handlers, propagation and whether it is disabled) and the settings of torch's compiler (dynamo's
    and Inductor's, with the ones hidden: pytest's ``monkeypatch.setattr`` undoes a torch config option by
    deleting it, which hides the option from every later reader; ``config.patch`` restores it properly)."""
    import logging
    import os
    import sys

    loggers = {"": logging.getLogger()} | {name: logger for name, logger in logging.Logger.manager.loggerDict.items()
                                             if isinstance(logger, logging.Logger)}
    def handlers(name, logger):  # pytest's own capture handlers come and go each phase; torch's are its own
        if name.startswith("torch"):
            return ()
        return tuple(handler for handler in logger.handlers if not type(handler).__module__.startswith("_pytest"))

    state = {"environment": {key: value for key, value in os.environ.items() if key != "PYTEST_CURRENT_TEST"},
             "logging": {name: (logger.level, handlers(name, logger), logger.propagate, logger.disabled)
                         for name, logger in loggers.items()},
             "logging.disable": logging.root.manager.disable}
    for name in ("torch._dynamo.config", "torch._inductor.config"):
        module = sys.modules.get(name)
        if module is not None:
            state[name] = (module.get_config_copy(), sorted(key for key, entry in module._config.items() if entry.hide))
    return state


# Environment variables a library sets on its own first import or use, whichever test gets there first (torch's
# Inductor on its first compile; lm-eval; scikit-learn and joblib, imported by sentence-transformers and lm-eval;
# transformers' generation): new ones are not a test's doing.
_LIBRARY_SETS = ("TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "HF_XET_HIGH_PERFORMANCE",
               "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "TOKENIZERS_PARALLELISM")


def _changes(before: dict, after: dict) -> list[str]:
    """What differs between two :func:`_global_state` snapshots, one line each (a config module imported during
    the test is compared with its defaults as it was imported: nothing to compare)."""
    import logging

    lines = []
    for key, old in before.items():
        new = after.get(key)
        if key == "logging":  # a logger made during the test compared with a new logger's settings
            for name, settings in new.items():
                if name not in old and not name.startswith("rdepth"):  # a library's own loggers as it made them
                    continue
                if old.get(name, (logging.NOTSET, (), True, False)) != settings:
                    lines.append(f"logger {name or 'root'!r}: {old.get(name)} -> {settings}")
            continue
        if isinstance(old, dict):
            for name in sorted(set(old) | set(new)):
                if name in _LIBRARY_SETS and name not in old:  # set by a library itself on first use
                    continue
                if old.get(name, "<unset>") != new.get(name, "<unset>"):
                    lines.append(f"{key}[{name!r}]: {old.get(name, '<unset>')!r} -> {new.get(name, '<unset>')!r}")
            continue
        if key in ("torch._dynamo.config", "torch._inductor.config"):
            (values, hidden), (new_values, new_hidden) = old, new
            for name in sorted(set(values) | set(new_values)):
                if values.get(name, "<unset>") != new_values.get(name, "<unset>"):
                    lines.append(f"{key}.{name}: {values.get(name, '<unset>')!r} -> {new_values.get(name, '<unset>')!r}")
            lines += [f"{key}.{name}: hidden (deleted, as pytest's monkeypatch undoes it; use config.patch)"
                      for name in sorted(set(new_hidden) - set(hidden))]
            continue
        if old != new:
            lines.append(f"{key}: {old!r} -> {new!r}")
    return lines


def _restore(before: dict) -> None:
    """Puts back what :func:`_global_state` recorded in ``before``."""
    import logging
    import os
    import sys

    current = os.environ.get("PYTEST_CURRENT_TEST")
    os.environ.clear()
    os.environ.update(before["environment"] | ({"PYTEST_CURRENT_TEST": current} if current else {}))
    for name, logger in logging.Logger.manager.loggerDict.items():  # loggers made since: as new ones are
        if isinstance(logger, logging.Logger) and name not in before["logging"]:
            logger.setLevel(logging.NOTSET)
            logger.propagate, logger.disabled = True, False
    for name, (level, handlers, propagate, disabled) in before["logging"].items():
        logger = logging.getLogger(name or None)
        logger.setLevel(level)
        if not name.startswith("torch"):  # (pytest's own capture handlers kept)
            logger.handlers[:] = [*handlers, *(handler for handler in logger.handlers
                                               if type(handler).__module__.startswith("_pytest"))]
        logger.propagate, logger.disabled = propagate, disabled
    logging.disable(before["logging.disable"])
    for name in ("torch._dynamo.config", "torch._inductor.config"):
        if name in before:
            module, (values, hidden) = sys.modules[name], before[name]
            for key, entry in module._config.items():
                entry.hide = key in hidden
            for key, value in values.items():
                if module.get_config_copy().get(key) != value:
                    setattr(module, key, value)


# Tests that compile with torch.compile (dynamo converts at least one frame): counted over the session, and
# under CI a run with fewer than this many passing fails (nine of them once failed on a fresh machine only).
COMPILING_TESTS_MINIMUM = 12
_compiling: dict[str, str] = {}  # test id -> its outcome


_compilations = [0]


def _count_compilation(args) -> None:
    _compilations[0] += 1


def _compiled_frames() -> int:
    """Compilations so far in this process: dynamo's start-of-compile callback, which stays registered through
    ``torch._dynamo.reset()`` (that clears every callback: its clear is wrapped to register this one again)."""
    from torch._dynamo import callback  # (imported once, ~2 s: the first compiling test counts too)

    handler = callback.callback_handler
    if _count_compilation not in handler.start_callbacks:
        handler.register_start_callback(_count_compilation)
        clear = type(handler).clear

        def clear_and_count(self=handler):
            clear(self)
            self.register_start_callback(_count_compilation)

        handler.clear = clear_and_count
    return _compilations[0]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    frames = getattr(item, "_compiled_frames_before", None)
    compiled = frames is not None and (report.when == "call" or report.failed) and _compiled_frames() > frames
    if compiled and _compiling.get(item.nodeid, "passed") == "passed":
        _compiling[item.nodeid] = report.outcome
    return report


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _compiling and not os.environ.get("CI"):
        return
    passed = sum(outcome == "passed" for outcome in _compiling.values())
    terminalreporter.write_line(f"compile tests: {len(_compiling)} tests compiled with torch.compile, {passed} passed")
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.getoption("markexpr")
    if os.environ.get("CI") and whole_suite and passed < COMPILING_TESTS_MINIMUM:
        terminalreporter.write_line(f"compile tests: fewer than {COMPILING_TESTS_MINIMUM} passed: failing the run")
        terminalreporter._session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def leaves_global_state_alone(request):
    """Fails a test that leaves the process's global state changed (:func:`_global_state`): the next tests
    would run in another world (a hidden dynamo option broke nine compile tests that ran after one test).
    Defined before the other autouse fixtures, so their undo (monkeypatch's) runs before this check."""
    before = _global_state()
    request.node._compiled_frames_before = _compiled_frames()
    yield
    changes = _changes(before, _global_state())
    if changes:
        _restore(before)  # the test fails alone: the tests after it run in the world they expect
        pytest.fail(f"{request.node.nodeid} left global state changed:\n  " + "\n  ".join(changes), pytrace=False)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Every test runs torch on one thread: tiny tensors gain nothing from thread hand-offs, and
    the suite's wall time stays steady on a shared 2-core machine. Commands called in-process plan
    their threads for a 1-core machine (rdepth.threads), so they keep that one thread too."""
    from rdepth.threads import Machine

    monkeypatch.setattr("rdepth.threads.machine", lambda: Machine(cores=1, load=0.0))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def small_chase_data(tmp_path_factory):
    """A prepared pointer-chasing task small enough for a few training steps (8 nodes, 4 queries, context
    32, difficulties 1-3): for tests that train on task data, e.g. two ranks against one process."""
    from rdepth.tasks.data import TaskDataConfig, prepare_task_data

    out = tmp_path_factory.mktemp("chase") / "data"
    return prepare_task_data(TaskDataConfig(task="chase", train_difficulties=(1, 3), train_tokens=6000,
                                            val_tokens=2000, block_size=32, out=out,
                                            task_params='{"chase": {"nodes": 8, "queries": 4, "ordered": true}}'))


def sigint_at_default() -> None:
    """(A child's ``preexec_fn``, before it runs Python) SIGINT at its default action, whatever the suite
    inherited: a shell's background job starts with SIGINT ignored, and a Python started so never installs its
    KeyboardInterrupt handler, so an interrupt a test sends would go unseen (the child runs on: a hang)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def python_sigint():
    """SIGINT raises KeyboardInterrupt in this process for the test (Python's own handler), as in any shell's
    foreground, whatever the suite inherited; the handler before is put back after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
