"""Settings of ``rdepth eval`` and ``rdepth generate`` (torch-free, so ``rdepth --help`` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass

from rdepth.config import MAX_LOOPS
from rdepth.errors import RdepthError, check_utf8
from rdepth.fields import check_fields, option
from rdepth.threads import THREADS_HELP

MAX_SAMPLES = 1024  # continuations generated side by side: each holds a key/value cache of the whole context
PROFILE_FORCE_HELP = ("apply --exit-profile even when it was calibrated on other weights (its recorded weights "
                      "SHA-256 differs) or records none")
DEVICE_HELP = "auto (CUDA when present), cpu or cuda[:N]"
AUTOCAST_NAMES = ("none", "bf16", "fp16")
# Exit rules whose gate is the run's own, given as the checkpoint (option ``gate``): the learned gate saved
# beside it (rdepth gate), and Ouro's exit gate inside the model (an imported Ouro).
CHECKPOINT_GATE_RULES = ("learned", "ouro")


def check_force_profile(command: str, config) -> None:
    """``--force-profile`` only applies with ``--exit-profile``: alone it is an error, never ignored."""
    if config.force_profile and config.exit_profile is None:
        raise RdepthError(f"{command}: --force-profile applies to --exit-profile; give one or drop it")


def policy_options(command: str, exit_policy: str | None, text: str | None, checkpoint: str) -> dict:
    """``--exit-options KEY=VALUE,...`` as a dict, each value an int, a float or text; a key given twice is
    a one-line error. A rule whose gate is the run's own (:data:`CHECKPOINT_GATE_RULES`) gets ``checkpoint``;
    a gate named by ``gate=FOLDER`` must have been trained for the run's model
    (:func:`rdepth.exitrun.gate_file.check_gate_option`, which the commands call)."""
    options, given = ({"gate": checkpoint} if exit_policy in CHECKPOINT_GATE_RULES else {}), set()
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise RdepthError(f"{command}: --exit-options wants KEY=VALUE,..., got {item!r}")
        for kind in (int, float):
            try:
                value = kind(value)
                break
            except ValueError:
                continue
        if key.strip() in given:
            raise RdepthError(f"{command}: --exit-options gives {key.strip()} twice; give each key once")
        given.add(key.strip())
        options[key.strip()] = value.strip() if isinstance(value, str) else value
    return options


def autocast_dtype(name: str):
    """The torch dtype of an autocast name (:data:`AUTOCAST_NAMES`; ``none`` -> None)."""
    import torch

    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def check_autocast_name(command: str, name: str) -> None:
    if name not in AUTOCAST_NAMES:
        raise RdepthError(f"{command}: autocast must be one of {', '.join(AUTOCAST_NAMES)}, got {name!r}")


def check_device_name(command: str, device: str) -> None:
    """A one-line error for a device string that is not auto, cpu or cuda[:N]."""
    if device in ("auto", "cpu", "cuda"):
        return
    if device.startswith("cuda:") and device[5:].isdigit():
        return
    raise RdepthError(f"{command}: device must be auto, cpu or cuda[:N], got {device!r}")


def check_positive(command: str, config: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RdepthError(f"{command}: {name} must be a positive integer, got {value!r}")


@dataclass
class EvalConfig:
    """One ``rdepth eval`` run: a checkpoint on held-out data at one or more loop budgets."""

    checkpoint: str = option("", "checkpoint folder, or a run folder (its latest checkpoint)", required=True)
    data: str = option("", "prepared data folder (its val split) or a UTF-8 text file", required=True)
    loops: list[str] | None = option(
        None, "loop counts N (every group) or N,N,... (per group); repeat the flag to compare budgets",
        default_text="the model's eval loop counts",
    )
    batch_size: int = option(16, "held-out windows per forward pass")
    max_batches: int | None = option(None, "evaluate at most this many batches", default_text="all")
    seed: int = option(0, "seed of the initial loop-state noise")
    device: str = option("auto", DEVICE_HELP)
    threads: int = option(0, THREADS_HELP)
    progress: bool = option(True, "show a progress bar")
    json: str | None = option(None, "also write the results to this JSON file")
    warm_start: bool = option(False, "start each group's loop from the state it handed on at the previous "
                                     "position (token by token; Geiping et al.'s continuous compute)")
    exit_profile: str | None = option(
        None, "evaluate with per-token exits from this exit profile (rdepth calibrate) instead of --loops",
        default_text="none")
    force_profile: bool = option(False, PROFILE_FORCE_HELP)
    baseline: list[str] | None = option(
        None, "task data: another checkpoint or run (e.g. a no-loop or deeper plain model trained on the same "
        "data) evaluated at its own loop counts in the same table; repeatable", default_text="none")

    def __post_init__(self) -> None:
        check_positive("eval", self, ("batch_size", "max_batches"))
        if not isinstance(self.seed, int) or self.seed < 0:
            raise RdepthError(f"eval: seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.threads, int) or self.threads < 0:
            raise RdepthError(f"eval: threads must be >= 0, got {self.threads!r}")
        check_device_name("eval", self.device)
        if self.exit_profile is not None and self.loops:
            raise RdepthError("eval: give --loops or --exit-profile, not both")
        check_force_profile("eval", self)

    @property
    def max_windows(self) -> int | None:
        return None if self.max_batches is None else self.max_batches * self.batch_size


@dataclass
class GenerateConfig:
    """One ``rdepth generate`` run: text from a prompt with a key/value cache."""

    checkpoint: str = option("", "checkpoint folder, or a run folder (its latest checkpoint)", required=True)
    prompt: str = option("The", "text to continue")
    max_new_tokens: int = option(60, "tokens to generate (fewer if the model's block size is reached)", bounds="[1, inf)")
    temperature: float = option(0.8, "sampling temperature; 0 = greedy", bounds="[0, inf)")
    top_k: int | None = option(40, "sample only from the k most likely tokens", default_text="no limit", bounds="[1, inf)")
    loops: str | None = option(None, "loop counts N or N,N,... per group", default_text="the model's eval loop counts")
    samples: int = option(1, f"independent continuations (at most {MAX_SAMPLES})", bounds=f"[1, {MAX_SAMPLES}]")
    seed: int = option(0, "seed of the initial loop-state noise and of sampling", bounds=f"[0, {2**62})")
    speculate: int | None = option(
        None, "loop-speculative decoding: draft K tokens at --draft-loops loop steps per group, verify them in one "
        "pass at --loops (or --exit / --exit-profile's rule): greedy gives plain decoding's tokens, sampling its "
        "distribution", default_text="off", bounds="[1, inf)", metavar="K")
    draft_loops: str | None = option(
        None, "with --speculate: the drafts' loop steps D per group (N or N,N,...), below the verifying budget; "
        "under an exit rule, the rule capped at D", default_text="1", metavar="D")
    speculate_at_most: int = option(
        1, "with --speculate and --prompts-file: the engine speculates for a greedy request only while at most M "
        "requests are in flight (1: a request alone); plain ticks above", bounds="[1, 4096]", metavar="M")
    show_special: bool = option(False, "show special tokens such as <|endoftext|> in the output")
    warm_start: bool = option(False, "start each group's loop from the state it handed on at the previous token "
                                     "(Geiping et al.'s continuous compute; the prompt runs token by token)")
    exit_profile: str | None = option(
        None, "per-token exits from this exit profile (rdepth calibrate) instead of --loops", default_text="none")
    force_profile: bool = option(False, PROFILE_FORCE_HELP)
    exit: str | None = option(
        None, "per-token exits by this exit policy (a name as in rdepth sweep --policies) at --tau, in every "
        "group, instead of --loops", default_text="none", metavar="POLICY")
    tau: float | None = option(
        None, "with --exit: the policy's threshold (argmax_stable: its patience)", default_text="the policy's own; "
        "required for policies with a threshold", bounds="(0, inf)")
    k_max: tuple[int, ...] | None = option(
        None, "with --exit: loop-step cap N (every group) or N,N,... (per group)",
        default_text="twice the model's eval loops", bounds=f"[1, {MAX_LOOPS}]")
    exit_options: str | None = option(
        None, "with --exit: the policy's options as KEY=VALUE,... (e.g. kl: direction=old_new,prior=uniform, "
        "Geiping et al.'s kl)", default_text="the policy's own", metavar="KEY=VALUE,...")
    prompts_file: str | None = option(
        None, "a text file of prompts, one per line (blank lines skipped): every prompt decoded through the "
        "continuous depth batching engine, --batch-size at a time, each row at its own loop step (instead "
        "of --prompt)", default_text="none (one --prompt)", metavar="FILE")
    batch_size: int = option(8, "with --prompts-file: requests decoded together (the engine's slots)", bounds="[1, 4096]")
    kv_layout: str = option("exact", "with --prompts-file: the engine's key/value layout: exact (the trained "
                            "rule) or shared (one slot per looped layer: memory flat in the loop budget, "
                            "outputs change)")
    tick: str = option("eager", "with --prompts-file: the engine's tick: eager (what each row needs), token (eager, "
                       "every loop to its exit within the tick), static or compiled (every slot through one device "
                       "function a tick, compiled; any looped groups), graph or compiled-graph (that function "
                       "replayed as a CUDA graph: a card only): docs/engine.md")
    ahead: int = option(1, "with --tick static or compiled: ticks one call runs before the host reads the device (the "
                        "device enters every row's next token itself: while every request decodes greedily and the "
                        "rule keeps no per-row memory; 4 is a good start)", bounds="[1, 64]")
    autocast: str = option("none", "autocast dtype of the forward passes: none, bf16 or fp16")
    device: str = option("auto", DEVICE_HELP)
    threads: int = option(0, THREADS_HELP, bounds="[0, inf)")

    def policy_options(self) -> dict:
        """``--exit-options`` as a dict, each value an int, a float or text; the learned rule's gate is the run's."""
        return policy_options("generate", self.exit, self.exit_options, self.checkpoint)

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise RdepthError(f"generate: prompt must be text, got {self.prompt!r}")
        check_utf8("generate: prompt", self.prompt)
        if self.k_max is not None:
            self.k_max = tuple(self.k_max)
        check_fields(self, "generate")
        if self.exit is not None and (not isinstance(self.exit, str) or not self.exit):
            raise RdepthError(f"generate: exit must be an exit policy name, got {self.exit!r}")
        check_autocast_name("generate", self.autocast)
        self._check_modes()
        check_device_name("generate", self.device)

    def _check_modes(self) -> None:
        """The ways of choosing the loops (--loops, --exit, --exit-profile) exclude each other."""
        if self.exit_profile is not None and self.exit is not None:
            raise RdepthError("generate: give --exit or --exit-profile, not both")
        check_force_profile("generate", self)
        if self.exit is None and (self.tau is not None or self.k_max is not None or self.exit_options is not None):
            raise RdepthError("generate: --tau, --k-max and --exit-options set the policy of --exit; give --exit too")
        if self.exit is not None and self.loops:
            raise RdepthError("generate: --exit replaces --loops; give one")
        if self.exit_profile is not None and self.loops:
            raise RdepthError("generate: --exit-profile replaces --loops; give one")
        self._check_decoding()

    def _check_decoding(self) -> None:
        """Speculative drafts, the engine (--prompts-file) and its key/value layout: what each combines with."""
        if self.speculate is not None and self.prompts_file is not None and (
                self.tick != "eager" or self.kv_layout != "exact"):
            raise RdepthError("generate: --speculate through the engine (--prompts-file) runs on --tick eager with "
                              "--kv-layout exact")
        if self.speculate_at_most != 1 and (self.speculate is None or self.prompts_file is None):
            raise RdepthError("generate: --speculate-at-most is the engine's (with --prompts-file and --speculate)")
        if self.draft_loops is not None and self.speculate is None:
            raise RdepthError("generate: --draft-loops sets the drafts of --speculate K; give --speculate too")
        if self.speculate is not None and self.warm_start:
            raise RdepthError("generate: --warm-start with --speculate is not supported (the verifier would need "
                              "the drafts' handed-on states)")
        if self.kv_layout not in ("exact", "shared"):
            raise RdepthError(f"generate: --kv-layout must be exact or shared, got {self.kv_layout!r}")
        if self.kv_layout != "exact" and self.prompts_file is None:
            raise RdepthError("generate: --kv-layout is the engine's (with --prompts-file)")
        ticks = ("eager", "token", "static", "compiled", "graph", "compiled-graph")
        if self.tick not in ticks:
            raise RdepthError(f"generate: --tick must be one of {', '.join(ticks)}, got {self.tick!r}")
        if self.ahead != 1 and self.tick in ("eager", "token"):
            raise RdepthError("generate: --ahead runs several ticks a call of the static or compiled tick; give "
                              "--tick static or compiled")
        if self.tick != "eager" and self.prompts_file is None:
            raise RdepthError("generate: --tick is the engine's (with --prompts-file)")
