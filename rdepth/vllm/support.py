"""What the vLLM plugin serves of an exported folder, and the one-line refusal of what it cannot (no vLLM import).

An exported ``config.json`` (:class:`rdepth.interop.hf_config.RdepthConfig`, with vLLM's ``hf_overrides`` applied)
is served when its model fields make a valid rdepth model (every block family, loop state, position kind, tied or
untied head, single-pass layers around any number of groups) and it names no exit policy: vLLM runs every token
of a batch through the same layers, so a group loops a fixed number of steps, the same for every token and
request, chosen at launch (``loop_counts``). Where the attention backend takes only some head sizes (vLLM's CPU
backend), the model's must be one of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from rdepth.config import ModelConfig, parse_loop_counts
from rdepth.errors import RdepthError

PREFIX = "rdepth vllm plugin"


def model_config_of(config) -> ModelConfig:
    """The rdepth model config held in an exported ``config.json`` (``vocab_size`` less the export's own pad
    token), validated (a one-line :class:`RdepthError` naming a bad field)."""
    from rdepth.interop.hf_model import model_config_of as read

    return read(config)


def served_loop_counts(config, model_config: ModelConfig) -> tuple[int, ...]:
    """The fixed budget per group: ``config.loop_counts`` (N, [N, ...] or "N:N:..."; set at launch with
    ``hf_overrides={"loop_counts": ...}``), else the model's eval counts (as the exported model's default)."""
    counts = getattr(config, "loop_counts", None)
    if counts is None:
        return model_config.default_eval_loops
    if isinstance(counts, str):
        counts = counts.replace(":", ",")
    return parse_loop_counts(counts, model_config.n_groups)


def refusal(config, head_sizes: Sequence[int] | None = None) -> str | None:
    """Why the plugin cannot serve ``config`` (one line), or None. ``head_sizes``: the head sizes the attention
    backend takes (None: any)."""
    try:
        model_config = model_config_of(config)
        served_loop_counts(config, model_config)
    except RdepthError as exc:
        return f"{PREFIX}: cannot serve this export: {exc}"
    policy = getattr(config, "exit_policy", None)
    if policy:
        name = policy.get("name") if isinstance(policy, dict) else policy
        return (f"{PREFIX}: this export names the exit policy {name!r}; vLLM runs every token at one fixed loop "
                "budget (per-token exits are not in its model interface): serve it with "
                "hf_overrides={\"exit_policy\": null, \"loop_counts\": [N, ...]}, or use rdepth serve for exits")
    if head_sizes is not None and model_config.head_dim not in head_sizes:
        return (f"{PREFIX}: head_dim {model_config.head_dim} (d_model {model_config.d_model} / n_head "
                f"{model_config.n_head}) is not one vLLM's attention backend here takes "
                f"({', '.join(str(size) for size in head_sizes)})")
    return None


def check(config, head_sizes: Sequence[int] | None = None) -> None:
    """:func:`refusal` as a raised :class:`RdepthError`."""
    reason = refusal(config, head_sizes)
    if reason is not None:
        raise RdepthError(reason)
