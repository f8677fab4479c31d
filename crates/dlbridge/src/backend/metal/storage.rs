//! Storage modes of Metal buffers: which one a new allocation gets, and what a foreign buffer's
//! raw `MTLStorageMode` means. Platform-free, so the rules are tested on every host.
//!
//! | mode | `MTLStorageMode` | host access | where it exists |
//! | --- | --- | --- | --- |
//! | [`StorageMode::Shared`] | `Shared` (0) | `contents()`, coherent after the GPU work completes | everywhere |
//! | [`StorageMode::Managed`] | `Managed` (1) | `contents()`; host writes need `didModifyRange:`, GPU writes need a blit `synchronizeResource:` before the host reads | macOS and Mac Catalyst only |
//! | [`StorageMode::Private`] | `Private` (2) | none: reach it with a GPU blit | everywhere |
//!
//! On a unified-memory GPU (every Apple-silicon Mac) the host and the GPU share one memory, and
//! a managed buffer behaves as a shared one: there is one copy of the bytes, and
//! `didModifyRange:`/`synchronizeResource:` have nothing to move. dlbridge still issues both for
//! managed buffers, so the same code is right on a discrete GPU.
//!
//! # Default mode
//! `DLBRIDGE_METAL_STORAGE_MODE` (`private`, `shared` or `managed`, any case) picks the mode of
//! allocations that do not name one. It is read once per process; an unknown value, or `managed`
//! where the OS has no managed mode, is reported with a warning and ignored. Unset, the
//! process-wide `DLBRIDGE_STORAGE_MODE` ([`crate::storage`]) applies, unless it names managed
//! storage where the OS has none. With neither, the default is `shared` on unified-memory devices
//! (the memory other frameworks — MLX, PyTorch MPS — can share without copies, and the host can
//! read) and `private` on discrete GPUs (where shared memory lives across the PCIe bus).
//! [`resolve_with_source`] says which of these decided.

use std::str::FromStr;

use crate::buffer::StorageMode;
use crate::error::{Error, Result};
use crate::storage::{Resolved, Source};

/// The environment variable that sets the default storage mode of Metal allocations.
pub const STORAGE_MODE_ENV: &str = "DLBRIDGE_METAL_STORAGE_MODE";

/// `MTLStorageModeShared`.
pub const MTL_STORAGE_SHARED: u64 = 0;
/// `MTLStorageModeManaged`.
pub const MTL_STORAGE_MANAGED: u64 = 1;
/// `MTLStorageModePrivate`.
pub const MTL_STORAGE_PRIVATE: u64 = 2;
/// `MTLStorageModeMemoryless` (textures only: a buffer never has it).
pub const MTL_STORAGE_MEMORYLESS: u64 = 3;

/// Whether the operating system dlbridge was built for has `MTLStorageModeManaged` (macOS and Mac
/// Catalyst do; iOS, tvOS and visionOS do not).
pub const MANAGED_AVAILABLE: bool = cfg!(any(target_os = "macos", target_env = "macabi"));

/// The dlbridge mode of a raw `MTLStorageMode` (as a foreign buffer reports it).
pub fn from_raw(raw: u64) -> Result<StorageMode> {
    match raw {
        MTL_STORAGE_SHARED => Ok(StorageMode::Shared),
        MTL_STORAGE_MANAGED => Ok(StorageMode::Managed),
        MTL_STORAGE_PRIVATE => Ok(StorageMode::Private),
        MTL_STORAGE_MEMORYLESS => Err(Error::UnsupportedDevice(
            "a memoryless Metal resource has no memory to share".into(),
        )),
        other => Err(Error::UnsupportedDevice(format!(
            "unknown MTLStorageMode {other}"
        ))),
    }
}

/// The raw `MTLStorageMode` of a dlbridge mode.
pub const fn to_raw(mode: StorageMode) -> u64 {
    match mode {
        StorageMode::Shared => MTL_STORAGE_SHARED,
        StorageMode::Managed => MTL_STORAGE_MANAGED,
        StorageMode::Private => MTL_STORAGE_PRIVATE,
    }
}

/// Whether the host may address a buffer of this mode through `contents()`.
pub const fn is_host_visible(mode: StorageMode) -> bool {
    !matches!(mode, StorageMode::Private)
}

/// What the environment asked for, parsed once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnvChoice {
    /// The variable is unset or empty.
    Unset,
    /// A valid mode.
    Mode(StorageMode),
    /// A value that names no usable mode; the text explains it, for a warning.
    Invalid(String),
}

/// Parses the value of [`STORAGE_MODE_ENV`]; `managed_available` says whether the OS has managed
/// storage.
pub fn parse_env(value: Option<&str>, managed_available: bool) -> EnvChoice {
    let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return EnvChoice::Unset;
    };
    match StorageMode::from_str(value) {
        Ok(StorageMode::Managed) if !managed_available => EnvChoice::Invalid(format!(
            "{STORAGE_MODE_ENV}={value:?}: managed storage exists only on macOS; ignored"
        )),
        Ok(mode) => EnvChoice::Mode(mode),
        Err(_) => EnvChoice::Invalid(format!(
            "{STORAGE_MODE_ENV}={value:?} is not private, shared or managed; ignored"
        )),
    }
}

/// The mode allocations on a device get when they do not name one.
pub fn default_mode(env: &EnvChoice, unified_memory: bool) -> StorageMode {
    match env {
        EnvChoice::Mode(mode) => *mode,
        EnvChoice::Unset | EnvChoice::Invalid(_) => {
            if unified_memory {
                StorageMode::Shared
            } else {
                StorageMode::Private
            }
        }
    }
}

/// The mode an allocation gets: the one asked for, or the device default. Asking for managed
/// storage where the OS has none is an error (it is not silently replaced).
pub fn resolve(
    requested: Option<StorageMode>,
    default: StorageMode,
    managed_available: bool,
) -> Result<StorageMode> {
    match requested {
        None => Ok(default),
        Some(StorageMode::Managed) if !managed_available => Err(Error::InvalidArgument(
            "managed Metal storage exists only on macOS; use shared (on unified memory it is the \
             same memory) or private"
                .into(),
        )),
        Some(mode) => Ok(mode),
    }
}

/// The mode an allocation on a Metal device gets and where it came from: `requested`; else
/// `DLBRIDGE_METAL_STORAGE_MODE` (`metal_env`); else `DLBRIDGE_STORAGE_MODE` (`generic_env`, unless
/// it names managed storage where the OS has none); else the device's default ([`default_mode`]).
pub fn resolve_with_source(
    requested: Option<StorageMode>,
    metal_env: &EnvChoice,
    generic_env: Option<StorageMode>,
    unified_memory: bool,
    managed_available: bool,
) -> Result<Resolved> {
    let generic = generic_env.filter(|&m| m != StorageMode::Managed || managed_available);
    let (mode, source) = match (requested, metal_env, generic) {
        (Some(mode), _, _) => (
            resolve(Some(mode), mode, managed_available)?,
            Source::Explicit,
        ),
        (None, EnvChoice::Mode(mode), _) => (*mode, Source::Environment),
        (None, _, Some(mode)) => (mode, Source::Environment),
        (None, _, None) => (default_mode(metal_env, unified_memory), Source::Default),
    };
    Ok(Resolved { mode, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_modes_round_trip() {
        for mode in [
            StorageMode::Shared,
            StorageMode::Managed,
            StorageMode::Private,
        ] {
            assert_eq!(from_raw(to_raw(mode)).unwrap(), mode);
        }
        assert!(matches!(
            from_raw(MTL_STORAGE_MEMORYLESS),
            Err(Error::UnsupportedDevice(_))
        ));
        assert!(from_raw(7).is_err());
        assert!(is_host_visible(StorageMode::Managed));
        assert!(!is_host_visible(StorageMode::Private));
    }

    #[test]
    fn environment_parsing() {
        assert_eq!(parse_env(None, true), EnvChoice::Unset);
        assert_eq!(parse_env(Some("  "), true), EnvChoice::Unset);
        assert_eq!(
            parse_env(Some("Shared"), true),
            EnvChoice::Mode(StorageMode::Shared)
        );
        assert_eq!(
            parse_env(Some(" PRIVATE "), false),
            EnvChoice::Mode(StorageMode::Private)
        );
        assert_eq!(
            parse_env(Some("managed"), true),
            EnvChoice::Mode(StorageMode::Managed)
        );
        let EnvChoice::Invalid(why) = parse_env(Some("managed"), false) else {
            panic!("managed must be refused where the OS lacks it");
        };
        assert!(why.contains("only on macOS"), "{why}");
        let EnvChoice::Invalid(why) = parse_env(Some("gpu"), true) else {
            panic!("an unknown mode must be refused");
        };
        assert!(why.contains("\"gpu\""), "{why}");
    }

    #[test]
    fn defaults_follow_the_memory_architecture() {
        assert_eq!(default_mode(&EnvChoice::Unset, true), StorageMode::Shared);
        assert_eq!(default_mode(&EnvChoice::Unset, false), StorageMode::Private);
        let bad = EnvChoice::Invalid("x".into());
        assert_eq!(default_mode(&bad, true), StorageMode::Shared);
        assert_eq!(default_mode(&bad, false), StorageMode::Private);
        let managed = EnvChoice::Mode(StorageMode::Managed);
        assert_eq!(default_mode(&managed, true), StorageMode::Managed);
    }

    #[test]
    fn resolution_with_its_source() {
        use StorageMode::*;
        let r = |mode, source| Resolved { mode, source };
        let unset = EnvChoice::Unset;
        let metal = EnvChoice::Mode(Private);
        let bad = EnvChoice::Invalid("x".into());
        let go = |req, env: &EnvChoice, generic, unified, managed| {
            resolve_with_source(req, env, generic, unified, managed).unwrap()
        };
        assert_eq!(
            go(None, &unset, None, true, true),
            r(Shared, Source::Default)
        );
        assert_eq!(
            go(None, &bad, None, false, true),
            r(Private, Source::Default)
        );
        assert_eq!(
            go(None, &unset, Some(Managed), true, true),
            r(Managed, Source::Environment)
        );
        // The Metal variable wins over the process-wide one.
        assert_eq!(
            go(None, &metal, Some(Shared), true, true),
            r(Private, Source::Environment)
        );
        // Process-wide managed where the OS has none: ignored, not an error.
        assert_eq!(
            go(None, &unset, Some(Managed), true, false),
            r(Shared, Source::Default)
        );
        assert_eq!(
            go(Some(Shared), &metal, Some(Private), false, true),
            r(Shared, Source::Explicit)
        );
        assert!(matches!(
            resolve_with_source(Some(Managed), &unset, None, true, false),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn resolution() {
        assert_eq!(
            resolve(None, StorageMode::Private, true).unwrap(),
            StorageMode::Private
        );
        assert_eq!(
            resolve(Some(StorageMode::Shared), StorageMode::Private, false).unwrap(),
            StorageMode::Shared
        );
        assert_eq!(
            resolve(Some(StorageMode::Managed), StorageMode::Shared, true).unwrap(),
            StorageMode::Managed
        );
        assert!(matches!(
            resolve(Some(StorageMode::Managed), StorageMode::Shared, false),
            Err(Error::InvalidArgument(_))
        ));
    }
}
