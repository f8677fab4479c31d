"""dlbridge: zero-copy DLPack exchange of CPU, CUDA and Metal memory.

>>> import numpy as np, dlbridge
>>> x = np.arange(6, dtype=np.float32).reshape(2, 3)
>>> a = dlbridge.from_dlpack(x)          # shares x's memory
>>> a.data_ptr == x.ctypes.data
True
>>> np.from_dlpack(a[:, 1]).tolist()     # views export without copies too
[1.0, 4.0]
"""

from ._dlbridge import (
    Array,
    Device,
    DType,
    __version__,
    arange,
    asarray,
    build_info,
    empty,
    empty_cache,
    empty_like,
    from_dlpack,
    full,
    full_like,
    memory_stats,
    ones,
    ones_like,
    open_shared,
    reset_peak_memory,
    set_cache_limit,
    set_memory_limit,
    storage_mode,
    synchronize,
    zeros,
    zeros_like,
)
# The element types (`dlbridge.float32`, ...): the extension's `__all__` names them, from its one
# list of them, and starts this module's `__all__` (type checkers, which cannot run that list,
# read the same names from the stub through this import of `__all__`; the copy leaves the
# extension's own list as it is).
from ._dlbridge import *  # noqa: F403
from ._dlbridge import __all__ as __all__

__all__ = list(__all__)
# `dlbridge.bool` is the element type, as `numpy.bool` is; like NumPy, `from dlbridge import *`
# leaves it out (it would shadow the built-in `bool`). The `as` form re-exports it for type
# checkers.
from ._dlbridge import bool as bool
from . import cuda, metal, ops
from ._dlbridge import Kernel
from .backend import (
    Backend,
    BackendUnavailableError,
    KernelExecutionResult,
    get_elementwise_kernel,
    get_matrix_multiply_kernel,
    get_vector_add_kernel,
)
from .unified import UnifiedBuffer
from . import safetensors
from .safetensors import load_file, safe_open, save_file, stream_file
from . import npy
from .npy import load_npy, load_npz
from . import shard
from ._load import IncompatibleKeys, load_into

__all__ += [
    "Array",
    "Backend",
    "BackendUnavailableError",
    "DType",
    "Kernel",
    "KernelExecutionResult",
    "UnifiedBuffer",
    "get_elementwise_kernel",
    "get_matrix_multiply_kernel",
    "get_vector_add_kernel",
    "ops",
    "Device",
    "__version__",
    "arange",
    "asarray",
    "build_info",
    "cuda",
    "metal",
    "synchronize",
    "empty",
    "from_dlpack",
    "full",
    "full_like",
    "ones",
    "ones_like",
    "empty_like",
    "zeros",
    "zeros_like",
    "memory_stats",
    "open_shared",
    "empty_cache",
    "reset_peak_memory",
    "set_memory_limit",
    "set_cache_limit",
    "storage_mode",
    "load_file",
    "safe_open",
    "save_file",
    "stream_file",
    "safetensors",
    "load_npy",
    "load_npz",
    "npy",
    "IncompatibleKeys",
    "load_into",
    "shard",
]
