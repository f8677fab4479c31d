//! What importing a foreign `kDLMetal` tensor does: share the producer's buffer, copy it on the
//! GPU, convert its elements, or refuse. Platform-free: the Metal runtime executes the plan.
//!
//! DLPack's `data` for `kDLMetal` is the producer's `id<MTLBuffer>`, and `byte_offset` locates the
//! first element inside it. dlbridge keeps every Metal buffer it hands to the host reachable from
//! the host, so a producer's **private** buffer (which only the GPU can address) is copied by a GPU
//! blit into a new shared buffer rather than shared; shared and managed buffers are shared as they
//! are (retained, with the producer kept alive until the last view is dropped).
//!
//! | producer storage | `copy=None` | `copy=True` | `copy=False` |
//! | --- | --- | --- | --- |
//! | shared / managed | share | GPU copy | share |
//! | private | GPU copy into shared | GPU copy into shared | `CopyRequired` |
//! | any, other dtype asked | convert | convert | `CopyRequired` |
//!
//! As with MLX and PyTorch, synchronization stays explicit: the producer must have finished
//! writing (`torch.mps.synchronize()`, `mx.eval`) before the import, because DLPack has no stream
//! for Metal.

use crate::buffer::StorageMode;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// What to do with a foreign Metal buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ImportPlan {
    /// Wrap the producer's buffer without copying.
    Share,
    /// Copy the view's elements on the GPU into a new shared buffer (a blit for compact views,
    /// the strided-copy kernel otherwise).
    Copy,
    /// Convert the elements to another dtype, in new memory. When `stage_on_gpu`, the producer's
    /// buffer is private and is first copied on the GPU into shared memory the host can read.
    Convert {
        /// The source must be copied into shared memory before the host converts it.
        stage_on_gpu: bool,
    },
}

/// Decides how to import a foreign Metal view whose buffer has `storage`, given the consumer's
/// `copy` request (`None`: only when needed) and the dtype it wants (`None`: the source's).
pub(crate) fn plan_import(
    storage: StorageMode,
    copy: Option<bool>,
    source: DType,
    target: Option<DType>,
) -> Result<ImportPlan> {
    let convert = target.is_some_and(|t| t != source);
    match (copy, convert, storage) {
        (Some(false), true, _) => Err(Error::CopyRequired(format!(
            "converting Metal {source} elements to {} needs new memory, and copy=False was given",
            target.unwrap_or(source)
        ))),
        (Some(false), false, StorageMode::Private) => Err(Error::CopyRequired(
            "the producer's Metal buffer has private storage, which the host cannot address; \
             dlbridge copies it into shared memory, and copy=False was given"
                .into(),
        )),
        (_, true, storage) => Ok(ImportPlan::Convert {
            stage_on_gpu: storage == StorageMode::Private,
        }),
        (Some(true), false, _) | (None, false, StorageMode::Private) => Ok(ImportPlan::Copy),
        (None | Some(false), false, StorageMode::Shared | StorageMode::Managed) => {
            Ok(ImportPlan::Share)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODES: [StorageMode; 3] = [
        StorageMode::Shared,
        StorageMode::Managed,
        StorageMode::Private,
    ];

    #[test]
    fn host_visible_buffers_are_shared_unless_a_copy_is_asked() {
        for storage in [StorageMode::Shared, StorageMode::Managed] {
            for copy in [None, Some(false)] {
                assert_eq!(
                    plan_import(storage, copy, DType::F32, None).unwrap(),
                    ImportPlan::Share
                );
                // Asking for the dtype it already has changes nothing.
                assert_eq!(
                    plan_import(storage, copy, DType::F32, Some(DType::F32)).unwrap(),
                    ImportPlan::Share
                );
            }
            assert_eq!(
                plan_import(storage, Some(true), DType::F32, None).unwrap(),
                ImportPlan::Copy
            );
        }
    }

    #[test]
    fn private_buffers_are_copied_or_refused() {
        for copy in [None, Some(true)] {
            assert_eq!(
                plan_import(StorageMode::Private, copy, DType::F16, None).unwrap(),
                ImportPlan::Copy
            );
        }
        let err = plan_import(StorageMode::Private, Some(false), DType::F16, None).unwrap_err();
        assert!(
            matches!(err, Error::CopyRequired(ref m) if m.contains("private")),
            "{err}"
        );
    }

    #[test]
    fn dtype_changes_convert_and_stage_private_sources() {
        for storage in MODES {
            for copy in [None, Some(true)] {
                assert_eq!(
                    plan_import(storage, copy, DType::F16, Some(DType::F32)).unwrap(),
                    ImportPlan::Convert {
                        stage_on_gpu: storage == StorageMode::Private
                    }
                );
            }
            let err = plan_import(storage, Some(false), DType::F16, Some(DType::F32)).unwrap_err();
            assert!(
                matches!(err, Error::CopyRequired(ref m) if m.contains("float16") && m.contains("float32")),
                "{err}"
            );
        }
    }
}
