"""What a typed user script does with dlbridge; `mypy --strict` must accept it as it is.

tests/python/test_typing.py checks it (with rejected.py) against the stubs of this checkout, and
also runs it: the types it asserts are the ones the module gives.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from typing_extensions import assert_type

import dlbridge
from dlbridge import Array, Device, DType


def shared_with_numpy() -> Array:
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = dlbridge.from_dlpack(host, copy=False)
    assert_type(a, Array)
    assert_type(a.readonly, bool)
    assert_type(a.is_contiguous, bool)
    assert_type(a.shape, tuple[int, ...])
    assert_type(a.data_ptr, int)
    assert a.data_ptr == host.ctypes.data
    column = a[:, 1]
    back = np.from_dlpack(column)
    assert back.tolist() == [1.0, 5.0, 9.0]
    return a


def created_here() -> None:
    z = dlbridge.zeros((2, 3), dtype=dlbridge.float64)
    e = dlbridge.empty(4, dtype="int32", device="cpu")
    f = dlbridge.full((2,), 1.5)
    r = dlbridge.arange(0, 10, 2, dtype=dlbridge.int64)
    flags = dlbridge.asarray([True, False], dtype=dlbridge.bool)
    assert_type(dlbridge.bool, DType)
    assert flags.dtype == dlbridge.bool
    assert f.dtype == "float32"  # dlbridge's default float dtype
    total = (z + 1.0).sum()
    assert_type(total, Array)
    assert float(total) == 6.0
    assert e.device == Device("cpu") and e.size == 4
    assert r.tolist() == [0, 2, 4, 6, 8]
    assert_type(r.device.type, str)
    assert_type(r.dtype.itemsize, int)


def memory() -> None:
    stats: dict[str, int | None] = dlbridge.memory_stats("cpu")
    assert isinstance(stats["active_bytes"], int)
    mode, source = dlbridge.storage_mode("cpu")
    assert_type(mode, str)
    assert source in ("default", "environment", "explicit")
    dlbridge.empty_cache()


def devices() -> list[str]:
    info: dict[str, Any] = dlbridge.build_info()
    names: list[str] = list(info["devices"])
    if dlbridge.cuda.is_available():
        names.append(dlbridge.cuda.device_name(0))
    else:
        assert_type(dlbridge.cuda.unavailable_reason(), str)
    if not dlbridge.metal.is_available():
        assert dlbridge.metal.unavailable_reason()
    return names


def ops() -> None:
    x = dlbridge.arange(6, dtype="float32").reshape(2, 3)
    y = dlbridge.ops.exp(x) * 2 - x.T.T
    m = x @ x.T
    assert_type(m, Array)
    assert y.shape == (2, 3) and m.shape == (2, 2)


def numpy_habits() -> None:
    a = dlbridge.asarray([[1.5, -2.0], [3.0, 0.5]], dtype="float32")
    # `item` is typed `Any`, as NumPy's: a float array's element assigns to a float.
    x: float = a[0, 0].item()
    assert x == 1.5
    n: int = a.argmax().item()
    assert n == 2
    assert_type(a // 2, Array)
    assert_type(a % 2, Array)
    assert_type(a**2, Array)
    assert_type(2**a, Array)
    assert_type(a.prod(axis=0), Array)
    assert_type(a.std(ddof=1), Array)
    assert_type(a.var(axis=(0, 1), keepdims=True), Array)
    assert_type(a.all(), Array)
    assert_type(a.any(axis=1), Array)
    assert_type(a.transpose(), Array)
    assert_type(a.transpose(1, 0), Array)
    assert_type(a.ravel(), Array)
    assert_type(a.flatten(), Array)
    assert_type(a[a > 0], Array)
    assert_type(dlbridge.ones((2, 2)), Array)
    assert_type(dlbridge.zeros_like(a), Array)
    assert_type(dlbridge.full_like(a, 3.0, dtype="float64"), Array)
    assert_type(dlbridge.ops.argmin(a, axis=0), Array)
    assert np.dtype(a.dtype) == np.float32
    assert a.dtype.itemsize == 4


def checkpoints() -> None:
    import os
    import tempfile

    import torch

    from dlbridge.safetensors.torch import load_file

    path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    dlbridge.save_file({"w": np.ones((4, 2), np.float32)}, path, metadata={"format": "np"})
    arrays = dlbridge.load_file(path, keys="w")
    assert_type(arrays, dict[str, Array])
    tensors = load_file(path)
    assert_type(tensors, dict[str, torch.Tensor])
    anything = dlbridge.load_file(path, framework="pt")
    assert_type(anything, dict[str, Any])
    with dlbridge.safe_open(path, framework="np") as f:
        assert_type(f.metadata(), dict[str, str] | None)
        rows = f.get_slice("w")[1:3]
        assert rows.shape == (2, 2)
    np.save(os.path.join(os.path.dirname(path), "w.npy"), np.ones(3, np.int32))
    one = dlbridge.load_npy(os.path.join(os.path.dirname(path), "w.npy"), "cpu", copy=True)
    assert_type(one, Array)
    np.savez(os.path.join(os.path.dirname(path), "w.npz"), a=np.ones(2))
    several = dlbridge.npy.load_npz(os.path.join(os.path.dirname(path), "w.npz"))
    assert_type(several, dict[str, Array])


if __name__ == "__main__":
    shared_with_numpy()
    created_here()
    memory()
    print(devices())
    ops()
    numpy_habits()
    checkpoints()
