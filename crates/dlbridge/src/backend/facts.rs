//! What dlbridge knows about a device kind, as plain data: each backend lists the kinds it serves
//! in a table of [`KindFacts`] (the `Backend` trait's `kinds`), and the core reads the table
//! ([`backend::facts`](fn@crate::backend::facts)) instead of matching on [`DeviceKind`]. A new kind is a new row
//! in its backend's table.

use crate::buffer::StorageMode;
use crate::device::DeviceKind;

/// The facts of one device kind: how its memory is addressed, which storage modes it has and
/// where each places memory, and how it goes to another process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KindFacts {
    /// The kind (its DLPack device type code is [`DeviceKind::to_raw`]).
    pub kind: DeviceKind,
    /// Whether a DLPack `data` pointer of this kind is an address (a Metal one is an opaque
    /// `id<MTLBuffer>`).
    pub addressable: bool,
    /// Whether the host reads and writes this memory directly.
    pub host_accessible: bool,
    /// The storage modes of the kind and where each places memory.
    pub storage: Storage,
    /// The storage mode of memory a foreign producer hands over on this kind.
    pub foreign_storage: StorageMode,
    /// How memory of this kind goes to another process.
    pub sharing: ShareRoute,
    /// Whether the kind has streams: a consumer names one to its producer, and dlbridge orders
    /// its own work on them.
    pub streams: bool,
    /// Whether a kernel faults on an element address that is not a multiple of its size (a CUDA
    /// fault poisons the context): such views are refused before any kernel sees them.
    pub faults_on_misaligned: bool,
    /// Whether the backend's file reader writes a file's bytes straight into existing memory of
    /// this kind (a load into a model's parameters); elsewhere they are loaded into new memory
    /// and copied in.
    pub reads_into: bool,
}

/// The storage modes of a device kind, and where an allocation asking for one lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// One mode whatever is asked (host memory: shared); the request is still recorded.
    Always(StorageMode),
    /// The kind names one mode (CUDA pinned host memory: shared): asking for another is an
    /// error. `placement` gives the kinds of the other modes, as for [`Storage::ByKind`].
    Names(StorageMode, Placement),
    /// Each mode is a kind of its own ([`Placement`]); `default` when nothing is asked.
    ByKind {
        /// The mode an allocation gets when nothing (not even the environment) asks for one.
        default: StorageMode,
        /// The kind each mode lands on.
        placement: Placement,
    },
    /// The modes are a property of each buffer on one kind (Metal); `default` when nothing is
    /// asked (the backend may refine it at run time).
    PerBuffer {
        /// The mode an allocation gets when nothing asks for one.
        default: StorageMode,
    },
}

/// The device kinds an allocation in each storage mode lands on (CUDA: `cuda`, `cuda_host`,
/// `cuda_managed`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Where `private` storage lands.
    pub private: DeviceKind,
    /// Where `shared` storage lands.
    pub shared: DeviceKind,
    /// Where `managed` storage lands.
    pub managed: DeviceKind,
}

impl Placement {
    /// The kind `mode` lands on.
    pub const fn of(&self, mode: StorageMode) -> DeviceKind {
        match mode {
            StorageMode::Private => self.private,
            StorageMode::Shared => self.shared,
            StorageMode::Managed => self.managed,
        }
    }
}

impl Storage {
    /// The mode an allocation gets when nothing asks for one.
    pub(crate) const fn default_mode(&self) -> StorageMode {
        match *self {
            Storage::Always(mode) | Storage::Names(mode, _) => mode,
            Storage::ByKind { default, .. } | Storage::PerBuffer { default } => default,
        }
    }

    /// Where each mode lands, for kinds whose modes are kinds.
    pub const fn placement(&self) -> Option<Placement> {
        match *self {
            Storage::Names(_, p) | Storage::ByKind { placement: p, .. } => Some(p),
            Storage::Always(_) | Storage::PerBuffer { .. } => None,
        }
    }
}

/// How memory of a device kind goes to another process (`crate::share`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShareRoute {
    /// It does not.
    None,
    /// Host memory in an anonymous shared file (`share::cpu`); `registered`: the file's mapping
    /// is registered with the kind's device through its backend's sharing capability (pinned
    /// host memory).
    HostFile {
        /// Whether the mapping is registered with the device.
        registered: bool,
    },
    /// Device memory, through its backend's sharing capability
    /// (the `Backend` trait's `sharing`).
    Device,
}
