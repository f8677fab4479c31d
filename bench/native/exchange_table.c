/* Times the DLPack 1.3 C exchange table of a type with no Python call in between: a loop of
 * export (managed_tensor_from_py_object_no_sync) + deleter, and of export + import
 * (managed_tensor_to_py_object_no_sync) + release of the new object. Built and called by
 * bench/bench_exchange_table.py (ctypes.PyDLL, so the GIL is held as the table requires). */
#include <Python.h>
#include <stdint.h>
#include <time.h>

typedef struct { uint32_t major, minor; } Version;
typedef struct Header { Version version; struct Header *prev_api; } Header;
typedef struct { int32_t device_type, device_id; } Device;
typedef struct { uint8_t code, bits; uint16_t lanes; } DataType;
typedef struct {
    void *data; Device device; int32_t ndim; DataType dtype;
    int64_t *shape, *strides; uint64_t byte_offset;
} DLTensor;
typedef struct Managed {
    Version version; void *manager_ctx; void (*deleter)(struct Managed *); uint64_t flags;
    DLTensor dl_tensor;
} Managed;
typedef struct {
    Header header;
    void *allocator;
    int (*from_py)(void *, Managed **);
    int (*to_py)(Managed *, void **);
    int (*dltensor_from_py)(void *, DLTensor *);
    int (*current_work_stream)(int32_t, int32_t, void **);
} Api;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Returns nanoseconds per iteration, or -1 on a failure (a Python exception is then set). */
double bench(PyObject *obj, PyObject *capsule, long n, int mode) {
    Api *api = (Api *)PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
    if (!api) return -1;
    while (api && api->header.version.major != 1) api = (Api *)api->header.prev_api;
    if (!api || !api->from_py) return -1;
    double start = now();
    for (long i = 0; i < n; i++) {
        Managed *m = NULL;
        if (api->from_py(obj, &m) != 0) return -1;
        if (mode == 0) {
            if (m->deleter) m->deleter(m);
        } else if (mode == 1) {
            void *back = NULL;
            if (api->to_py(m, &back) != 0) return -1;
            Py_DECREF((PyObject *)back);
        } else {
            DLTensor view;
            if (api->dltensor_from_py(obj, &view) != 0) return -1;
            if (m->deleter) m->deleter(m);
        }
    }
    return (now() - start) / n * 1e9;
}
