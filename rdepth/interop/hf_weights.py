"""The safetensors weights of a Hugging Face folder, found and read as ``transformers`` does (one reader for
every importer).

A folder holds its weights in ``model.safetensors``, or in shards that ``model.safetensors.index.json``
lists (``{"weight_map": {tensor name: shard file}}``). A folder holding both is read from the single
file, as ``from_pretrained`` reads it (the index beside it is ignored). An index is checked before any
shard is opened: a JSON object whose ``weight_map`` maps tensor names to file names in the folder;
then every tensor must sit in the shard the index names, and every indexed tensor must be there.
Whatever is wrong is one :class:`~rdepth.errors.RdepthError` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rdepth.errors import RdepthError
from rdepth.run.checkpoint import check_weight_values

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def has_safetensors(folder: Path) -> bool:
    """Whether ``folder`` holds safetensors weights (the single file or a shard index)."""
    return (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()


def read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` of the safetensors index ``path`` (tensor name -> shard file in the same folder),
    its shape checked: a one-line error naming ``path`` for anything else."""
    def refuse(why: str) -> RdepthError:
        return RdepthError(f"{path} is not a safetensors index ({why})")

    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise refuse(getattr(exc, "msg", type(exc).__name__)) from None
    if not isinstance(data, dict):
        raise refuse(f"a JSON {type(data).__name__}, not an object")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise refuse(f"its weight_map is {_short(weight_map)}, not a mapping of tensor names to shard files")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise refuse(f"its weight_map puts {name!r} in {_short(file)}, not a file name")
        if Path(file).name != file or file in ("", ".", ".."):
            raise RdepthError(f"{path} names a shard outside the folder: {file!r}")
    return weight_map


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def weight_files(folder: Path) -> tuple[list[str], dict[str, str] | None]:
    """The files holding ``folder``'s weights, and the index's weight map (None for the single file):
    ``model.safetensors`` when present, else the shards its index names (sorted)."""
    if (folder / SINGLE_FILE).is_file():
        return [SINGLE_FILE], None
    index = folder / INDEX_FILE
    if not index.is_file():
        raise RdepthError(f"{folder} has no {SINGLE_FILE} (nor an {INDEX_FILE} naming its shards)")
    weight_map = read_index(index)
    return sorted(set(weight_map.values())), weight_map


def read_hub_weights(folder: Path, check_values: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of ``folder``'s safetensors weights (see the module's docstring), checked floating point
    and finite (``check_values=False``: left to the caller, whose folder may hold integer buffers it drops);
    a missing, corrupt or inconsistent file is a one-line error naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files, weight_map = weight_files(folder)
    index_path = folder / INDEX_FILE
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise RdepthError(f"{folder} has no {name}" + (f" (a shard its {INDEX_FILE} names)" if weight_map else ""))
        try:
            shard = load_file(str(path))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise RdepthError(f"weights {path} are corrupt or truncated ({exc})") from None
        if weight_map is not None:
            stray = sorted(tensor for tensor in shard if weight_map.get(tensor) != name)
            if stray:
                where = repr(weight_map[stray[0]]) if stray[0] in weight_map else None
                raise RdepthError(f"{index_path} is wrong: {name} holds {stray[0]!r}, which the index puts "
                                  f"{'in ' + where if where else 'nowhere'}")
        weights.update(shard)
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(weights))
        if absent:
            raise RdepthError(f"{index_path} is wrong: {absent[0]!r} is not in {weight_map[absent[0]]}")
    if check_values:
        check_weight_values(folder, weights)
    return weights
