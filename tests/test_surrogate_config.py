"""``rdepth surrogate``'s settings: flags generated from the config dataclasses, one seed per run."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from rdepth.cli.options import add_dataclass_flags, build
from rdepth.errors import RdepthError
from rdepth.surrogate.config import INIT_CHOICES, PHASE_METHOD_NAMES, SIMILARITY_NAMES, FitConfig, SurrogateRunConfig


def _parse(*argv: str) -> SurrogateRunConfig:
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, SurrogateRunConfig)
    add_dataclass_flags(parser, FitConfig)
    args = parser.parse_args(list(argv))
    return build(SurrogateRunConfig, {"fit": build(FitConfig, {}, args)}, args)


def test_flags_map_onto_both_configs_with_the_dataclass_defaults():
    config = _parse("--k", "3", "--steps-joint", "7", "--first-token-weight", "0.5", "--seed", "4")
    assert config.k == 3 and config.fit.steps_joint == 7 and config.fit.first_token_weight == 0.5
    assert config.fit.seed == 4 == config.seed  # the run's seed seeds the fitting, as before
    defaults = _parse()
    assert defaults == SurrogateRunConfig() and defaults.fit == FitConfig()
    for field in dataclasses.fields(SurrogateRunConfig) + dataclasses.fields(FitConfig):
        assert field.metadata.get("help") or not field.metadata.get("cli", True), field.name


def test_bad_values_fail_at_parse_time():
    with pytest.raises(RdepthError, match="k must be >= 1"):
        _parse("--k", "0")
    with pytest.raises(RdepthError, match="similarity"):
        _parse("--similarity", "bogus")
    with pytest.raises(RdepthError, match="force_end"):
        _parse("--force-end", "1.5")


def test_choice_names_are_the_registries():
    from rdepth.surrogate import model, phases
    from rdepth.surrogate.measure import similarity

    assert set(SIMILARITY_NAMES) == set(similarity.SIMILARITIES)
    assert set(PHASE_METHOD_NAMES) == set(phases.PHASE_METHODS)
    assert model.INIT_CHOICES is INIT_CHOICES
