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
import time
import traceback
from typing import Any, Callable, Optional, Sequence, Tuple, Union

from . import _dlbridge, cuda, ops
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

    ``success`` is False when the kernel failed: a compiled kernel that failed to launch or
    faulted on the device (``error`` is the driver's message; for a CUDA fault the driver keeps
    for the rest of the process, it says that the process must be restarted), or a Python
    callable that raised (``error`` is the exception's traceback, as Python prints it).
    ``execution_time_ms`` is the device time between events recorded around the kernel (host
    time for Python callables on the CPU; for a failed kernel, the time until it failed).
    ``output`` is a Python callable's return value (None for compiled kernels and failures).
    """

    success: bool
    execution_time_ms: float
    error: Optional[str] = None
    output: Any = None


class Backend(_dlbridge._Backend):
    """One device's compute backend: ``"cpu"``, ``"cuda"`` / ``"cuda:N"`` or ``"metal"`` /
    ``"metal:N"``; with no argument the best available (CUDA, then Metal, then the CPU).

    Raises :class:`BackendUnavailableError` when the backend cannot run here.

    The native base (``dlbridge::compute::Backend``) does the work; this class adds Python
    callables as kernels, on every backend.
    """

    def __new__(cls, device: Optional[Union[str, Device]] = None) -> "Backend":
        try:
            return super().__new__(cls, device)
        except RuntimeError as e:  # the only RuntimeError the constructor raises
            raise BackendUnavailableError(str(e)) from None

    # Wider than the native's: a Python callable is a kernel too, returned as it is.
    def compile_kernel(  # type: ignore[override]
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
        return super().compile_kernel(source, name, options)

    def execute_kernel(
        self,
        kernel: Union[Kernel, Callable[..., Any]],
        grid: Dims,
        block: Dims,
        *args: Any,
        shared_mem: int = 0,
        raise_errors: bool = False,
    ) -> KernelExecutionResult:
        """Runs ``kernel`` over ``grid`` blocks of ``block`` threads with ``args`` and waits for
        it.

        Arguments may be dlbridge arrays, any DLPack array (imported without a copy, so a kernel
        can work on a PyTorch tensor in place) and numbers (a Python ``int`` fills a 4- or
        8-byte integer parameter, a ``float`` a ``float`` or ``double``; NumPy scalars pass their
        exact type). Bad arguments (a zero grid, an array on another device, a freed array, the
        wrong count) raise before anything runs. A kernel that fails is a result with
        ``success=False``: a launch or device failure of a compiled kernel, with the driver's
        message in ``error``, and an exception a Python callable raises, with its traceback in
        ``error``. ``raise_errors=True`` raises those instead (the callable's own exception, with
        its traceback; ``RuntimeError`` for a device failure). ``KeyboardInterrupt`` and other
        exceptions that are not ``Exception`` always propagate.
        """
        try:
            ms = self._launch(kernel, grid, block, args, shared_mem)
        except RuntimeError as e:  # the launch or the kernel failed on the device
            if raise_errors:
                raise
            return KernelExecutionResult(False, 0.0, str(e))
        if ms is not None:
            return KernelExecutionResult(True, ms)
        assert not isinstance(kernel, Kernel)  # `_launch` gives None only for a Python callable
        return self._run_callable(kernel, args, raise_errors)

    def _run_callable(
        self, fn: Callable[..., Any], args: Sequence[Any], raise_errors: bool
    ) -> KernelExecutionResult:
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
            try:
                out = fn(*views)
            except Exception as e:
                if raise_errors:
                    raise
                return _failed(start, e)
            return KernelExecutionResult(True, (time.perf_counter() - start) * 1e3, None, out)
        arrays = [
            _dlbridge.from_dlpack(a) if hasattr(a, "__dlpack__") and not isinstance(a, Array) else a
            for a in args
        ]
        start = time.perf_counter()
        if kind == "cuda":
            index = self.device_id
            begin = cuda.Event(index, enable_timing=True)
            end = cuda.Event(index, enable_timing=True)
            begin.record()  # the current stream, where dlbridge's kernels run
        try:
            out = fn(*arrays)
        except Exception as e:
            if raise_errors:
                raise
            return _failed(start, e)
        try:
            # A fault in the callable's GPU work surfaces here: reported as a compiled kernel's is.
            if kind == "cuda":
                end.record()
                end.synchronize()
                elapsed = float(begin.elapsed_time(end))
            else:
                self.synchronize()
                elapsed = (time.perf_counter() - start) * 1e3
        except RuntimeError as e:
            if raise_errors:
                raise
            return KernelExecutionResult(False, (time.perf_counter() - start) * 1e3, str(e))
        return KernelExecutionResult(True, elapsed, None, out)


def _failed(start: float, error: BaseException) -> KernelExecutionResult:
    """The result of a Python callable, started at ``start`` (``time.perf_counter()``), that
    raised ``error``: its traceback as Python prints it, in ``error``."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return KernelExecutionResult(False, (time.perf_counter() - start) * 1e3, text)


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
