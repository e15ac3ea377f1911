"""The slowest-converging tokens of an analysed budget: the table the report page shows."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def token_in_context(decode, ids: list[int], position: int, context: int) -> tuple[str, str]:
    """The text of the ``context`` tokens before ``ids[position]`` and of the token itself.

    Both come from decoding id *sequences*, never one token alone: a byte-level BPE token may
    hold part of a character, which decodes to U+FFFD on its own. The token's text is what
    decoding it together with its context adds; characters cut by the context's start are
    dropped.
    """
    start = max(0, position - context)
    before = decode(ids[start:position]) if position > start else ""
    end = position + 1
    through = decode(ids[start:end])
    while through.endswith("\ufffd") and end < min(len(ids), position + 4):  # the token ends mid-character
        end += 1
        through = decode(ids[start:end])
    if through.startswith(before):
        token = through[len(before):]
    else:  # the token completes a character the prefix had cut: show the completed character
        common = len(before.rstrip("\ufffd"))
        before, token = before[:common], through[common:]
    return before.lstrip("\ufffd"), token


def slowest_tokens(
    convergence: dict[str, np.ndarray],
    final_relative: np.ndarray,
    windows: torch.Tensor,
    tokenizer,
    top: int,
    context: int = 8,
) -> list[dict[str, Any]]:
    """The ``top`` tokens with the largest total convergence step over groups.

    ``convergence`` maps group name -> [N] steps (rows: sequence-major over the
    input positions of ``windows`` [S, T + 1]); ties go to the larger
    ``final_relative`` [N] (the last relative step size in the last group).
    ``tokenizer`` (None: show ids) decodes the token with its ``context`` tokens before it
    (:func:`token_in_context`); the row's ``context`` marks the token as «token».
    """
    names = list(convergence)
    total = sum(convergence[name].astype(np.int64) for name in names)
    order = np.lexsort((-final_relative, -total))[:top]
    seq_len = windows.shape[1] - 1

    def text(ids) -> str:
        if tokenizer is None:
            return " ".join(map(str, ids))
        try:
            return tokenizer.decode([int(i) for i in ids])
        except Exception:  # a tokenizer may reject a partial byte sequence
            return " ".join(map(str, ids))

    rows = []
    for row in order:
        sequence, position = divmod(int(row), seq_len)
        ids = windows[sequence, :seq_len].tolist()
        before, token = token_in_context(text, ids, position, context)
        entry = {
            "token": repr(token),
            "context": (before + "«" + token + "»").replace("\n", "\\n"),
            "sequence": sequence,
            "position": position,
        }
        entry.update({f"steps {name}": int(convergence[name][row]) for name in names})
        entry[f"last rel. step {names[-1]}"] = float(final_relative[row])
        rows.append(entry)
    return rows
