"""rdepth's vLLM plugin: ``rdepth export`` folders served by vLLM at a fixed loop budget (docs/serve.md, "vLLM").

vLLM calls :func:`register` in each of its processes (the ``vllm.general_plugins`` entry point in rdepth's
``pyproject.toml``), wherever rdepth and vLLM are installed together; nothing here imports vLLM until it does, so
``import rdepth.vllm`` costs nothing elsewhere. :func:`register`:

- names :class:`rdepth.vllm.model.RdepthForCausalLM` (imported by vLLM when a folder's ``architectures`` names
  it) in vLLM's model registry;
- registers the export's config class (:class:`rdepth.interop.hf_config.RdepthConfig`) with transformers, so a
  folder loads without ``trust_remote_code`` (the modeling code vLLM runs is the plugin's, not the folder's);
- checks a folder as vLLM reads its config, in the launching process, before any worker starts
  (:func:`rdepth.vllm.support.refusal`): an export the plugin cannot hold (an invalid model config, an exit
  policy, a head size the attention backend refuses, bad ``loop_counts``) stops the launch with one line naming
  it (an :class:`~rdepth.errors.RdepthError`; uncaught, it prints as that line alone, not a traceback).
"""

from __future__ import annotations

import sys

ARCHITECTURE = "RdepthForCausalLM"


def register() -> None:
    """vLLM's plugin hook (see the module); safe to call more than once."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from rdepth.interop.hf_config import RdepthConfig

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "rdepth.vllm.model:RdepthForCausalLM")
    AutoConfig.register("rdepth", RdepthConfig, exist_ok=True)
    MODELS_CONFIG_MAP[ARCHITECTURE] = _launch_check()
    _one_line_errors()


def _launch_check():
    """vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``), which it calls as it builds the model
    config, with ``hf_overrides`` applied: the plugin's refusal there."""
    from vllm.model_executor.models.config import VerifyAndUpdateConfig

    class RdepthLaunchCheck(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_model_config(model_config) -> None:
            from rdepth.vllm.model import supported_head_sizes
            from rdepth.vllm.support import check

            check(model_config.hf_config, supported_head_sizes())

    return RdepthLaunchCheck


def _one_line_errors() -> None:
    """An uncaught :class:`RdepthError` (the launch check's refusal) prints as its one line, as rdepth's CLI prints
    it; every other exception as before."""
    from rdepth.errors import RdepthError

    previous = sys.excepthook
    if getattr(previous, "_rdepth_one_line", False):
        return

    def hook(kind, value, trace):
        if isinstance(value, RdepthError):
            print(f"error: {value}", file=sys.stderr)
            return
        previous(kind, value, trace)

    hook._rdepth_one_line = True
    sys.excepthook = hook
