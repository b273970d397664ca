"""The scoring constants an operator can set have one source: the config schema."""

import dataclasses

import pytest

from dtrain.config import Config, ValidatorConfig
from dtrain.validation.scoring import ScoringConfig

# ScoringConfig field -> [validator] setting
SETTINGS = {"w_gradient": "weight_gradient", "w_steps": "weight_steps", "w_bandwidth": "weight_bandwidth",
            "w_participation": "weight_allreduce", "ema_alpha": "ema_alpha"}


def test_library_defaults_are_the_schema_defaults():
    library, schema = ScoringConfig(), ValidatorConfig()
    for ours, theirs in SETTINGS.items():
        assert getattr(library, ours) == getattr(schema, theirs), ours


def test_from_validator_takes_every_operator_setting():
    cfg = Config()
    changed = dataclasses.replace(cfg.validator, weight_gradient=0.5, weight_steps=0.1, weight_bandwidth=0.3,
                                  weight_allreduce=0.1, ema_alpha=0.25)
    scoring = ScoringConfig.from_validator(changed)
    for ours, theirs in SETTINGS.items():
        assert getattr(scoring, ours) == getattr(changed, theirs), ours


def test_from_validator_still_validates():
    bad = dataclasses.replace(ValidatorConfig(), ema_alpha=0.0)
    with pytest.raises(ValueError, match="ema_alpha"):
        ScoringConfig.from_validator(bad)
