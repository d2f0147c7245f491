"""Errors a user can act on. The CLI prints them as one line and exits non-zero."""


class PolytrainError(Exception):
    """Base class: the message alone tells the user what went wrong and how to fix it."""


class ConfigError(PolytrainError, ValueError):
    """A config value that cannot work; the message names the key and the fix."""


class CheckpointError(PolytrainError):
    """A checkpoint that is missing, incomplete, foreign or unreadable."""


class TrainingDiverged(PolytrainError):
    """The loss became NaN or infinite."""
