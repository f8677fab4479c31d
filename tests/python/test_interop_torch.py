"""PyTorch (CPU) <-> dlbridge, both directions: zero-copy proven by pointers and by writes."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import dlbridge
from conftest import capsule_info, collect, ptr_of, random_values

# (torch dtype, dlbridge name, DLPack (code, bits))
DTYPES = [
    (torch.bool, "bool", (6, 8)),
    (torch.int8, "int8", (0, 8)),
    (torch.int16, "int16", (0, 16)),
    (torch.int32, "int32", (0, 32)),
    (torch.int64, "int64", (0, 64)),
    (torch.uint8, "uint8", (1, 8)),
    (torch.uint16, "uint16", (1, 16)),
    (torch.uint32, "uint32", (1, 32)),
    (torch.uint64, "uint64", (1, 64)),
    (torch.float16, "float16", (2, 16)),
    (torch.bfloat16, "bfloat16", (4, 16)),
    (torch.float32, "float32", (2, 32)),
    (torch.float64, "float64", (2, 64)),
    (torch.complex64, "complex64", (5, 64)),
    (torch.complex128, "complex128", (5, 128)),
    (torch.float8_e4m3fn, "float8_e4m3fn", (10, 8)),
    (torch.float8_e4m3fnuz, "float8_e4m3fnuz", (11, 8)),
    (torch.float8_e5m2, "float8_e5m2", (12, 8)),
    (torch.float8_e5m2fnuz, "float8_e5m2fnuz", (13, 8)),
    (torch.float8_e8m0fnu, "float8_e8m0fnu", (14, 8)),
]
IDS = [name for _, name, _ in DTYPES]
FLOAT8 = {"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"}


def torch_values(rng, shape, tdtype, name):
    """Seeded values representable exactly in ``tdtype`` (powers of two for e8m0)."""
    if name == "float8_e8m0fnu":
        return torch.from_numpy(2.0 ** rng.integers(-4, 5, size=shape)).to(tdtype)
    if name in FLOAT8 or name == "bfloat16":
        return torch.from_numpy(random_values(rng, shape, np.float32)).to(tdtype)
    if name.startswith("uint") and name != "uint8":
        return torch.from_numpy(random_values(rng, shape, np.int64).clip(0)).to(tdtype)
    return torch.from_numpy(random_values(rng, shape, name))


def as_float_list(x):
    """Values for comparison: via float32 upcast for types Python lists cannot hold exactly."""
    if isinstance(x, torch.Tensor):
        if x.dtype in (torch.bfloat16,) or x.dtype.itemsize == 1 and x.dtype.is_floating_point:
            return x.to(torch.float32).tolist()
        return x.tolist()
    return x.tolist()


def mark_for(name):
    if name == "bool":
        return True
    if name.startswith("complex"):
        return 3 - 4j
    if name == "float8_e8m0fnu":
        return 64.0
    if name in FLOAT8 or name in ("float16", "bfloat16", "float32", "float64"):
        return 12.0
    return 77


@pytest.mark.parametrize("tdtype,name,code", DTYPES, ids=IDS)
def test_torch_to_dlbridge_every_dtype(tdtype, name, code, rng):
    t = torch_values(rng, (4, 6), tdtype, name)
    a = dlbridge.from_dlpack(t)
    assert a.dtype == name
    assert a.dtype == tdtype
    assert (a.dtype.code, a.dtype.bits) == code
    assert a.data_ptr == t.data_ptr()
    assert a.tolist() == as_float_list(t)
    m = mark_for(name)
    a[1, 2] = m
    assert as_float_list(t[1, 2]) == m
    if name != "float8_e8m0fnu":
        t[3, 0] = m
        assert a[3, 0].item() == m


@pytest.mark.parametrize("tdtype,name,code", DTYPES, ids=IDS)
def test_dlbridge_to_torch_every_dtype(tdtype, name, code, rng):
    src = torch_values(rng, (4, 6), tdtype, name)
    a = dlbridge.asarray(as_float_list(src), dtype=name)
    assert not a.is_foreign
    t = torch.from_dlpack(a)
    assert t.dtype == tdtype
    assert t.data_ptr() == a.data_ptr
    assert as_float_list(t) == as_float_list(src)
    m = mark_for(name)
    a[2, 2] = m
    assert as_float_list(t[2, 2]) == m
    if name != "float8_e8m0fnu":
        t[0, 1] = m
        assert a[0, 1].item() == m


def test_torch_exports_versioned_1_x():
    info = capsule_info(torch.arange(3).__dlpack__(max_version=(1, 3)))
    assert info["name"] == "dltensor_versioned"
    assert info["version"][0] == 1


# Views of a (4, 6) base that both libraries can express.
VIEWS = {
    "full": lambda x: x,
    "slice": lambda x: x[1:, 2:],
    "strided": lambda x: x[::2, 1::3],
    "transposed": lambda x: x.T,
    "row": lambda x: x[2],
    "column": lambda x: x[:, 3],
    "0d": lambda x: x[3, 5],
    "zero-size": lambda x: x[2:2],
    "zero-size-cols": lambda x: x[:, 6:],
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_torch_views_to_dlbridge(view, rng):
    base = torch.from_numpy(random_values(rng, (4, 6), np.float32))
    tv = VIEWS[view](base)
    a = dlbridge.from_dlpack(tv)
    assert a.shape == tuple(tv.shape)
    assert a.tolist() == tv.tolist()
    if tv.numel():
        assert a.data_ptr == tv.data_ptr()
        assert a.strides == tuple(tv.stride())
        a[(0,) * a.ndim] = 1234.0
        assert tv[(0,) * tv.dim()].item() == 1234.0
        assert int((base == 1234.0).sum()) == 1


@pytest.mark.parametrize("view", list(VIEWS))
def test_dlbridge_views_to_torch(view, rng):
    src = random_values(rng, (4, 6), np.float64)
    a = dlbridge.asarray(src.tolist(), dtype="float64")
    av = VIEWS[view](a)
    t = torch.from_dlpack(av)
    ref = np.asarray(VIEWS[view](src))
    assert tuple(t.shape) == ref.shape
    assert t.tolist() == ref.tolist()
    if av.size:
        assert t.data_ptr() == av.data_ptr
        assert t.stride() == av.strides
        t[(0,) * t.dim()] = -1234.0
        assert av[(0,) * av.ndim].item() == -1234.0


def test_byte_offset_views_to_torch():
    a = dlbridge.arange(20, dtype="int32")
    v = a[3:]
    assert v.byte_offset == 12
    t = torch.from_dlpack(v)
    assert t.data_ptr() == a.data_ptr + 12
    assert t.tolist() == list(range(3, 20))
    t[0] = -5
    assert a[3].item() == -5
    w = a.reshape(4, 5)[1:, 2:]
    tw = torch.from_dlpack(w)
    assert tw.data_ptr() == a.data_ptr + 7 * 4
    assert tw.tolist() == np.arange(20).reshape(4, 5)[1:, 2:].tolist()


def test_torch_offsets_are_folded_into_data():
    base = torch.arange(20, dtype=torch.float32)
    t = base[5:].view(3, 5)[1:, ::2]
    cap = t.__dlpack__(max_version=(1, 3))
    info = capsule_info(cap)
    assert info["data"] + info["byte_offset"] == t.data_ptr()
    a = dlbridge.from_dlpack(cap)
    assert a.data_ptr == t.data_ptr()
    assert a.tolist() == t.tolist()


_NEGATIVE_STEP_PROBE = """
import sys, numpy as np, torch, dlbridge
src = sys.argv[1]
a = (np.arange(12, dtype=np.float32) if src == "numpy" else dlbridge.arange(12, dtype="float32"))
a = a.reshape(3, 4)
for v in (a[:, ::-1], a[::-1], a[::-2, 1:]):
    try:
        torch.from_dlpack(v)
        print("imported")
    except (RuntimeError, BufferError, ValueError) as e:
        print("raised", type(e).__name__)
"""


def _negative_step_probe(src):
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _NEGATIVE_STEP_PROBE, src], capture_output=True, text=True, timeout=120
    )
    return out.returncode, out.stdout.split("\n")


def test_negative_steps_dlbridge_to_torch_raise_torchs_error():
    # PyTorch refuses negative strides. Some builds abort the process instead of raising (seen
    # with torch 2.11+cu130, for NumPy and CuPy producers alike), so the import runs in a child.
    rc, lines = _negative_step_probe("dlbridge")
    if rc != 0:
        np_rc, _ = _negative_step_probe("numpy")
        if np_rc != 0:
            pytest.skip(f"this PyTorch ({torch.__version__}) aborts on negative strides from NumPy too")
        pytest.fail(f"torch.from_dlpack(dlbridge view) crashed (rc={rc}) where NumPy's raised")
    assert [l.split()[0] for l in lines if l] == ["raised"] * 3, lines
    # torch.flip copies; what it produces imports fine.
    f = torch.arange(6).flip(0)
    assert dlbridge.from_dlpack(f).tolist() == [5, 4, 3, 2, 1, 0]


def test_broadcast_both_ways():
    base = torch.arange(3, dtype=torch.int64)
    e = base.expand(4, 3)
    a = dlbridge.from_dlpack(e)
    assert a.strides == (0, 1)
    assert a.data_ptr == base.data_ptr()
    assert a.tolist() == e.tolist()
    d = dlbridge.arange(3).reshape(3, 1)
    b = d.broadcast_to((3, 5))
    t = torch.from_dlpack(b)
    assert t.stride() == (1, 0)
    assert t.data_ptr() == d.data_ptr
    d[1, 0] = 100
    assert t[1].tolist() == [100] * 5


def test_0d_and_zero_size():
    s = torch.tensor(3.5)
    a = dlbridge.from_dlpack(s)
    assert a.shape == () and a.item() == 3.5 and a.data_ptr == s.data_ptr()
    t = torch.from_dlpack(dlbridge.full((), 2.0))
    assert t.shape == () and t.item() == 2.0
    z = torch.empty(0, 3)
    az = dlbridge.from_dlpack(z)  # torch exports NULL data for zero-size tensors
    assert az.shape == (0, 3) and az.size == 0 and az.tolist() == []
    assert az[:, 1].shape == (0,)
    tz = torch.from_dlpack(dlbridge.zeros((3, 0)))
    assert tuple(tz.shape) == (3, 0)
    assert tuple(torch.from_dlpack(az).shape) == (0, 3)


@pytest.mark.parametrize("copy", [None, False, True])
def test_copy_keyword_both_directions(copy):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    a = dlbridge.from_dlpack(t, copy=copy)
    assert a.tolist() == t.tolist()
    assert (a.data_ptr == t.data_ptr()) == (copy is not True)
    t[0, 0] = 77.0
    assert (a[0, 0].item() == 77.0) == (copy is not True)
    t2 = torch.from_dlpack(a, copy=copy)
    assert (t2.data_ptr() == a.data_ptr) == (copy is not True)
    a[2, 2] = -3.0
    assert (t2[2, 2].item() == -3.0) == (copy is not True)


def test_readonly_dlbridge_array_into_torch():
    n = np.arange(4, dtype=np.float32)
    n.flags.writeable = False
    a = dlbridge.from_dlpack(n)
    assert a.readonly
    with pytest.raises(BufferError):
        a[0] = 1.0
    t = torch.from_dlpack(a)  # torch does not model read-only memory; it still shares it
    assert t.data_ptr() == ptr_of(n)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_detached_grad_tensors():
    t = torch.ones(3, requires_grad=True)
    a = dlbridge.from_dlpack(t.detach())
    assert a.data_ptr == t.data_ptr()
    a[0] = 5.0
    assert t[0].item() == 5.0


def test_lazy_conj_tensors_are_never_read_wrong():
    """PyTorch marks conj() views with a bit instead of rewriting memory, which DLPack cannot say.
    torch's own exporter refuses them (BufferError); a consumer must either refuse too or see the
    logical values, never the raw memory."""
    base = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    t = base.conj()
    assert t.is_conj()
    with pytest.raises(BufferError):
        t.__dlpack__(max_version=(1, 3))
    with pytest.raises(BufferError):
        np.from_dlpack(t)
    try:
        a = dlbridge.from_dlpack(t)
    except BufferError:
        return
    assert a.tolist() == t.tolist() == [1 - 2j, 3 + 1j]


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's beta/deprecation notices
@pytest.mark.parametrize("kind", ["sparse", "sparse-csr", "meta", "quantized"])
def test_tensors_dlpack_cannot_express_raise_buffer_error(kind):
    """torch's own exporter refuses these with BufferError; dlbridge must raise BufferError too
    (the array API's signal that DLPack cannot carry the data), whatever path it takes."""
    t = {
        "sparse": lambda: torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,)),
        "sparse-csr": lambda: torch.eye(3).to_sparse_csr(),
        "meta": lambda: torch.empty(3, device="meta"),
        "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
    }[kind]()
    with pytest.raises(BufferError):
        t.__dlpack__(max_version=(1, 3))
    with pytest.raises(BufferError):
        dlbridge.from_dlpack(t)


def test_torch_producer_released_after_views_dropped():
    import weakref

    t = torch.arange(100, dtype=torch.float32)
    w = weakref.ref(t)
    a = dlbridge.from_dlpack(t)[::3]
    n = np.from_dlpack(a)
    del t
    collect()
    assert w() is not None
    del a
    collect()
    assert w() is not None
    assert n[1] == 3.0
    del n
    collect()
    assert w() is None


def test_round_trip_chain_keeps_one_buffer():
    t = torch.arange(10, dtype=torch.int16)
    a = dlbridge.from_dlpack(t)
    t2 = torch.from_dlpack(a[2:])
    b = dlbridge.from_dlpack(t2)
    n = np.from_dlpack(b)
    assert ptr_of(n) == t.data_ptr() + 4
    n[0] = 999
    assert t[2].item() == 999
