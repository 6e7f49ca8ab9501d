"""The serving engine: one loaded pair, its slots, its planners' board, its prompt cache and the
scheduling of requests (:mod:`specdec.serving.engine`). ``specdec serve``, :func:`specdec.generate_many`
and a cluster's replica are its callers."""

from specdec.serving.engine import (
    Chunk, Engine, EngineStatus, Finished, Handle, ModelThread, Observer, Work,
)
from specdec.serving.errors import (
    BadInput, Cancelled, ConstraintFailed, EngineError, Failed, MethodRefused, ModelFailed, QueueFull, ShuttingDown,
    TimedOut, Unavailable,
)

__all__ = ["BadInput", "Cancelled", "Chunk", "ConstraintFailed", "Engine", "EngineError", "EngineStatus", "Failed",
           "Finished", "Handle", "MethodRefused", "ModelFailed", "ModelThread", "Observer", "QueueFull",
           "ShuttingDown", "TimedOut", "Unavailable", "Work"]
