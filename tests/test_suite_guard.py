"""The suite's guard (``tests/conftest.py``): a test that leaves torch's compiler settings, the environment or
the logging configuration changed fails, and the tests after it run as if it had not; a test that undoes what
it changes passes."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]

INNER = '''
import logging
import os

import torch
import torch._dynamo


def test_hides_a_dynamo_option(monkeypatch):  # pytest's undo deletes the option: hidden from every later test
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)


def test_changes_a_dynamo_option():
    torch._dynamo.config.cache_size_limit = 3


def test_leaves_an_environment_variable():
    os.environ["RDEPTH_GUARD_PROBE"] = "1"


def test_changes_a_logger():
    logging.getLogger("rdepth").setLevel(logging.CRITICAL)


def test_undoes_what_it_changes(monkeypatch):
    with torch._dynamo.config.patch(recompile_limit=2):
        assert torch._dynamo.config.recompile_limit == 2
    monkeypatch.setenv("RDEPTH_GUARD_PROBE", "2")
    logging.getLogger("rdepth.guard_new")  # a logger made by the test, left as made


def test_runs_after_the_others():
    assert torch._dynamo.config.recompile_limit == 8 and torch._dynamo.config.cache_size_limit == 8
    assert "RDEPTH_GUARD_PROBE" not in os.environ and logging.getLogger("rdepth").level == logging.NOTSET
'''


def test_the_guard_fails_each_test_that_leaves_global_state_changed(pytester):
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                          "from tests.conftest import leaves_global_state_alone  # noqa: F401\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    text = result.stdout.str()
    errors = {line.split("::")[1].split()[0] for line in text.splitlines() if line.startswith("ERROR test_inner")}
    assert errors == {"test_hides_a_dynamo_option", "test_changes_a_dynamo_option",
                      "test_leaves_an_environment_variable", "test_changes_a_logger"}, text
    assert result.parseoutcomes() == {"passed": 6, "errors": 4}, text
    assert "recompile_limit: hidden (deleted" in text and "recompile_limit: 8 -> 3" in text  # (cache_size_limit is its alias)
    assert "RDEPTH_GUARD_PROBE" in text and "logger 'rdepth'" in text
