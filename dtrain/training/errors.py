"""Exceptions of the training core.

Every error names what failed and what the operator can do about it. The core
never falls back silently: callers catch these and decide.
"""


class TrainingError(Exception):
    """Base class of every error raised by ``dtrain.training``."""


class ModelLoadError(TrainingError):
    """A model preset is unknown or a Hub model could not be loaded."""


class TokenizerLoadError(TrainingError):
    """The configured tokenizer could not be loaded and fallback was not allowed."""


class DataSourceError(TrainingError):
    """A dataset could not be opened or read (wrong name, unreachable Hub, missing files)."""


class CheckpointError(TrainingError):
    """A checkpoint is missing, corrupt, or does not match the model."""


class TrainerStateError(TrainingError):
    """The trainer was used out of order (e.g. step() with nothing accumulated)."""
