"""Exit profiles: a policy with one threshold per group, saved as JSON beside a run.

``rdepth calibrate`` writes one (:mod:`rdepth.calibrate.run`); ``rdepth eval``
takes it with ``--exit-profile``. The file holds what a controller needs (the
policy, its swept parameter, one value per group, the step caps and the policy
options) and what it was calibrated for and on (target, data, predicted and
realised quality and steps), so that a profile can be checked against the model
it is loaded for and read by people.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rdepth.config import MAX_LOOPS
from rdepth.errors import RdepthError
from rdepth.io import read_json_object

KIND = "rdepth-exit-profile"
FORMAT = 1


def make_profile(policy: str, values: Sequence[float], k_max: Sequence[int], options: dict | None = None,
                 **record: Any) -> dict:
    """A profile dict (validated); ``record`` adds what it was calibrated for and on."""
    from rdepth.exits.registry import get_policy_class

    cls = get_policy_class(policy)
    profile = {"kind": KIND, "format": FORMAT, "policy": policy, "parameter": cls.sweep_parameter,
               "values": [float(v) for v in values], "k_max": [int(k) for k in k_max],
               "options": dict(options or {}), **record}
    check_profile(profile, "exit profile")
    return profile


def check_profile(profile: dict, where: str) -> None:
    """A one-line error for a profile that is not one or is malformed."""
    from rdepth.exits.registry import get_policy_class

    if profile.get("kind") != KIND or profile.get("format") != FORMAT:
        raise RdepthError(f"{where}: not an rdepth exit profile (format {FORMAT})")
    get_policy_class(profile.get("policy", "?"))
    values, k_max = profile.get("values"), profile.get("k_max")
    if not isinstance(values, list) or not isinstance(k_max, list) or not values or len(values) != len(k_max):
        raise RdepthError(f"{where}: values and k_max must be lists of the same length (one per group)")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values):
        raise RdepthError(f"{where}: values must be positive finite numbers, got {values}")
    if not all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_LOOPS for k in k_max):
        raise RdepthError(f"{where}: k_max must be integers in 1..{MAX_LOOPS} (the loop bound), got {k_max}")
    if not isinstance(profile.get("options", {}), dict):
        raise RdepthError(f"{where}: options must be an object")


FORCE_FLAG = "--force-profile"


def load_profile(path: str | Path, n_groups: int | None = None, checkpoint: str | Path | None = None,
                 force: bool = False) -> dict:
    """Read and check a profile; with ``n_groups``, it must have one value per group of the model; with
    ``checkpoint`` (a checkpoint or run folder), it must have been calibrated on those weights
    (its ``run`` identity, :func:`rdepth.run.checkpoint.run_identity`) unless ``force``."""
    profile = read_json_object(Path(path), "exit profile")
    check_profile(profile, f"exit profile {path}")
    if n_groups is not None and len(profile["values"]) != n_groups:
        raise RdepthError(f"exit profile {path} has {len(profile['values'])} group value(s) for a model with "
                          f"{n_groups} group(s)")
    if checkpoint and not force:
        from rdepth.run.checkpoint import check_run_identity, resolve_checkpoint

        check_run_identity(profile.get("run"), resolve_checkpoint(checkpoint), f"exit profile {path}", FORCE_FLAG)
    if checkpoint and profile["policy"] == "learned":
        check_profile_gate(profile, path, checkpoint)
    return profile


def check_profile_gate(profile: dict, path: str | Path, checkpoint: str | Path) -> None:
    """A learned profile runs the gate it was calibrated with, on a model that gate was trained for: its
    ``gate_sha256`` must be the gate's (:func:`rdepth.exitrun.gate_file.gate_sha256`; a gate trained again
    since is refused, ``--force-profile`` or not), and the gate must be bound to ``checkpoint``'s model."""
    from rdepth.exitrun.gate_file import gate_sha256, load_gate

    gate = load_gate(profile.get("options", {}).get("gate") or checkpoint, drives=checkpoint)
    recorded = profile.get("gate_sha256")
    if recorded is None:
        raise RdepthError(f"exit profile {path} does not record the SHA-256 of the exit gate it was calibrated "
                          "with (an older rdepth wrote it): calibrate again with rdepth calibrate --policy learned")
    if recorded != gate_sha256(gate):
        raise RdepthError(f"exit profile {path} was calibrated with another exit gate than {gate.source} (trained "
                          "again since?): calibrate again with rdepth calibrate --policy learned")


def profile_controller_factory(profile: dict, decode_factory: Callable[[], Any] | None = None) -> Callable:
    """A factory of fresh controllers running the profile's policy with each group's own value."""
    from rdepth.exits.controller import controller_factory

    return controller_factory(profile["policy"], profile["values"], profile["k_max"], decode_factory,
                              profile.get("options", {}))
