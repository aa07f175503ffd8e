"""Every error the library raises on purpose, in one place; each is exported from ``shardopt``.

A ``ValueError`` subclass when the caller's input is wrong (an argument, a checkpoint, a
state dict), a ``RuntimeError`` subclass when the state of the job is (a model changed around
the optimizer, a missing process group). Messages name the param (FQN), file or rank and
say what to do.
"""


class UsageError(ValueError, TypeError):
    """The optimizer was called the way torch.optim optimizers are, or with a wrong argument
    (also a ``TypeError``, as Python raises for a call with the wrong arguments)."""


class StateDictError(ValueError):
    """An optimizer state dict does not fit this optimizer; names the FQN and rank."""


class StateWriteError(ValueError):
    """A write to ``optimizer.state`` that could not reach the sharded state."""


class LowPrecisionStateError(ValueError):
    """An fp32 view of Adam moments stored in less than fp32 was asked for."""


class OffloadError(ValueError):
    """A call that needs the state on the device while it is offloaded, or a bad offload kind."""


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file, FQN or rank."""


class FormatError(CheckpointError):
    """A file is not a well-formed checkpoint file (the message names it)."""


class ParamMovedError(RuntimeError):
    """A trainable param left the optimizer's buffer (the model was changed after the
    optimizer took hold of its params); only rebuilding the optimizer fixes it."""


class WrappedModelError(RuntimeError):
    """The model was wrapped or copied after the optimizer was built over it."""


class GradientOrderError(RuntimeError):
    """A gradient arrived for a bucket whose reduction had already started."""


class ProcessGroupError(RuntimeError):
    """The environment names a job of several ranks but torch.distributed is not initialised."""


class LockTimeout(RuntimeError):
    """Another process held a checkpoint root's lock for longer than the lock timeout."""


__all__ = ["CheckpointError", "FormatError", "GradientOrderError", "LockTimeout",
           "LowPrecisionStateError", "OffloadError", "ParamMovedError", "ProcessGroupError",
           "StateDictError", "StateWriteError", "UsageError", "WrappedModelError"]
