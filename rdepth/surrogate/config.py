"""Settings of ``rdepth surrogate`` and of surrogate fitting (torch-free, so ``rdepth --help`` stays fast).

Every field carries its command-line help (:func:`rdepth.fields.option`); the CLI
generates its flags from these dataclasses. The choice tables here are the names
of the registries in :mod:`.similarity`, :mod:`.phases` and :mod:`.model` (a test
keeps them equal).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from rdepth.errors import RdepthError
from rdepth.fields import option
from rdepth.threads import THREADS_HELP

SIMILARITY_NAMES = ("pooled_cosine", "token_cosine", "cka")  # rdepth.surrogate.measure.similarity.SIMILARITIES
PHASE_METHOD_NAMES = ("dp", "maxcut")  # rdepth.surrogate.phases.PHASE_METHODS
INIT_CHOICES = ("first", "middle", "random")
# How a fit uses the teacher's states as inputs (rdepth.surrogate.fit.stage_loss):
# "anneal": per step and sequence, replace the block's input by the teacher's state with an
#   annealed probability, in both stages (scheduled sampling);
# "mixed": the reference code's scheme (KempnerInstitute/raptor, raptor/trainer.py): stage 1
#   loss = r * one-step loss (every input the teacher's) + (1 - r) * free-rollout loss, r annealed;
#   stage 2 free rollout only.
FORCING_CHOICES = ("anneal", "mixed")
PROBE_CHOICES = ("none", "wordnet")  # rdepth.surrogate.text_probe
PROBE_MIN_GLOSSES = 2  # a probe needs at least two glosses to train and to score


@dataclass(frozen=True)
class FitConfig:
    """How a Raptor surrogate is fitted to its teacher's layer states (two stages, annealed forcing)."""

    steps_block: int = option(100, "stage 1 (block by block) steps per block")
    steps_joint: int = option(200, "stage 2 (all blocks jointly) steps")
    lr: float = option(3e-4, "AdamW learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    grad_clip: float = option(1.0, "gradient norm clip")
    forcing: str = option("anneal", "teacher forcing: anneal (each block input replaced by the teacher's state "
                          "with an annealed probability, both stages) or mixed (the reference code's: stage 1 loss "
                          "= r x one-step + (1 - r) x free rollout with r annealed, stage 2 free rollout only)")
    force_start: float = option(1.0, "forcing at the start of each stage (anneal: probability; mixed: one-step "
                                "weight r, stage 1 only)")
    force_end: float = option(0.0, "forcing after annealing (0 = free rollout)")
    anneal_fraction: float = option(0.6, "fraction of each stage over which forcing anneals (the reference "
                                    "code anneals over 0.25 of its steps)")
    input_noise: float = option(0.0, "std of Gaussian noise added to every block input while fitting (the "
                                "reference code's sigma; its runs use 0)")
    first_token_weight: float = option(1.0, "loss weight of the first ([CLS]) token relative to the others")
    log_every: int = option(10, "steps between metrics.jsonl records")
    seed: int = option(0, "seed of the fitting's random draws (the surrogate command sets it to its --seed)",
                       cli=False)

    def __post_init__(self) -> None:
        for name in ("steps_block", "steps_joint"):
            if getattr(self, name) < 0:
                raise RdepthError(f"fit: {name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise RdepthError(f"fit: lr must be > 0, got {self.lr}")
        if self.forcing not in FORCING_CHOICES:
            raise RdepthError(f"fit: forcing must be one of {FORCING_CHOICES}, got {self.forcing!r}")
        if not self.input_noise >= 0:
            raise RdepthError(f"fit: input_noise must be >= 0, got {self.input_noise}")
        for name in ("force_start", "force_end", "anneal_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise RdepthError(f"fit: {name} must lie in [0, 1], got {getattr(self, name)}")
        if self.first_token_weight < 0 or self.weight_decay < 0 or self.grad_clip <= 0:
            raise RdepthError("fit: first_token_weight and weight_decay must be >= 0 and grad_clip > 0")
        if self.log_every < 1:
            raise RdepthError(f"fit: log_every must be >= 1, got {self.log_every}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class VisionConfig:
    """The vision teacher's training and the image sets of a vision run (``--teacher vit-fmnist``)."""

    vit_epochs: int = option(3, "epochs of the ViT teacher's training on all 60,000 Fashion-MNIST training "
                             "images (a teacher already saved in OUT/teacher with the same settings is reused)")
    images_fit: int = option(4096, "training images whose layer states the surrogates fit")
    images_probe: int = option(10000, "training images the linear probes are trained on")
    images_test: int = option(10000, "test images the probes are scored on")
    images_dynamics: int = option(2000, "test images of the fidelity and dynamics measurements")
    image_batch: int = option(128, "images per batch (state banks and fitting)")
    compare_k: tuple[int, ...] = option((1, 2, 3), "block counts of the retention table (the surrogate of --k "
                                        "is saved and its dynamics drawn; --k is added if missing)")
    perturbation: float = option(0.05, "self-correction test: perturbation norm relative to each token's state")
    null_seeds: int = option(3, "seeds of the null controls of the dynamics findings (the teacher against a "
                             "random-init ViT of its shape and its own layers in a shuffled order, each on a seeded "
                             "half of the dynamics images); verdicts need >= 3; 0 skips them")
    data_dir: str = option("/usr/share/datasets/fashion-mnist", "folder of the Fashion-MNIST idx .gz files "
                           "(Debian package dataset-fashion-mnist)")

    def __post_init__(self) -> None:
        for name in ("vit_epochs", "images_fit", "images_probe", "images_test", "images_dynamics", "image_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RdepthError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.null_seeds, int) or isinstance(self.null_seeds, bool) or self.null_seeds < 0:
            raise RdepthError(f"null_seeds must be an integer >= 0, got {self.null_seeds!r}")
        if not self.compare_k or any(not isinstance(k, int) or k < 1 for k in self.compare_k):
            raise RdepthError(f"compare_k must list block counts >= 1, got {self.compare_k!r}")
        if not 0.0 < self.perturbation < 1.0:
            raise RdepthError(f"perturbation must lie in (0, 1), got {self.perturbation}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SurrogateRunConfig:
    """Everything one ``rdepth surrogate`` run needs; every CLI flag is a field (fitting: ``fit``)."""

    teacher: str = option("minilm-l6", "packaged teacher (minilm-l6, minilm-l3; vision: vit-fmnist, "
                          "vit-fmnist-sd, trained on Fashion-MNIST in OUT/teacher or reused from there), a Hugging "
                          "Face checkpoint folder (BERT or GPT-2), an rdepth run trained with --groups '' or a "
                          "saved ViT teacher folder (OUT/teacher of a vision run)")
    k: int = option(2, "number of distinct recurrent blocks (phases)")
    out: str = option("runs/surrogate", "run folder (report, numbers, surrogate checkpoint)")
    corpus: str = option("wiki", "text for fitting and evaluation: a corpus name (wiki) or a .txt/.jsonl "
                         "file or folder")
    n_fit: int = option(1024, "sentences to fit on")
    n_eval: int = option(256, "held-out sentences to evaluate on")
    max_length: int = option(64, "tokens per sentence at most")
    batch_size: int = option(32, "sentences per batch")
    similarity: str = option("pooled_cosine", f"layer similarity used to choose phases: {', '.join(SIMILARITY_NAMES)}")
    phase_method: str = option("dp", "phase finder: dp (exact dynamic programme) or maxcut (recursive max-cut)")
    init: str = option("first", "block initialisation: first or middle layer of its phase, or random")
    threads: int = option(0, THREADS_HELP)
    seed: int = option(0, "random seed of the sentence sample, the initialisation and the fitting (sets fit.seed)")
    probe: str = option("none", "downstream probe of a text teacher: none, or wordnet (linear probes for the 45 "
                        "lexicographer classes of WordNet glosses; Debian package wordnet-base, fetched with apt-get "
                        "download into the rdepth cache unless --wordnet-dir is given)")
    probe_k: tuple[int, ...] = option((1, 2, 3), "block counts of the downstream probe table (--probe; --k is "
                                      "added if missing)")
    probe_train: int = option(2000, "glosses the probes are trained on (--probe)")
    probe_test: int = option(1000, "held-out glosses the probes are scored on, disjoint from the training ones")
    wordnet_dir: str = option("", "folder holding WordNet's data.noun, data.verb, data.adj and data.adv "
                              "(default: read from the wordnet-base package in the rdepth cache)")
    fit: FitConfig = dataclasses.field(default_factory=FitConfig, metadata={"cli": False})
    vision: VisionConfig = dataclasses.field(default_factory=VisionConfig, metadata={"cli": False})

    def __post_init__(self) -> None:
        for name in ("k", "n_fit", "n_eval", "max_length", "batch_size", "threads", "seed", "probe_train",
                     "probe_test"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise RdepthError(f"{name} must be an integer, got {value!r}")
        if self.k < 1:
            raise RdepthError(f"k must be >= 1, got {self.k}")
        for name in ("n_fit", "n_eval", "max_length", "batch_size"):
            if getattr(self, name) < 1:
                raise RdepthError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_eval < 3:
            raise RdepthError(f"n_eval must be >= 3 (neighbour retrieval), got {self.n_eval}")
        _check_choices(self)
        if self.threads < 0:
            raise RdepthError(f"threads must be >= 0, got {self.threads}")
        if not self.probe_k or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in self.probe_k):
            raise RdepthError(f"probe_k must list block counts >= 1, got {self.probe_k!r}")
        for name in ("probe_train", "probe_test"):
            if getattr(self, name) < PROBE_MIN_GLOSSES:
                raise RdepthError(f"{name} must be >= {PROBE_MIN_GLOSSES}, got {getattr(self, name)}")
        if self.fit.seed != self.seed:  # one seed per run, as the command always had
            object.__setattr__(self, "fit", dataclasses.replace(self.fit, seed=self.seed))

    def to_dict(self) -> dict:
        return asdict(self)


def _check_choices(config: SurrogateRunConfig) -> None:
    """The named choices of a surrogate run: similarity, phase method, initialisation and probe."""
    if config.similarity not in SIMILARITY_NAMES:
        raise RdepthError(f"similarity must be one of {sorted(SIMILARITY_NAMES)}, got {config.similarity!r}")
    if config.phase_method not in PHASE_METHOD_NAMES:
        raise RdepthError(f"phase_method must be one of {sorted(PHASE_METHOD_NAMES)}, got {config.phase_method!r}")
    if config.init not in INIT_CHOICES:
        raise RdepthError(f"init must be one of {INIT_CHOICES}, got {config.init!r}")
    if config.probe not in PROBE_CHOICES:
        raise RdepthError(f"probe must be one of {PROBE_CHOICES}, got {config.probe!r}")
