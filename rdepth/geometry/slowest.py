"""The slowest-converging tokens of an analysed budget: the table the report page shows."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


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
    ``tokenizer`` (None: show ids) decodes the token and its ``context`` tokens before it.
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
        entry = {
            "token": repr(text([ids[position]])),
            "context": text(ids[max(0, position - context) : position + 1]).replace("\n", "\\n"),
            "sequence": sequence,
            "position": position,
        }
        entry.update({f"steps {name}": int(convergence[name][row]) for name in names})
        entry[f"last rel. step {names[-1]}"] = float(final_relative[row])
        rows.append(entry)
    return rows
