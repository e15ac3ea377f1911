"""bench/serve_stream_gaps.py: streams under load against one rdepth serve. End to end on a tiny task run (every
request streamed to its end, per-stream gaps measured, the server stopped), and bad flags as one line before any
server starts."""

from __future__ import annotations

import json

import pytest
from test_reliability_round6_bench import _left_running, _started_processes, bench_module, in_process, task_run  # noqa: F401


def argv(task_run, *flags):  # noqa: F811
    data, run = task_run
    return ["--run", str(run), "--data", str(data), "--difficulties", "1,2,3", "--loops", "2", "--requests", "6",
            "--prompt-tokens", "4", "--max-tokens", "3", "--batch-size", "2", *flags]


def test_every_stream_is_timed_and_the_server_stopped(task_run, capsys, monkeypatch, tmp_path):  # noqa: F811
    bench = bench_module("serve_stream_gaps", monkeypatch)
    started = _started_processes(monkeypatch)
    out = tmp_path / "gaps.json"
    code, lines = in_process(capsys, "bench/serve_stream_gaps.py",
                             lambda: bench.main(argv(task_run, "--clients", "1,3", "--json", str(out), "--",
                                                     "--tick", "static", "--ahead", "2")))
    assert code == 0, lines
    servers = [process for process in started if "serve" in process.args]
    assert not _left_running(started) and len(servers) == 1
    report = json.loads(out.read_text())
    assert report["flags"] == ["--loops", "2", "--tick", "static", "--ahead", "2"]
    assert [row["clients"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["streams"] == 6
        assert 0 <= row["longest_gap_p50_s"] <= row["longest_gap_p99_s"] < row["wall_s"]
        assert 0 < row["first_chunk_p50_s"] <= row["first_chunk_p99_s"]


@pytest.mark.parametrize("flags, words", [(["--clients", "0"], "--clients takes integers >= 1"),
                                          (["--clients", "x"], "--clients takes integers"),
                                          (["--loops", "0"], "--loops must be >= 1, got 0")])
def test_bad_flags_are_one_line_before_a_server_starts(task_run, capsys, monkeypatch, flags, words):  # noqa: F811
    bench = bench_module("serve_stream_gaps", monkeypatch)
    started = _started_processes(monkeypatch)
    code, lines = in_process(capsys, "bench/serve_stream_gaps.py", lambda: bench.main(argv(task_run, *flags)))
    assert not started
    assert code == 2 and len(lines) == 1 and words in lines[0], lines
