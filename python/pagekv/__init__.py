"""PageKV: a paged KV-cache engine for LLM inference.

The C++ library's Python module: the planner (:func:`plan`), the paged block
pool with its block tables (:class:`KvCache`) and zero-copy views of its
blocks (NumPy and DLPack). Errors are :class:`Error` subclasses that also
derive from the matching built-in (``InvalidArgumentError`` is a
``ValueError``, ``ResourceExhaustedError`` a ``MemoryError``, ...).
docs/PYTHON.md has the whole API.
"""

from ._pagekv import (  # noqa: F401
    DataLossError,
    Error,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    IoError,
    KvCache,
    PrefixCache,
    NotFoundError,
    OutOfRangeError,
    ResourceExhaustedError,
    UnavailableError,
    UnimplementedError,
    __version__,
    plan,
    presets,
)

__all__ = [
    "DataLossError",
    "Error",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "IoError",
    "KvCache",
    "PrefixCache",
    "NotFoundError",
    "OutOfRangeError",
    "ResourceExhaustedError",
    "UnavailableError",
    "UnimplementedError",
    "__version__",
    "plan",
    "presets",
]
