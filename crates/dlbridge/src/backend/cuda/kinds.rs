//! The CUDA device kinds as data ([`KindFacts`]): device memory, pinned host memory and managed
//! memory, each storage mode a kind of its own. Compiled with or without the backend (foreign
//! CUDA memory is described by the same facts).

use crate::backend::facts::{KindFacts, Placement, ShareRoute, Storage};
use crate::buffer::StorageMode;
use crate::device::DeviceKind;

const PLACEMENT: Placement = Placement {
    private: DeviceKind::Cuda,
    shared: DeviceKind::CudaHost,
    managed: DeviceKind::CudaManaged,
};

/// `cuda`, `cuda_host` and `cuda_managed`.
pub(crate) const KINDS: &[KindFacts] = &[
    KindFacts {
        kind: DeviceKind::Cuda,
        addressable: true,
        host_accessible: false,
        storage: Storage::ByKind {
            default: StorageMode::Private,
            placement: PLACEMENT,
        },
        foreign_storage: StorageMode::Private,
        sharing: ShareRoute::Device,
        streams: true,
        faults_on_misaligned: true,
        reads_into: true,
    },
    KindFacts {
        kind: DeviceKind::CudaHost,
        addressable: true,
        host_accessible: true,
        storage: Storage::Names(StorageMode::Shared, PLACEMENT),
        foreign_storage: StorageMode::Shared,
        sharing: ShareRoute::HostFile { registered: true },
        streams: true,
        faults_on_misaligned: true,
        reads_into: false,
    },
    KindFacts {
        kind: DeviceKind::CudaManaged,
        addressable: true,
        host_accessible: true,
        storage: Storage::Names(StorageMode::Managed, PLACEMENT),
        foreign_storage: StorageMode::Managed,
        sharing: ShareRoute::None,
        streams: true,
        faults_on_misaligned: true,
        reads_into: false,
    },
];
