"""Render a report page to PNG with headless Chromium, to look at it as a reader would.

    python scripts/screenshot_report.py runs/demo/report/index.html              # first screen
    python scripts/screenshot_report.py runs/demo/report --height 6000 --out page.png

The first screen is a 1280 x 800 viewport (what a laptop shows before any
scrolling); pass ``--height`` for more of the page. Chromium is found as
``chromium``, ``chromium-browser``, ``google-chrome`` or ``$CHROMIUM``
(Debian: ``apt-get install chromium``); without it the script says so and exits
with status 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The Chromium binary to use: ``$CHROMIUM`` if set, else the first of :data:`BROWSERS` on PATH."""
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"]) or os.environ["CHROMIUM"]
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def page_path(target: str | os.PathLike) -> Path:
    """The HTML file to render: ``target`` itself, or ``target/index.html`` for a folder."""
    path = Path(target)
    if path.is_dir():
        path = path / "index.html"
    if not path.is_file():
        raise FileNotFoundError(f"no report page at {path}")
    return path.resolve()


def chromium_command(browser: str, page: Path, png: Path, width: int, height: int, profile: Path) -> list[str]:
    """The headless Chromium call that writes ``png`` (``width`` x ``height`` CSS pixels) of ``page``."""
    return [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
        f"--user-data-dir={profile}", "--allow-file-access-from-files", "--virtual-time-budget=5000",
        f"--window-size={width},{height}", f"--screenshot={png}", page.as_uri(),
    ]


def screenshot(target: str | os.PathLike, png: str | os.PathLike, *, width: int = 1280, height: int = 800,
               browser: str | None = None, timeout: float = 120) -> Path:
    """Render the report page ``target`` (a file or a folder holding index.html) to ``png``; returns its path."""
    browser = browser or find_chromium()
    if browser is None:
        raise RuntimeError("Chromium not found: apt-get install chromium (or set $CHROMIUM)")
    page, png = page_path(target), Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rdepth-chromium-") as profile:
        command = chromium_command(browser, page, png, width, height, Path(profile))
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not png.is_file():
        raise RuntimeError(f"Chromium failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("page", help="report page (index.html) or the folder holding it")
    parser.add_argument("--out", help="PNG to write (default: report_screenshot.png beside the page)")
    parser.add_argument("--width", type=int, default=1280, help="viewport width in CSS pixels (default 1280)")
    parser.add_argument("--height", type=int, default=800, help="viewport height in CSS pixels (default 800)")
    args = parser.parse_args(argv)
    try:
        page = page_path(args.page)
        png = screenshot(page, args.out or page.parent / "report_screenshot.png", width=args.width,
                         height=args.height)
    except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
