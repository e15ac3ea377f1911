"""Draw the README's figure: the main job's exact match against test loops per difficulty.

    python scripts/readme_figure.py                                   # the README's recorded run
    python scripts/readme_figure.py --overview OUT/report/overview.json  # any task demo's first screen

Without ``--overview`` it draws the run whose table the README and docs/results/main-job.md quote
(`rdepth demo --out runs/demo_loop`, seed 0, at 2f37a34 on the 2-core AMD EPYC; that run's folder is
not kept, so its numbers are recorded below). The figure is the demo's own
(`rdepth.demo.task_report.draw_task_overview`), saved as a palette PNG so that it stays small.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rdepth.demo.task_report import draw_task_overview  # noqa: E402

BUDGETS = [1, 2, 3, 4, 6, 8, 12, 32]
# Exact match (%) on 256 held-out problems per difficulty, one row per loop budget above, then no loop.
RECORDED = {
    1: ([30.1, 99.6, 99.6, 99.6, 99.6, 99.6, 99.6, 99.6], 100.0),
    2: ([0.0, 73.4, 99.2, 99.2, 99.2, 99.2, 99.2, 99.2], 0.0),
    3: ([0.0, 3.9, 88.7, 98.4, 98.4, 98.0, 98.0, 98.0], 0.0),
    4: ([0.0, 0.0, 50.0, 95.3, 96.9, 96.9, 96.9, 96.9], 0.0),
    5: ([0.0, 0.0, 28.5, 85.2, 93.0, 92.6, 92.6, 92.6], 0.0),
    6: ([0.0, 0.0, 7.4, 63.3, 90.2, 90.2, 89.5, 89.8], 0.0),
    7: ([0.0, 0.0, 2.3, 42.2, 88.7, 89.5, 89.8, 89.1], 0.0),
    8: ([0.0, 0.0, 2.0, 37.5, 86.7, 89.1, 89.1, 88.3], 0.0),
    12: ([0.0, 0.8, 7.0, 21.5, 78.9, 87.1, 88.3, 87.9], 2.0),
}
DEFAULT_OUT = ROOT / "docs" / "figures" / "main_job_accuracy.png"


def recorded_overview() -> dict:
    """The recorded run in the shape of a demo's ``overview.json`` (the fields the figure reads)."""
    return {
        "train_difficulties": [1, 8], "budgets": BUDGETS, "train_mean_loops": 6.0,
        "looped": {str(d): {str(b): v / 100 for b, v in zip(BUDGETS, row, strict=True)}
                   for d, (row, _) in RECORDED.items()},
        "baselines": {"no_loop": {str(d): no_loop / 100 for d, (_, no_loop) in RECORDED.items()}},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--overview", help="a task demo's OUT/report/overview.json (default: the recorded run)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the PNG to write")
    parser.add_argument("--colors", type=int, default=32, help="palette size of the PNG")
    args = parser.parse_args(argv)
    try:
        overview = recorded_overview() if args.overview is None else json.loads(Path(args.overview).read_text())
    except (OSError, ValueError) as error:
        print(f"error: cannot read {args.overview}: {error}", file=sys.stderr)
        return 2
    from PIL import Image

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / draw_task_overview(tmp, overview)[0][0]
        image = Image.open(path).convert("RGB").quantize(colors=args.colors)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        image.save(out, optimize=True)
    print(f"{out}: {out.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
