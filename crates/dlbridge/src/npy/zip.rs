//! The central directory of a ZIP archive (an `.npz` file): where each member's bytes lie.
//!
//! Read from the archive's bytes alone, without a file: the end-of-central-directory record (and
//! its ZIP64 form, for archives and members past 4 GiB), then each central entry, then each
//! member's local header, which says where its data begins. Every offset and length is checked
//! against the archive's length before it is used.

use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The most members an archive may list: more is taken for a corrupt or hostile file, not
/// allocated.
pub const MAX_MEMBERS: usize = 1 << 20;

const EOCD: &[u8; 4] = b"PK\x05\x06";
const EOCD_LEN: usize = 22;
const ZIP64_LOCATOR: &[u8; 4] = b"PK\x06\x07";
const ZIP64_LOCATOR_LEN: usize = 20;
const ZIP64_EOCD: &[u8; 4] = b"PK\x06\x06";
const ZIP64_EOCD_LEN: usize = 56;
const CENTRAL: &[u8; 4] = b"PK\x01\x02";
const CENTRAL_LEN: usize = 46;
const LOCAL: &[u8; 4] = b"PK\x03\x04";
const LOCAL_LEN: usize = 30;
/// The tag of the ZIP64 extra field in a central entry.
const ZIP64_EXTRA: u16 = 0x0001;

/// How a member's bytes are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    /// As they are (`np.savez`).
    Stored,
    /// Deflated (`np.savez_compressed`).
    Deflated,
    /// Another method, by its number in the ZIP specification.
    Other(u16),
}

/// One member of an archive, as its central entry and local header give it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZipMember {
    /// The member's name.
    pub name: String,
    /// How its bytes are stored.
    pub compression: Compression,
    /// Its stored bytes, as absolute offsets in the archive (inside it, checked).
    pub data: Range<u64>,
    /// Its length once uncompressed.
    pub uncompressed_len: u64,
}

/// The members of the ZIP archive `bytes` (the whole archive), in the order its central directory
/// lists them, named `path` in errors.
///
/// Errors are [`Error::InvalidFile`]: no end-of-central-directory record in the archive's last
/// 64 KiB, an archive spread over several disks, a directory or an entry past the end of the
/// archive or past [`MAX_MEMBERS`], a bad signature, an encrypted member, a stored member whose
/// two lengths differ, a local header naming another member than its central entry, a name given
/// twice, and a name that is not UTF-8 (or ASCII, where the entry does not say UTF-8).
pub fn read_directory(bytes: &[u8], path: &Path) -> Result<Vec<ZipMember>> {
    let invalid = |reason: String| Error::InvalidFile {
        path: PathBuf::from(path),
        reason,
    };
    let eocd = find_eocd(bytes).ok_or_else(|| {
        let hint = if bytes.starts_with(b"\x93NUMPY") {
            " (a .npy file: read it with load_npy)"
        } else {
            ""
        };
        invalid(format!(
            "not a ZIP archive (.npz): no end-of-central-directory record in its last {} \
             bytes{hint}",
            bytes.len().min(EOCD_LEN + u16::MAX as usize)
        ))
    })?;
    let (disk, cd_disk) = (u16_at(bytes, eocd + 4), u16_at(bytes, eocd + 6));
    let mut entries = u64::from(u16_at(bytes, eocd + 10));
    let mut cd_len = u64::from(u32_at(bytes, eocd + 12));
    let mut cd_start = u64::from(u32_at(bytes, eocd + 16));
    let mut cd_limit = eocd as u64;
    // All ones where the ZIP64 record has the numbers.
    if (disk, cd_disk) != (0, 0) && disk != u16::MAX && cd_disk != u16::MAX {
        return Err(invalid("the archive is spread over several disks".into()));
    }
    let zip64 = entries == u64::from(u16::MAX)
        || cd_len == u64::from(u32::MAX)
        || cd_start == u64::from(u32::MAX);
    if let Some(locator) = eocd.checked_sub(ZIP64_LOCATOR_LEN)
        && bytes[locator..].starts_with(ZIP64_LOCATOR)
    {
        let record = u64_at(bytes, locator + 8);
        let fits = usize::try_from(record).ok().filter(|&r| {
            r.checked_add(ZIP64_EOCD_LEN)
                .is_some_and(|end| end <= locator)
        });
        match fits {
            Some(record) if bytes[record..].starts_with(ZIP64_EOCD) => {
                entries = u64_at(bytes, record + 32);
                cd_len = u64_at(bytes, record + 40);
                cd_start = u64_at(bytes, record + 48);
                cd_limit = record as u64;
            }
            _ => {
                return Err(invalid(format!(
                    "the ZIP64 locator points at byte {record}, where no ZIP64 \
                     end-of-central-directory record is"
                )));
            }
        }
    } else if zip64 {
        return Err(invalid(
            "the end-of-central-directory record asks for a ZIP64 record and none precedes it"
                .into(),
        ));
    }
    if entries > MAX_MEMBERS as u64 {
        return Err(invalid(format!(
            "the directory lists {entries} members, over the limit of {MAX_MEMBERS}"
        )));
    }
    let cd_end = cd_start
        .checked_add(cd_len)
        .filter(|&end| end <= cd_limit)
        .ok_or_else(|| {
            invalid(format!(
                "the central directory ({cd_len} bytes at byte {cd_start}) runs past its end \
                 record at byte {cd_limit} (truncated, or data before the archive)"
            ))
        })?;
    // Both ends are at most `bytes.len()`, so they fit in usize.
    let directory = &bytes[cd_start as usize..cd_end as usize];
    let mut members: Vec<ZipMember> = Vec::with_capacity(entries as usize);
    let mut at = 0usize;
    for index in 0..entries {
        let entry = read_entry(bytes, directory, &mut at)
            .map_err(|reason| invalid(format!("member {index} of the directory: {reason}")))?;
        if members.iter().any(|m| m.name == entry.name) {
            return Err(invalid(format!(
                "the member {:?} is listed twice",
                entry.name
            )));
        }
        members.push(entry);
    }
    Ok(members)
}

/// One central entry at `*at` of `directory`, and its local header in `archive`; moves `at` past
/// the entry.
fn read_entry(
    archive: &[u8],
    directory: &[u8],
    at: &mut usize,
) -> std::result::Result<ZipMember, String> {
    let start = *at;
    let Some(fixed) = directory.get(start..start + CENTRAL_LEN) else {
        return Err("the central directory ends inside it".into());
    };
    if !fixed.starts_with(CENTRAL) {
        return Err(format!(
            "no central entry signature at directory offset {start}"
        ));
    }
    let flags = u16_at(fixed, 8);
    let method = u16_at(fixed, 10);
    let mut compressed = u64::from(u32_at(fixed, 20));
    let mut uncompressed = u64::from(u32_at(fixed, 24));
    let name_len = usize::from(u16_at(fixed, 28));
    let extra_len = usize::from(u16_at(fixed, 30));
    let comment_len = usize::from(u16_at(fixed, 32));
    let mut offset = u64::from(u32_at(fixed, 42));
    let name_start = start + CENTRAL_LEN;
    let extra_start = name_start + name_len;
    let end = extra_start + extra_len + comment_len;
    let (Some(raw_name), Some(extra)) = (
        directory.get(name_start..extra_start),
        directory.get(extra_start..extra_start + extra_len),
    ) else {
        return Err("the central directory ends inside an entry's name or extra field".into());
    };
    if end > directory.len() {
        return Err("the central directory ends inside an entry's comment".into());
    }
    *at = end;
    let name = decode_name(raw_name, flags & (1 << 11) != 0)?;
    if flags & 1 != 0 {
        return Err(format!("{name:?} is encrypted"));
    }
    // The ZIP64 extra field holds, in order, the lengths and the offset whose 32-bit fields are
    // all ones.
    let all_ones = u64::from(u32::MAX);
    let mut wide: Vec<&mut u64> = [&mut uncompressed, &mut compressed, &mut offset]
        .into_iter()
        .filter(|v| **v == all_ones)
        .collect();
    if !wide.is_empty() {
        let field = extra_field(extra, ZIP64_EXTRA).ok_or_else(|| {
            format!("{name:?} has a 32-bit length or offset of all ones and no ZIP64 field")
        })?;
        for (k, value) in wide.iter_mut().enumerate() {
            let Some(bytes) = field.get(8 * k..8 * k + 8) else {
                return Err(format!("{name:?}'s ZIP64 field is too short"));
            };
            **value = u64_at(bytes, 0);
        }
    }
    drop(wide);
    let compression = match method {
        0 => Compression::Stored,
        8 => Compression::Deflated,
        other => Compression::Other(other),
    };
    if compression == Compression::Stored && compressed != uncompressed {
        return Err(format!(
            "{name:?} is stored, yet its stored length {compressed} differs from its length \
             {uncompressed}"
        ));
    }
    let local = usize::try_from(offset)
        .ok()
        .and_then(|o| Some((o, archive.get(o..o.checked_add(LOCAL_LEN)?)?)));
    let Some((local, fixed)) = local.filter(|(_, f)| f.starts_with(LOCAL)) else {
        return Err(format!(
            "{name:?}'s local header at byte {offset} is missing or past the end of the archive"
        ));
    };
    let local_name = usize::from(u16_at(fixed, 26));
    let local_extra = usize::from(u16_at(fixed, 28));
    let data_start = (local + LOCAL_LEN + local_name + local_extra) as u64;
    if archive.get(local + LOCAL_LEN..local + LOCAL_LEN + local_name) != Some(raw_name) {
        return Err(format!(
            "{name:?}'s local header names another member (or the archive ends inside it)"
        ));
    }
    let data = data_start
        .checked_add(compressed)
        .filter(|&end| end <= archive.len() as u64)
        .map(|end| data_start..end)
        .ok_or_else(|| {
            format!(
                "{name:?}'s {compressed} bytes at byte {data_start} run past the end of the \
                 archive ({} bytes; truncated?)",
                archive.len()
            )
        })?;
    Ok(ZipMember {
        name,
        compression,
        data,
        uncompressed_len: uncompressed,
    })
}

/// The body of the extra field tagged `tag` in `extra` (a run of tag, length, body).
fn extra_field(extra: &[u8], tag: u16) -> Option<&[u8]> {
    let mut at = 0;
    while at + 4 <= extra.len() {
        let (id, len) = (u16_at(extra, at), usize::from(u16_at(extra, at + 2)));
        let body = extra.get(at + 4..at + 4 + len)?;
        if id == tag {
            return Some(body);
        }
        at += 4 + len;
    }
    None
}

/// A member's name: UTF-8 where the entry says so (flag bit 11, which Python's `zipfile` sets
/// for names that are not ASCII), else ASCII (code page 437 past ASCII is refused).
fn decode_name(raw: &[u8], utf8: bool) -> std::result::Result<String, String> {
    if !utf8 && !raw.is_ascii() {
        return Err(format!(
            "the name b\"{}\" is neither ASCII nor marked UTF-8",
            raw.escape_ascii()
        ));
    }
    String::from_utf8(raw.to_vec())
        .map_err(|_| format!("the name b\"{}\" is not UTF-8", raw.escape_ascii()))
}

/// Where the end-of-central-directory record begins: the last signature in the archive's last
/// 64 KiB + 22 bytes whose record, comment included, ends inside the archive.
fn find_eocd(bytes: &[u8]) -> Option<usize> {
    let last = bytes.len().checked_sub(EOCD_LEN)?;
    let first = last.saturating_sub(u16::MAX as usize);
    (first..=last).rev().find(|&at| {
        bytes[at..].starts_with(EOCD)
            && at + EOCD_LEN + usize::from(u16_at(bytes, at + 20)) <= bytes.len()
    })
}

/// The little-endian integer at `at` of `bytes` (the callers checked the bytes are there).
fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(b)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An archive of `members` (name, bytes, method), written as Python's `zipfile` writes
    /// them, with a ZIP64 extra field in every local header when `zip64` (as `np.savez` asks
    /// for) and, when `zip64_directory`, the central entries' offsets and the end record in
    /// their ZIP64 forms too.
    pub(crate) fn archive(members: &[(&str, &[u8], u16)], zip64_directory: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let mut central = Vec::new();
        for &(name, data, method) in members {
            let offset = out.len() as u64;
            out.extend_from_slice(LOCAL);
            out.extend_from_slice(&[45, 0, 0, 0]);
            out.extend_from_slice(&method.to_le_bytes());
            out.extend_from_slice(&[0; 8]); // time, date, crc
            out.extend_from_slice(&u32::MAX.to_le_bytes());
            out.extend_from_slice(&u32::MAX.to_le_bytes());
            out.extend_from_slice(&(name.len() as u16).to_le_bytes());
            out.extend_from_slice(&20u16.to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&ZIP64_EXTRA.to_le_bytes());
            out.extend_from_slice(&16u16.to_le_bytes());
            out.extend_from_slice(&(data.len() as u64).to_le_bytes());
            out.extend_from_slice(&(data.len() as u64).to_le_bytes());
            out.extend_from_slice(data);
            central.extend_from_slice(CENTRAL);
            central.extend_from_slice(&[45, 3, 45, 0, 0, 0]);
            central.extend_from_slice(&method.to_le_bytes());
            central.extend_from_slice(&[0; 8]);
            central.extend_from_slice(&(data.len() as u32).to_le_bytes());
            central.extend_from_slice(&(data.len() as u32).to_le_bytes());
            central.extend_from_slice(&(name.len() as u16).to_le_bytes());
            central.extend_from_slice(&(if zip64_directory { 12u16 } else { 0 }).to_le_bytes());
            central.extend_from_slice(&[0; 10]); // comment length .. external attributes
            let short = if zip64_directory {
                u32::MAX
            } else {
                offset as u32
            };
            central.extend_from_slice(&short.to_le_bytes());
            central.extend_from_slice(name.as_bytes());
            if zip64_directory {
                central.extend_from_slice(&ZIP64_EXTRA.to_le_bytes());
                central.extend_from_slice(&8u16.to_le_bytes());
                central.extend_from_slice(&offset.to_le_bytes());
            }
        }
        let cd_start = out.len() as u64;
        out.extend_from_slice(&central);
        let n = members.len() as u64;
        if zip64_directory {
            let record = out.len() as u64;
            out.extend_from_slice(ZIP64_EOCD);
            out.extend_from_slice(&44u64.to_le_bytes());
            out.extend_from_slice(&[45, 3, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            out.extend_from_slice(&n.to_le_bytes());
            out.extend_from_slice(&n.to_le_bytes());
            out.extend_from_slice(&(central.len() as u64).to_le_bytes());
            out.extend_from_slice(&cd_start.to_le_bytes());
            out.extend_from_slice(ZIP64_LOCATOR);
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&record.to_le_bytes());
            out.extend_from_slice(&1u32.to_le_bytes());
        }
        out.extend_from_slice(EOCD);
        out.extend_from_slice(&[0; 4]);
        let (count, len, start) = if zip64_directory {
            (u16::MAX, u32::MAX, u32::MAX)
        } else {
            (n as u16, central.len() as u32, cd_start as u32)
        };
        out.extend_from_slice(&count.to_le_bytes());
        out.extend_from_slice(&count.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&start.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out
    }

    fn read(bytes: &[u8]) -> Result<Vec<ZipMember>> {
        read_directory(bytes, Path::new("t.npz"))
    }

    #[test]
    fn members_and_their_bytes() {
        for zip64 in [false, true] {
            let bytes = archive(
                &[
                    ("a.npy", b"hello", 0),
                    ("dir/b.npy", b"", 0),
                    ("c", b"xyz", 8),
                ],
                zip64,
            );
            let members = read(&bytes).unwrap();
            let names: Vec<&str> = members.iter().map(|m| m.name.as_str()).collect();
            assert_eq!(names, ["a.npy", "dir/b.npy", "c"]);
            let a = &members[0];
            assert_eq!(&bytes[a.data.start as usize..a.data.end as usize], b"hello");
            assert_eq!(a.compression, Compression::Stored);
            assert!(members[1].data.is_empty());
            assert_eq!(members[2].compression, Compression::Deflated);
        }
        assert!(read(&archive(&[], false)).unwrap().is_empty());
    }

    #[test]
    fn malformed_archives_are_errors() {
        let good = archive(&[("a.npy", b"hello", 0), ("b.npy", b"world", 0)], false);
        let cd = good.len() - EOCD_LEN - 2 * (CENTRAL_LEN + 5);
        let mut cases: Vec<(Vec<u8>, &str)> = vec![
            (Vec::new(), "not a ZIP"),
            (b"\x93NUMPY".to_vec(), "read it with load_npy"),
            (good[..good.len() - 1].to_vec(), "not a ZIP"),
            (good[20..].to_vec(), "runs past"),
            (
                archive(&[("a.npy", b"x", 0), ("a.npy", b"y", 0)], false),
                "twice",
            ),
        ];
        let mut bad_sig = good.clone();
        bad_sig[cd] = b'Q';
        cases.push((bad_sig, "signature"));
        let mut encrypted = good.clone();
        encrypted[cd + 8] = 1;
        cases.push((encrypted, "encrypted"));
        let mut far = good.clone();
        far[cd + 42..cd + 46].copy_from_slice(&1000u32.to_le_bytes());
        cases.push((far, "local header"));
        let mut long = good.clone();
        long[cd + 20..cd + 28].copy_from_slice(&[0, 1, 0, 0, 0, 1, 0, 0]);
        cases.push((long, "past the end"));
        let mut uneven = good.clone();
        uneven[cd + 20] = 4;
        cases.push((uneven, "differs"));
        let mut wide = good.clone();
        wide[cd + 42..cd + 46].copy_from_slice(&u32::MAX.to_le_bytes());
        cases.push((wide, "no ZIP64 field"));
        let mut disks = good.clone();
        let eocd = good.len() - EOCD_LEN;
        disks[eocd + 4] = 1;
        cases.push((disks, "disks"));
        let mut name = good.clone();
        name[cd + CENTRAL_LEN] = 0xe9;
        cases.push((name, "neither ASCII"));
        let mut other = good.clone();
        other[LOCAL_LEN] = b'z'; // the first local header's name
        cases.push((other, "another member"));
        let mut count = good.clone();
        count[eocd + 10] = 3;
        cases.push((count, "ends inside"));
        let mut needs64 = good.clone();
        needs64[eocd + 16..eocd + 20].copy_from_slice(&u32::MAX.to_le_bytes());
        cases.push((needs64, "ZIP64 record"));
        for (bytes, expected) in cases {
            let e = read(&bytes).unwrap_err().to_string();
            assert!(e.contains(expected), "{expected:?} in {e:?}");
        }
    }

    /// Every prefix and every single-byte change of an archive gives members or an error,
    /// never a panic, and members always lie inside the archive.
    #[test]
    fn prefixes_and_byte_flips_never_panic() {
        for zip64 in [false, true] {
            let good = archive(&[("a.npy", b"hello", 0), ("b", b"!", 8)], zip64);
            let check = |bytes: &[u8]| {
                if let Ok(members) = read(bytes) {
                    for m in members {
                        assert!(m.data.start <= m.data.end && m.data.end <= bytes.len() as u64);
                    }
                }
            };
            for end in 0..good.len() {
                check(&good[..end]);
            }
            for i in 0..good.len() {
                for b in [0u8, 1, 0xff, 0x7f] {
                    let mut changed = good.clone();
                    changed[i] = b;
                    check(&changed);
                }
            }
        }
    }
}
