"""JAX (CPU) <-> dlbridge.

JAX arrays are immutable (XLA may share or donate their buffers), so JAX -> dlbridge is a
read-only view (pointer equality, equal values, every write refused with BufferError; copy=True
gives writable memory of dlbridge's). dlbridge -> JAX is zero-copy for compact, 64-byte aligned
memory (dlbridge allocations are), which a write through dlbridge then shows.
"""

from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import dlbridge  # noqa: E402
from conftest import capsule_info, collect, ptr_of, random_values  # noqa: E402



@pytest.fixture(autouse=True)
def _jax_on_the_cpu():
    """This file is about JAX's CPU arrays; on a GPU machine JAX's default device is the GPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


STANDARD = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
            "float16", "float32", "float64", "complex64", "complex128"]
EXTENDED = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
            "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu"]


def jax_dtype(name):
    return getattr(jnp, name) if hasattr(jnp, name) else getattr(ml_dtypes, name)


def host_values(rng, shape, name):
    """Seeded NumPy values exactly representable in ``name``."""
    if name == "float8_e8m0fnu":
        return (2.0 ** rng.integers(-4, 5, size=shape)).astype(ml_dtypes.float8_e8m0fnu)
    if name in EXTENDED:
        return random_values(rng, shape, np.float32).astype(jax_dtype(name))
    return random_values(rng, shape, name)


def as_list(x):
    """Comparable values: extended floats through float32."""
    arr = np.asarray(x)
    if arr.dtype.name in EXTENDED:
        return arr.astype(np.float32).tolist()
    return arr.tolist()


def dl_list(a: dlbridge.Array):
    return a.astype("float32").tolist() if a.dtype in EXTENDED else a.tolist()


@pytest.mark.parametrize("name", STANDARD + EXTENDED)
def test_jax_to_dlbridge_every_dtype(name, rng):
    h = host_values(rng, (4, 6), name)
    x = jnp.asarray(h)
    assert x.dtype == h.dtype
    a = dlbridge.from_dlpack(x)
    assert a.dtype == name
    assert a.dtype == x.dtype
    assert a.data_ptr == x.unsafe_buffer_pointer()
    assert dl_list(a) == as_list(h)
    assert dl_list(a[1:, ::-2]) == as_list(h[1:, ::-2])
    assert a.size == 24 and a.shape == (4, 6)


@pytest.mark.parametrize("name", STANDARD + EXTENDED)
def test_dlbridge_to_jax_every_dtype(name, rng):
    h = host_values(rng, (4, 6), name)
    a = dlbridge.from_dlpack(np.asarray(h, dtype=np.float32) if name in EXTENDED else h)
    if name in EXTENDED:
        a = a.astype(name)
    else:
        a = a.copy()  # dlbridge-owned, 64-byte aligned
    assert a.data_ptr % 64 == 0
    j = jnp.from_dlpack(a)
    assert j.dtype == jax_dtype(name)
    assert j.unsafe_buffer_pointer() == a.data_ptr
    assert as_list(j) == as_list(h)


def test_jax_exports_legacy_capsules():
    x = jnp.arange(3.0)
    assert capsule_info(x.__dlpack__())["name"] == "dltensor"
    info = capsule_info(x.__dlpack__(max_version=(1, 3)))
    assert info["name"] == "dltensor"  # JAX only produces legacy capsules
    assert info["data"] == x.unsafe_buffer_pointer()


def test_write_through_dlbridge_is_seen_by_jax():
    a = dlbridge.arange(12, dtype="float32").reshape(3, 4)
    j = jnp.from_dlpack(a)
    assert j.unsafe_buffer_pointer() == a.data_ptr
    a[0, 0] = 100.0
    a[2, 3] = -1.0
    assert float(j[0, 0]) == 100.0
    assert np.asarray(j)[2, 3] == -1.0


def test_views_of_imported_jax_arrays(rng):
    h = random_values(rng, (5, 6), np.float64)
    x = jnp.asarray(h)
    a = dlbridge.from_dlpack(x)
    base = x.unsafe_buffer_pointer()
    for key in [(slice(1, None), slice(2, None)), (slice(None, None, 2), slice(1, None, 3)),
                (slice(None, None, -1), slice(None, None, -2)), (3,), (Ellipsis, 4), (None, 2, 5)]:
        v = a[key]
        ref = h[key]  # same layout in NumPy: the element offsets must agree
        assert v.tolist() == ref.tolist()
        assert v.data_ptr == base + (ptr_of(ref) - ptr_of(h))
    assert a.T.tolist() == h.T.tolist()
    assert a.broadcast_to((2, 5, 6)).tolist() == np.broadcast_to(h, (2, 5, 6)).tolist()


@pytest.mark.parametrize("view", ["T", "permute", "newaxis", "reshape"])
def test_compact_permuted_views_to_jax(view):
    a = dlbridge.arange(24, dtype="int32").reshape(2, 3, 4)
    v = {"T": a.T, "permute": a.permute(1, 0, 2), "newaxis": a[None, :, None],
         "reshape": a.reshape(4, 6)}[view]
    j = jnp.from_dlpack(v)
    assert j.shape == v.shape
    assert np.asarray(j).tolist() == v.tolist()
    assert j.unsafe_buffer_pointer() == v.data_ptr


def test_misaligned_view_is_copied_by_jax():
    """JAX imports without a copy only 64-byte aligned data; a[1:] starts 16 bytes in."""
    a = dlbridge.arange(12, dtype="float32").reshape(3, 4)
    v = a[1:]
    assert v.byte_offset == 16
    j = jnp.from_dlpack(v)
    assert np.asarray(j).tolist() == v.tolist()
    assert j.unsafe_buffer_pointer() != v.data_ptr
    a[1, 0] = 55.0
    assert float(j[0, 0]) == 4.0  # JAX holds its own copy


def test_aligned_byte_offset_view_is_shared_with_jax():
    a = dlbridge.arange(64, dtype="float64").reshape(8, 8)
    v = a[1:]  # 64 bytes in: still aligned
    assert v.byte_offset == 64
    j = jnp.from_dlpack(v)
    assert j.unsafe_buffer_pointer() == a.data_ptr + 64
    assert np.asarray(j).tolist() == v.tolist()


@pytest.mark.parametrize("view", ["negative", "strided", "column", "broadcast"])
def test_non_compact_views_raise_jaxs_error(view):
    a = dlbridge.arange(12, dtype="float32").reshape(3, 4)
    v = {"negative": a[:, ::-1], "strided": a[:, ::2], "column": a[:, 1],
         "broadcast": dlbridge.arange(4, dtype="float32").broadcast_to((3, 4))}[view]
    with pytest.raises(jax.errors.JaxRuntimeError, match="compact"):
        jnp.from_dlpack(v)
    # A compact copy goes through.
    assert np.asarray(jnp.from_dlpack(v.copy())).tolist() == v.tolist()


def test_0d_and_zero_size():
    s = jnp.array(2.5)
    a = dlbridge.from_dlpack(s)
    assert a.shape == () and a.item() == 2.5
    assert a.data_ptr == s.unsafe_buffer_pointer()
    j = jnp.from_dlpack(dlbridge.full((), 3.0, "float64"))
    assert j.shape == () and float(j) == 3.0
    z = dlbridge.from_dlpack(jnp.zeros((0, 3)))
    assert z.shape == (0, 3) and z.tolist() == []
    jz = jnp.from_dlpack(dlbridge.zeros((3, 0)))
    assert jz.shape == (3, 0)


@pytest.mark.parametrize("copy", [None, False, True])
def test_dlbridge_import_copy_keyword(copy):
    x = jnp.arange(8, dtype=jnp.float32)
    a = dlbridge.from_dlpack(x, copy=copy)
    assert a.tolist() == list(range(8))
    assert (a.data_ptr == x.unsafe_buffer_pointer()) == (copy is not True)
    # JAX's memory is read-only through dlbridge; a copy is dlbridge's own, and writable.
    assert a.readonly == (copy is not True)
    if copy:
        a[0] = 9.0  # our own memory: writing it cannot disturb JAX
        assert float(x[0]) == 0.0


# Every import route of the extension: the array API's from_dlpack and asarray, and the operand
# routes of ops and kernels (which import through the same consumer).
IMPORTS = {
    "from_dlpack": dlbridge.from_dlpack,
    "asarray": dlbridge.asarray,
    "asarray(copy=False)": lambda x: dlbridge.asarray(x, copy=False),
    "from_dlpack(device=cpu)": lambda x: dlbridge.from_dlpack(x, device="cpu"),
}


@pytest.mark.parametrize("route", IMPORTS)
def test_jax_arrays_import_read_only_without_a_copy(route):
    """JAX treats its arrays as immutable (XLA may share or donate a buffer): a write through
    dlbridge would change a value JAX holds constant. The import stays zero-copy, read-only."""
    x = jnp.arange(4.0)
    a = IMPORTS[route](x)
    assert a.data_ptr == x.unsafe_buffer_pointer()  # still zero-copy
    assert a.readonly and a[1:].readonly and a.T.readonly
    with pytest.raises(BufferError, match="read-only"):
        a[0] = 99.0
    with pytest.raises(BufferError, match="read-only"):
        a[1:][0] = 99.0
    assert np.asarray(x).tolist() == [0.0, 1.0, 2.0, 3.0]
    # Exported onward, the flag goes with it: NumPy's view is read-only too.
    assert not np.from_dlpack(a).flags.writeable


@pytest.mark.parametrize("route", [dlbridge.from_dlpack, dlbridge.asarray])
def test_jax_copy_true_is_writable(route):
    x = jnp.arange(4.0)
    a = route(x, copy=True)
    assert not a.readonly and a.data_ptr != x.unsafe_buffer_pointer()
    a[0] = 99.0
    assert a.tolist()[0] == 99.0 and float(x[0]) == 0.0


def test_jax_array_refused_as_an_out_operand():
    """`out=` writes into the array it is given: a JAX array is refused, and stays unchanged."""
    out = jnp.zeros(())
    with pytest.raises(BufferError, match="read-only"):
        dlbridge.arange(4, dtype="float64").sum(out=out)
    assert float(out) == 0.0
    ok = np.zeros(())
    dlbridge.arange(4, dtype="float64").sum(out=ok)  # a writable NumPy out= still works
    assert float(ok) == 6.0


def test_jax_array_read_only_in_a_python_kernel():
    """A CPU Python kernel receives NumPy views of its arguments: a JAX argument's is read-only,
    so the kernel's write fails (a failed result) instead of changing the JAX array."""
    x = jnp.arange(4.0)
    be = dlbridge.Backend("cpu")

    def write(v):
        v[0] = 99.0

    result = be.execute_kernel(write, 1, 1, x)
    assert not result.success and "read-only" in result.error
    assert float(x[0]) == 0.0


def test_jax_import_of_readonly_dlbridge_array_is_refused():
    """JAX asks for a legacy capsule, which cannot say read-only: dlbridge refuses the export."""
    n = np.arange(4, dtype=np.float32)
    n.flags.writeable = False
    a = dlbridge.from_dlpack(n)
    with pytest.raises(BufferError):
        jnp.from_dlpack(a)
    j = jnp.from_dlpack(a.copy())
    assert np.asarray(j).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_jax_float4_is_read_correctly_or_refused():
    """JAX stores float4_e2m1fn packed two to a byte (its legacy capsule says nothing more, which
    DLPack reads as packed). dlbridge must return the right values or refuse, never misread."""
    vals = [0.5, 1.0, 1.5, 2.0, -3.0, 6.0]
    x = jnp.array(vals, dtype=ml_dtypes.float4_e2m1fn)
    try:
        a = dlbridge.from_dlpack(x)
    except BufferError:
        return
    assert a.shape == (6,)
    assert a.data_ptr == x.unsafe_buffer_pointer()
    try:
        got = a.tolist()
    except BufferError:
        return
    assert got == vals


def test_jax_source_released_after_views_dropped():
    import weakref

    x = jnp.arange(100.0)
    w = weakref.ref(x)
    a = dlbridge.from_dlpack(x)[::3]
    del x
    collect()
    assert a[1].item() == 3.0
    del a
    collect()
    assert w() is None


def test_round_trip_jax_dlbridge_jax():
    """JAX's memory imported by dlbridge is read-only by JAX's contract, and goes back to JAX
    without a copy, although JAX asks for a legacy capsule, which cannot say read-only: JAX hands
    the same memory out in that form itself; its views go too. A read-only view made by dlbridge
    (``share``'s read-only handles, say) is still refused that form (above)."""
    x = jnp.arange(16, dtype=jnp.int32).reshape(4, 4)
    a = dlbridge.from_dlpack(x)
    assert a.readonly
    y = jnp.from_dlpack(a)
    assert y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer() == a.data_ptr
    assert (np.asarray(y) == np.asarray(x)).all()
    row = jnp.from_dlpack(a[1])  # JAX copies memory it finds unaligned; the values are right
    assert (np.asarray(row) == np.asarray(x[1])).all()
    with pytest.raises(BufferError, match="read-only"):
        a[0, 0] = 1
    ro = np.arange(4, dtype=np.int32)
    ro.flags.writeable = False
    with pytest.raises(BufferError, match="legacy"):
        dlbridge.from_dlpack(ro).__dlpack__()  # read-only memory of another producer
    c = a.copy()
    z = jnp.from_dlpack(c)
    assert z.unsafe_buffer_pointer() == c.data_ptr
    assert (np.asarray(z) == np.asarray(x)).all()
