"""The compute-backend API: one object per device that allocates, copies, synchronizes, reports
memory, and compiles and runs kernels.

>>> import numpy as np, dlbridge
>>> be = dlbridge.Backend("cpu")
>>> a = be.copy_to_device(np.arange(4, dtype=np.float32))
>>> be.copy_to_host(dlbridge.ops.add(a, a)).tolist()
[0.0, 2.0, 4.0, 6.0]

``Backend()`` picks the best device available: CUDA, then Metal, then the CPU.

Kernels come in two forms. On CUDA and Metal, :meth:`Backend.compile_kernel` compiles source
(CUDA C through NVRTC, or MSL) and :meth:`Backend.execute_kernel` launches it on the current
stream with a grid and block, timed by device events. On every backend (and the only form on the
CPU), a Python callable is a kernel too: it receives the arguments — as NumPy views of the same
memory on the CPU, as dlbridge arrays elsewhere — and its time is measured around the call.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from . import _dlbridge, cuda, metal, ops
from ._dlbridge import Array, Device, Kernel

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "KernelExecutionResult",
    "get_elementwise_kernel",
    "get_matrix_multiply_kernel",
    "get_vector_add_kernel",
]

Dims = Union[int, Tuple[int, ...]]


class BackendUnavailableError(RuntimeError):
    """The backend asked for is not compiled in, or finds no device on this machine."""


@dataclasses.dataclass(frozen=True)
class KernelExecutionResult:
    """What :meth:`Backend.execute_kernel` reports.

    ``success`` is False when the launch or the kernel failed on the device; ``error`` then says
    why (for a CUDA fault the driver keeps for the rest of the process, it says that the process
    must be restarted). An exception a Python callable raises is not a result: it propagates to
    the caller of :meth:`Backend.execute_kernel` unchanged, with its traceback. ``execution_time_ms`` is the device time between events recorded around the
    kernel (host time for Python callables on the CPU). ``output`` is a Python callable's return
    value (None for compiled kernels).
    """

    success: bool
    execution_time_ms: float
    error: Optional[str] = None
    output: Any = None


_NAME_PATTERNS = (
    # CUDA C: __global__ void name(   (extern "C" or not)
    re.compile(r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+([A-Za-z_]\w*)\s*\("),
    # MSL: kernel void name(
    re.compile(r"\bkernel\s+void\s+([A-Za-z_]\w*)\s*\("),
)


def _entry_name(source: str) -> str:
    names = [m.group(1) for p in _NAME_PATTERNS for m in p.finditer(source)]
    if len(names) != 1:
        found = ", ".join(names) if names else "none"
        raise ValueError(
            f"name the kernel's entry point: the source defines {len(names)} kernels ({found})"
        )
    return names[0]


def _dims(value: Dims, what: str) -> Tuple[int, ...]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) for d in dims):
        raise TypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if any(d <= 0 for d in dims):
        raise ValueError(f"{what} {dims} must be positive in every dimension")
    return dims


class Backend:
    """One device's compute backend: ``"cpu"``, ``"cuda"`` / ``"cuda:N"`` or ``"metal"`` /
    ``"metal:N"``; with no argument the best available (CUDA, then Metal, then the CPU).

    Raises :class:`BackendUnavailableError` when the backend cannot run here.
    """

    def __init__(self, device: Optional[Union[str, Device]] = None) -> None:
        if device is None:
            if cuda.is_available():
                device = "cuda:0"
            elif metal.device_count() > 0:
                device = "metal:0"
            else:
                device = "cpu"
        dev = device if isinstance(device, Device) else Device(device)
        kind = dev.type
        if kind not in ("cpu", "cuda", "metal"):
            raise ValueError(
                f"a Backend runs on 'cpu', 'cuda[:N]' or 'metal[:N]', not {str(dev)!r}"
            )
        if kind == "cuda":
            if not cuda.is_available():
                raise BackendUnavailableError(f"CUDA backend not available: {cuda.unavailable_reason()}")
            if dev.index >= cuda.device_count():
                raise BackendUnavailableError(
                    f"cuda:{dev.index} does not exist ({cuda.device_count()} CUDA devices found)"
                )
        if kind == "metal" and dev.index >= metal.device_count():
            reason = metal.unavailable_reason() or f"{metal.device_count()} Metal devices found"
            raise BackendUnavailableError(f"Metal backend not available for metal:{dev.index}: {reason}")
        self._device = dev

    # -- what it is ---------------------------------------------------------------------------

    @property
    def device(self) -> Device:
        """The device this backend computes on."""
        return self._device

    @property
    def backend_type(self) -> str:
        """``"cpu"``, ``"cuda"`` or ``"metal"``."""
        return self._device.type

    @property
    def is_available(self) -> bool:
        """Whether the backend can run on this machine (always True for a constructed backend
        unless the device went away)."""
        kind = self.backend_type
        if kind == "cuda":
            return cuda.is_available() and self.device_id < cuda.device_count()
        if kind == "metal":
            return self.device_id < metal.device_count()
        return True

    @property
    def device_count(self) -> int:
        """How many devices of this backend's kind exist (1 for the CPU)."""
        kind = self.backend_type
        if kind == "cuda":
            return cuda.device_count()
        if kind == "metal":
            return metal.device_count()
        return 1

    @property
    def device_id(self) -> int:
        """The device's index."""
        return self._device.index

    def __repr__(self) -> str:
        return f"dlbridge.Backend({str(self._device)!r})"

    # -- memory -------------------------------------------------------------------------------

    def allocate(self, shape: Any, dtype: Any = "float32") -> Array:
        """An uninitialised array on this device, from the caching pool."""
        return _dlbridge.empty(shape, dtype, device=self._device)

    def allocate_zeros(self, shape: Any, dtype: Any = "float32") -> Array:
        """A zero-filled array on this device."""
        return _dlbridge.zeros(shape, dtype, device=self._device)

    def free(self, array: Array) -> None:
        """Returns ``array``'s memory to the pool now; using ``array`` afterwards raises
        ``ValueError``. Refused (``BufferError``) while another view or an export shares the
        memory, since freeing it then would leave them dangling."""
        if not isinstance(array, Array):
            raise TypeError(f"free() takes a dlbridge.Array, not {type(array).__name__}")
        _dlbridge._free(array)

    def copy_to_device(self, host_array: Any) -> Array:
        """A copy of ``host_array`` (NumPy, any DLPack or buffer-protocol array, or nested
        sequences) in new memory on this device."""
        return _dlbridge.asarray(host_array, device=self._device, copy=True)

    def copy_to_host(self, array: Any) -> Any:
        """A NumPy copy of ``array`` (any device)."""
        import numpy as np

        a = array if isinstance(array, Array) else _dlbridge.asarray(array)
        if a.device.type == "cpu":
            return np.array(np.from_dlpack(a), copy=True)
        return np.from_dlpack(a.to("cpu"))

    def synchronize(self) -> None:
        """Waits until this device has finished the work dlbridge (and, on CUDA, every stream)
        enqueued."""
        kind = self.backend_type
        if kind == "cuda":
            cuda.synchronize(self._device.index)
        elif kind == "metal":
            metal.synchronize(self._device.index)

    def get_memory_info(self) -> Dict[str, Optional[int]]:
        """The caching pool's figures (:func:`dlbridge.memory_stats`: the limits are None where unset); on CUDA also the device's
        ``free_bytes`` and ``total_bytes`` as the driver reports them."""
        info = dict(_dlbridge.memory_stats(self._device))
        if self.backend_type == "cuda":
            free, total = cuda.mem_get_info(self._device.index)
            info["free_bytes"], info["total_bytes"] = free, total
        return info

    def clear_cache(self) -> None:
        """Returns every cached block of this device's pool to the driver."""
        _dlbridge.empty_cache(self._device)

    # -- kernels ------------------------------------------------------------------------------

    def compile_kernel(
        self,
        source: Union[str, Callable[..., Any]],
        name: Optional[str] = None,
        options: Optional[Sequence[str]] = None,
    ) -> Union[Kernel, Callable[..., Any]]:
        """Compiles a kernel for this device (cached by source, name and options).

        CUDA: CUDA C compiled by NVRTC (``options`` are NVRTC options; the device's architecture
        is added). Metal: MSL. ``name`` is the entry point; when omitted, the one kernel the
        source defines. A compiler error raises ``RuntimeError`` carrying the compiler's log.
        A Python callable is accepted on every backend and returned as it is (the only kind of
        kernel on the CPU).
        """
        if callable(source):
            return source
        if not isinstance(source, str):
            raise TypeError(f"a kernel is source text or a Python callable, not {type(source).__name__}")
        if self.backend_type == "cpu":
            raise TypeError(
                "the CPU backend runs Python callables as kernels (they receive NumPy views of "
                "the arrays); source code compiles on CUDA and Metal"
            )
        entry = name if name is not None else _entry_name(source)
        return _dlbridge._compile_kernel(self._device, source, entry, list(options or []))

    def execute_kernel(
        self,
        kernel: Union[Kernel, Callable[..., Any]],
        grid: Dims,
        block: Dims,
        *args: Any,
        shared_mem: int = 0,
    ) -> KernelExecutionResult:
        """Runs ``kernel`` over ``grid`` blocks of ``block`` threads with ``args`` and waits for
        it.

        Arguments may be dlbridge arrays, any DLPack array (imported without a copy, so a kernel
        can work on a PyTorch tensor in place) and numbers (a Python ``int`` fills a 4- or
        8-byte integer parameter, a ``float`` a ``float`` or ``double``; NumPy scalars pass their
        exact type). Bad arguments (a zero grid, an array on another device, a freed array, the
        wrong count) raise, and so does any exception a Python callable raises (the original,
        with its traceback); a launch or kernel failure on the device is reported with
        ``success=False``.
        """
        grid, block = _dims(grid, "grid"), _dims(block, "block")
        if isinstance(kernel, Kernel):
            if kernel.device != self._device:
                raise ValueError(f"the kernel was compiled for {kernel.device}, this backend is {self._device}")
            try:
                ms = _dlbridge._launch_kernel(kernel, grid, block, args, shared_mem)
            except RuntimeError as e:
                return KernelExecutionResult(False, 0.0, str(e))
            return KernelExecutionResult(True, ms)
        if not callable(kernel):
            raise TypeError(f"a kernel is a compiled Kernel or a Python callable, not {type(kernel).__name__}")
        return self._run_callable(kernel, args)

    def _run_callable(self, fn: Callable[..., Any], args: Sequence[Any]) -> KernelExecutionResult:
        kind = self.backend_type
        if kind == "cpu":
            import numpy as np

            def view(a: Any) -> Any:
                if isinstance(a, Array) or hasattr(a, "__dlpack__"):
                    arr = a if isinstance(a, Array) else _dlbridge.from_dlpack(a)
                    if arr.device.type != "cpu":
                        raise ValueError(f"the CPU backend got an array on {arr.device}")
                    return np.from_dlpack(arr)
                return a

            views = [view(a) for a in args]
            start = time.perf_counter()
            # An exception the callable raises propagates as it is, with its traceback.
            out = fn(*views)
            return KernelExecutionResult(True, (time.perf_counter() - start) * 1e3, None, out)
        arrays = [
            _dlbridge.from_dlpack(a) if hasattr(a, "__dlpack__") and not isinstance(a, Array) else a
            for a in args
        ]
        if kind == "cuda":
            index = self._device.index
            begin = cuda.Event(index, enable_timing=True)
            end = cuda.Event(index, enable_timing=True)
            begin.record()  # the current stream, where dlbridge's kernels run
            out = fn(*arrays)  # its own exceptions propagate, with their tracebacks
            try:
                end.record()
                end.synchronize()  # a fault in the callable's GPU work surfaces here
                elapsed = float(begin.elapsed_time(end))
            except RuntimeError as e:
                return KernelExecutionResult(False, 0.0, str(e))
            return KernelExecutionResult(True, elapsed, None, out)
        start = time.perf_counter()
        out = fn(*arrays)  # its own exceptions propagate, with their tracebacks
        try:
            self.synchronize()
        except RuntimeError as e:  # a fault in the callable's GPU work
            return KernelExecutionResult(False, (time.perf_counter() - start) * 1e3, str(e))
        return KernelExecutionResult(True, (time.perf_counter() - start) * 1e3, None, out)


def get_vector_add_kernel() -> Callable[[Any, Any], Array]:
    """A vector-add kernel: ``kernel(a, b)`` returns ``a + b`` on the arrays' device."""
    return ops.add


def get_matrix_multiply_kernel() -> Callable[[Any, Any], Array]:
    """A matrix-multiply kernel: ``kernel(A, B)`` returns ``A @ B`` (cuBLAS on CUDA)."""
    return ops.matmul


def get_elementwise_kernel(operation: str) -> Optional[Callable[..., Array]]:
    """The element-wise kernel ``operation`` (``add sub mul div sqrt exp log sin cos abs square
    negative``), or None for any other name."""
    if operation in ops.UNARY or operation in ops.BINARY:
        kernel: Callable[..., Array] = getattr(ops, operation)
        return kernel
    return None
