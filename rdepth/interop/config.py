"""Settings of ``rdepth export``, ``rdepth import-hf`` and ``rdepth retrofit`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from rdepth.errors import RdepthError
from rdepth.fields import option
from rdepth.run.config import PROFILE_FORCE_HELP, check_force_profile


@dataclass
class ExportConfig:
    """One ``rdepth export``: a run's checkpoint as a Hugging Face folder."""

    checkpoint: str = option("", "checkpoint folder, or a run folder (its latest checkpoint)", required=True)
    out: str = option("", "new folder to write (must not exist, or be empty)", required=True)
    loops: str | None = option(None, "default loop counts of the exported model: N or N,N,... per group",
                               default_text="the model's eval loop counts")
    state_seed: int = option(0, "seed of the exported model's initial loop state (overridable per call)")
    exit_policy: str | None = option(None, "default per-token exit rule of the exported model (a name from "
                                     "rdepth sweep, e.g. acceleration)", default_text="none: fixed loop counts")
    exit_tau: float | None = option(None, "threshold of --exit-policy", default_text="none")
    exit_k_max: str = option("32", "loop cap of --exit-policy: N or N,N,... per group")
    exit_profile: str | None = option(None, "default exit rule from an exit profile (rdepth calibrate): its "
                                      "policy, one threshold per group and its caps", default_text="none")
    force_profile: bool = option(False, PROFILE_FORCE_HELP)
    license: str = option("other", "licence identifier in the model card's front matter (a Hub licence id, "
                          "e.g. apache-2.0; the weights' terms follow from the training data)")

    def __post_init__(self) -> None:
        if not isinstance(self.state_seed, int) or not 0 <= self.state_seed < 2**62:
            raise RdepthError(f"export: state_seed must be in 0..2^62, got {self.state_seed!r}")
        if self.exit_tau is not None and self.exit_policy is None:
            raise RdepthError("export: --exit-tau needs --exit-policy")
        if self.exit_profile is not None and self.exit_policy is not None:
            raise RdepthError("export: give --exit-policy or --exit-profile, not both")
        check_force_profile("export", self)
        if not self.license or any(ch.isspace() or ch in ":#\"'" for ch in self.license):
            raise RdepthError(f"export: --license must be one identifier such as apache-2.0, got {self.license!r}")

    def exit_spec(self, n_groups: int | None = None, checkpoint: str | None = None) -> dict | None:
        """The ``exit_policy`` of the exported config.json (None without --exit-policy or --exit-profile).
        With ``checkpoint``, a profile must have been calibrated on its weights (unless --force-profile),
        as for every command that takes a profile; with ``n_groups``, it must have one value per group."""
        if self.exit_profile is not None:
            from rdepth.exitrun.profile import load_profile

            profile = load_profile(self.exit_profile, n_groups, checkpoint, self.force_profile)
            if profile["parameter"] != "tau":
                raise RdepthError(f"export: --exit-profile needs a policy with a tau; {profile['policy']} has "
                                  f"{profile['parameter']}")
            return {"name": profile["policy"], "tau": profile["values"], "k_max": profile["k_max"],
                    **profile.get("options", {})}
        if self.exit_policy is None:
            return None
        try:
            caps = [int(k) for k in str(self.exit_k_max).split(",") if k.strip()]
        except ValueError:
            raise RdepthError(f"export: --exit-k-max expects N or N,N,..., got {self.exit_k_max!r}") from None
        spec = {"name": self.exit_policy, "k_max": caps[0] if len(caps) == 1 else caps}
        if self.exit_tau is not None:
            spec["tau"] = self.exit_tau
        return spec


class ImportFormat(NamedTuple):
    """A format ``rdepth import-hf`` reads, as its --help, the README's command table and its refusal of any
    other name it."""

    short: str  # in the one-line help and the README's command table
    name: str  # in the description and the refusal
    note: str  # in the description


# model_type -> the format (rdepth.interop.hf_import.IMPORTERS has an importer for each)
IMPORT_FORMATS: dict[str, ImportFormat] = {
    "rdepth": ImportFormat("rdepth exports", "folders written by rdepth export", "the round trip is exact"),
    "gpt2": ImportFormat("GPT-2", "GPT-2 folders", "a plain model of gpt2 blocks, whose layers rdepth retrofit loops"),
    "huginn_raven": ImportFormat("Huginn-0125", "Huginn-0125 (raven) folders", "e.g. tomg-group-umd/huginn-0125"),
    "ouro": ImportFormat("Ouro", "Ouro (LoopLM) folders", "e.g. ByteDance/Ouro-1.4B and Ouro-2.6B"),
}


@dataclass
class ImportConfig:
    """One ``rdepth import-hf``: a Hugging Face folder as an rdepth run."""

    hf: str = option("", "Hugging Face model folder (config.json, model.safetensors or its shards and their "
                     "index, tokenizer.json)", required=True)
    out: str = option("", "new rdepth run folder to write (must not exist, or be empty)", required=True)


@dataclass
class RetrofitConfig:
    """One ``rdepth retrofit``: loop chosen layers of a plain rdepth model."""

    checkpoint: str = option("", "checkpoint or run folder of a plain model (trained with --groups '')",
                             required=True)
    groups: str = option("", "layers to loop, e.g. '2-3' or '1|2-3|4' (0-based, a-b inclusive)", required=True)
    out: str = option("", "new run folder to write (must not exist, or be empty)", required=True)
    mean_loops: float = option(4.0, "mean training loop count of the new model (for rdepth train --init-from)")
    backprop_depth: int | None = option(None, "loop steps that get gradients", default_text="the source model's")
    init_state_scale: float | None = option(None, "std scale of the random initial loop state (0: zero state)",
                                            default_text="the source model's")

    def __post_init__(self) -> None:
        if not self.groups.strip():
            raise RdepthError("retrofit: --groups must name the layers to loop, e.g. '2-3'")


@dataclass
class LmEvalConfig:
    """One ``rdepth lm-eval``: lm-eval harness tasks at one or more loop budgets."""

    checkpoint: str = option("", "checkpoint folder, or a run folder (its latest checkpoint)", required=True)
    tasks: str = option("", "lm-eval task names, comma-separated", required=True)
    include_path: str | None = option(None, "folder of extra task YAML files (local tasks, no hub needed)")
    loops: list[str] | None = option(
        None, "loop counts N (every group) or N,N,... (per group); repeat the flag to compare budgets",
        default_text="the model's eval loop counts",
    )
    limit: int | None = option(None, "examples per task", default_text="all")
    batch_size: int = option(8, "requests per forward pass")
    seed: int = option(0, "seed of the initial loop-state noise")
    device: str = option("cpu", "cpu or cuda[:N]")
    threads: int = option(0, "torch CPU threads (0: torch's default)")
    json: str | None = option(None, "also write the results to this JSON file")
    bootstrap_iters: int = option(1000, "bootstrap resamples for the standard errors of metrics that are not "
                                  "means (a mean's is sample std / sqrt(n)); 0: no standard errors")
    speculate: int | None = option(
        None, "generation tasks: loop-speculative decoding, K drafts a round at --draft-loops loop steps per group "
        "verified at each budget in one pass (the same texts as plain decoding)", default_text="off", metavar="K")
    draft_loops: str | None = option(None, "with --speculate: the drafts' loop steps D per group (N or N,N,...), "
                                           "below every budget", default_text="1", metavar="D")
    speculate_at_most: int | None = option(
        None, "with --speculate: speculate for a request only while at most M are in flight", default_text="1",
        metavar="M")

    def __post_init__(self) -> None:
        if not isinstance(self.bootstrap_iters, int) or isinstance(self.bootstrap_iters, bool) \
                or self.bootstrap_iters < 0:
            raise RdepthError(f"lm-eval: bootstrap_iters must be >= 0, got {self.bootstrap_iters!r}")
        if not [task for task in self.tasks.split(",") if task.strip()]:
            raise RdepthError("lm-eval: --tasks must name at least one task")
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 0:
            raise RdepthError(f"lm-eval: threads must be >= 0, got {self.threads!r}")
        for name in ("batch_size", "limit", "speculate", "speculate_at_most"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise RdepthError(f"lm-eval: {name} must be a positive integer, got {value!r}")
        if self.speculate is None and (self.draft_loops is not None or self.speculate_at_most is not None):
            raise RdepthError("lm-eval: --draft-loops and --speculate-at-most set the drafts of --speculate K; "
                              "give --speculate too")

    @property
    def speculation(self) -> dict:
        """The model's speculation arguments (:func:`rdepth.interop.lm_eval_model.speculation_options`)."""
        options = {"speculate": self.speculate, "draft_loops": self.draft_loops,
                   "speculate_at_most": self.speculate_at_most}
        return {name: value for name, value in options.items() if value is not None}

    @property
    def task_list(self) -> list[str]:
        return [task.strip() for task in self.tasks.split(",") if task.strip()]
