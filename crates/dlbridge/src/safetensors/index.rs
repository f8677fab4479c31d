//! The index of a sharded checkpoint (`model.safetensors.index.json`), parsed from its bytes: no
//! path is opened here, so the parser is a pure function of its input (and fuzzed as one).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path};

use serde_json::Value;

use crate::error::{Result, invalid_file};

use super::header::{MAX_HEADER_LEN, parse_strict_json};

/// A parsed and validated checkpoint index: `{"metadata": {..}, "weight_map": {tensor: shard}}`.
///
/// Every shard is a relative path of plain names inside the index's folder (no `..`, no root,
/// no NUL), every tensor is placed in exactly one shard (a name given twice is refused, as any
/// key given twice in the JSON is), and the text is at most [`MAX_HEADER_LEN`] bytes of UTF-8.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Index {
    metadata: Option<BTreeMap<String, String>>,
    weight_map: BTreeMap<String, String>,
}

impl Index {
    /// Parses the index `bytes`, naming `path` in errors
    /// ([`Error::InvalidFile`](crate::Error::InvalidFile)): text over [`MAX_HEADER_LEN`] bytes, not UTF-8 or not a
    /// JSON object, a key given twice at any depth, `metadata` that is not an object (or `null`),
    /// no `weight_map` object, a `weight_map` value that is not a string, or a shard path that
    /// is empty, absolute, leaves the folder (`..`), or holds a NUL byte.
    ///
    /// String metadata values are kept as they are; others (such as `total_size`) as their JSON
    /// text. Keys other than `metadata` and `weight_map` are ignored.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Index> {
        let invalid = |reason: String| invalid_file(path, reason);
        if bytes.len() as u64 > MAX_HEADER_LEN {
            return Err(invalid(format!(
                "the index is {} bytes, over the limit of {MAX_HEADER_LEN}",
                bytes.len()
            )));
        }
        let text = std::str::from_utf8(bytes).map_err(|e| {
            invalid(format!(
                "not UTF-8 (invalid byte at offset {})",
                e.valid_up_to()
            ))
        })?;
        let value = parse_strict_json(text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
        let Value::Object(mut root) = value else {
            return Err(invalid("the index is not a JSON object".into()));
        };
        let metadata = match root.remove("metadata") {
            None | Some(Value::Null) => None,
            Some(Value::Object(map)) => Some(
                map.into_iter()
                    .map(|(key, value)| match value {
                        Value::String(text) => (key, text),
                        other => (key, other.to_string()),
                    })
                    .collect(),
            ),
            Some(_) => return Err(invalid("`metadata` is not an object".into())),
        };
        let Some(Value::Object(entries)) = root.remove("weight_map") else {
            return Err(invalid("the index has no `weight_map` object".into()));
        };
        let mut weight_map = BTreeMap::new();
        for (name, file) in entries {
            let Value::String(file) = file else {
                return Err(invalid(format!(
                    "`weight_map` entry `{name}` is not a file name"
                )));
            };
            if !is_inside(&file) {
                return Err(invalid(format!(
                    "shard `{}` (of tensor `{name}`) is not a path inside the index's folder",
                    file.escape_debug()
                )));
            }
            weight_map.insert(name, file);
        }
        Ok(Index {
            metadata,
            weight_map,
        })
    }

    /// The index's `metadata` (`None` where it has none, or `null`).
    pub fn metadata(&self) -> Option<&BTreeMap<String, String>> {
        self.metadata.as_ref()
    }

    /// Tensor name → shard path (relative to the index's folder), in name order.
    pub fn weight_map(&self) -> &BTreeMap<String, String> {
        &self.weight_map
    }

    /// The distinct shard paths, in name order.
    pub fn shards(&self) -> BTreeSet<&str> {
        self.weight_map.values().map(String::as_str).collect()
    }
}

/// Whether `file` is a relative path of plain names (`.` allowed), not empty and without NUL.
fn is_inside(file: &str) -> bool {
    !file.is_empty()
        && !file.contains('\0')
        && Path::new(file)
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Index> {
        Index::parse(text.as_bytes(), Path::new("model.safetensors.index.json"))
    }

    #[test]
    fn a_good_index() {
        let index = parse(
            r#"{"metadata": {"total_size": 24, "format": "pt"}, "weight_map": {"b": "two.st", "a": "./one.st", "c": "sub/two.st"}, "other": [1]}"#,
        )
        .unwrap();
        let metadata = index.metadata().unwrap();
        assert_eq!(metadata["total_size"], "24");
        assert_eq!(metadata["format"], "pt");
        assert_eq!(index.weight_map()["a"], "./one.st");
        assert_eq!(
            index.shards().into_iter().collect::<Vec<_>>(),
            ["./one.st", "sub/two.st", "two.st"]
        );
        assert_eq!(parse(r#"{"weight_map": {}}"#).unwrap().metadata(), None);
        assert_eq!(
            parse(r#"{"metadata": null, "weight_map": {}}"#)
                .unwrap()
                .metadata(),
            None
        );
    }

    #[test]
    fn bad_indexes_say_why() {
        for (text, says) in [
            ("[]", "not a JSON object"),
            ("{", "not valid JSON"),
            (r#"{"metadata": {}}"#, "no `weight_map` object"),
            (r#"{"weight_map": []}"#, "no `weight_map` object"),
            (
                r#"{"metadata": 3, "weight_map": {}}"#,
                "`metadata` is not an object",
            ),
            (
                r#"{"weight_map": {"a": 1}}"#,
                "entry `a` is not a file name",
            ),
            (r#"{"weight_map": {"a": ""}}"#, "not a path inside"),
            (r#"{"weight_map": {"a": "../x.st"}}"#, "not a path inside"),
            (r#"{"weight_map": {"a": "/etc/x.st"}}"#, "not a path inside"),
            (r#"{"weight_map": {"a": "x/../../y"}}"#, "not a path inside"),
            (r#"{"weight_map": {"a": "x\u0000y"}}"#, "not a path inside"),
            (
                r#"{"weight_map": {"a": "x", "a": "y"}}"#,
                "duplicate key `a`",
            ),
            (r#"{"weight_map": {}, "weight_map": {}}"#, "duplicate key"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(says), "{text}: {e}");
            assert!(e.contains("model.safetensors.index.json"), "{e}");
        }
        let e = Index::parse(b"{\"weight_map\": {\"\xff\": \"x\"}}", Path::new("i.json"));
        assert!(e.unwrap_err().to_string().contains("not UTF-8"));
        let huge = vec![b' '; MAX_HEADER_LEN as usize + 1];
        let e = Index::parse(&huge, Path::new("i.json")).unwrap_err();
        assert!(e.to_string().contains("over the limit"), "{e}");
    }
}
