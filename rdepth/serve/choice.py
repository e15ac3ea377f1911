"""One choice's answer as its tokens come: its text (stop strings cut it, an end token ends it), the part of
it safe to stream, its depth report and its log-probabilities.

**What a stream may send.** A chunk never carries text the full response would not hold at that place:
while the choice is open, the text held back is (a) a trailing U+FFFD, the decoding of a character whose
bytes have not all come (a byte-level tokenizer splits a multi-byte character over tokens), and (b) the
longest end of the text that begins a stop string (the next token may complete the stop, which cuts it).
At the end everything left is sent, so the stream's chunks joined are the full response's text.
"""

from __future__ import annotations

from rdepth.engine import Finished
from rdepth.engine.request import TokenLogprob
from rdepth.serve.runner import TokenEvent

FINISH = {"length": "length", "context": "length", "stop": "stop", "cancelled": "stop", "error": "error"}
REPLACEMENT = "\ufffd"


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of ``text`` an open choice holds back (see the module)."""
    whole = text.rstrip(REPLACEMENT)
    longest = 0
    if whole:
        last = whole[-1]
        for stop in stops:  # the stop's prefixes that end with the text's last character, the longest first
            at = stop.rfind(last, 0, min(len(stop) - 1, len(whole)))
            while at + 1 > longest:
                if whole.endswith(stop[:at + 1]):
                    longest = at + 1
                    break
                at = stop.rfind(last, 0, at)
    return len(text) - len(whole) + longest


def prefix_offsets(tokenizer, ids: list[int]) -> tuple[list[str], list[int]]:
    """Each token's own text, and where it starts in ``decode(ids)``: the length of the text of the tokens
    before it (less a trailing U+FFFD: a character still incomplete there starts at its first byte)."""
    pieces = [tokenizer.decode([t]) for t in ids]
    if REPLACEMENT not in "".join(pieces) and "".join(pieces) == tokenizer.decode(ids):  # the usual case
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return pieces, offsets
    return pieces, [len(tokenizer.decode(ids[:i]).rstrip(REPLACEMENT)) for i in range(len(ids))]


class Choice:
    """A choice's state (see the module). ``tokens``: the new tokens taken (at most ``limit``; an end token
    included, whose text is none), each with its ``steps``, ``rules``, log-probability and text offset."""

    def __init__(self, served, index: int, prompt: list[int], settings, seed: int):
        self.served, self.index, self.prompt, self.seed = served, index, prompt, seed
        self.stops, self.limit, self.echo = settings.stops, settings.max_tokens, settings.echo
        self.wants_logprobs = settings.logprobs is not None
        self.policy = settings.policy  # the budget or rule it runs (the server's, or its request's own)
        self.tokens: list[int] = []
        self.steps: list[list[int]] = []
        self.rules: list[list[str]] = []
        self.logprobs: list[TokenLogprob | None] = []
        self.offsets: list[int] = []  # where each new token's text starts in ``text``
        self.prompt_logprobs: list[TokenLogprob] = []
        self.prefix = served.tokenizer.decode(prompt) if self.echo else ""
        self._text_tokens: list[int] = []
        self._decoded = ""
        self.text = ""
        self.sent = 0  # characters of text already streamed
        self.finish_reason: str | None = None
        self.cut = False  # a stop string ended it (the engine's request goes on until cancelled)
        self.done = False  # the engine's result came
        self.error: str | None = None
        self.speculation: dict | None = None  # its loop-speculation counts (a speculating server's, once done)

    def add(self, event: TokenEvent) -> bool:
        """Take a new token; False where it is not taken (the choice ended: a stop string, an end token, its
        limit of 0 new tokens when it only scores the prompt)."""
        if self.finish_reason is not None or len(self.tokens) >= self.limit:
            return False
        self.offsets.append(len(self._decoded.rstrip(REPLACEMENT)))
        self.tokens.append(event.token)
        self.steps.append(event.steps)
        self.rules.append(event.rules)
        self.logprobs.append(event.logprob)
        if event.token in self.served.end_tokens:
            self.offsets[-1] = len(self.text)
            self.finish_reason = "stop"
            return True
        self._text_tokens.append(event.token)
        self._decoded = self.text = self.served.tokenizer.decode(self._text_tokens)
        cuts = [cut for cut in (self.text.find(stop) for stop in self.stops) if cut >= 0]
        if cuts:
            self.text = self.text[:min(cuts)]
            self.finish_reason = "stop"
            self.cut = True
            self.offsets[-1] = min(self.offsets[-1], len(self.text))
        return True

    def finish(self, done: Finished) -> None:
        self.done = True
        if self.finish_reason is None:
            self.finish_reason = FINISH.get(done.finish_reason, done.finish_reason)
        self.error = done.error
        self.prompt_logprobs = done.prompt_logprobs
        if getattr(self.served.runner.engine, "speculation", None) is not None:
            self.speculation = {"rounds": done.rounds, "drafted": done.drafted, "accepted": done.accepted,
                                "acceptance": done.accepted / done.drafted if done.drafted else None}

    def release(self) -> str:
        """The text that may be streamed now and was not yet (see the module)."""
        end = len(self.text) if self.finish_reason is not None else len(self.text) - held_back(self.text, self.stops)
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def depth(self, first: int = 0, last: int | None = None, final: bool = False) -> dict:
        """The depth report of new tokens ``first:last``; the whole choice's (with the means per group, the
        policy it ran and the seed) for ``first`` 0 and no ``last``; ``final`` (a stream's last chunk of the
        choice): with the policy."""
        steps, rules = self.steps[first:last], self.rules[first:last]
        report = {"steps": steps, "rules": rules}
        if first == 0 and last is None:
            groups = len(steps[0]) if steps else 0
            report["mean_steps"] = [sum(s[g] for s in steps) / len(steps) for g in range(groups)] if steps else []
            report["policy"] = self.policy
            report["seed"] = self.seed
        elif final:
            report["policy"] = self.policy
        if (first == 0 and last is None or final) and self.speculation is not None:
            report["speculation"] = self.speculation
        if self.error:
            report["error"] = self.error
        return report
