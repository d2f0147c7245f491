"""Errors a user can act on. The CLI prints them as one line and exits non-zero."""


class PolytrainError(Exception):
    """Base class: the message alone tells the user what went wrong and how to fix it."""


class ConfigError(PolytrainError, ValueError):
    """A config value that cannot work; the message names the key and the fix."""


class CheckpointError(PolytrainError):
    """A checkpoint that is missing, incomplete, foreign or unreadable."""


class TrainingDiverged(PolytrainError):
    """The loss became NaN or infinite."""


class AcceleratorUnavailable(PolytrainError, RuntimeError):
    """The accelerator asked for (POLYTRAIN_ACCELERATOR) cannot be used in this process."""


class CompatError(PolytrainError, RuntimeError):
    """A CUDA call that polytrain's CUDA shim cannot carry out on the active accelerator; the
    message names the call and why."""


class CudaExtensionImportError(CompatError, ImportError):
    """A compiled CUDA extension imported under the shim. An ImportError, so code that falls
    back to pure PyTorch when `import fused_kernels` fails keeps doing so."""
