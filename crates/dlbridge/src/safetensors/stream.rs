//! A checkpoint streamed group by group ([`crate::engine::stream`]): the plan of the groups a
//! caller names, over the checkpoint's shards.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::file::Checkpoint;
use crate::engine::{self, FileSet, GroupPlan, Item, LoadOptions, LoadStream, MappedFile};
use crate::error::{Error, Result};

impl FileSet for Checkpoint {
    fn file(&self, index: usize) -> Option<&MappedFile> {
        self.shards().get(index).map(|shard| shard.mapped())
    }
}

impl Checkpoint {
    /// Streams `groups` (each a name and the tensors it hands out, in order) onto
    /// `options.device`, group after group in the given order, keeping at most `ahead` loaded
    /// groups waiting ([`engine::stream`]); a tensor may appear in one group only.
    ///
    /// # Errors
    /// A name the checkpoint does not hold, or one named twice ([`Error::InvalidArgument`]),
    /// before anything is read; the loads' errors come from the iterator.
    pub fn stream(
        self,
        groups: &[(String, Vec<String>)],
        options: LoadOptions,
        ahead: usize,
    ) -> Result<LoadStream> {
        // Each shard's plan once, by name.
        let mut located: Vec<BTreeMap<String, Item>> = self
            .shards()
            .iter()
            .map(|shard| {
                let items = shard.items(|_| true)?;
                Ok(items.into_iter().map(|i| (i.name.clone(), i)).collect())
            })
            .collect::<Result<_>>()?;
        let mut plans = Vec::with_capacity(groups.len());
        for (name, tensors) in groups {
            let mut items = Vec::with_capacity(tensors.len());
            for tensor in tensors {
                let (shard, _) = self.info(tensor).ok_or_else(|| {
                    Error::InvalidArgument(format!("no tensor `{tensor}` in the checkpoint"))
                })?;
                let index = self
                    .shards()
                    .iter()
                    .position(|s| std::ptr::eq(s, shard))
                    .unwrap_or_default();
                let item = located[index].remove(tensor.as_str()).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "tensor `{tensor}` is named twice in the stream's groups"
                    ))
                })?;
                items.push((index, item));
            }
            plans.push(GroupPlan {
                name: name.clone(),
                items,
            });
        }
        engine::stream(Arc::new(self), plans, options, ahead)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::tensor::Tensor;

    /// Groups of a two-shard checkpoint in the caller's order, and the names refused before
    /// anything is read: one the checkpoint lacks, one named twice.
    #[test]
    fn groups_span_shards_and_bad_names_are_refused() {
        let folder =
            std::env::temp_dir().join(format!("dlbridge-st-stream-{}", std::process::id()));
        let a = Tensor::from_slice(&[1.0f32; 300], &[300]).unwrap();
        let b = Tensor::from_slice(&[2.0f32; 300], &[300]).unwrap();
        let c = Tensor::from_slice(&[3u8; 10], &[10]).unwrap();
        let index = crate::safetensors::save_sharded(
            &[("a", &a), ("b", &b), ("c", &c)],
            None,
            &folder,
            1500,
            &crate::engine::WriteOptions::default(),
            &mut |_, _| {},
        )
        .unwrap();
        let open = || Checkpoint::open(&index).unwrap();
        assert_eq!(open().shards().len(), 2);
        let groups = vec![
            ("second".to_owned(), vec!["c".to_owned(), "b".to_owned()]),
            ("first".to_owned(), vec!["a".to_owned()]),
        ];
        let got: Vec<_> = open()
            .stream(&groups, LoadOptions::new(Device::CPU), 1)
            .unwrap()
            .map(|g| g.unwrap())
            .collect();
        assert_eq!(got[0].name, "second");
        assert_eq!(got[0].tensors[0].1.to_vec::<u8>().unwrap(), vec![3u8; 10]);
        assert_eq!(
            got[0].tensors[1].1.to_vec::<f32>().unwrap(),
            vec![2.0f32; 300]
        );
        assert_eq!(
            got[1].tensors[0].1.to_vec::<f32>().unwrap(),
            vec![1.0f32; 300]
        );
        for bad in [
            vec![("g".to_owned(), vec!["nope".to_owned()])],
            vec![
                ("g".to_owned(), vec!["a".to_owned()]),
                ("h".to_owned(), vec!["a".to_owned()]),
            ],
        ] {
            assert!(matches!(
                open().stream(&bad, LoadOptions::new(Device::CPU), 1),
                Err(Error::InvalidArgument(_))
            ));
        }
        std::fs::remove_dir_all(&folder).unwrap();
    }
}
