//! The DLPack 1.3 C ABI, written out by hand from the specification.
//!
//! These are plain `#[repr(C)]` mirrors of `dlpack.h`. Nothing here is validated: a value of
//! these types that came from another library is trusted for nothing but its deleter (see
//! [`crate::dlpack`] for the checks made at the border).

use std::ffi::{c_char, c_int, c_void};

/// The major version of DLPack this crate speaks.
pub const DLPACK_MAJOR_VERSION: u32 = 1;
/// The minor version of DLPack this crate speaks.
pub const DLPACK_MINOR_VERSION: u32 = 3;

/// Bit 0 of [`DLManagedTensorVersioned::flags`]: the tensor must not be written to.
pub const DLPACK_FLAG_BITMASK_READ_ONLY: u64 = 1 << 0;
/// Bit 1: the producer copied the data to make this tensor (for example because the consumer asked
/// for another device or for `copy=True`).
pub const DLPACK_FLAG_BITMASK_IS_COPIED: u64 = 1 << 1;
/// Bit 2: sub-byte elements (such as 4-bit floats) are each padded to a whole byte instead of being
/// packed.
pub const DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED: u64 = 1 << 2;

/// `DLPackVersion`: the ABI version a versioned tensor was produced with.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DLPackVersion {
    /// Incompatible ABI changes bump the major version.
    pub major: u32,
    /// Compatible additions bump the minor version.
    pub minor: u32,
}

/// `DLDeviceType` values, kept as plain integers so that an unknown value read from a foreign
/// tensor is never an invalid Rust enum.
pub type DLDeviceType = i32;

/// `kDLCPU`: host memory.
pub const K_DL_CPU: DLDeviceType = 1;
/// `kDLCUDA`: CUDA device memory.
pub const K_DL_CUDA: DLDeviceType = 2;
/// `kDLCUDAHost`: pinned CUDA host memory (`cudaMallocHost`).
pub const K_DL_CUDA_HOST: DLDeviceType = 3;
/// `kDLOpenCL`.
pub const K_DL_OPENCL: DLDeviceType = 4;
/// `kDLVulkan`.
pub const K_DL_VULKAN: DLDeviceType = 7;
/// `kDLMetal`: `data` is an `id<MTLBuffer>`.
pub const K_DL_METAL: DLDeviceType = 8;
/// `kDLVPI`: Verilog simulator buffers.
pub const K_DL_VPI: DLDeviceType = 9;
/// `kDLROCM`.
pub const K_DL_ROCM: DLDeviceType = 10;
/// `kDLROCMHost`.
pub const K_DL_ROCM_HOST: DLDeviceType = 11;
/// `kDLExtDev`: reserved for extension devices.
pub const K_DL_EXT_DEV: DLDeviceType = 12;
/// `kDLCUDAManaged`: CUDA managed (unified) memory.
pub const K_DL_CUDA_MANAGED: DLDeviceType = 13;
/// `kDLOneAPI`: Unified shared memory through oneAPI.
pub const K_DL_ONE_API: DLDeviceType = 14;
/// `kDLWebGPU`.
pub const K_DL_WEBGPU: DLDeviceType = 15;
/// `kDLHexagon`: Qualcomm Hexagon DSP.
pub const K_DL_HEXAGON: DLDeviceType = 16;
/// `kDLMAIA`: Microsoft MAIA.
pub const K_DL_MAIA: DLDeviceType = 17;
/// `kDLTrn`: AWS Trainium.
pub const K_DL_TRN: DLDeviceType = 18;

/// `DLDevice`: a device type and an index.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DLDevice {
    /// One of the `K_DL_*` device types.
    pub device_type: DLDeviceType,
    /// The device's ordinal (0 for the host).
    pub device_id: i32,
}

/// `DLDataTypeCode` values.
pub type DLDataTypeCode = u8;

/// `kDLInt`: signed integer.
pub const K_DL_INT: DLDataTypeCode = 0;
/// `kDLUInt`: unsigned integer.
pub const K_DL_UINT: DLDataTypeCode = 1;
/// `kDLFloat`: IEEE floating point.
pub const K_DL_FLOAT: DLDataTypeCode = 2;
/// `kDLOpaqueHandle`: an opaque pointer-sized handle.
pub const K_DL_OPAQUE_HANDLE: DLDataTypeCode = 3;
/// `kDLBfloat`: brain floating point.
pub const K_DL_BFLOAT: DLDataTypeCode = 4;
/// `kDLComplex`: complex number (`bits` counts both parts).
pub const K_DL_COMPLEX: DLDataTypeCode = 5;
/// `kDLBool`: boolean (8 bits in practice).
pub const K_DL_BOOL: DLDataTypeCode = 6;
/// `kDLFloat8_e3m4`.
pub const K_DL_FLOAT8_E3M4: DLDataTypeCode = 7;
/// `kDLFloat8_e4m3`.
pub const K_DL_FLOAT8_E4M3: DLDataTypeCode = 8;
/// `kDLFloat8_e4m3b11fnuz`.
pub const K_DL_FLOAT8_E4M3B11FNUZ: DLDataTypeCode = 9;
/// `kDLFloat8_e4m3fn`.
pub const K_DL_FLOAT8_E4M3FN: DLDataTypeCode = 10;
/// `kDLFloat8_e4m3fnuz`.
pub const K_DL_FLOAT8_E4M3FNUZ: DLDataTypeCode = 11;
/// `kDLFloat8_e5m2`.
pub const K_DL_FLOAT8_E5M2: DLDataTypeCode = 12;
/// `kDLFloat8_e5m2fnuz`.
pub const K_DL_FLOAT8_E5M2FNUZ: DLDataTypeCode = 13;
/// `kDLFloat8_e8m0fnu`.
pub const K_DL_FLOAT8_E8M0FNU: DLDataTypeCode = 14;
/// `kDLFloat6_e2m3fn`.
pub const K_DL_FLOAT6_E2M3FN: DLDataTypeCode = 15;
/// `kDLFloat6_e3m2fn`.
pub const K_DL_FLOAT6_E3M2FN: DLDataTypeCode = 16;
/// `kDLFloat4_e2m1fn`.
pub const K_DL_FLOAT4_E2M1FN: DLDataTypeCode = 17;

/// `DLDataType`: element type code, bits per lane and number of lanes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DLDataType {
    /// One of the `K_DL_*` type codes.
    pub code: DLDataTypeCode,
    /// Bits per lane.
    pub bits: u8,
    /// Lanes per element (1 for scalars).
    pub lanes: u16,
}

/// `DLTensor`: the plain descriptor of a strided tensor.
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    /// Host or device pointer, or an opaque handle (`id<MTLBuffer>` for Metal) that must never be
    /// offset or dereferenced.
    pub data: *mut c_void,
    /// Where `data` lives.
    pub device: DLDevice,
    /// Number of dimensions.
    pub ndim: i32,
    /// Element type.
    pub dtype: DLDataType,
    /// `ndim` extents.
    pub shape: *mut i64,
    /// `ndim` strides in elements, or NULL for compact row-major (producers older than 1.2 only).
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

/// `DLManagedTensor`: the legacy (unversioned) owning wrapper, capsule name `"dltensor"`.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The descriptor.
    pub dl_tensor: DLTensor,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Releases the tensor; may be NULL.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLManagedTensorVersioned`: the versioned owning wrapper, capsule name `"dltensor_versioned"`.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    /// The ABI version the producer wrote.
    pub version: DLPackVersion,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Releases the tensor; may be NULL.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// `DLPACK_FLAG_BITMASK_*` bits.
    pub flags: u64,
    /// The descriptor.
    pub dl_tensor: DLTensor,
}

/// `DLPackManagedTensorAllocator`: a producer allocates a new tensor shaped like `prototype`
/// (only dtype, ndim, shape and device are read). Returns 0, or -1 after calling `set_error`
/// exactly once.
pub type DLPackManagedTensorAllocator = unsafe extern "C" fn(
    prototype: *mut DLTensor,
    out: *mut *mut DLManagedTensorVersioned,
    error_ctx: *mut c_void,
    set_error: Option<
        unsafe extern "C" fn(error_ctx: *mut c_void, kind: *const c_char, message: *const c_char),
    >,
) -> c_int;

/// `DLPackManagedTensorFromPyObjectNoSync`: exports a Python object of the producer's type as an
/// owning versioned tensor, without stream synchronization. 0, or -1 with a Python exception set.
pub type DLPackManagedTensorFromPyObjectNoSync =
    unsafe extern "C" fn(py_object: *mut c_void, out: *mut *mut DLManagedTensorVersioned) -> c_int;

/// `DLPackDLTensorFromPyObjectNoSync`: fills a non-owning descriptor valid until control returns
/// to the producer's object. 0, or -1 with a Python exception set.
pub type DLPackDLTensorFromPyObjectNoSync =
    unsafe extern "C" fn(py_object: *mut c_void, out: *mut DLTensor) -> c_int;

/// `DLPackCurrentWorkStream`: the producer's current stream on a device (NULL for the CPU).
/// 0, or -1 with a Python exception set.
pub type DLPackCurrentWorkStream = unsafe extern "C" fn(
    device_type: DLDeviceType,
    device_id: i32,
    out_current_stream: *mut *mut c_void,
) -> c_int;

/// `DLPackManagedTensorToPyObjectNoSync`: imports an owning tensor (ownership is stolen) as a
/// Python object of the producer's type. 0, or -1 with a Python exception set.
pub type DLPackManagedTensorToPyObjectNoSync = unsafe extern "C" fn(
    tensor: *mut DLManagedTensorVersioned,
    out_py_object: *mut *mut c_void,
) -> c_int;

/// `DLPackExchangeAPIHeader`: the part of the exchange table that stays stable across versions.
#[repr(C)]
#[derive(Debug)]
pub struct DLPackExchangeAPIHeader {
    /// The table's DLPack version; a consumer checks the major version before using it.
    pub version: DLPackVersion,
    /// An older table, for consumers of an older major version (NULL if none).
    pub prev_api: *mut DLPackExchangeAPIHeader,
}

/// `DLPackExchangeAPI`: the C function table a type publishes as `__dlpack_c_exchange_api__` (a
/// capsule named `"dlpack_exchange_api"`), for exchanges without Python calls (DLPack 1.3).
#[repr(C)]
#[derive(Debug)]
pub struct DLPackExchangeAPI {
    /// Version and chain.
    pub header: DLPackExchangeAPIHeader,
    /// Never NULL.
    pub managed_tensor_allocator: Option<DLPackManagedTensorAllocator>,
    /// Never NULL.
    pub managed_tensor_from_py_object_no_sync: Option<DLPackManagedTensorFromPyObjectNoSync>,
    /// Never NULL.
    pub managed_tensor_to_py_object_no_sync: Option<DLPackManagedTensorToPyObjectNoSync>,
    /// May be NULL.
    pub dltensor_from_py_object_no_sync: Option<DLPackDLTensorFromPyObjectNoSync>,
    /// Never NULL.
    pub current_work_stream: Option<DLPackCurrentWorkStream>,
}

// The ABI is fixed by the C header; these assertions catch any drift at compile time.
#[cfg(target_pointer_width = "64")]
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<DLPackVersion>() == 8);
    assert!(size_of::<DLDevice>() == 8);
    assert!(size_of::<DLDataType>() == 4);
    assert!(size_of::<DLTensor>() == 48);
    assert!(align_of::<DLTensor>() == 8);
    assert!(offset_of!(DLTensor, data) == 0);
    assert!(offset_of!(DLTensor, device) == 8);
    assert!(offset_of!(DLTensor, ndim) == 16);
    assert!(offset_of!(DLTensor, dtype) == 20);
    assert!(offset_of!(DLTensor, shape) == 24);
    assert!(offset_of!(DLTensor, strides) == 32);
    assert!(offset_of!(DLTensor, byte_offset) == 40);
    assert!(size_of::<DLManagedTensor>() == 64);
    assert!(offset_of!(DLManagedTensor, dl_tensor) == 0);
    assert!(offset_of!(DLManagedTensor, manager_ctx) == 48);
    assert!(offset_of!(DLManagedTensor, deleter) == 56);
    assert!(size_of::<DLManagedTensorVersioned>() == 80);
    assert!(offset_of!(DLManagedTensorVersioned, version) == 0);
    assert!(offset_of!(DLManagedTensorVersioned, manager_ctx) == 8);
    assert!(offset_of!(DLManagedTensorVersioned, deleter) == 16);
    assert!(offset_of!(DLManagedTensorVersioned, flags) == 24);
    assert!(offset_of!(DLManagedTensorVersioned, dl_tensor) == 32);
    assert!(size_of::<DLPackExchangeAPIHeader>() == 16);
    assert!(size_of::<DLPackExchangeAPI>() == 56);
    assert!(offset_of!(DLPackExchangeAPI, current_work_stream) == 48);
};
