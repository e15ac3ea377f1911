"""A tokenizer's chat template, kept beside a run's tokenizer (``RUN/tokenizer/chat_template.json``).

Hugging Face folders carry their chat template in ``tokenizer_config.json`` (``chat_template``: one Jinja
template, or a list of named ones), or in a ``chat_template.jinja`` file beside it, with the special tokens it
names (``bos_token``, ``eos_token``: a string, or an object with ``content``). ``rdepth import-hf`` keeps
them (:func:`hub_chat_template`) in one file, ``{"chat_template", "bos_token", "eos_token"}``, which
``rdepth serve`` reads (:func:`run_chat_template`) for ``/v1/chat/completions``. rdepth's own tokenizers
define none: a model trained here has no chat template.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rdepth.errors import RdepthError

CHAT_TEMPLATE_FILE = "chat_template.json"


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens' text it is rendered with."""

    chat_template: str
    bos_token: str | None = None
    eos_token: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, indent=1) + "\n"


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RdepthError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise RdepthError(f"{path} does not hold a JSON object")
    return value


def hub_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The chat template of the Hugging Face folder ``folder`` (None where it has none): ``chat_template.jinja``
    if present, else ``tokenizer_config.json``'s ``chat_template`` (of a list, the one named ``default``, else
    the first), with that file's ``bos_token`` and ``eos_token``."""
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    template = config.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if template is None:
        return None
    if not isinstance(template, str) or not template.strip():
        raise RdepthError(f"{folder}: the chat template is not a Jinja template string")
    return ChatTemplate(template, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))


def run_chat_template(checkpoint: str | Path) -> ChatTemplate | None:
    """The chat template kept with the tokenizer of a run (found from a run or checkpoint path, as its tokenizer
    is); None where none was kept."""
    from rdepth.run.heldout import run_tokenizer_dir

    path = run_tokenizer_dir(checkpoint) / CHAT_TEMPLATE_FILE
    if not path.is_file():
        return None
    data = _read_json(path)
    if not isinstance(data.get("chat_template"), str):
        raise RdepthError(f"{path} holds no 'chat_template' string")
    return ChatTemplate(data["chat_template"], _token_text(data.get("bos_token")), _token_text(data.get("eos_token")))
