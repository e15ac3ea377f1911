"""``rdepth serve --replicas 2``: two whole servers under Ray Serve behind one port of 127.0.0.1 (issue 65, item 4).

One Ray cluster for the module (its own ``$RAY_TMPDIR``, 2 CPUs, no dashboard), the command run as a user runs
it, in Ray's venv (tests/ray_venv.py; the module skips where neither that venv nor an importable ``ray`` is
there). Through Ray's proxy: a request with an exit rule gets the per-token depth report, its tokens and loop steps
the batch-1 decode's under that rule, some below the cap (exits kept); identical greedy requests spread over both
replicas (told apart by the ``x-rdepth-replica`` header) answer identically; SIGTERM ends the command with one line
and leaves no process of its cluster behind. Bad flags are one line and exit 2 without Ray."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from ray_venv import ray_python
from serve_helpers import ROOT, SERVER
from test_serve_depth import alone

from rdepth.cli.main import main
from rdepth.run.checkpoint import load_model

PYTHON = sys.executable if importlib.util.find_spec("ray") else ray_python()
needs_ray = pytest.mark.skipif(PYTHON is None, reason="Ray Serve is absent: python tests/ray_venv.py builds .ray-venv")
RULE = {"exit": "kl", "tau": 0.05, "k_max": 4}  # on the tiny run: some tokens exit below the cap of 4, some not
ECHOED = {"exit": "kl", "tau": 0.05, "k_max": [4, 4]}  # the rule as the depth report echoes it (a cap per group)


class Cluster:
    """``rdepth serve --replicas 2`` in a process of its own, and the Ray folder its cluster writes under."""

    def __init__(self, run: Path, log_path: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        # A short folder: Ray's sockets live under it, and a Unix socket's path holds at most 107 bytes.
        self.ray_dir = tempfile.mkdtemp(prefix="rdray", dir="/tmp")
        self.log_path = log_path
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RAY_TMPDIR": self.ray_dir,
               "RAY_USAGE_STATS_ENABLED": "0"}
        with open(log_path, "w") as log:  # a session of its own: every process Ray starts for it is in it
            self.process = subprocess.Popen(
                [str(PYTHON), "-c", SERVER, "serve", "--checkpoint", str(run), "--replicas", "2", "--port",
                 str(self.port), "--device", "cpu", "--threads", "1", "--batch-size", "3", "--name", "tiny",
                 "--max-loops", "4", "--allow-exits", "kl:0.1"],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)

    def wait_ready(self, seconds: float = 120) -> None:
        end = time.monotonic() + seconds
        while True:
            assert self.process.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, f"the replicas did not start:\n{self.log_path.read_text()}"
            time.sleep(0.3)

    def processes(self) -> list[int]:
        """The live processes of the command's session: the command, Ray's own and the replicas (Ray renames
        them, ``ray::ServeReplica...``, so neither their command line nor their environment tells them apart)."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:  # gone meanwhile
                    continue
                if int(fields[3]) == self.process.pid and fields[0] != "Z":  # (state, ppid, pgrp, session)
                    found.append(int(entry.name))
        return found

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it; the command's exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)

    def clean_up(self) -> None:
        """Whatever a failed test left: the command and any process of its cluster, then its folder."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.ray_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tiny_text_run, tmp_path_factory):
    started = Cluster(tiny_text_run, tmp_path_factory.mktemp("serve_ray") / "server.log")
    try:
        started.wait_ready()
        yield started
    finally:
        started.clean_up()


@pytest.fixture(scope="module")
def model(tiny_text_run):
    return load_model(tiny_text_run)[0]


def complete(port: int, prompt: str, depth: dict) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "rdepth": depth}
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


@needs_ray
def test_the_depth_report_comes_back_with_exits_below_the_cap(cluster, model, tiny_text_run):
    choice = complete(cluster.port, "The city", RULE).json()["choices"][0]
    text, steps, _ = alone(tiny_text_run, model, "The city", 6, ECHOED)
    report = choice["rdepth"]
    assert choice["text"] == text and report["steps"] == steps[: len(report["steps"])]
    assert report["policy"] == ECHOED
    flat = [(step, rule) for token_steps, token_rules in zip(report["steps"], report["rules"], strict=True)
            for step, rule in zip(token_steps, token_rules, strict=True)]
    assert all(step <= 4 for step, _ in flat)
    assert any(step < 4 for step, _ in flat), "no token exited below the cap: the exit rule did not run"
    assert all(rule == "rule" for step, rule in flat if step < 4)
    fixed = complete(cluster.port, "The city", {"loops": 3}).json()["choices"][0]
    assert fixed["text"] == alone(tiny_text_run, model, "The city", 6, {"loops": [3, 3]})[0]
    assert {tuple(token) for token in fixed["rdepth"]["steps"]} == {(3, 3)}


@needs_ray
def test_requests_spread_over_both_replicas_answer_identically(cluster, model, tiny_text_run):
    """Identical greedy requests, 8 at once: Ray's router sends them to both replicas (each replica's header
    names it); every answer, text and depth report, is the same, and the batch-1 decode's."""
    replicas, answers = set(), []
    with ThreadPoolExecutor(8) as pool:
        for _ in range(4):  # the router's choice is Ray's: a few rounds until both replicas answered
            responses = list(pool.map(lambda _: complete(cluster.port, "In 1900 the", RULE), range(8)))
            replicas |= {response.headers["x-rdepth-replica"] for response in responses}
            answers += [response.json()["choices"][0] for response in responses]
            if len(replicas) == 2:
                break
    assert len(replicas) == 2, f"every request went to one replica: {replicas}"
    text, steps, _ = alone(tiny_text_run, model, "In 1900 the", 6, ECHOED)
    for answer in answers:
        assert answer["text"] == text and answer["rdepth"]["steps"] == steps[: len(answer["rdepth"]["steps"])]
    assert len({str(answer["rdepth"]) for answer in answers}) == 1


@needs_ray
def test_sigterm_ends_it_in_one_line_and_leaves_no_process(cluster):
    assert cluster.processes(), "no process of the cluster found: the check below would prove nothing"
    assert cluster.stop() == 128 + signal.SIGTERM
    assert cluster.log_path.read_text().rstrip().splitlines()[-1] == "rdepth serve: terminated (SIGTERM)"
    end = time.monotonic() + 15  # Ray's own processes leave a moment after the command
    while cluster.processes() and time.monotonic() < end:
        time.sleep(0.3)
    assert cluster.processes() == []


def exit_status(argv: list[str]) -> int:
    """The command line's exit status, whether ``main`` returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "0"], "replicas must be an integer in [1, 1024], got 0"),
    (["--replicas", "two"], "--replicas expects int, got 'two'"),
    (["--ray-address", "auto"], "give --replicas too"),
    (["--replicas", "2", "--replica-gpus", "-1"], "replica_gpus must be a number in [0, 64]"),
])
def test_bad_replica_flags_are_one_line_and_exit_2(flags, message, capsys, tmp_path):
    assert exit_status(["serve", "--checkpoint", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="ray is importable here")
def test_replicas_without_ray_name_the_extra(capsys, tmp_path):
    assert exit_status(["serve", "--checkpoint", str(tmp_path), "--replicas", "2"]) == 2
    assert capsys.readouterr().err.strip() == ("rdepth serve: error: rdepth serve --replicas needs Ray Serve: "
                                               "pip install 'rdepth[ray]'")
