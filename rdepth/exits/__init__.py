"""Early exit from recurrence loops.

Layout (each file one purpose; dependencies point down the list):

* ``base``: the exit-policy protocol; ``policies``: the rules; ``registry``:
  policies by name; ``decode``: how decoded rules read a state (the head, or
  the rest of the model); ``gate``: the learned exit gate (a head per group on
  the loop state) that the ``learned`` rule reads;
  ``controller``: policies as a model loop controller;
  ``recorded``: policies replayed on recorded iterates (:func:`replay`);
  ``config`` (torch-free): the step caps (``k_max``) and decode modes every
  command shares.
* The rules import only the model and the config: what is saved beside a run
  and how a run is evaluated under them (the gate's file, exit profiles,
  held-out evaluation with exits) live in :mod:`rdepth.exitrun`, and the
  workflows in :mod:`rdepth.sweep` (``rdepth sweep``) and
  :mod:`rdepth.calibrate` (``rdepth calibrate``). One late binding runs up:
  the ``learned`` rule given a run folder reads its gate through
  :mod:`rdepth.exitrun.gate_file`, imported when asked for (the exported
  model's bundled rules run without it).

The public names below load on first use, so that importing
``rdepth.exits.config`` (for ``rdepth --help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "POLICIES": "rdepth.exits.registry",
    "ExitPolicy": "rdepth.exits.base",
    "get_policy_class": "rdepth.exits.registry",
    "make_policy": "rdepth.exits.registry",
    "register_policy": "rdepth.exits.base",
    "PolicyController": "rdepth.exits.controller",
    "controller_factory": "rdepth.exits.controller",
    "drive_recorded": "rdepth.exits.recorded",
    "replay": "rdepth.exits.recorded",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rdepth.exits' has no attribute {name!r}")
