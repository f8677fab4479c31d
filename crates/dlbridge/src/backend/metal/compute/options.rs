//! The options a run-time MSL kernel compiles with, parsed from the command-line-style strings
//! [`crate::compute::kernel::compile`] takes, and the argument rules of a launch. Platform-free;
//! the runtime turns [`CompileOptions`] into an `MTLCompileOptions`.
//!
//! | option | effect |
//! | --- | --- |
//! | `-DNAME`, `-D NAME` | defines the macro `NAME` as `1` (`preprocessorMacros`) |
//! | `-DNAME=VALUE`, `-D NAME=VALUE` | defines `NAME` as `VALUE` |
//! | `-ffast-math` / `-fno-fast-math` | fast math on / off (`mathMode` where the OS has it, else `fastMathEnabled`); Metal's default is on |
//! | `-std=metalX.Y` | the MSL version (`languageVersion`), one of 1.1–1.2, 2.0–2.4, 3.0–3.2, 4.0; default: the newest the OS knows |
//!
//! Anything else is refused with [`Error::InvalidArgument`] rather than ignored.

use crate::error::{Error, Result};

/// The most buffer arguments a Metal kernel takes (`[[buffer(0)]]` to `[[buffer(30)]]`).
pub(crate) const MAX_KERNEL_ARGS: usize = 31;

/// The MSL versions `-std=` accepts, as `(major, minor)`.
const LANGUAGE_VERSIONS: [(u32, u32); 11] = [
    (1, 1),
    (1, 2),
    (2, 0),
    (2, 1),
    (2, 2),
    (2, 3),
    (2, 4),
    (3, 0),
    (3, 1),
    (3, 2),
    (4, 0),
];

/// What `MTLCompileOptions` gets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct CompileOptions {
    /// Preprocessor macros, in order (a later definition of a name replaces an earlier one).
    pub(crate) macros: Vec<(String, String)>,
    /// `Some(on)` when a fast-math flag was given.
    pub(crate) fast_math: Option<bool>,
    /// `MTLLanguageVersion`'s raw value (`major << 16 | minor`), when `-std=` was given.
    pub(crate) language_version: Option<u64>,
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// Parses the compile options of a run-time MSL kernel (see the module's table).
pub(crate) fn parse(options: &[String]) -> Result<CompileOptions> {
    let mut out = CompileOptions::default();
    let mut args = options.iter();
    while let Some(arg) = args.next() {
        let arg = arg.trim();
        if let Some(rest) = arg.strip_prefix("-D") {
            let def = if rest.is_empty() {
                args.next().map(|s| s.trim()).ok_or_else(|| {
                    Error::InvalidArgument("`-D` needs a macro name after it".into())
                })?
            } else {
                rest
            };
            let (name, value) = def.split_once('=').unwrap_or((def, "1"));
            if !is_identifier(name) {
                return Err(Error::InvalidArgument(format!(
                    "`-D{def}`: `{name}` is not a macro name"
                )));
            }
            out.macros.retain(|(n, _)| n != name);
            out.macros.push((name.to_string(), value.to_string()));
        } else if arg == "-ffast-math" {
            out.fast_math = Some(true);
        } else if arg == "-fno-fast-math" {
            out.fast_math = Some(false);
        } else if let Some(version) = arg.strip_prefix("-std=metal") {
            let parsed = version.split_once('.').and_then(|(major, minor)| {
                Some((major.parse::<u32>().ok()?, minor.parse::<u32>().ok()?))
            });
            match parsed {
                Some(v) if LANGUAGE_VERSIONS.contains(&v) => {
                    out.language_version = Some((u64::from(v.0) << 16) | u64::from(v.1));
                }
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "`{arg}`: Metal knows MSL 1.1-1.2, 2.0-2.4, 3.0-3.2 and 4.0 \
                         (`-std=metal3.1`)"
                    )));
                }
            }
        } else {
            return Err(Error::InvalidArgument(format!(
                "unknown Metal compile option `{arg}`: dlbridge accepts -DNAME[=VALUE], \
                 -ffast-math, -fno-fast-math and -std=metalX.Y"
            )));
        }
    }
    Ok(out)
}

/// Threadgroup memory lengths are set in multiples of this many bytes.
pub(crate) const THREADGROUP_MEMORY_GRANULE: u32 = 16;

/// The threadgroup memory length to set for `shared_mem` requested bytes (rounded up to
/// [`THREADGROUP_MEMORY_GRANULE`]), or an error when it exceeds the device's `limit`.
pub(crate) fn threadgroup_memory(shared_mem: u32, limit: usize) -> Result<usize> {
    let len = (shared_mem as usize).next_multiple_of(THREADGROUP_MEMORY_GRANULE as usize);
    if len > limit {
        return Err(Error::InvalidArgument(format!(
            "{shared_mem} bytes of threadgroup memory exceed the device's {limit}"
        )));
    }
    Ok(len)
}

/// Checks a launch's threads per threadgroup against the pipeline's limit, and the argument
/// count against Metal's buffer table.
pub(crate) fn check_launch(block: [u32; 3], max_threads: usize, args: usize) -> Result<()> {
    let threads = block.iter().map(|&b| b as u64).product::<u64>();
    if threads > max_threads as u64 {
        return Err(Error::InvalidArgument(format!(
            "{threads} threads per threadgroup ({block:?}) exceed the kernel's limit of \
             {max_threads} (maxTotalThreadsPerThreadgroup)"
        )));
    }
    if args > MAX_KERNEL_ARGS {
        return Err(Error::InvalidArgument(format!(
            "{args} arguments: a Metal kernel takes at most {MAX_KERNEL_ARGS} buffer arguments"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn macros_math_and_version() {
        let o = parse(&strings(&[
            "-DN=4",
            "-D",
            "USE_X",
            "-ffast-math",
            "-DN=8",
            "-std=metal3.1",
        ]))
        .unwrap();
        assert_eq!(
            o.macros,
            vec![
                ("USE_X".to_string(), "1".to_string()),
                ("N".to_string(), "8".to_string())
            ]
        );
        assert_eq!(o.fast_math, Some(true));
        assert_eq!(o.language_version, Some((3 << 16) + 1));
        assert_eq!(parse(&[]).unwrap(), CompileOptions::default());
        assert_eq!(
            parse(&strings(&["-fno-fast-math"])).unwrap().fast_math,
            Some(false)
        );
    }

    #[test]
    fn bad_options_are_refused() {
        for bad in [
            vec!["-O3"],
            vec!["-D"],
            vec!["-D1X"],
            vec!["-DA-B=2"],
            vec!["-std=metal9.9"],
            vec!["-std=metal3"],
            vec!["-std=c++17"],
        ] {
            let err = parse(&strings(&bad)).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{bad:?}: {err}");
        }
    }

    #[test]
    fn launch_limits() {
        assert_eq!(threadgroup_memory(0, 32768).unwrap(), 0);
        assert_eq!(threadgroup_memory(100, 32768).unwrap(), 112);
        assert!(threadgroup_memory(40000, 32768).is_err());
        assert!(check_launch([32, 32, 1], 1024, 3).is_ok());
        assert!(check_launch([64, 32, 1], 1024, 3).is_err());
        assert!(check_launch([1, 1, 1], 1024, 32).is_err());
    }
}
