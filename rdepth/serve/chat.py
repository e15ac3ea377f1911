"""Chat: a conversation rendered by the tokenizer's chat template (:mod:`rdepth.run.chat_template`), then
tokenised with the template's special tokens read as themselves.

rdepth's tokenizers encode text literally (``<|endoftext|>`` in a prompt is its characters); a chat template
writes its special tokens (``<|im_start|>``, the end of a turn) as text that must become their ids, as
Hugging Face tokenizers read them. :func:`encode_with_specials` splits the text at every special token the
tokenizer holds and encodes the pieces between them literally; ``/tokenize`` reads text the same way (what
lm-eval's remote tokenizer sends, an end token's text included).

The template runs in Jinja's immutable sandbox with the names chat templates use (``raise_exception``,
``strftime_now``, ``tojson``), ``trim_blocks`` and ``lstrip_blocks`` on, as Hugging Face renders them.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from rdepth.errors import RdepthError
from rdepth.run.chat_template import ChatTemplate
from rdepth.serve.errors import BadRequest

ROLES = ("system", "developer", "user", "assistant", "tool")


class _TemplateRefused(Exception):
    """``raise_exception(message)`` in a template: the conversation does not fit it (the client's fault)."""


def _raise(message: str):
    raise _TemplateRefused(message)


class ChatRenderer:
    """A compiled chat template (a template that does not compile is a one-line error when the server starts)."""

    def __init__(self, template: ChatTemplate):
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ModuleNotFoundError:
            raise RdepthError("chat templates need jinja2 (pip install jinja2)") from None
        self._errors = (TemplateError, _TemplateRefused, TypeError, ValueError)
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
        environment.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        environment.filters["tojson"] = lambda value, indent=None, ensure_ascii=False: json.dumps(
            value, indent=indent, ensure_ascii=ensure_ascii)
        try:
            self._compiled = environment.from_string(template.chat_template)
        except TemplateError as exc:
            raise RdepthError(f"the tokenizer's chat template does not compile: {exc}") from None
        self.template = template

    def render(self, messages: list[dict]) -> str:
        """The conversation as the model's prompt, ending where the assistant's turn begins."""
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=True,
                                         bos_token=self.template.bos_token or "",
                                         eos_token=self.template.eos_token or "")
        except self._errors as exc:
            raise BadRequest(f"the model's chat template refuses these messages: {exc}", "messages") from None


def chat_messages(value: Any) -> list[dict]:
    """``messages`` checked: a non-empty list of ``{"role", "content"}`` (content a string, or a list of text
    parts, joined), ``name`` allowed; anything else a :class:`BadRequest` naming it."""
    if not isinstance(value, list) or not value:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise BadRequest(f"'{where}' must be an object with 'role' and 'content'", "messages")
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise BadRequest(f"'{where}' has unsupported field(s): {', '.join(unknown)} (this server takes role, "
                             "content and name)", "messages")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise BadRequest(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"'{where}.content' parts must be text parts ({{'type': 'text', 'text': ...}})",
                                 "messages")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise BadRequest(f"'{where}.content' must be a string or a list of text parts", "messages")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"'{where}.content' is not valid Unicode (it holds a lone surrogate)",
                             "messages") from None
        messages.append({"role": role, "content": content, **({"name": message["name"]} if "name" in message
                                                                else {})})
    return messages


def special_tokens(tokenizer) -> dict[str, int]:
    """The text of every special token the tokenizer holds, and its id: a ``tokenizers`` BPE's special added
    tokens (an imported model's chat markers among them), and the end-of-text token."""
    specials: dict[str, int] = {}
    inner = getattr(tokenizer, "_tokenizer", None)  # a BpeTokenizer's tokenizers.Tokenizer
    if inner is not None and hasattr(inner, "get_added_tokens_decoder"):
        specials.update({token.content: index for index, token in inner.get_added_tokens_decoder().items()
                         if token.special and token.content})
    eot = getattr(tokenizer, "eot_id", None)
    if eot is not None:
        specials.setdefault(tokenizer.decode([eot]), eot)
    return specials


class SpecialEncoder:
    """Text to token ids with every special token's text read as that token (see the module)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.specials = special_tokens(tokenizer)
        names = sorted(self.specials, key=len, reverse=True)  # the longest first where one holds another
        self._split = re.compile("(" + "|".join(re.escape(name) for name in names) + ")") if names else None

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.tokenizer.encode(text)
        ids: list[int] = []
        for index, piece in enumerate(self._split.split(text)):
            if index % 2:
                ids.append(self.specials[piece])
            elif piece:
                ids.extend(self.tokenizer.encode(piece))
        return ids

    def token_id(self, text: str | None) -> int | None:
        """The id of the special token ``text`` (None where it is not one)."""
        return self.specials.get(text) if text else None
