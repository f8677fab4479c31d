"""Calls the stubs must reject: each line carries the error code mypy must report on it.

`mypy --strict` (which warns about unused `type: ignore` comments) fails if any of these lines is
accepted, so a stub that loosens one of these signatures fails the test. Not meant to run.
"""

import numpy as np

import dlbridge

host = np.zeros(4, dtype=np.float32)
a = dlbridge.from_dlpack(host)

dlbridge.from_dlpack(host, copy="yes")  # type: ignore[arg-type]
dlbridge.from_dlpack(host, True)  # type: ignore[call-arg]
dlbridge.asarray(host, storage=3)  # type: ignore[arg-type]
a.to("cpu", copy="no")  # type: ignore[arg-type]
a.readonly = True  # type: ignore[misc]
n: str = a.ndim  # type: ignore[assignment]
flag: str = a.readonly  # type: ignore[assignment]
dlbridge.zeros((2, 2), dtype="float32", storage=None, device="cpu", order="C")  # type: ignore[call-arg]
dlbridge.set_memory_limit(limit=1 << 20)  # type: ignore[call-arg]
dlbridge.cuda.stream(1, 2, 3)  # type: ignore[call-arg]
dlbridge.DType("float32").name = "x"  # type: ignore[misc]
dlbridge.load_file("model.safetensors", keys=3)  # type: ignore[call-overload]
dlbridge.load_npz(3)  # type: ignore[arg-type]
