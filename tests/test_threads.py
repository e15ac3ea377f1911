"""The thread plan: a pure rule on constructed machines, how commands apply it, and the task demo's
fixed thread count (the same numbers on any machine) with its one-line plan."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from rdepth.threads import Machine, apply_plan, machine, thread_plan


@pytest.mark.parametrize("cores,processes,load,threads", [
    (2, 1, 0.0, 2),   # an idle 2-core machine: both cores
    (2, 2, 0.0, 1),   # the demo's two runs side by side: one core each
    (2, 1, 0.4, 2),   # a little background noise rounds away
    (2, 1, 1.0, 1),   # one other busy process: the core left
    (2, 2, 1.0, 1),   # never fewer than one
    (2, 1, 3.0, 1),   # busier than the core count: one thread
    (8, 2, 0.0, 4),
    (8, 2, 2.4, 3),   # 5.6 free cores -> 6 -> 3 each
    (8, 3, 0.0, 2),   # shares round down: 3 x 2 <= 8
    (1, 1, 0.0, 1),
    (64, 1, 70.0, 1),
])
def test_thread_plan_on_constructed_machines(cores, processes, load, threads):
    assert thread_plan(cores, processes, load) == threads


@pytest.mark.parametrize("bad", [dict(cores=0), dict(parallel_processes=0), dict(load=-1.0)])
def test_thread_plan_refuses_impossible_inputs(bad):
    with pytest.raises(ValueError):
        thread_plan(**{"cores": 2, "parallel_processes": 1, "load": 0.0, **bad})


def test_machine_reads_the_affinity_and_the_load(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.25, 9.0, 9.0))
    assert machine() == Machine(cores=3, load=1.25)

    def unavailable():
        raise OSError("no load average")

    monkeypatch.setattr(os, "getloadavg", unavailable)
    assert machine().load == 0.0


def test_apply_plan_sets_torch_threads_and_a_request_wins(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    busy = Machine(cores=2, load=1.0)
    assert apply_plan(0, 1, busy) == 1
    assert apply_plan(0, 1, Machine(cores=4, load=0.0)) == 4
    assert apply_plan(3, 1, busy) == 3  # --threads N wins over a busy machine
    assert calls == [1, 4, 3]


def _namespace(command: str, threads: int | None) -> argparse.Namespace:
    return argparse.Namespace(command=command, **{"TrainConfig.threads": threads})


def test_the_command_line_plans_threads_unless_they_are_given(monkeypatch):
    from rdepth.cli import main as cli_main

    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr("rdepth.threads.machine", lambda: Machine(cores=2, load=1.5))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cli_main._plan_threads(_namespace("train", None))
    assert calls == [1]  # a busy 2-core machine: one thread
    cli_main._plan_threads(_namespace("train", 2))  # --threads 2: the command sets it itself
    cli_main._plan_threads(_namespace("demo", None))  # the demo plans its own
    cli_main._plan_threads(argparse.Namespace(command="prepare"))  # no threads flag: torch untouched
    assert calls == [1]
    monkeypatch.setattr("rdepth.threads.machine", lambda: Machine(cores=8, load=0.0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: four ranks share the machine
    cli_main._plan_threads(_namespace("train", None))
    assert calls == [1, 2]


def _demo_config(tmp_path, **fields):
    from rdepth.demo.run import DemoConfig

    return DemoConfig(out=str(tmp_path / "demo"), **fields)


def test_the_task_demo_trains_every_run_at_the_fixed_thread_count(tmp_path):
    from rdepth.demo.task import _runs, run_threads
    from rdepth.tasks.data import TaskDataConfig, prepare_task_data

    config = _demo_config(tmp_path, baselines=("no_loop", "deep"), train_tokens=3000, train_difficulties=(1, 4),
                          task_params='{"chase": {"nodes": 8, "queries": 4, "ordered": true}}',
                          model_overrides='{"block_size": 32}')
    data = prepare_task_data(TaskDataConfig(task="chase", train_difficulties=(1, 4), train_tokens=3000,
                                            val_tokens=3000, block_size=32, task_params=config.task_params,
                                            out=tmp_path / "data"))
    runs = _runs(config, data)
    assert set(runs) == {"looped", "no_loop", "deep"}
    assert {train.threads for _, train in runs.values()} == {1} and run_threads(config) == 1
    assert config.ranks == 2 and {train.batch_size for _, train in runs.values()} == {32}
    typed = _demo_config(tmp_path, threads=3)
    assert {train.threads for _, train in _runs(typed, data).values()} == {3}


@pytest.mark.parametrize("fields,fragment", [
    (dict(ranks=3), "does not split evenly over --ranks 3"),
    (dict(ranks=0), "ranks"),
    (dict(mode="text", ranks=2), "--ranks applies to --mode task only"),
])
def test_demo_ranks_are_checked(fields, fragment, tmp_path):
    from rdepth.errors import RdepthError

    with pytest.raises(RdepthError, match=fragment):
        _demo_config(tmp_path, **fields)


def test_the_demo_prints_its_plan(tmp_path):
    from rdepth.demo.task import thread_plan_text

    idle = Machine(cores=2, load=0.0)
    text = thread_plan_text(_demo_config(tmp_path), idle)
    assert text.startswith("threads: 2 usable cores, load 0.0; each run trained by 2 data-parallel processes, "
                           "1 torch thread each")
    assert "do not depend on the machine" in text
    assert "1 core for 2 processes" in thread_plan_text(_demo_config(tmp_path), Machine(cores=1, load=0.0))
    assert "the machine is busy" in thread_plan_text(_demo_config(tmp_path), Machine(cores=2, load=2.5))
    assert "busy" not in text
    assert "--ranks 8 would use more cores" in thread_plan_text(_demo_config(tmp_path), Machine(cores=8, load=0.0))
    assert "would use more" not in thread_plan_text(_demo_config(tmp_path), Machine(cores=3, load=0.0))
    typed = thread_plan_text(_demo_config(tmp_path, threads=2), idle)
    assert "2 torch threads each" in typed and "may differ from a run at the default 1" in typed


@pytest.mark.parametrize("bad", [-1, True, 5000])
def test_demo_threads_must_be_a_count(bad, tmp_path):
    from rdepth.errors import RdepthError

    with pytest.raises(RdepthError, match="threads"):
        _demo_config(tmp_path, threads=bad)


def test_verbose_is_accepted_after_the_command_too():
    from rdepth.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["demo", "--verbose"]).verbose is True
    assert parser.parse_args(["-v", "demo"]).verbose is True
    assert parser.parse_args(["demo"]).verbose is False


def test_the_demo_quiets_the_sweep_and_geometry_loggers_unless_verbose():
    import logging

    from rdepth.cli.demo import CHATTY_LOGGERS, quiet

    sweep = logging.getLogger("rdepth.sweep.task")
    with quiet(CHATTY_LOGGERS):
        assert not sweep.isEnabledFor(logging.INFO) and sweep.isEnabledFor(logging.WARNING)
        assert logging.getLogger("rdepth.demo.task").level == logging.NOTSET  # the stages still log
    with quiet(CHATTY_LOGGERS, enabled=False):
        assert logging.getLogger("rdepth.exits").level == logging.NOTSET
    assert logging.getLogger("rdepth.exits").level == logging.NOTSET  # restored after
