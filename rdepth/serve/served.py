"""What the server serves (:class:`ServedModel`): the model's name, its tokenizer and chat template, the
engine's runner and the limits the server sets on a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rdepth.serve.chat import ChatRenderer, SpecialEncoder
from rdepth.serve.depth import Depths
from rdepth.serve.runner import EngineRunner

# A string prompt longer than this many characters per position of the context is refused before it is
# tokenised: to fit, its tokens would average more than this many characters (English text runs about 4), and
# tokenising it would cost the server hundreds of bytes per character.
CHARS_PER_POSITION = 16


@dataclass
class ServedModel:
    """What the API serves: the name clients pass as ``model``, the tokenizer, the engine's runner and the
    limits the server sets (``max_tokens`` per request, ``max_n`` choices per prompt, ``max_choices`` choices
    per request (prompts x n), ``max_body_bytes`` per request body, ``max_logprobs`` most likely tokens per
    position), the loop-state noise seed, the chat template (None: the model has none) and the depths a
    request's ``rdepth`` object may ask for (:class:`~rdepth.serve.depth.Depths`; None: only the server's
    ``policy``).

    ``end_tokens``: the tokens that end a completion (``finish_reason`` "stop", no text): the tokenizer's
    end-of-text token and the chat template's end-of-turn token; ``encoder`` reads special tokens' text as them
    (chat prompts, ``/tokenize``)."""

    name: str
    tokenizer: Any
    runner: EngineRunner
    context: int
    policy: dict
    max_tokens: int = 256
    max_n: int = 16
    noise_seed: int = 0
    max_choices: int = 64
    max_body_bytes: int = 4 * 1024 * 1024
    max_logprobs: int = 20
    chat: ChatRenderer | None = None
    depths: Depths | None = None
    end_tokens: frozenset[int] = field(init=False)
    encoder: SpecialEncoder = field(init=False)

    def __post_init__(self) -> None:
        self.encoder = SpecialEncoder(self.tokenizer)
        ends = {getattr(self.tokenizer, "eot_id", None)}
        if self.chat is not None:
            ends.add(self.encoder.token_id(self.chat.template.eos_token))
        self.end_tokens = frozenset(int(t) for t in ends if t is not None)
