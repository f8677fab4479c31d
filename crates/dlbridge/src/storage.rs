//! Which [`StorageMode`] an allocation gets: an explicit request, else the process-wide
//! `DLBRIDGE_STORAGE_MODE` environment variable, else the device's default.
//!
//! | device | default | honoured modes |
//! | --- | --- | --- |
//! | CPU | `shared` | every request is reported as `shared`: host memory is shared memory |
//! | CUDA | `private` | `private` (device memory), `shared` (pinned host memory), `managed` |
//! | CUDA host / CUDA managed | `shared` / `managed` | the device kind names the mode; another explicit mode is an error |
//! | Metal | `shared` on unified memory, `private` on discrete GPUs; `DLBRIDGE_METAL_STORAGE_MODE` comes before this variable ([`backend::metal::storage`](crate::backend::metal::storage)) | `private`, `shared`, `managed` (macOS) |
//!
//! # The environment variable
//! `DLBRIDGE_STORAGE_MODE` is read once, the first time a storage mode is resolved, and the answer
//! is kept for the life of the process: changing the variable afterwards has no effect. Its value
//! is matched ignoring case and surrounding white space (`private`, `Shared`, ` MANAGED `); an
//! empty value counts as unset. Any other value is ignored (every device keeps its default), and
//! the problem is reported once: through `log::warn!` when the variable is read, and as a message
//! that [`take_env_warning`] hands to exactly one caller (the Python package turns it into a
//! `RuntimeWarning`).

use std::sync::{Mutex, OnceLock};

use crate::backend::facts::{KindFacts, Storage};
use crate::buffer::StorageMode;
use crate::error::{Error, Result};

/// The name of the environment variable that picks the storage mode of allocations that do not
/// ask for one.
pub const ENV_VAR: &str = "DLBRIDGE_STORAGE_MODE";

/// Where a resolved storage mode came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// The device's default: nothing asked for a mode.
    Default,
    /// The `DLBRIDGE_STORAGE_MODE` environment variable.
    Environment,
    /// The caller asked for it (an argument, or a device kind that names its mode).
    Explicit,
}

impl Source {
    /// The lower-case name (`default`, `environment`, `explicit`).
    pub const fn name(self) -> &'static str {
        match self {
            Source::Default => "default",
            Source::Environment => "environment",
            Source::Explicit => "explicit",
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A storage mode and where it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Resolved {
    /// The mode allocations get (on the CPU always [`StorageMode::Shared`]).
    pub mode: StorageMode,
    /// What asked for it. On the CPU this still says what was asked, although the mode is
    /// `shared` whatever it was.
    pub source: Source,
}

/// Resolves the storage mode of an allocation on a device kind with `facts` (its backend's
/// [`KindFacts`], [`backend::facts`](fn@crate::backend::facts)): `explicit` when given, else the
/// environment variable (read on the first call, see the module documentation), else the kind's
/// default.
///
/// # Errors
/// [`Error::InvalidArgument`] when the kind names a mode itself (CUDA host, CUDA managed) and
/// `explicit` asks for another.
#[inline]
pub(crate) fn resolve(facts: &KindFacts, explicit: Option<StorageMode>) -> Result<Resolved> {
    resolve_with(facts, explicit, environment_mode())
}

/// [`resolve`] with the environment's answer given instead of read: `environment` is what
/// `DLBRIDGE_STORAGE_MODE` would say (`None`: unset or invalid).
///
/// # Errors
/// As [`resolve`].
pub(crate) fn resolve_with(
    facts: &KindFacts,
    explicit: Option<StorageMode>,
    environment: Option<StorageMode>,
) -> Result<Resolved> {
    let default = facts.storage.default_mode();
    let (asked, source) = match facts.storage {
        // These kinds name their mode: the device is the explicit request.
        Storage::Names(..) => match explicit {
            Some(mode) if mode != default => {
                return Err(Error::InvalidArgument(format!(
                    "{} memory is {default} storage; it cannot be {mode}",
                    facts.kind.name()
                )));
            }
            _ => (default, Source::Explicit),
        },
        _ => match (explicit, environment) {
            (Some(mode), _) => (mode, Source::Explicit),
            (None, Some(mode)) => (mode, Source::Environment),
            (None, None) => (default, Source::Default),
        },
    };
    let mode = match facts.storage {
        // Host memory is shared memory whatever was asked for.
        Storage::Always(mode) => mode,
        _ => asked,
    };
    Ok(Resolved { mode, source })
}

/// The environment variable's storage mode: `None` when it is unset, empty or invalid. Reads
/// the variable on the first call only.
pub(crate) fn environment_mode() -> Option<StorageMode> {
    environment().mode
}

/// The warning about an invalid `DLBRIDGE_STORAGE_MODE`, to exactly one caller: the first call
/// after the variable was found invalid returns the message, every other call `None`. Reads the
/// variable if nothing has yet.
#[inline]
pub fn take_env_warning() -> Option<String> {
    // Skips the lock in the common case of a valid (or no) value.
    environment().warning.as_ref()?;
    PENDING_WARNING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .take()
}

/// What the environment said, read once.
struct Environment {
    mode: Option<StorageMode>,
    /// The warning, kept so that [`take_env_warning`] can skip its lock when there is none.
    warning: Option<String>,
}

static ENVIRONMENT: OnceLock<Environment> = OnceLock::new();
static PENDING_WARNING: Mutex<Option<String>> = Mutex::new(None);

#[inline]
fn environment() -> &'static Environment {
    ENVIRONMENT.get_or_init(|| {
        let raw = std::env::var_os(ENV_VAR);
        let (mode, warning) = parse_env_value(raw.as_deref().map(|v| v.to_str()));
        if let Some(message) = &warning {
            log::warn!("{message}");
            *PENDING_WARNING
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(message.clone());
        }
        Environment { mode, warning }
    })
}

/// Interprets the variable's value: `None` when unset, `Some(None)` when it is not Unicode.
/// Returns the mode and, for an invalid value, the warning to give.
fn parse_env_value(value: Option<Option<&str>>) -> (Option<StorageMode>, Option<String>) {
    let invalid = |shown: &str| {
        format!(
            "{ENV_VAR}={shown} is not a storage mode (expected private, shared or managed, in \
             any case); it is ignored and every device uses its default storage mode"
        )
    };
    match value {
        None => (None, None),
        Some(None) => (None, Some(invalid("<not valid Unicode>"))),
        Some(Some(text)) if text.trim().is_empty() => (None, None),
        Some(Some(text)) => match text.parse::<StorageMode>() {
            Ok(mode) => (Some(mode), None),
            Err(_) => (None, Some(invalid(&format!("{text:?}")))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_values() {
        assert_eq!(parse_env_value(None), (None, None));
        assert_eq!(parse_env_value(Some(Some("  "))), (None, None));
        for (text, mode) in [
            ("private", StorageMode::Private),
            ("Shared", StorageMode::Shared),
            (" MANAGED\n", StorageMode::Managed),
        ] {
            assert_eq!(parse_env_value(Some(Some(text))), (Some(mode), None));
        }
        for bad in [Some("pinned"), Some("private,shared"), None] {
            let (mode, warning) = parse_env_value(Some(bad));
            assert_eq!(mode, None);
            let warning = warning.expect("an invalid value warns");
            assert!(warning.contains(ENV_VAR), "{warning}");
            if let Some(bad) = bad {
                assert!(warning.contains(bad), "{warning}");
            }
        }
    }

    #[test]
    fn defaults_environment_and_explicit() {
        use crate::device::DeviceKind;
        use StorageMode::*;
        let facts = |kind| crate::backend::facts(kind).expect("a kind of this build");
        let (cpu, cuda, metal) = (
            facts(DeviceKind::Cpu),
            facts(DeviceKind::Cuda),
            facts(DeviceKind::Metal),
        );
        let (cuda_host, cuda_managed) =
            (facts(DeviceKind::CudaHost), facts(DeviceKind::CudaManaged));
        let r = |mode, source| Resolved { mode, source };
        assert_eq!(
            resolve_with(cpu, None, None).unwrap(),
            r(Shared, Source::Default)
        );
        assert_eq!(
            resolve_with(cuda, None, None).unwrap(),
            r(Private, Source::Default)
        );
        assert_eq!(
            resolve_with(metal, None, None).unwrap(),
            r(Shared, Source::Default)
        );
        assert_eq!(
            resolve_with(cuda, None, Some(Managed)).unwrap(),
            r(Managed, Source::Environment)
        );
        assert_eq!(
            resolve_with(metal, Some(Private), Some(Managed)).unwrap(),
            r(Private, Source::Explicit)
        );
        // The CPU reports shared whatever is asked, but says who asked.
        assert_eq!(
            resolve_with(cpu, None, Some(Private)).unwrap(),
            r(Shared, Source::Environment)
        );
        assert_eq!(
            resolve_with(cpu, Some(Managed), None).unwrap(),
            r(Shared, Source::Explicit)
        );
        // Kinds that name their mode.
        assert_eq!(
            resolve_with(cuda_host, None, Some(Private)).unwrap(),
            r(Shared, Source::Explicit)
        );
        assert!(matches!(
            resolve_with(cuda_managed, Some(Private), None),
            Err(Error::InvalidArgument(_))
        ));
        assert!(crate::backend::facts(DeviceKind::Other(4)).is_none());
    }
}
