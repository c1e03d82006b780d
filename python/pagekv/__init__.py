"""PageKV: a paged KV-cache engine for LLM inference.

The C++ library's Python module: the planner (:func:`plan`), the paged block
pool with its block tables (:class:`KvCache`) and zero-copy views of its
blocks (NumPy and DLPack), prefix caching (:class:`PrefixCache`), the KV
tiers (:func:`HostStore`, :func:`DiskStore`, :func:`RedisStore`,
:class:`Tiers`), and the engine over a model file (:class:`Engine`,
:func:`generate`). Errors are :class:`Error` subclasses that also derive from
the matching built-in (``InvalidArgumentError`` is a ``ValueError``,
``ResourceExhaustedError`` a ``MemoryError``, ...). docs/PYTHON.md has the
whole API.
"""

from ._pagekv import (  # noqa: F401
    BlockMeta,
    BlockStore,
    DataLossError,
    DiskStore,
    Engine,
    Error,
    FailedPreconditionError,
    HostStore,
    InternalError,
    InvalidArgumentError,
    IoError,
    KvCache,
    NotFoundError,
    OutOfRangeError,
    PrefixCache,
    RedisStore,
    ResourceExhaustedError,
    Tiers,
    TokenStream,
    UnavailableError,
    UnimplementedError,
    __version__,
    generate,
    plan,
    presets,
)

__all__ = [
    "BlockMeta",
    "BlockStore",
    "DataLossError",
    "DiskStore",
    "Engine",
    "Error",
    "FailedPreconditionError",
    "HostStore",
    "InternalError",
    "InvalidArgumentError",
    "IoError",
    "KvCache",
    "NotFoundError",
    "OutOfRangeError",
    "PrefixCache",
    "RedisStore",
    "ResourceExhaustedError",
    "Tiers",
    "TokenStream",
    "UnavailableError",
    "UnimplementedError",
    "__version__",
    "generate",
    "plan",
    "presets",
]
