"""Prints what the GPU machine's peers do with DLPack on CUDA (which keyword arguments they pass
to a producer's __dlpack__, which capsule versions they accept). A development aid."""
import sys, ctypes, ctypes.util, os, subprocess
print(sys.version)
print("libcuda:", ctypes.util.find_library("cuda"), "nvrtc:", ctypes.util.find_library("nvrtc"))
print("LD_LIBRARY_PATH", os.environ.get("LD_LIBRARY_PATH"))
import torch, cupy, jax, numpy as np
print("torch", torch.__version__, "cupy", cupy.__version__, "jax", jax.__version__, "numpy", np.__version__)
print("jax devices", jax.devices())

class Spy:
    def __init__(self, inner, name):
        self.inner, self.name = inner, name
    def __dlpack__(self, **kw):
        print(f"  {self.name}.__dlpack__ got", {k: (v if not isinstance(v, int) or v < 1000 else hex(v)) for k, v in kw.items()})
        return self.inner.__dlpack__(**kw)
    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()

t = torch.arange(8, device="cuda", dtype=torch.float32)
c = cupy.arange(8, dtype=cupy.float32)
for cname, consume in [("torch", torch.from_dlpack), ("cupy", cupy.from_dlpack), ("jax", jax.dlpack.from_dlpack)]:
    for pname, prod in [("torch", t), ("cupy", c)]:
        print(f"{cname}.from_dlpack({pname}):")
        try:
            consume(Spy(prod, pname))
        except Exception as e:
            print("   error", type(e).__name__, e)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        print(f"{cname}.from_dlpack(torch) inside a torch side stream {hex(s.cuda_stream)}:")
        try:
            consume(Spy(t, "torch"))
        except Exception as e:
            print("   error", type(e).__name__, e)
    cs = cupy.cuda.Stream(non_blocking=True)
    with cs:
        print(f"{cname}.from_dlpack(cupy) inside a cupy stream {hex(cs.ptr)}:")
        try:
            consume(Spy(c, "cupy"))
        except Exception as e:
            print("   error", type(e).__name__, e)
print("torch exchange api attr:", hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))
import inspect
src = inspect.getsource(torch.utils.dlpack.from_dlpack)
print("torch.from_dlpack mentions c_exchange:", "exchange" in src)
j = jax.numpy.arange(8.0)
print("jax dlpack device", j.__dlpack_device__())
for kw in [dict(), dict(max_version=(1, 3)), dict(stream=1), dict(stream=None, max_version=(1,3))]:
    try:
        cap = j.__dlpack__(**kw); print("jax __dlpack__", kw, "->", cap)
    except Exception as e:
        print("jax __dlpack__", kw, "error", type(e).__name__, e)
for kw in [dict(max_version=(1, 3)), dict(stream=-1, max_version=(1,3))]:
    print("cupy __dlpack__", kw, c.__dlpack__(**kw))
print("pinned torch dlpack device", torch.empty(4, pin_memory=True).__dlpack_device__())
try:
    from torch.utils.dlpack import DLDeviceType
    print([(m.name, m.value) for m in DLDeviceType])
except Exception as e:
    print(e)
