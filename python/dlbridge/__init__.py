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
    bfloat16,
    build_info,
    complex64,
    complex128,
    empty,
    empty_cache,
    float4_e2m1fn,
    float6_e2m3fn,
    float6_e3m2fn,
    float8_e3m4,
    float8_e4m3,
    float8_e4m3b11fnuz,
    float8_e4m3fn,
    float8_e4m3fnuz,
    float8_e5m2,
    float8_e5m2fnuz,
    float8_e8m0fnu,
    float16,
    float32,
    float64,
    from_dlpack,
    full,
    int8,
    int16,
    int32,
    int64,
    memory_stats,
    reset_peak_memory,
    set_cache_limit,
    set_memory_limit,
    storage_mode,
    synchronize,
    uint8,
    uint16,
    uint32,
    uint64,
    zeros,
)
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

__all__ = [
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
    "zeros",
    "memory_stats",
    "empty_cache",
    "reset_peak_memory",
    "set_memory_limit",
    "set_cache_limit",
    "storage_mode",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float4_e2m1fn",
]
