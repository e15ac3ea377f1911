"""Ranks die with the process that started them (issue 43): `rdepth demo --ranks 2` killed with SIGKILL
left both ranks training; they wrote a checkpoint and summary.json after the demo died, and a re-run
refused the folder as in use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _children(pid: int) -> list[int]:
    """The live spawned workers (multiprocessing's spawn_main) whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z" and "spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_when_their_parent_is_killed(small_chase_data, tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from rdepth.config import ModelConfig
        from rdepth.train.config import TrainConfig
        from rdepth.train.ranks import train_ranks

        model = ModelConfig(n_layer=2, n_head=2, d_model=32, block_size=32, vocab_size=42, groups="1",
                            mean_loops=3.0, backprop_depth=2, tokenizer="task:chase")
        train = TrainConfig(data={str(small_chase_data)!r}, out={str(tmp_path / "run")!r}, max_steps=100000,
                            batch_size=8, lr=3e-3, warmup_steps=2, eval_every=100000, checkpoint_every=100000,
                            eval_batches=1, log_every=1000, threads=1, seed=0)
        train_ranks(model, train, 2, {str(tmp_path / "logs")!r})
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
            ranks = _children(parent.pid)
        assert len(ranks) == 2, "the two ranks did not start"
        time.sleep(3)  # let them get into training
        assert all(_alive(pid) for pid in ranks)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks), "a rank outlived its killed parent"
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
