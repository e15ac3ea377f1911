"""``rdepth serve`` on a looped ``transformers`` folder (HRM-Text, Inkling-2): the same HTTP API, over a
:class:`~rdepth.looped.engine.LoopedEngine`.

The folder is read in place (:func:`~rdepth.looped.load.open_looped`), its own tokenizer and chat template
serve the text, and the engine runs the server's policy for every request: the model's budget, ``--loops`` (the
adapter's loops in order: HRM-Text ``H,L``; Inkling-2 ``passes``), or ``--exit RULE`` (HRM-Text: the rule on the
L loop of each H step and on the H loop, as ``rdepth generate --exit`` runs it). Each token reports the steps of
each loop (summed over its runs: HRM-Text's L over the H steps). A request's own depth (its ``rdepth`` object)
is refused with a 400 naming why, and so is every flag the folder does not read, in one line at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rdepth.errors import RdepthError
from rdepth.looped.load import check_flags_apply
from rdepth.serve.depth import Depths
from rdepth.serve.errors import BadRequest

# The flags of rdepth serve a looped folder reads (no --seed: its loops start from no noise; no --k-max: the caps
# are the loops' own budgets; no tick, layout, speculation or request depths: the looped engine's own tick).
APPLICABLE = ("checkpoint", "name", "host", "port", "batch_size", "loops", "exit", "tau", "exit_options",
              "max_tokens", "context", "max_n", "max_choices", "max_logprobs", "max_body_bytes", "device", "threads")


class FolderTokenizer:
    """A folder's ``transformers`` tokenizer as rdepth's tokenizer (:class:`rdepth.data.tokenizers.Tokenizer`):
    text encoded as it stands (no special tokens added), ``vocab_size`` the model's embedding rows (a prompt of
    ids past them is refused), ``eot_id`` the tokenizer's end-of-sequence token (None: it has none)."""

    def __init__(self, tokenizer: Any, name: str, rows: int) -> None:
        self.inner, self.name, self.vocab_size = tokenizer, name, rows
        self.eot_id = tokenizer.eos_token_id
        self._tokenizer = getattr(tokenizer, "backend_tokenizer", None)  # its special tokens, for the chat encoder

    def encode(self, text: str) -> list[int]:
        return list(self.inner(text, add_special_tokens=False)["input_ids"])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        return self.inner.decode(list(ids))


@dataclass
class FolderDepths(Depths):
    """The server's policy for every request: a request's ``rdepth`` object is refused (400)."""

    def card(self) -> dict:
        return {"max_loops": None, "caps": list(self.caps), "exits": {}}  # (no request brings a depth)

    def read(self, value: Any):
        if value is None:
            return self.default, self.policy
        raise BadRequest("this server drives a looped transformers folder at its own policy "
                         f"({self.policy}); a request's 'rdepth' depth is not served", "rdepth")


def served_folder(config, given: dict[str, Any]):
    """The :class:`~rdepth.serve.served.ServedModel` of ``config.checkpoint``, a looped folder (its engine's
    thread started)."""
    import torch

    from rdepth.looped.engine import LoopedEngine
    from rdepth.looped.generate import exit_policies, parse_budgets
    from rdepth.looped.load import folder_tokenizer, open_looped
    from rdepth.run.chat_template import hub_chat_template
    from rdepth.run.device import resolve_device
    from rdepth.serve.chat import ChatRenderer
    from rdepth.serve.runner import EngineRunner
    from rdepth.serve.served import ServedModel

    check_flags_apply("serve", given, APPLICABLE)
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    tokenizer = folder_tokenizer(config.checkpoint)
    template = hub_chat_template(config.checkpoint)
    adapter = open_looped(config.checkpoint, torch.float32)
    adapter.model.to(device)
    budgets = parse_budgets(adapter, config.loops, "serve")
    policies = exit_policies(adapter, config, "serve") if config.exit is not None else {}
    context = int(getattr(adapter.model.config, "max_position_embeddings", 0) or 0)
    if config.context is not None and context and config.context > context:
        raise RdepthError(f"serve: --context {config.context} exceeds the model's context {context}")
    engine = LoopedEngine(adapter, config.batch_size, budgets=budgets, low=policies.get("L"), high=policies.get("H"),
                          capacity=config.context)
    steps = adapter.budgets(budgets)
    if config.exit is None:
        policy = {"loops": [steps[name] for name in engine.loops]}
    else:
        policy = {"exit": config.exit, "tau": config.tau, "k_max": list(engine.k_max)}
    rows = adapter.model.get_input_embeddings().num_embeddings
    name = config.name or Path(config.checkpoint).resolve().name
    depths = FolderDepths(tuple(engine.k_max), {}, None, policy)
    return ServedModel(name, FolderTokenizer(tokenizer, adapter.model_type, rows), EngineRunner(engine).start(),
                       engine.capacity, policy, config.max_tokens, config.max_n, 0, config.max_choices,
                       config.max_body_bytes, config.max_logprobs, ChatRenderer(template) if template else None, depths)
