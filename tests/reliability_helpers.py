"""Shared by the reliability tests: a tiny training command line and the one-line-error check."""

from __future__ import annotations

TINY = [
    "--n-layer", "3", "--n-head", "2", "--d-model", "32", "--block-size", "32",
    "--groups", "1", "--mean-loops", "3", "--backprop-depth", "2", "--threads", "1",
]


def train_argv(data, out, *extra) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--batch-size", "4", "--log-every", "1",
            "--eval-every", "3", "--eval-batches", "1", "--checkpoint-every", "3", "--warmup-steps", "2",
            *TINY, *extra]


def error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "%|" not in line]
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]
