// dlbridge's CUDA copy kernels. `scripts/build-ptx.sh` compiles this file with nvcc to
// `copy.ptx` beside it (PTX for compute_75, which the driver JIT-compiles for any newer GPU);
// the Rust backend embeds that PTX and loads it once per device.
//
// Both kernels copy between two layouts of the same shape. Strides are in elements of the
// kernel's element type, which the host planner may have widened (eight float16 elements moved
// as one 16-byte element, say); extents and strides are 64-bit so no view is too large.

#include <stdint.h>

#define MAX_DIMS 8
#define TILE 32
#define TILE_ROWS 8

struct Strided {
    long long numel;
    int ndim;
    long long shape[MAX_DIMS];
    long long src_strides[MAX_DIMS];
    long long dst_strides[MAX_DIMS];
};

// A batch of 2-D transposes: x is the axis where the destination is contiguous, y the axis where
// the source is. Every other axis is a batch axis, walked through blockIdx.z.
struct Tiled {
    long long nx, ny;
    long long src_sx, dst_sy;
    long long batch;
    int nb;
    long long bshape[MAX_DIMS];
    long long bsrc[MAX_DIMS];
    long long bdst[MAX_DIMS];
};

struct __align__(16) V16 { uint64_t a, b; };

template <typename T>
__device__ __forceinline__ void strided_copy(T* __restrict__ dst, const T* __restrict__ src,
                                             const Strided& p) {
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < p.numel; i += step) {
        long long rem = i, so = 0, d = 0;
        for (int k = p.ndim - 1; k >= 0; --k) {
            long long idx = rem % p.shape[k];
            rem /= p.shape[k];
            so += idx * p.src_strides[k];
            d += idx * p.dst_strides[k];
        }
        dst[d] = src[so];
    }
}

template <typename T>
__device__ __forceinline__ void tiled_copy(T* __restrict__ dst, const T* __restrict__ src,
                                           const Tiled& p) {
    __shared__ T tile[TILE][TILE + 1];
    long long tiles_x = (p.nx + TILE - 1) / TILE;
    long long tiles_y = (p.ny + TILE - 1) / TILE;
    for (long long b = blockIdx.z; b < p.batch; b += gridDim.z) {
        long long rem = b, so = 0, d = 0;
        for (int k = p.nb - 1; k >= 0; --k) {
            long long idx = rem % p.bshape[k];
            rem /= p.bshape[k];
            so += idx * p.bsrc[k];
            d += idx * p.bdst[k];
        }
        for (long long ty = blockIdx.y; ty < tiles_y; ty += gridDim.y) {
            for (long long tx = blockIdx.x; tx < tiles_x; tx += gridDim.x) {
                long long x0 = tx * TILE, y0 = ty * TILE;
                // Read rows of x with threads along y: the source is contiguous in y.
                long long y = y0 + threadIdx.x;
                for (int r = threadIdx.y; r < TILE; r += TILE_ROWS) {
                    long long x = x0 + r;
                    if (x < p.nx && y < p.ny) tile[r][threadIdx.x] = src[so + x * p.src_sx + y];
                }
                __syncthreads();
                // Write with threads along x: the destination is contiguous in x.
                long long x = x0 + threadIdx.x;
                for (int r = threadIdx.y; r < TILE; r += TILE_ROWS) {
                    long long yy = y0 + r;
                    if (x < p.nx && yy < p.ny) dst[d + x + yy * p.dst_sy] = tile[threadIdx.x][r];
                }
                __syncthreads();
            }
        }
    }
}

#define DEFINE(BYTES, T)                                                                        \
    extern "C" __global__ void dlbridge_strided_copy_##BYTES(T* dst, const T* src, Strided p) { \
        strided_copy<T>(dst, src, p);                                                           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(TILE * TILE_ROWS)                              \
        dlbridge_tiled_copy_##BYTES(T* dst, const T* src, Tiled p) {                            \
        tiled_copy<T>(dst, src, p);                                                             \
    }

DEFINE(1, uint8_t)
DEFINE(2, uint16_t)
DEFINE(4, uint32_t)
DEFINE(8, uint64_t)
DEFINE(16, V16)
