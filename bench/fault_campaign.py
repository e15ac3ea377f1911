"""Fault and bad-input campaign against the ``rdepth`` command line (issue 16).

Re-runs the campaign's categories in temporary folders, every case a real
``python -m rdepth ...`` process with a bounded time:

- ``flags``: bad flag values (non-finite, out of range, unbounded loop counts and sizes);
- ``files``: corrupt and hostile files (checkpoint config/state/optimizer/``latest``,
  weights, manifest, shards, tokenizer);
- ``kills``: SIGKILL / SIGTERM / SIGINT at chosen moments of a training run, then resume;
- ``concurrent``: two writers of one output folder started together;
- ``output``: an output that is a file or under a file, a full disk (``RLIMIT_FSIZE``, no
  root needed), a folder holding a user's files; read-only output where not root;
- ``data``: data and checkpoint that do not belong together; resume semantics;
- ``round3`` (issue 31): calibrate, exit profiles (bounds, run identity), export/retrofit/import-hf and
  reproduce inputs, demo re-runs over damaged files, huge model configs, non-UTF-8 and mathtext text,
  flags that do not apply, and re-runs of analyze/sweep killed at several stages (never a mixed folder);
- ``consolidate`` (issue 43): ``rdepth consolidate`` of a ``--parallel fsdp`` run (one rank under torchrun)
  while it trains with ``--keep-last 1`` (a checkpoint removed while being read), and killed while writing
  ``model.safetensors`` then re-run;
- ``round5`` (issue 55): a gate bound to its model (another model's gate, flipped bytes, a gate replaced
  under a profile, ``--overwrite``, an interrupted gate's temporary file), export onto a full disk, rule flags
  that do not apply, a key twice in ``--exit-options``, ``bench/exit_wall.py`` on bad input, raven folders
  (both weight layouts, a small vocabulary), ``import-hf``'s named formats, Ctrl-C while importing, an
  exported folder's client (generate's hidden states, gradient checkpointing, sdpa, ``max_length``, card),
  the ecosystem page's worked example.

Each case is classified:

- ``clean``: it did what it should (a bad input: non-zero exit, one line, no traceback;
  a good input: success and the right result); the summary splits them into ``refused`` (the
  case's last command exited with status 2 and one line on stderr) and ``accepted`` (the rest:
  successes, resumes, one of two concurrent writers winning);
- ``untidy``: a bad input refused without a traceback, but with another exit status than 2 or
  more than one line on stderr;
- ``traceback``: a Python traceback reached the user;
- ``silent``: a bad input was accepted (exit 0), or a run gave a wrong result;
- ``lost``: a file that existed before was damaged or removed;
- ``hang``: the case ran past its time limit (killed);
- ``orphan``: a process the case started, or one of its children, was still running after it (checked by
  the cases that start commands in the background: ``consolidate``'s).

Usage (CPU; about 15 minutes on 2 cores, 180 cases (514 s on the loaded 2-core Intel Xeon of issue 55); the
consolidate category alone about 70 s, round5 about 80 s)::

    python bench/fault_campaign.py [--timeout 60] [--only flags,files] [--json results.json] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
TINY = ["--n-layer", "3", "--n-head", "2", "--d-model", "32", "--block-size", "32", "--groups", "1",
        "--mean-loops", "3", "--backprop-depth", "2", "--threads", "1"]
CLASSES = ("clean", "untidy", "traceback", "silent", "lost", "hang", "orphan")


@dataclass
class Outcome:
    code: int | None  # None: killed at the time limit
    out: str
    err: str
    seconds: float

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip() and "%|" not in line
                and " INFO " not in line and " WARNING " not in line]


@dataclass
class Case:
    category: str
    name: str
    run: Callable[[Campaign, Path], str | None]  # returns a class, or None for "look at the outcome"
    result: str = ""
    kind: str = ""  # of a clean case: "refused" (its last command exited 2 with one line) or "accepted"
    note: str = ""
    seconds: float = 0.0


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"


def snapshot(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (hidden staging debris excluded)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): sha(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)}


class Campaign:
    def __init__(self, work: Path, timeout: float):
        self.work = work
        self.timeout = timeout
        self.counter = 0

    # -------------------------------------------------------------- running
    def rdepth(self, *argv: str, timeout: float | None = None, limit_bytes: int | None = None,
               cwd: Path | None = None) -> Outcome:
        def limits():
            if limit_bytes is not None:  # a "full disk" without root: writes past the limit fail (EFBIG)
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "rdepth", *argv], env=ENV, cwd=cwd or self.work,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=limits, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout or self.timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            code = None
        self.last = Outcome(code, out, err, time.monotonic() - started)
        return self.last

    def rdepth_python(self, code: str) -> None:
        """Run ``code`` in a fresh interpreter with this rdepth (a stand-in for "the next command")."""
        subprocess.run([sys.executable, "-c", code], env=ENV, cwd=self.work, timeout=self.timeout, check=True,
                       capture_output=True)

    def fresh(self, name: str) -> Path:
        self.counter += 1
        path = self.work / f"{self.counter:03d}-{name}"
        path.mkdir(parents=True)
        return path

    def copy(self, source: Path, name: str) -> Path:
        return Path(shutil.copytree(source, self.fresh(name) / source.name))

    def train_argv(self, data: Path, out: Path, *extra: str) -> list[str]:
        return ["train", "--data", str(data), "--out", str(out), "--batch-size", "4", "--log-every", "1",
                "--eval-every", "3", "--eval-batches", "1", "--checkpoint-every", "3", "--warmup-steps", "2",
                *TINY, *extra]

    # -------------------------------------------------------------- fixtures
    def setup(self) -> None:
        self.data = self.work / "data"
        outcome = self.rdepth("prepare", "--corpus", "wiki", "--tokenizer", "bpe:512", "--out", str(self.data),
                              "--max-documents", "300", timeout=600)
        if outcome.code != 0:
            raise SystemExit(f"campaign set-up: prepare failed:\n{outcome.err[-2000:]}")
        self.run = self.work / "run"
        outcome = self.rdepth(*self.train_argv(self.data, self.run, "--max-steps", "6"), timeout=600)
        if outcome.code != 0:
            raise SystemExit(f"campaign set-up: train failed:\n{outcome.err[-2000:]}")
        self.checkpoint = self.run / "checkpoints" / "step_000006"
        # data of the same name and size from another text: ids that mean other tokens
        corpus = self.work / "other.jsonl"
        lines = [json.dumps({"text": f"zyx qwv {i * 3} pmk jjt {i} oof wub kappa{i % 17} lambda"})
                 for i in range(3000)]
        corpus.write_text("\n".join(lines) + "\n")
        self.other_data = self.work / "other"
        outcome = self.rdepth("prepare", "--corpus", str(corpus), "--tokenizer", "bpe:512", "--out",
                              str(self.other_data), timeout=600)
        if outcome.code != 0:
            raise SystemExit(f"campaign set-up: prepare of the other data failed:\n{outcome.err[-2000:]}")


# ------------------------------------------------------------------ classification
def expect_error(outcome: Outcome, protected: dict[str, str] | None = None, folder: Path | None = None) -> str:
    """A bad input: non-zero exit, one line on stderr, no traceback, nothing protected changed."""
    if outcome.code is None:
        return "hang"
    if "Traceback" in outcome.err:
        return "traceback"
    if protected is not None and folder is not None:
        now = snapshot(folder)
        if any(now.get(name) != digest for name, digest in protected.items()):
            return "lost"
    if outcome.code == 0:
        return "silent"
    return "clean"


def expect_success(outcome: Outcome, check: Callable[[], bool] | None = None) -> str:
    if outcome.code is None:
        return "hang"
    if "Traceback" in outcome.err:
        return "traceback"
    if outcome.code != 0:
        return "silent"  # a good input refused: reported as a wrong result
    if check is not None and not check():
        return "silent"
    return "clean"


def bad_flag(command: str, *flags: str) -> Callable[[Campaign, Path], str]:
    def run(c: Campaign, tmp: Path) -> str:
        if command == "train":
            argv = c.train_argv(c.data, tmp / "run", "--max-steps", "3", *flags)
        elif command == "eval":
            argv = ["eval", "--checkpoint", str(c.run), "--data", str(c.data), "--max-batches", "1", *flags]
        elif command == "generate":
            argv = ["generate", "--checkpoint", str(c.run), "--max-new-tokens", "3", *flags]
        elif command == "analyze":
            argv = ["analyze", "--checkpoints", str(c.run), "--data", str(c.data), "--out", str(tmp / "a"),
                    "--sequences", "2", *flags]
        elif command == "sweep":
            argv = ["sweep", "--checkpoint", str(c.run), "--data", str(c.data), "--out", str(tmp / "s"),
                    "--max-batches", "1", "--no-timing", *flags]
        elif command == "prepare":
            argv = ["prepare", "--corpus", "wiki", "--max-documents", "50", "--out", str(tmp / "d"), *flags]
        elif command == "demo":
            argv = ["demo", "--out", str(tmp / "demo"), "--max-documents", "50", *flags]
        else:
            argv = [command, *flags]
        before = snapshot(c.run)
        return expect_error(c.rdepth(*argv), before, c.run)
    return run


# ------------------------------------------------------------------ cases
def flag_cases() -> list[Case]:
    cases = []
    train = [("--lr", "inf"), ("--lr", "1e10"), ("--lr", "nan"), ("--weight-decay", "nan"),
             ("--weight-decay", "-1"), ("--norm-eps", "-1"), ("--beta1", "2"), ("--beta2", "1.5"),
             ("--threads", "-1"), ("--seed", str(2**63)), ("--seed", "-1"), ("--mean-loops", "inf"),
             ("--loop-sigma", "inf"), ("--init-state-scale", "inf"), ("--mean-loops", "1e9"),
             ("--block-size", "100000"), ("--groups", "2-1"), ("--groups", "0|0"), ("--max-steps", "0"),
             ("--batch-size", "0"), ("--grad-accum", "3"), ("--device", "foo"), ("--preset", "huge"),
             ("--grad-clip", "nan"), ("--min-lr-ratio", "2"), ("--warmup-steps", "-1"),
             ("--eval-loops", "100000000"), ("--stop-at", "99"), ("--max-steps", "x"), ("--n-head", "7")]
    for flag, value in train:
        cases.append(Case("flags", f"train {flag} {value}", bad_flag("train", flag, value)))
    evals = [("--device", "foo"), ("--loops", "0"), ("--loops", "1000000000"), ("--batch-size", "0"),
             ("--threads", "-1"), ("--seed", "-1"), ("--loops", "1,2,3,4"), ("--max-batches", "0")]
    for flag, value in evals:
        cases.append(Case("flags", f"eval {flag} {value}", bad_flag("eval", flag, value)))
    gens = [("--temperature", "nan"), ("--temperature", "-1"), ("--device", "foo"), ("--max-new-tokens", "0"),
            ("--top-k", "0"), ("--seed", str(2**63)), ("--loops", "1000000000")]
    for flag, value in gens:
        cases.append(Case("flags", f"generate {flag} {value}", bad_flag("generate", flag, value)))
    for command, flag, value in [("analyze", "--device", "foo"), ("analyze", "--long-loops", "1000000000"),
                                 ("sweep", "--device", "foo"), ("sweep", "--grid", "kl=-1"),
                                 ("sweep", "--policies", ""), ("sweep", "--k-max", "1000000000"),
                                 ("prepare", "--val-fraction", "1.5"), ("prepare", "--tokenizer", "bpe:10"),
                                 ("demo", "--preset", "huge"), ("demo", "--lr", "-1")]:
        cases.append(Case("flags", f"{command} {flag} {value!r}", bad_flag(command, flag, value)))
    # issues 38 and 43: flags that were silently ignored or contradict each other; rules without what they need
    for command, *flags in [("demo", "--mode", "text", "--task", "chase"),
                            ("demo", "--mode", "text", "--task-params", "{"),
                            ("demo", "--mode", "task"),  # with the text-only --max-documents bad_flag passes
                            ("train", "--compile-mode", "max-autotune-no-cudagraphs", "--no-compile"),
                            ("train", "--groups", "", "--eval-loops", "4"),
                            ("sweep", "--policies", "learned"),  # a run without a trained exit gate
                            ("generate", "--exit", "learned"),
                            ("generate", "--exit", "confidence", "--exit-tau", "2")]:
        cases.append(Case("flags", f"{command} {' '.join(flags)}", bad_flag(command, *flags)))
    return cases


def _damaged_run(c: Campaign, tmp: Path, damage: Callable[[Path], None]) -> Path:
    run = c.copy(c.run, "run")
    damage(run / "checkpoints" / "step_000006")
    return run


def file_case(name: str, damage: Callable[[Path], None], command: str = "resume") -> Case:
    def run(c: Campaign, tmp: Path) -> str:
        damaged = _damaged_run(c, tmp, damage)
        before = {k: v for k, v in snapshot(damaged).items() if not k.startswith("checkpoints/step_000006")}
        if command == "resume":
            outcome = c.rdepth("train", "--out", str(damaged), "--resume", "--max-steps", "9")
        else:
            outcome = c.rdepth("eval", "--checkpoint", str(damaged), "--data", str(c.data), "--max-batches", "1")
        return expect_error(outcome, before, damaged)
    return Case("files", f"{command}: {name}", run)


def _edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _save_torch(path: Path, payload) -> None:
    import torch

    torch.save(payload, path)


def data_case(name: str, damage: Callable[[Path], None]) -> Case:
    def run(c: Campaign, tmp: Path) -> str:
        data = c.copy(c.data, "data")
        damage(data)
        return expect_error(c.rdepth(*c.train_argv(data, tmp / "run", "--max-steps", "3")))
    return Case("files", f"train on data: {name}", run)


def _flip_byte(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x5A
    path.write_bytes(bytes(blob))


def _out_of_range(data: Path) -> None:
    ids = np.fromfile(data / "train.bin", dtype=np.uint16)
    ids[5] = 60000
    ids.tofile(data / "train.bin")
    _edit_json(data / "manifest.json", lambda m: m["splits"]["train"].update(
        sha256=hashlib.sha256(ids.tobytes()).hexdigest()))


def _as_uint8(data: Path) -> None:
    def edit(m):
        m["dtype"] = "uint8"
        for split in m["splits"].values():
            split["tokens"] *= 2
    _edit_json(data / "manifest.json", edit)


def file_cases() -> list[Case]:
    cases = [
        file_case("config.json mean_loops a string", lambda ck: _edit_json(ck / "config.json",
                                                                         lambda d: d.update(mean_loops="4")), "eval"),
        file_case("config.json n_layer a float", lambda ck: _edit_json(ck / "config.json",
                                                                     lambda d: d.update(n_layer=3.0)), "eval"),
        file_case("config.json mean_loops 1e12", lambda ck: _edit_json(ck / "config.json",
                                                                     lambda d: d.update(mean_loops=1e12)), "eval"),
        file_case("config.json not JSON", lambda ck: (ck / "config.json").write_text("{oops"), "eval"),
        file_case("config.json a list", lambda ck: (ck / "config.json").write_text("[1]"), "eval"),
        file_case("weights truncated", lambda ck: (ck / "model.safetensors").write_bytes(
            (ck / "model.safetensors").read_bytes()[:1000]), "eval"),
        file_case("weights header hostile", lambda ck: (ck / "model.safetensors").write_bytes(
            (2**40).to_bytes(8, "little") + b"{}"), "eval"),
        file_case("state.json step a string", lambda ck: _edit_json(ck / "state.json", lambda d: d.update(step="6"))),
        file_case("state.json step disagrees with the folder", lambda ck: _edit_json(
            ck / "state.json", lambda d: d.update(step=2))),
        file_case("state.json not JSON", lambda ck: (ck / "state.json").write_text("{")),
        file_case("state.json tokens_seen a list", lambda ck: _edit_json(ck / "state.json",
                                                                       lambda d: d.update(tokens_seen=[1]))),
        file_case("trainer.pt garbage", lambda ck: (ck / "trainer.pt").write_bytes(b"\x80\x04garbage")),
        file_case("trainer.pt a list", lambda ck: _save_torch(ck / "trainer.pt", [1, 2])),
        file_case("trainer.pt optimizer a list", lambda ck: _save_torch(ck / "trainer.pt", {"optimizer": [1]})),
        file_case("trainer.pt moments of another shape", lambda ck: _reshape_moments(ck / "trainer.pt")),
        file_case("latest points outside the run", lambda ck: (ck.parent / "latest").write_text(
            "../../run/checkpoints/step_000003"), "eval"),
        file_case("latest holds garbage", lambda ck: (ck.parent / "latest").write_bytes(b"\xff\xfe"), "eval"),
        file_case("run config.json train a string", lambda ck: _edit_json(
            ck.parents[1] / "config.json", lambda d: d.update(train="x"))),
        data_case("a flipped byte in train.bin", lambda d: _flip_byte(d / "train.bin")),
        data_case("ids out of range (hash updated)", _out_of_range),
        data_case("manifest dtype edited to uint8", _as_uint8),
        data_case("manifest shard path ../", lambda d: _edit_json(
            d / "manifest.json", lambda m: m["splits"]["train"].update(file="../run/config.json"))),
        data_case("manifest tokens a string", lambda d: _edit_json(
            d / "manifest.json", lambda m: m["splits"]["val"].update(tokens="10"))),
        data_case("manifest vocab_size negative", lambda d: _edit_json(
            d / "manifest.json", lambda m: m.update(vocab_size=-5))),
        data_case("manifest truncated", lambda d: (d / "manifest.json").write_text('{"format_version": 1, "dty')),
        data_case("train.bin truncated", lambda d: (d / "train.bin").write_bytes((d / "train.bin").read_bytes()[:7])),
        data_case("tokenizer.json corrupt", lambda d: (d / "tokenizer.json").write_text("{nope")),
    ]
    return cases


def _reshape_moments(path: Path) -> None:
    import torch

    state = torch.load(path, weights_only=True)
    next(iter(state["optimizer"]["state"].values()))["exp_avg"] = torch.zeros(5)
    torch.save(state, path)


# ------------------------------------------------------------------ kills
def _weights(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def _same_weights(a: Path, b: Path) -> bool:
    import torch

    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def kill_case(sig: signal.Signals, when: str) -> Case:
    """Start a 9-step run, send ``sig`` after its first checkpoint (``when`` = "checkpoint") or
    mid-run between checkpoints (after step 4), then resume; the finished run must equal the straight one, and no checkpoint
    that existed may change."""
    def run(c: Campaign, tmp: Path) -> str:
        out = tmp / "run"
        argv = c.train_argv(c.data, out, "--max-steps", "9")
        proc = subprocess.Popen([sys.executable, "-m", "rdepth", *argv], env=ENV, cwd=c.work,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + c.timeout
        if when == "checkpoint":
            while proc.poll() is None and time.monotonic() < deadline and \
                    not (out / "checkpoints" / "step_000003" / "state.json").exists():
                time.sleep(0.02)
        else:  # mid-run, between checkpoints: after step 4's log line (a fixed 3 s missed fast runs)
            metrics = out / "metrics.jsonl"
            while proc.poll() is None and time.monotonic() < deadline and not (
                    metrics.exists() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= 4):
                time.sleep(0.01)
        proc.send_signal(sig)
        try:
            proc.wait(timeout=c.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return "hang"
        err = proc.stderr.read()
        if "Traceback" in err:
            return "traceback"
        before = snapshot(out / "checkpoints")
        resume = c.rdepth("train", "--out", str(out), "--resume", "--max-steps", "9") \
            if (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step_*")) \
            else c.rdepth(*argv)
        if resume.code is None:
            return "hang"
        if "Traceback" in resume.err:
            return "traceback"
        after = snapshot(out / "checkpoints")
        if any(after.get(k) != v for k, v in before.items() if k.startswith("step_")):
            return "lost"
        if resume.code != 0:
            c.note = resume.error_lines[-1:] and resume.error_lines[-1]
            return "silent"
        straight = c.work / "straight9"
        if not straight.exists():
            c.rdepth(*c.train_argv(c.data, straight, "--max-steps", "9"), timeout=600)
        same = _same_weights(straight / "checkpoints" / "step_000009", out / "checkpoints" / "step_000009")
        steps = [r["step"] for r in _records(out / "metrics.jsonl") if "loss" in r]
        debris = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".step_")]
        return "clean" if same and steps == list(range(1, 10)) and not debris else "silent"
    return Case("kills", f"{sig.name} {'after the first checkpoint' if when == 'checkpoint' else 'between checkpoints'}, "
                "then resume", run)


def _records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            out.append({"cut": line})
    return out


def kill_cases() -> list[Case]:
    cases = [kill_case(sig, when) for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)
             for when in ("checkpoint", "early")]

    def sigterm_exit(c: Campaign, tmp: Path) -> str:
        out = tmp / "run"
        proc = subprocess.Popen([sys.executable, "-m", "rdepth",
                                 *c.train_argv(c.data, out, "--max-steps", "100000")], env=ENV, cwd=c.work,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + c.timeout
        while proc.poll() is None and time.monotonic() < deadline and not (out / "checkpoints").is_dir():
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=c.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return "hang"
        err = proc.stderr.read()
        if "Traceback" in err:
            return "traceback"
        return "clean" if code == 128 + signal.SIGTERM and "terminated" in err else "silent"
    cases.append(Case("kills", "SIGTERM exits like Ctrl-C (status 143, one line)", sigterm_exit))

    def demo_ranks_orphaned(c: Campaign, tmp: Path) -> str:
        """``rdepth demo --ranks 2`` SIGKILLed once its ranks train (issue 43): the ranks die with it."""
        out = tmp / "demo"
        proc = subprocess.Popen([sys.executable, "-m", "rdepth", "demo", "--out", str(out), "--ranks", "2",
                                 "--baselines", "none", "--no-analyze", "--no-sweep", "--max-steps", "100000"],
                                env=ENV, cwd=c.work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def descendants() -> list[int]:  # the demo's processes below it (spawned ranks, the resource tracker)
            listing = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
            children: dict[int, list[int]] = {}
            for line in listing.splitlines():
                pid, ppid = map(int, line.split())
                children.setdefault(ppid, []).append(pid)
            found, todo = [], [proc.pid]
            while todo:
                for child in children.get(todo.pop(), []):
                    found.append(child)
                    todo.append(child)
            return found

        def alive(pids: list[int]) -> list[int]:
            listing = subprocess.run(["ps", "-eo", "pid=,stat="], capture_output=True, text=True).stdout
            running = {int(line.split()[0]) for line in listing.splitlines() if not line.split()[1].startswith("Z")}
            return [pid for pid in pids if pid in running]

        deadline = time.monotonic() + c.timeout
        while proc.poll() is None and time.monotonic() < deadline and len(descendants()) < 2:
            time.sleep(0.2)
        ranks = descendants()
        if proc.poll() is not None or len(ranks) < 2:
            proc.kill()
            return "untidy"  # the ranks never started: nothing was tested
        time.sleep(2.0)  # the ranks train
        ranks = descendants()
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while alive(ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = alive(ranks)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return "orphan" if left else "clean"
    cases.append(Case("kills", "demo --ranks 2 SIGKILLed while its ranks train: the ranks die with it",
                      demo_ranks_orphaned))

    def prepare_killed(c: Campaign, tmp: Path) -> str:
        data = c.copy(c.data, "data")
        before = snapshot(data)
        proc = subprocess.Popen([sys.executable, "-m", "rdepth", "prepare", "--corpus", "wiki", "--tokenizer",
                                 "bpe:512", "--max-documents", "300", "--out", str(data)], env=ENV, cwd=c.work,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2.5)
        proc.kill()
        proc.wait()
        check = c.rdepth(*c.train_argv(data, tmp / "run", "--max-steps", "1"))
        if check.code is None:
            return "hang"
        return "clean" if check.code == 0 and snapshot(data).keys() >= {"manifest.json", "train.bin"} \
            else ("lost" if snapshot(data) != before else "silent")
    cases.append(Case("kills", "SIGKILL during a prepare that replaces a folder", prepare_killed))
    return cases


# ------------------------------------------------------------------ concurrency
def concurrent_case(name: str, argv_of: Callable[[Campaign, Path], list[str]],
                    check: Callable[[Campaign, Path], bool] | None = None) -> Case:
    def run(c: Campaign, tmp: Path) -> str:
        argv = argv_of(c, tmp)
        procs = [subprocess.Popen([sys.executable, "-m", "rdepth", *argv], env=ENV, cwd=c.work,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        codes, errs = [], []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=4 * c.timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                return "hang"
            errs.append(proc.stderr.read())
        if any("Traceback" in err for err in errs):
            return "traceback"
        if sorted(codes) != [0, 2]:
            return "silent"  # both ran (a mixed folder) or both failed
        return "clean" if check is None or check(c, tmp) else "silent"
    return Case("concurrent", name, run)


def concurrency_cases() -> list[Case]:
    def one_series(c: Campaign, tmp: Path) -> bool:
        steps = [r.get("step") for r in _records(tmp / "run" / "metrics.jsonl") if "loss" in r]
        return steps == list(range(1, 7))
    return [
        concurrent_case("two trains, same --out",
                        lambda c, tmp: c.train_argv(c.data, tmp / "run", "--max-steps", "6"), one_series),
        concurrent_case("two prepares, same --out",
                        lambda c, tmp: ["prepare", "--corpus", "wiki", "--tokenizer", "bpe:512",
                                        "--max-documents", "100", "--out", str(tmp / "d")]),
        concurrent_case("two analyzes, same --out",
                        lambda c, tmp: ["analyze", "--checkpoints", str(c.run), "--data", str(c.data),
                                        "--out", str(tmp / "a"), "--sequences", "2"]),
        concurrent_case("two sweeps, same --out",
                        lambda c, tmp: ["sweep", "--checkpoint", str(c.run), "--data", str(c.data),
                                        "--out", str(tmp / "s"), "--max-batches", "1", "--no-timing"]),
    ]


# ------------------------------------------------------------------ output
def output_cases() -> list[Case]:
    def out_is_file(command: str):
        def run(c: Campaign, tmp: Path) -> str:
            target = tmp / "taken"
            target.write_text("mine")
            argv = {"train": c.train_argv(c.data, target, "--max-steps", "3"),
                    "analyze": ["analyze", "--checkpoints", str(c.run), "--data", str(c.data), "--out", str(target),
                                "--sequences", "2"],
                    "eval-json": ["eval", "--checkpoint", str(c.run), "--data", str(c.data), "--max-batches", "1",
                                  "--json", str(tmp)],
                    "train-under": c.train_argv(c.data, target / "run", "--max-steps", "3"),
                    "prepare": ["prepare", "--corpus", "wiki", "--max-documents", "50", "--out", str(target)]}[command]
            return expect_error(c.rdepth(*argv), {"taken": sha(target)}, tmp)
        return run

    def used_folder(c: Campaign, tmp: Path) -> str:
        run = tmp / "run"
        run.mkdir()
        for name in ("config.json", "summary.json", "metrics.jsonl"):
            (run / name).write_text('{"mine": true}\n')
        return expect_error(c.rdepth(*c.train_argv(c.data, run, "--max-steps", "3")), snapshot(run), run)

    def full_disk(c: Campaign, tmp: Path) -> str:
        run = c.copy(c.run, "run")
        before = {k: v for k, v in snapshot(run).items() if k.startswith("checkpoints/step_")}
        outcome = c.rdepth("train", "--out", str(run), "--resume", "--max-steps", "12", limit_bytes=150_000)
        result = expect_error(outcome, before, run)
        if result == "clean" and len(outcome.error_lines) != 1:
            return "traceback"
        return result

    def full_disk_prepare(c: Campaign, tmp: Path) -> str:
        data = c.copy(c.data, "data")
        before = snapshot(data)
        outcome = c.rdepth("prepare", "--corpus", "wiki", "--tokenizer", "bpe:512", "--max-documents", "300",
                           "--out", str(data), limit_bytes=60_000)
        return expect_error(outcome, before, data)

    def read_only(c: Campaign, tmp: Path) -> str:
        if os.geteuid() == 0:
            return "skip"
        folder = tmp / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        try:
            return expect_error(c.rdepth(*c.train_argv(c.data, folder / "run", "--max-steps", "3")))
        finally:
            folder.chmod(0o755)

    def analyze_overwrite(c: Campaign, tmp: Path) -> str:
        out = tmp / "report"
        out.mkdir()
        (out / "index.html").write_text("<p>my page</p>")
        outcome = c.rdepth("analyze", "--checkpoints", str(c.run), "--data", str(c.data), "--out", str(out),
                           "--sequences", "2")
        if outcome.code is None:
            return "hang"
        if "Traceback" in outcome.err:
            return "traceback"
        return "clean" if (out / "index.html").read_text() == "<p>my page</p>" or outcome.code != 0 else "lost"

    return [
        Case("output", "train --out is a file", out_is_file("train")),
        Case("output", "train --out under a file", out_is_file("train-under")),
        Case("output", "analyze --out is a file", out_is_file("analyze")),
        Case("output", "eval --json is a folder", out_is_file("eval-json")),
        Case("output", "prepare --out is a file", out_is_file("prepare")),
        Case("output", "train --out holds a user's files, no checkpoint", used_folder),
        Case("output", "full disk during a resumed train (RLIMIT_FSIZE)", full_disk),
        Case("output", "full disk during a prepare that replaces a folder", full_disk_prepare),
        Case("output", "read-only output folder", read_only),
        Case("output", "analyze --out holds someone's index.html", analyze_overwrite),
    ]


# ------------------------------------------------------------------ data and resume semantics
def data_cases() -> list[Case]:
    def eval_other_tokenizer(c: Campaign, tmp: Path) -> str:
        return expect_error(c.rdepth("eval", "--checkpoint", str(c.run), "--data", str(c.other_data),
                                     "--max-batches", "1"))

    def resume_other_tokenizer(c: Campaign, tmp: Path) -> str:
        run = c.copy(c.run, "run")
        before = snapshot(run)
        return expect_error(c.rdepth("train", "--out", str(run), "--data", str(c.other_data), "--resume",
                                     "--max-steps", "9"), before, run)

    def resume_keeps_saved(c: Campaign, tmp: Path) -> str:
        run = c.copy(c.run, "run")
        outcome = c.rdepth("train", "--out", str(run), "--resume", "--max-steps", "9")

        def check() -> bool:
            saved = json.loads((run / "config.json").read_text())["train"]
            return saved["batch_size"] == 4 and saved["checkpoint_every"] == 3 and saved["warmup_steps"] == 2
        return expect_success(outcome, check)

    def resume_changed_batch(c: Campaign, tmp: Path) -> str:
        run = c.copy(c.run, "run")
        before = snapshot(run)
        return expect_error(c.rdepth("train", "--out", str(run), "--resume", "--max-steps", "9",
                                     "--batch-size", "8"), before, run)

    def resume_other_preset(c: Campaign, tmp: Path) -> str:
        run = c.copy(c.run, "run")
        before = snapshot(run)
        return expect_error(c.rdepth("train", "--out", str(run), "--resume", "--max-steps", "9",
                                     "--preset", "small"), before, run)

    def prepare_single_txt(c: Campaign, tmp: Path) -> str:
        text = tmp / "book.txt"
        text.write_text("\n".join(f"Line {i}: word{i % 97} and more text about the river, {i * 7}."
                                   for i in range(4000)))
        outcome = c.rdepth("prepare", "--corpus", str(text), "--tokenizer", "bpe:300", "--out", str(tmp / "d"))
        return expect_success(outcome, lambda: (tmp / "d" / "manifest.json").is_file())

    def divergence(c: Campaign, tmp: Path) -> str:
        out = tmp / "run"
        outcome = c.rdepth(*c.train_argv(c.data, out, "--max-steps", "6", "--lr", "10", "--weight-decay", "0",
                                         "--warmup-steps", "0", "--grad-clip", "0"))
        if outcome.code is None:
            return "hang"
        if "Traceback" in outcome.err:
            return "traceback"
        import torch

        for checkpoint in sorted((out / "checkpoints").glob("step_*")):
            if not all(torch.isfinite(t).all() for t in _weights(checkpoint).values()):
                return "silent"  # a non-finite checkpoint was saved
        return "clean"

    return [
        Case("data", "eval on data from a same-named other tokenizer", eval_other_tokenizer),
        Case("data", "resume on data from a same-named other tokenizer", resume_other_tokenizer),
        Case("data", "resume with only --out keeps the saved config", resume_keeps_saved),
        Case("data", "resume with another --batch-size", resume_changed_batch),
        Case("data", "resume with another --preset", resume_other_preset),
        Case("data", "prepare a single .txt file", prepare_single_txt),
        Case("data", "lr 10 without clipping: no non-finite checkpoint saved", divergence),
    ]


# ------------------------------------------------------------------ round 3 (issue 31): newer commands
def _profile(c: Campaign) -> Path:
    """A profile calibrated on the campaign's run (made once)."""
    path = c.work / "profile.json"
    if not path.exists():
        outcome = c.rdepth("calibrate", "--checkpoint", str(c.run), "--data", str(c.data), "--out", str(path),
                           "--max-quality-loss", "0.5", "--windows", "4", "--validation-windows", "4", timeout=300)
        if outcome.code != 0:
            raise RuntimeError(f"calibrate of the campaign's profile failed: {outcome.err[-300:]}")
    return path


def _other_run(c: Campaign) -> Path:
    """A second run of the same shape (another seed), trained once."""
    run = c.work / "run-seed1"
    if not run.exists():
        outcome = c.rdepth(*c.train_argv(c.data, run, "--max-steps", "3", "--seed", "1"), timeout=300)
        if outcome.code != 0:
            raise RuntimeError(f"training the second run failed: {outcome.err[-300:]}")
    return run


def _eval(c: Campaign, run: Path, *extra: str) -> list[str]:
    return ["eval", "--checkpoint", str(run), "--data", str(c.data), "--max-batches", "1", *extra]


def round3_cases() -> list[Case]:
    import torch

    def checkpoint_edit(edit: Callable[[Path], None], argv: Callable[[Campaign, Path], list[str]]):
        def run(c: Campaign, tmp: Path) -> str:
            copy = c.copy(c.run, "run")
            edit(sorted((copy / "checkpoints").glob("step_*"))[-1])
            return expect_error(c.rdepth(*argv(c, copy)))
        return run

    def huge(field: str, value: int):
        def edit(checkpoint: Path) -> None:
            _edit_json(checkpoint / "config.json", lambda cfg: cfg.update({field: value, "n_head": 2}))
        return edit

    def weights(change: Callable[[dict], dict]):
        def edit(checkpoint: Path) -> None:
            from safetensors.torch import save_file
            save_file(change(_weights(checkpoint)), str(checkpoint / "model.safetensors"))
        return edit

    def mathtext_folder(c: Campaign, tmp: Path) -> str:
        run = Path(shutil.copytree(c.run, tmp / "x$\\frac{$"))
        return expect_success(c.rdepth("analyze", "--checkpoints", str(run), "--data", str(c.data), "--out",
                                       str(tmp / "a"), "--sequences", "2", "--long-loops", "4"),
                              lambda: (tmp / "a" / "index.html").is_file())

    def non_utf8_prompt(c: Campaign, tmp: Path) -> str:
        prompt = b"ab\xff\xfecd".decode("utf-8", "surrogateescape")  # the bytes reach argv unchanged
        return expect_error(c.rdepth("generate", "--checkpoint", str(c.run), "--prompt", prompt))

    def corrupt_val(c: Campaign, tmp: Path) -> str:
        data = c.copy(c.data, "data")
        _flip_byte(data / "val.bin")
        outcome = c.rdepth("eval", "--checkpoint", str(c.run), "--data", str(data), "--max-batches", "1")
        if outcome.code not in (0, None) and "SHA-256" not in outcome.err:
            c.note = "refused for another reason than the hash"
            return "silent"
        return expect_error(outcome)

    def profile_edit(edit: Callable[[dict], None]):
        def run(c: Campaign, tmp: Path) -> str:
            profile = json.loads(_profile(c).read_text())
            edit(profile)
            (tmp / "p.json").write_text(json.dumps(profile))
            return expect_error(c.rdepth(*_eval(c, c.run, "--exit-profile", str(tmp / "p.json"))))
        return run

    def profile_other_run(force: bool):
        def run(c: Campaign, tmp: Path) -> str:
            argv = _eval(c, _other_run(c), "--exit-profile", str(_profile(c)), *(["--force-profile"] if force else []))
            return expect_success(c.rdepth(*argv)) if force else expect_error(c.rdepth(*argv))
        return run

    def export_profile_other_run(force: bool):
        def run(c: Campaign, tmp: Path) -> str:
            argv = ["export", "--checkpoint", str(_other_run(c)), "--out", str(tmp / "hf"), "--exit-profile",
                    str(_profile(c)), *(["--force-profile"] if force else [])]
            if force:
                return expect_success(c.rdepth(*argv), lambda: (tmp / "hf" / "config.json").is_file())
            result = expect_error(c.rdepth(*argv))
            return "lost" if result == "clean" and (tmp / "hf").exists() else result
        return run

    def force_alone(c: Campaign, tmp: Path) -> str:
        outcome = c.rdepth(*_eval(c, c.run, "--force-profile"))
        result = expect_error(outcome)
        if result == "clean" and "--force-profile applies" not in outcome.err:
            c.note = "refused, but not for --force-profile"
            return "silent"
        return result

    def calibrate_flag(*flags: str):
        def run(c: Campaign, tmp: Path) -> str:
            return expect_error(c.rdepth("calibrate", "--checkpoint", str(c.run), "--data", str(c.data), "--out",
                                         str(tmp / "p.json"), *flags))
        return run

    def calibrate_existing(c: Campaign, tmp: Path) -> str:
        profile = _profile(c)
        before = snapshot(profile.parent)
        outcome = c.rdepth("calibrate", "--checkpoint", str(c.run), "--data", str(c.data), "--out", str(profile),
                           "--max-quality-loss", "0.1")
        return expect_error(outcome, {profile.name: before[profile.name]}, profile.parent)

    def two_calibrates(c: Campaign, tmp: Path) -> str:
        run = c.copy(c.run, "run")
        argv = [sys.executable, "-m", "rdepth", "calibrate", "--checkpoint", str(run), "--data", str(c.data),
                "--max-quality-loss", "0.5", "--windows", "4", "--validation-windows", "4"]
        procs = [subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        results = [p.communicate(timeout=c.timeout * 2) for p in procs]
        codes = sorted(p.returncode for p in procs)
        if any("Traceback" in err for _, err in results):
            return "traceback"
        wrote = [out for out, _ in results if "wrote" in out]
        if codes != [0, 2] or len(wrote) != 1 or len(list(run.glob("exit_profile_*.json"))) != 1:
            c.note = f"exit codes {codes}, {len(wrote)} said wrote"
            return "silent"
        return "clean"

    def sweep_foreign(c: Campaign, tmp: Path) -> str:
        out = tmp / "mine"
        out.mkdir()
        (out / "index.html").write_text("<p>my page</p>")
        (out / "sweep.json").write_text("my numbers")
        before = snapshot(out)
        outcome = c.rdepth("sweep", "--checkpoint", str(c.run), "--data", str(c.data), "--out", str(out),
                           "--max-batches", "1", "--no-timing")
        result = expect_error(outcome, before, out)
        if result == "clean" and (set(snapshot(out)) != set(before) or outcome.seconds > 15):
            c.note = f"refused after {outcome.seconds:.0f} s or wrote files"
            return "lost"
        return result

    def rerun_killed(command: str):
        def run(c: Campaign, tmp: Path) -> str:
            out = tmp / "o"
            if command == "analyze":
                argv = lambda n: ["analyze", "--checkpoints", str(c.run), "--data", str(c.data), "--out", str(out),  # noqa: E731
                                  "--sequences", str(n), "--long-loops", "4"]
            else:
                argv = lambda n: ["sweep", "--checkpoint", str(c.run), "--data", str(c.data), "--out", str(out),  # noqa: E731
                                  "--max-batches", str(n), "--batch-size", "2", "--no-timing"]
            first = c.rdepth(*argv(2))
            if first.code != 0:
                return expect_success(first)
            old = snapshot(out)
            for fraction in (0.5, 0.8, 0.95):  # kills at several stages of the re-run
                proc = subprocess.Popen([sys.executable, "-m", "rdepth", *argv(3)], env=ENV, cwd=c.work,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                time.sleep(first.seconds * fraction)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if (out / ".rdepth-swap.json").exists():  # killed inside a committed swap: the next command
                    # that locks the folder finishes it (the journal is the completion marker until then)
                    c.rdepth_python(f"from rdepth.io import exclusive\nwith exclusive({str(out)!r}, 'next'): pass")
                now = snapshot(out)
                if now != old:  # the re-run finished before the kill: then it must be whole and is the new old
                    changed = {name for name in set(now) | set(old) if now.get(name) != old.get(name)}
                    if not ({"index.html"} <= changed):
                        c.note = f"mixed after a kill at {fraction:.0%}: {sorted(changed)[:4]}"
                        return "lost"
                    old = now
            after = c.rdepth("eval", "--checkpoint", str(c.run), "--data", str(c.data), "--max-batches", "1",
                             "--json", str(out / "eval.json"))  # any later command in the folder ...
            again = c.rdepth(*argv(2))  # ... and a re-run clean the debris
            leftovers = [p.name for p in out.rglob("*") if p.name.endswith(".tmp") or ".rdepth-staging" in str(p)]
            if after.code != 0 or again.code != 0 or leftovers:
                c.note = f"leftovers {leftovers[:3]}"
                return "lost" if leftovers else "silent"
            return "clean"
        return run

    def demo_rerun(content: str):
        def run(c: Campaign, tmp: Path) -> str:
            out = tmp / "demo"
            (out / "train").mkdir(parents=True)
            (out / "train" / "config.json").write_text(content)
            return expect_error(c.rdepth("demo", "--out", str(out), "--train-tokens", "20000", "--max-steps", "2",
                                         "--baselines", "none", "--no-analyze", "--no-sweep", timeout=c.timeout * 2))
        return run

    def modes(c: Campaign, tmp: Path) -> str:
        bad = [p.name for p in c.checkpoint.iterdir() if p.stat().st_mode & 0o044 != 0o044]
        c.note = f"not world-readable: {bad}" if bad else ""
        return "silent" if bad else "clean"

    def resume_time_limit(c: Campaign, tmp: Path) -> str:
        run = c.copy(c.run, "run")
        return expect_error(c.rdepth("train", "--resume", "--out", str(run), "--time-limit", "2"), snapshot(run), run)

    def refused_for(fragment: str, *argv: str):
        """A bad input refused for the right reason (its one line names ``fragment``)."""
        def run(c: Campaign, tmp: Path) -> str:
            outcome = c.rdepth(*[a.replace("TMP", str(tmp)) for a in argv])
            result = expect_error(outcome)
            if result == "clean" and fragment not in outcome.err:
                c.note = f"refused, but not for {fragment!r}"
                return "silent"
            return result
        return run

    cases = [
        Case("round3", "eval: checkpoint config d_model 1e6", checkpoint_edit(huge("d_model", 10**6),
                                                                              lambda c, r: _eval(c, r))),
        Case("round3", "eval: checkpoint config n_layer 1e5", checkpoint_edit(huge("n_layer", 10**5),
                                                                              lambda c, r: _eval(c, r))),
        Case("round3", "eval: int32 weights", checkpoint_edit(weights(lambda w: {k: v.to(torch.int32) for k, v in w.items()}),
                                                              lambda c, r: _eval(c, r))),
        Case("round3", "eval: all-NaN weights", checkpoint_edit(
            weights(lambda w: {k: torch.full_like(v, float("nan")) for k, v in w.items()}), lambda c, r: _eval(c, r))),
        Case("round3", "export: all-NaN weights", checkpoint_edit(
            weights(lambda w: {k: torch.full_like(v, float("nan")) for k, v in w.items()}),
            lambda c, r: ["export", "--checkpoint", str(r), "--out", str(r.parent / "hf")])),
        Case("round3", "retrofit: int32 weights", checkpoint_edit(
            weights(lambda w: {k: v.to(torch.int32) for k, v in w.items()}),
            lambda c, r: ["retrofit", "--checkpoint", str(r), "--groups", "1", "--out", str(r.parent / "rf")])),
        Case("round3", "eval: val.bin corrupted in range", corrupt_val),
        Case("round3", "generate --samples 100000", bad_flag("generate", "--samples", "100000")),
        Case("round3", "generate: non-UTF-8 --prompt", non_utf8_prompt),
        Case("round3", "analyze: folder name with mathtext $", mathtext_folder),
        Case("round3", "prepare task:chase*inf+assign",
             refused_for("positive finite", "prepare", "--corpus", "task:chase*inf+assign", "--out", "TMP/d")),
        Case("round3", "prepare task:chase --train-tokens 1e12",
             refused_for("train_tokens", "prepare", "--corpus", "task:chase", "--train-tokens", "1000000000000",
                         "--out", "TMP/d")),
        Case("round3", "prepare task:chase --tokenizer bpe:512",
             refused_for("--tokenizer", "prepare", "--corpus", "task:chase", "--tokenizer", "bpe:512", "--out", "TMP/d")),
        Case("round3", "demo --corpus FILE in task mode", bad_flag("demo", "--corpus", "notes.txt")),
        Case("round3", "demo --tokenizer foo in task mode", bad_flag("demo", "--tokenizer", "foo")),
        Case("round3", "demo re-run: train/config.json corrupt", demo_rerun("{not json")),
        Case("round3", "demo re-run: train/config.json a JSON list", demo_rerun("[1, 2]")),
        # (a summary.json that is a JSON list needs a config.json matching the demo's settings to be reached:
        # tests/test_reliability_inputs.py covers it in-process)
        Case("round3", "calibrate --mean-steps inf", calibrate_flag("--mean-steps", "inf")),
        Case("round3", "calibrate --windows 100000", calibrate_flag("--max-quality-loss", "0.1", "--windows", "100000")),
        Case("round3", "calibrate --difficulty 5 on text", calibrate_flag("--max-quality-loss", "0.1", "--difficulty", "5")),
        Case("round3", "calibrate onto an existing profile", calibrate_existing),
        Case("round3", "two calibrates, same run folder", two_calibrates),
        Case("round3", "eval: profile k_max 1e9", profile_edit(lambda p: p.update(k_max=[10**9]))),
        Case("round3", "eval: profile without its run identity", profile_edit(lambda p: p.pop("run"))),
        Case("round3", "eval: profile of another run (same shape)", profile_other_run(False)),
        Case("round3", "eval: profile of another run with --force-profile", profile_other_run(True)),
        Case("round3", "export: profile of another run (same shape)", export_profile_other_run(False)),
        Case("round3", "export: profile of another run with --force-profile", export_profile_other_run(True)),
        Case("round3", "eval --force-profile without --exit-profile", force_alone),
        Case("round3", "train --resume --time-limit 2", resume_time_limit),
        Case("round3", "sweep --out holds a user's files", sweep_foreign),
        Case("round3", "analyze re-run killed at 50/80/95%", rerun_killed("analyze")),
        Case("round3", "sweep re-run killed at 50/80/95%", rerun_killed("sweep")),
        Case("round3", "import-hf of a missing model (offline)",
             lambda c, tmp: expect_error(c.rdepth("import-hf", "--hf", str(tmp / "nowhere"), "--out", str(tmp / "o")))),
        Case("round3", "reproduce with an unknown paper", lambda c, tmp: expect_error(c.rdepth("reproduce", "nope"))),
        Case("round3", "checkpoint files are world-readable (0644)", modes),
    ]
    return cases


# ------------------------------------------------------------------ consolidate (issue 43)
def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fsdp_train(c: Campaign, out: Path, *extra: str, session: bool = True) -> subprocess.Popen:
    """``rdepth train --parallel fsdp`` on one rank under torchrun, in the background (its own session)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
            str(_free_port()), "-m", "rdepth", *c.train_argv(c.data, out, *extra), "--parallel", "fsdp"]
    return subprocess.Popen(argv, env=ENV, cwd=c.work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=session)


def _session_alive(pid: int) -> bool:
    """Whether any process of the session ``pid`` led is still running; kills what is left."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    os.killpg(pid, signal.SIGKILL)
    return True


def _debris(run: Path) -> list[str]:
    root = run / "checkpoints"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.name.startswith((".step_", ".tmp")) or p.name.endswith(".tmp"))


def _temporary_files(checkpoint: Path) -> list[Path]:
    """consolidate's temporary file (``.model.safetensors.XXXXXXXX.tmp``; ``.model.safetensors.tmp`` in
    earlier versions) and the one safetensors writes first beside it (``.tmpXXXXXX``)."""
    return [*checkpoint.glob(".model.safetensors.*tmp"), *checkpoint.glob(".tmp??????")]


def consolidate_cases() -> list[Case]:
    def beside_training(c: Campaign, tmp: Path) -> str:
        """Consolidate the run folder again and again while it trains, saving every step and keeping one
        checkpoint: each consolidate writes the newest one or is one line, never "corrupt"; then once more
        after the training (under the run's lock), and eval reads the result."""
        out = tmp / "run"
        train = _fsdp_train(c, out, "--max-steps", "200", "--checkpoint-every", "1", "--eval-every", "1000",
                            "--keep-last", "1", "--milestone-every", "1000")
        deadline = time.monotonic() + 4 * c.timeout
        while train.poll() is None and time.monotonic() < deadline and not (out / "checkpoints" / "latest").exists():
            time.sleep(0.05)
        beside = []
        while train.poll() is None and time.monotonic() < deadline:
            beside.append(c.rdepth("consolidate", "--checkpoint", str(out), "--overwrite"))
        try:
            train.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _session_alive(train.pid)
            return "hang"
        train_err = train.stderr.read()
        after = c.rdepth("consolidate", "--checkpoint", str(out), "--overwrite")
        debris = _debris(out)
        check = c.rdepth("eval", "--checkpoint", str(out), "--data", str(c.data), "--max-batches", "1")
        outcomes = [*beside, after, check]
        written = sum(o.code == 0 for o in beside)
        refusals = [o.error_lines[-1] for o in beside if o.code != 0 and o.error_lines]
        rotated = sum(o.err.count("removed or replaced while being read") for o in beside)
        c.note = (f"{len(beside)} consolidates beside training: {written} wrote the newest checkpoint "
                  f"({rotated} reads of a checkpoint rotated away, read again), {len(beside) - written} refused"
                  + (f" ({refusals[0][:100]})" if refusals else ""))
        if _session_alive(train.pid):
            return "orphan"
        if any(o.code is None for o in outcomes):
            return "hang"
        if "Traceback" in train_err or any("Traceback" in o.err for o in outcomes):
            return "traceback"
        if debris:
            c.note += f"; debris {debris[:3]}"
            return "lost"
        if train.returncode != 0 or after.code != 0 or check.code != 0 or not beside \
                or any(o.code not in (0, 2) or "corrupt" in o.err for o in beside):
            return "silent"
        if any(o.code == 2 and len(o.error_lines) != 1 for o in beside):
            return "untidy"
        return "clean"

    def killed_mid_write(c: Campaign, tmp: Path) -> str:
        """SIGKILL while model.safetensors is written (50 MB: a 4-layer d_model-512 model): as soon as its
        temporary file appears, once safetensors' has bytes, once it holds half or more; after each kill the
        file is absent or the earlier one, whole; the next consolidate removes the temporary files and
        writes it."""
        out = tmp / "run"
        train = _fsdp_train(c, out, "--max-steps", "1", "--checkpoint-every", "1", "--eval-every", "1000",
                            "--n-layer", "4", "--n-head", "8", "--d-model", "512", session=False)
        try:
            train.wait(timeout=4 * c.timeout)
        except subprocess.TimeoutExpired:
            train.kill()
            return "hang"
        if train.returncode != 0:
            c.note = f"set-up: train exited {train.returncode}: {train.stderr.read()[-160:]}"
            return "error"
        checkpoint = out / "checkpoints" / "step_000001"
        target = checkpoint / "model.safetensors"

        def kill_when(ready: Callable[[int], bool], *extra: str) -> str:
            """Start consolidate; SIGKILL its session once its temporary file's size satisfies ``ready``."""
            proc = subprocess.Popen([sys.executable, "-m", "rdepth", "consolidate", "--checkpoint", str(out), *extra],
                                    env=ENV, cwd=c.work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
            deadline, size, where = time.monotonic() + 4 * c.timeout, None, ""
            while proc.poll() is None and time.monotonic() < deadline:
                sizes = []
                for temp in _temporary_files(checkpoint):
                    try:
                        owner = "ours" if temp.name.startswith(".model.") else "safetensors'"
                        sizes.append((temp.stat().st_size, owner))
                    except FileNotFoundError:  # renamed meanwhile
                        pass
                size, where = max(sizes) if sizes else (None, "")
                if size is not None and ready(size):
                    break
                time.sleep(0.001)
            with contextlib.suppress(ProcessLookupError):  # it finished before the kill
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if size is None or proc.returncode >= 0:
                return "finished first"
            return f"{size / 2**20:.0f} MB ({where})"

        kills = [kill_when(lambda size: True)]
        if target.exists():  # the kill came after the rename: the whole file
            c.note = "the first kill came after the rename"
        first = c.rdepth("consolidate", "--checkpoint", str(out), "--overwrite")
        if first.code != 0 or _temporary_files(checkpoint):
            c.note = f"re-run after a kill: exit {first.code}, left {[p.name for p in _temporary_files(checkpoint)]}"
            return expect_success(first) if first.code != 0 else "lost"
        whole, full_size = sha(target), target.stat().st_size
        for ready in (lambda size: size > 0, lambda size: size >= full_size // 2):
            kills.append(kill_when(ready, "--overwrite"))
            if sha(target) != whole:
                c.note = f"model.safetensors changed by a kill at {kills[-1]}"
                return "lost"
        again = c.rdepth("consolidate", "--checkpoint", str(out), "--overwrite")
        leftovers = [p.name for p in _temporary_files(checkpoint)]
        check = c.rdepth("eval", "--checkpoint", str(out), "--data", str(c.data), "--max-batches", "1")
        c.note = f"killed with {', '.join(kills)} of {full_size / 2**20:.0f} MB written"
        if all(kill == "finished first" for kill in kills):
            return "skip"  # no kill came while the file was written: nothing was tested
        if any(o.code is None for o in (first, again, check)):
            return "hang"
        if any("Traceback" in o.err for o in (first, again, check)):
            return "traceback"
        if leftovers:
            c.note += f"; left {leftovers}"
            return "lost"
        return "clean" if again.code == 0 and check.code == 0 and sha(target) == whole else "silent"

    return [
        Case("consolidate", "consolidate while training with --keep-last 1", beside_training),
        Case("consolidate", "consolidate killed mid-write, then re-run", killed_mid_write),
    ]


# ------------------------------------------------------------------ round 5 (issue 55)
def _gated(c: Campaign, name: str, source: Path | None = None) -> Path:
    """A copy of ``source`` (default the campaign's run) with a gate trained for it, made once per name."""
    run = c.work / f"gated-{name}"
    if not run.exists():
        shutil.copytree(source or c.run, run)
        outcome = c.rdepth("gate", "--checkpoint", str(run), "--data", str(c.data), "--windows", "8", "--k-max", "3",
                           "--steps", "20", "--no-progress", "--overwrite", timeout=300)
        if outcome.code != 0:
            raise RuntimeError(f"gate for the campaign failed: {outcome.err[-300:]}")
    return run


def _script(c: Campaign, script: str, *argv: str) -> Outcome:
    """A bench script run as a user runs it (``python bench/NAME.py ...``)."""
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *argv], env=ENV, cwd=c.work,
                              capture_output=True, text=True, timeout=c.timeout)
        c.last = Outcome(done.returncode, done.stdout, done.stderr, time.monotonic() - started)
    except subprocess.TimeoutExpired as expired:
        c.last = Outcome(None, "", str(expired.stderr or ""), time.monotonic() - started)
    return c.last


# what a client of an exported folder runs (rdepth unimportable): generate's hidden states with the cache
# and without, gradient checkpointing, attn_implementation="sdpa", generate() with no length
_CLIENT = """
import sys, torch
sys.modules["rdepth"] = None
from transformers import AutoModelForCausalLM
folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
ids = torch.tensor([[1, 2, 3, 4]])
for use_cache in (True, False):
    out = model.generate(ids, max_new_tokens=3, do_sample=False, output_hidden_states=True,
                         return_dict_in_generate=True, use_cache=use_cache)
    assert all(step is not None for step in out.hidden_states), "hidden states None"
model.train()
model.gradient_checkpointing_enable()
model(ids, labels=ids).loss.backward()
model.eval()
named = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_implementation="sdpa").eval()
assert torch.equal(named(ids).logits, model(ids).logits), "sdpa differs"
assert model.generation_config.max_length == model.config.block_size, "max_length"
card = open(folder + "/README.md").read()
assert "equal length" not in card and "No beam search" not in card and "license_name" in card, "card"
"""


def round5_cases() -> list[Case]:
    def other_models_gate(c: Campaign, tmp: Path) -> str:
        other = _gated(c, "other", _other_run(c))
        return expect_error(c.rdepth("generate", "--checkpoint", str(_gated(c, "own")), "--max-new-tokens", "2",
                                     "--exit", "learned", "--tau", "0.5", "--exit-options", f"gate={other}"))

    def flipped_gate(c: Campaign, tmp: Path) -> str:
        copy = c.copy(_gated(c, "own"), "run")
        gate = next((copy / "checkpoints").glob("step_*")) / "exit_gate.safetensors"
        raw = bytearray(gate.read_bytes())
        raw[-3] ^= 0x10  # inside the last bias: still a finite float
        gate.write_bytes(bytes(raw))
        return expect_error(c.rdepth("generate", "--checkpoint", str(copy), "--max-new-tokens", "2", "--exit",
                                     "learned", "--tau", "0.5"))

    def gate_again(c: Campaign, tmp: Path) -> str:
        copy = c.copy(_gated(c, "own"), "run")
        before = snapshot(copy)
        return expect_error(c.rdepth("gate", "--checkpoint", str(copy), "--data", str(c.data), "--windows", "8",
                                     "--steps", "5", "--no-progress"), before, copy)

    def profile_new_gate(c: Campaign, tmp: Path) -> str:
        copy = c.copy(_gated(c, "own"), "run")
        profile = tmp / "learned.json"
        made = c.rdepth("calibrate", "--checkpoint", str(copy), "--data", str(c.data), "--policy", "learned",
                        "--max-quality-loss", "0.5", "--k-max", "3", "--windows", "4", "--validation-windows", "4",
                        "--out", str(profile), timeout=300)
        again = c.rdepth("gate", "--checkpoint", str(copy), "--data", str(c.data), "--windows", "8", "--k-max", "3",
                         "--steps", "7", "--no-progress", "--overwrite")
        if made.code != 0 or again.code != 0:
            c.note = f"set-up failed: calibrate {made.code}, gate {again.code}"
            return "error"
        return expect_error(c.rdepth(*_eval(c, copy, "--exit-profile", str(profile))))

    def interrupted_gate(c: Campaign, tmp: Path) -> str:
        copy = c.copy(_gated(c, "own"), "run")
        debris = next((copy / "checkpoints").glob("step_*")) / ".exit_gate.safetensors.k1ll3d00.tmp"
        debris.write_bytes(b"what a SIGKILL mid-write leaves")
        outcome = c.rdepth("gate", "--checkpoint", str(copy), "--data", str(c.data), "--windows", "8", "--k-max", "3",
                           "--steps", "5", "--no-progress", "--overwrite")
        if debris.exists():
            c.note = "the temporary file is still there"
            return "lost"
        return expect_success(outcome)

    def export_full_disk(c: Campaign, tmp: Path) -> str:
        weights = next((c.run / "checkpoints").glob("step_*")) / "model.safetensors"
        outcome = c.rdepth("export", "--checkpoint", str(c.run), "--out", str(tmp / "hf"),
                           limit_bytes=weights.stat().st_size // 2)
        if (tmp / "hf").exists() or [p for p in tmp.iterdir() if p.name.startswith(".")]:
            c.note = "a partial export was left"
            return "lost"
        return expect_error(outcome)

    def sweep_flag(*flags: str):
        def run(c: Campaign, tmp: Path) -> str:
            return expect_error(c.rdepth("sweep", "--checkpoint", str(c.run), "--data", str(c.data), "--out",
                                         str(tmp / "s"), "--max-batches", "1", "--no-timing", *flags))
        return run

    def calibrate_flag(*flags: str):
        def run(c: Campaign, tmp: Path) -> str:
            return expect_error(c.rdepth("calibrate", "--checkpoint", str(c.run), "--data", str(c.data), "--out",
                                         str(tmp / "p.json"), "--max-quality-loss", "0.1", *flags))
        return run

    def exit_wall(*argv: str):
        def run(c: Campaign, tmp: Path) -> str:
            filled = [str(c.run) if a == "RUN" else str(c.data) if a == "DATA" else str(tmp / "nope") if a == "NOPE"
                      else a for a in argv]
            outcome = _script(c, "exit_wall.py", *filled)
            if outcome.code not in (None, 0) and not outcome.err.strip().startswith("bench/exit_wall.py: error:"):
                c.note = f"not the command line's form: {outcome.err.strip()[:120]}"
                return "untidy"
            return expect_error(outcome)
        return run

    def raven(c: Campaign, tmp: Path, **overrides) -> Path:
        code = ("import sys; from rdepth.interop.hf_raven import write_raven_folder; "
                f"write_raven_folder(sys.argv[1], tokenizer_json='{{}}', **{overrides!r})")
        subprocess.run([sys.executable, "-c", code, str(tmp / "raven")], env=ENV, check=True, timeout=c.timeout)
        return tmp / "raven"

    def raven_both(c: Campaign, tmp: Path) -> str:
        from rdepth.data.tokenizers import train_bpe

        tokenizer = train_bpe(["the river and the town"] * 50, 300, name="bpe:300")
        tokenizer.save(tmp / "bpe")
        folder = raven(c, tmp, vocab_size=tokenizer.vocab_size)
        (folder / "tokenizer.json").write_text((tmp / "bpe" / "tokenizer.json").read_text())
        shard = folder / "model-00001-of-00001.safetensors"
        from safetensors.torch import load_file, save_file
        weights = load_file(str(folder / "model.safetensors"))
        # unmistakable (every value > 50) but importable: the rotary table left as it is
        save_file({k: v if k == "freqs_cis" else v + 100.0 for k, v in weights.items()}, str(shard))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard.name for k in weights}}))
        outcome = c.rdepth("import-hf", "--hf", str(folder), "--out", str(tmp / "run"))
        imported = tmp / "run" / "checkpoints" / "step_000000" / "model.safetensors"
        if outcome.code == 0 and imported.is_file():
            got = load_file(str(imported))
            took = "shards" if any(float(t.float().abs().max()) > 50 for t in got.values()) else "single"
            c.note = f"took the {took} file(s) (transformers takes model.safetensors)"
            return "clean" if took == "single" else "silent"
        return expect_error(outcome)  # refusing the ambiguity in one line is the other acceptable answer

    def raven_small_vocab(c: Campaign, tmp: Path) -> str:
        outcome = c.rdepth("import-hf", "--hf", str(raven(c, tmp)), "--out", str(tmp / "run"))
        if "bpe:96" in outcome.err:
            c.note = "names a tokenizer spec the user never wrote"
            return "untidy"
        return expect_error(outcome)

    def import_help(c: Campaign, tmp: Path) -> str:
        helped = c.rdepth("import-hf", "--help")
        odd = tmp / "odd"
        odd.mkdir()
        (odd / "config.json").write_text(json.dumps({"model_type": "bert"}))
        refused = c.rdepth("import-hf", "--hf", str(odd), "--out", str(tmp / "r"))
        if "Huginn-0125" not in " ".join(helped.out.split()) or "Huginn-0125" not in refused.err:
            c.note = "the help or the refusal does not name the Huginn-0125 (raven) folders it reads"
            return "silent"
        return expect_error(refused)

    def ctrl_c_while_importing(c: Campaign, tmp: Path) -> str:
        results = []
        for delay in (0.05, 0.2, 0.5, 1.0):
            proc = subprocess.Popen([sys.executable, "-m", "rdepth", "eval", "--checkpoint", str(c.run), "--data",
                                     str(c.data)], env=ENV, cwd=c.work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=c.timeout)
            c.last = Outcome(proc.returncode, out, err, delay)
            results.append((delay, proc.returncode, err))
        if any("Traceback" in err for _, _, err in results):
            c.note = "a traceback at " + ", ".join(f"{d} s" for d, _, err in results if "Traceback" in err)
            return "traceback"
        c.note = "exits " + ", ".join(f"{code} at {d} s" for d, code, _ in results)
        # -SIGINT with nothing printed: the signal came before the interpreter installed its handler (the
        # shell shows 130 as for any program); after that, one line and 130
        fine = all(code == 130 or code == -signal.SIGINT and not err.strip() for _, code, err in results)
        c.last = None  # an interrupt is neither a refusal (exit 2) nor a success: judged here, not by the summary
        return "clean" if fine else "untidy"

    def client_probe(c: Campaign, tmp: Path) -> str:
        made = c.rdepth("export", "--checkpoint", str(c.run), "--out", str(tmp / "hf"))
        if made.code != 0:
            return expect_success(made)
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", _CLIENT, str(tmp / "hf")], env={**ENV, "PYTHONPATH": ""},
                              cwd=tmp, capture_output=True, text=True, timeout=c.timeout)
        c.last = Outcome(done.returncode, done.stdout, done.stderr, time.monotonic() - started)
        if done.returncode != 0:
            c.note = (done.stderr.strip().splitlines() or ["?"])[-1][:160]
            return "traceback" if "AssertionError" not in done.stderr else "silent"
        return "clean"

    def worked_example(c: Campaign, tmp: Path) -> str:
        text = (ROOT / "docs" / "ecosystem.md").read_text()
        example = text.split("## A worked example", 1)[1].split("\n## ", 1)[0]
        if "runs/gpu-task" in example or "$ rdepth demo" not in example:
            c.note = "the worked example's task model is made elsewhere"
            return "silent"
        return "clean"

    return [
        Case("round5", "generate --exit learned with another model's gate", other_models_gate),
        Case("round5", "a gate with a flipped byte", flipped_gate),
        Case("round5", "gate onto an existing gate without --overwrite", gate_again),
        Case("round5", "a learned profile after its gate was trained again", profile_new_gate),
        Case("round5", "gate after an interrupted gate's temporary file", interrupted_gate),
        Case("round5", "export onto a full disk (RLIMIT_FSIZE)", export_full_disk),
        Case("round5", "sweep --kl-prior without kl", sweep_flag("--policies", "acceleration", "--kl-prior", "none")),
        Case("round5", "sweep --kl-direction without kl", sweep_flag("--policies", "step_norm", "--kl-direction",
                                                                      "old_new")),
        Case("round5", "sweep --decode rest without a decoded policy", sweep_flag("--policies", "acceleration",
                                                                                   "--decode", "rest")),
        Case("round5", "sweep --decode-loops without --decode rest", sweep_flag("--policies", "kl", "--decode-loops",
                                                                                 "2")),
        Case("round5", "calibrate --kl-prior with acceleration", calibrate_flag("--policy", "acceleration",
                                                                               "--kl-prior", "uniform")),
        Case("round5", "generate --exit-options with a key twice",
             bad_flag("generate", "--exit", "kl", "--tau", "0.1", "--exit-options", "prior=uniform,prior=none")),
        Case("round5", "exit_wall: a missing run", exit_wall("task", "--run", "NOPE", "--data", "DATA")),
        Case("round5", "exit_wall: an unknown policy", exit_wall("text", "--run", "RUN", "--data", "DATA",
                                                                 "--policies", "nope")),
        Case("round5", "exit_wall: --problems 0", exit_wall("text", "--run", "RUN", "--data", "DATA", "--problems", "0")),
        Case("round5", "exit_wall: a difficulty with no held-out set (text data)",
             exit_wall("task", "--run", "RUN", "--data", "DATA", "--policies", "step_norm", "--problems", "2")),
        Case("round5", "import-hf: raven folder with model.safetensors and a sharded index", raven_both),
        Case("round5", "import-hf: raven vocabulary under 257", raven_small_vocab),
        Case("round5", "import-hf names every format it reads", import_help),
        Case("round5", "Ctrl-C while the command line imports", ctrl_c_while_importing),
        Case("round5", "export's client: generate hidden states, checkpointing, sdpa, max_length, card", client_probe),
        Case("round5", "docs/ecosystem.md's worked example makes its own task model", worked_example),
    ]


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per case (default 60)")
    parser.add_argument("--only", default="", help="comma-separated categories (default: all)")
    parser.add_argument("--match", default="", help="run only the cases whose name contains one of these comma-separated texts")
    parser.add_argument("--json", default=None, help="write every case's result to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args(argv)
    groups = {"flags": flag_cases, "files": file_cases, "kills": kill_cases, "concurrent": concurrency_cases,
              "output": output_cases, "data": data_cases, "round3": round3_cases,
              "consolidate": consolidate_cases, "round5": round5_cases}
    chosen = [g for g in (args.only.split(",") if args.only else groups) if g]
    # started in the background (`nohup ... &`), this process inherits an ignored SIGINT, and so would every
    # command it starts: the SIGINT cases would test nothing. A handler here is reset to the default on exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    work = Path(tempfile.mkdtemp(prefix="rdepth-campaign-"))
    campaign = Campaign(work, args.timeout)
    started = time.monotonic()
    print(f"rdepth fault campaign in {work} (python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"{args.timeout:.0f} s per case)", flush=True)
    campaign.setup()
    cases = _chosen_cases(groups, chosen, args.match)
    for case in cases:
        _run_case(campaign, case)
    totals = _print_totals(cases, chosen, started)
    if args.json:
        _write_results(Path(args.json), totals, cases)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(totals[name] == 0 for name in CLASSES[1:]) else 1


def _chosen_cases(groups: dict, chosen: list[str], match: str) -> list[Case]:
    """The cases of the ``chosen`` groups, in order; with ``match`` (comma-separated texts), only those whose
    name contains one of them."""
    matches = [text for text in match.split(",") if text]
    return [case for name in chosen for case in groups[name]()
            if not matches or any(text in case.name for text in matches)]


def _run_case(campaign: Campaign, case: Case) -> None:
    """Run one case in a fresh folder, classify it (a clean refusal must be exit 2 with one line) and
    print its line."""
    tmp = campaign.fresh("case")
    campaign.note = ""
    campaign.last = None
    begin = time.monotonic()
    try:
        case.result = case.run(campaign, tmp)
    except Exception as exc:  # the campaign's own failure: report, do not count as the CLI's
        case.result, case.note = "error", f"{type(exc).__name__}: {exc}"
    case.seconds = time.monotonic() - begin
    case.note = case.note or campaign.note or ""
    last = getattr(campaign, "last", None)
    if case.result == "clean":
        _classify_clean(case, last)
    if case.result not in ("clean", "skip") and not case.note and last is not None:
        lines = last.error_lines
        case.note = (lines[-1][:160] if lines else f"exit {last.code}")
    print(f"  {case.result:>9}  {case.category:<10} {case.name}  ({case.seconds:.1f} s)"
          + (f"  [{case.note}]" if case.note else ""), flush=True)


def _classify_clean(case: Case, last) -> None:
    """A clean case's kind: refused (the last command failed; untidy unless exit 2 with one error line)
    or accepted."""
    refused = last is not None and last.code not in (0, None)
    if refused and (last.code != 2 or len(last.error_lines) != 1):
        case.result = "untidy"
        case.note = f"exit {last.code}, {len(last.error_lines)} lines: {' | '.join(last.error_lines)[:160]}"
    case.kind = "refused" if refused else "accepted"


def _print_totals(cases: list[Case], chosen: list[str], started: float) -> dict[str, int]:
    """Print the campaign's totals and one line per category; return the totals."""
    totals = {name: sum(case.result == name for case in cases) for name in (*CLASSES, "skip", "error")}
    totals.update({kind: sum(case.kind == kind for case in cases if case.result == "clean")
                   for kind in ("refused", "accepted")})
    print(f"\n{len(cases)} cases in {time.monotonic() - started:.0f} s: " +
          ", ".join(f"{totals[name]} {name}" for name in (*CLASSES, "skip", "error") if totals[name] or name in CLASSES))
    for category in chosen:
        _print_category(category, [case for case in cases if case.category == category])
    return totals


def _print_category(category: str, mine: list[Case]) -> None:
    bad = [case for case in mine if case.result not in ("clean", "skip")]
    kinds = ", ".join(f"{sum(c.kind == k for c in mine if c.result == 'clean')} {k}" for k in ("refused", "accepted"))
    print(f"  {category:<10} {len(mine) - len(bad)}/{len(mine)} clean ({kinds})" +
          (": " + "; ".join(f"{c.name} -> {c.result}" for c in bad) if bad else ""))


def _write_results(path: Path, totals: dict[str, int], cases: list[Case]) -> None:
    path.write_text(json.dumps({"totals": totals, "cases": [
        {"category": c.category, "name": c.name, "result": c.result, "kind": c.kind, "note": c.note,
         "seconds": round(c.seconds, 1)} for c in cases]}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
