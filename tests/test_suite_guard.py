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


def test_ci_fails_a_whole_run_in_which_too_few_tests_compiled(pytester, monkeypatch):
    """Under CI=true a run of the whole suite (its testpaths) with fewer compiling tests than the floor fails,
    naming the count; the same run outside CI, or a run of chosen files under CI, passes."""
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                          "from tests.conftest import (leaves_global_state_alone, pytest_runtest_makereport,  # noqa\n"
                          "                            pytest_terminal_summary)\n")
    pytester.makeini("[pytest]\ntestpaths = inner\n")
    pytester.mkdir("inner")
    pytester.makepyfile(**{"inner/test_plain": "def test_nothing_compiles():\n    assert True\n"})
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == 1 and "fewer than 12 passed: failing the run" in result.stdout.str()
    assert "compile tests: 0 tests compiled with torch.compile, 0 passed" in result.stdout.str()
    assert pytester.runpytest_subprocess("-p", "no:cacheprovider", "inner/test_plain.py").ret == 0
    monkeypatch.delenv("CI")
    assert pytester.runpytest_subprocess("-p", "no:cacheprovider").ret == 0
