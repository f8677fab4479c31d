//! The checkpoint index parser (`model.safetensors.index.json`) on hostile bytes.
//!
//! `Index::parse` is a pure function of the bytes (no file is opened), so it is fed them as they
//! come. Whatever it accepts is checked against an independent reading by `serde_json` (which
//! keeps the last of two equal keys where the parser refuses them):
//! - the bytes are UTF-8 JSON of an object with a `weight_map` object, and the parser's weight
//!   map is exactly that object's, every value a string;
//! - every shard path is non-empty, relative, free of NUL and of `..` and root components, so
//!   that joined to the index's folder it stays inside it; the shard list is the set of them;
//! - the metadata is absent exactly where `metadata` is absent or `null`, and holds each value's
//!   string, or for other values their JSON text.
//!
//! And whatever the reference finds valid is accepted, unless the parser names a key given
//! twice. Nothing may panic, overflow, or take long (nesting depth is bounded by `serde_json`).

#![no_main]

use std::path::{Component, Path};

use dlbridge::safetensors::Index;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

/// Whether `file` is a shard path the index may name.
fn inside(file: &str) -> bool {
    !file.is_empty()
        && !file.contains('\0')
        && Path::new(file)
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
}

/// The reference verdict on a JSON value read without the duplicate-key check.
fn valid(root: &Value) -> bool {
    let Value::Object(root) = root else {
        return false;
    };
    let metadata_ok = matches!(
        root.get("metadata"),
        None | Some(Value::Null | Value::Object(_))
    );
    let Some(Value::Object(weight_map)) = root.get("weight_map") else {
        return false;
    };
    metadata_ok
        && weight_map
            .values()
            .all(|file| file.as_str().is_some_and(inside))
}

fuzz_target!(|data: &[u8]| {
    let parsed = Index::parse(data, Path::new("fuzz.index.json"));
    let reference: Option<Value> = std::str::from_utf8(data)
        .ok()
        .and_then(|text| serde_json::from_str(text).ok());
    let index = match parsed {
        Ok(index) => index,
        Err(e) => {
            let says = e.to_string();
            assert!(says.contains("fuzz.index.json"), "{says}");
            if !says.contains("duplicate key") {
                assert!(
                    !reference.as_ref().is_some_and(valid),
                    "refused what the reference finds valid: {says}"
                );
            }
            return;
        }
    };
    let root = reference.expect("accepted bytes serde_json does not read");
    assert!(valid(&root), "accepted what the reference finds invalid");
    let Value::Object(root) = root else {
        unreachable!("valid() checked it is an object")
    };
    let Some(Value::Object(weight_map)) = root.get("weight_map") else {
        unreachable!("valid() checked the weight map")
    };
    assert_eq!(weight_map.len(), index.weight_map().len());
    for (name, file) in index.weight_map() {
        assert_eq!(weight_map.get(name).and_then(Value::as_str), Some(file.as_str()));
        assert!(inside(file), "{file:?}");
        assert!(Path::new("/folder").join(file).starts_with("/folder"));
        assert!(index.shards().contains(file.as_str()));
    }
    assert!(
        index
            .shards()
            .iter()
            .all(|shard| index.weight_map().values().any(|f| f == shard))
    );
    match (root.get("metadata"), index.metadata()) {
        (None | Some(Value::Null), None) => {}
        (Some(Value::Object(reference)), Some(metadata)) => {
            assert_eq!(reference.len(), metadata.len());
            for (key, value) in reference {
                let text = value.as_str().map_or_else(|| value.to_string(), str::to_owned);
                assert_eq!(metadata.get(key), Some(&text), "{key}");
            }
        }
        (reference, ours) => panic!("metadata {reference:?} read as {ours:?}"),
    }
});
