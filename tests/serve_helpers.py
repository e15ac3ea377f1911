"""``rdepth serve`` in a process of its own on a free port of 127.0.0.1, for tests whose client talks to it over a
real socket (lm-eval's ``local-completions``, the ``openai`` package)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SERVER = "import sys; from rdepth.cli.main import main; sys.exit(main(sys.argv[1:]))"


@contextlib.contextmanager
def serve_process(run: Path, folder: Path, *flags: str) -> Iterator[int]:
    """``rdepth serve --checkpoint run FLAGS`` on one thread and a free port, its log in ``folder/server.log``;
    yields the port once ``/health`` answers; the process is ended on the way out."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = Path(folder) / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-c", SERVER, "serve", "--checkpoint", str(run), "--port",
                                    str(port), "--device", "cpu", "--threads", "1", *flags],
                                   stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            end = time.monotonic() + 120
            while True:
                assert process.poll() is None, log_path.read_text()
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    assert time.monotonic() < end, "the server did not start"
                    time.sleep(0.2)
            yield port
        finally:
            process.terminate()
            process.wait(timeout=30)
