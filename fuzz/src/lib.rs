//! What the fuzz targets share: a reader that turns fuzz bytes into values (every read succeeds;
//! past the end it yields zeros, so a short input is still a whole test case), and brute-force
//! references for strided layouts.

/// Fuzz bytes read front to back.
pub struct Input<'a> {
    bytes: &'a [u8],
}

impl<'a> Input<'a> {
    /// Reads from `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Input { bytes }
    }

    /// Whether every byte has been read.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The next `N` bytes, zero-padded past the end.
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.bytes.len());
        out[..n].copy_from_slice(&self.bytes[..n]);
        self.bytes = &self.bytes[n..];
        out
    }

    /// One byte.
    pub fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }

    /// A little-endian `u16`.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }

    /// A little-endian `u32`.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }

    /// A little-endian `u64`.
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }

    /// A little-endian `i64`.
    pub fn i64(&mut self) -> i64 {
        i64::from_le_bytes(self.take())
    }

    /// A value in `0..n` (`n > 0`), from one byte.
    pub fn below(&mut self, n: u8) -> u8 {
        self.u8() % n
    }

    /// An extent: mostly small, now and then one of the values that break arithmetic.
    pub fn extent(&mut self) -> i64 {
        let b = self.u8();
        match b {
            0..=223 => i64::from(b % 6),
            224..=239 => i64::from(b - 224) + 6,
            240 => -1,
            241 => i64::MIN,
            242 => 1 << 62,
            243 => (1 << 31) + 1,
            244 => i64::MAX,
            245 => (1 << 32) - 1,
            _ => self.i64(),
        }
    }

    /// A stride in elements: mostly small, either sign, now and then an extreme.
    pub fn stride(&mut self) -> i64 {
        let b = self.u8();
        match b {
            0..=223 => i64::from(b % 19) - 9,
            224..=231 => 1 << (u32::from(b - 224) * 4 + 4),
            232 => i64::MIN,
            233 => i64::MAX,
            234 => -(1 << 62),
            235 => 1 << 62,
            236 => i64::MIN + 1,
            237 => (1 << 40) + 3,
            _ => self.i64(),
        }
    }
}

/// Index vectors of `shape` in row-major order (calls `f` once per element; none when an extent
/// is 0, once for a 0-d shape).
pub fn for_each_index(shape: &[usize], mut f: impl FnMut(&[usize])) {
    if shape.contains(&0) {
        return;
    }
    let mut idx = vec![0usize; shape.len()];
    loop {
        f(&idx);
        let mut axis = shape.len();
        loop {
            if axis == 0 {
                return;
            }
            axis -= 1;
            idx[axis] += 1;
            if idx[axis] < shape[axis] {
                break;
            }
            idx[axis] = 0;
        }
    }
}

/// The element count of `shape` if it is at most `limit` (`None` otherwise, without overflowing).
pub fn small_numel(shape: &[usize], limit: usize) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d).filter(|&n| n <= limit))
        .or_else(|| shape.contains(&0).then_some(0))
}

/// `sum(idx[i] * strides[i])` in elements, exactly.
pub fn element_offset(idx: &[usize], strides: &[isize]) -> i128 {
    idx.iter()
        .zip(strides)
        .map(|(&i, &s)| i as i128 * s as i128)
        .sum()
}

/// The lowest and highest element offsets of a non-empty strided layout, computed without
/// enumerating (each axis contributes its reach independently), exactly.
pub fn reference_extent(shape: &[usize], strides: &[isize]) -> Option<(i128, i128)> {
    if shape.contains(&0) {
        return None;
    }
    let (mut lo, mut hi) = (0i128, 0i128);
    for (&d, &s) in shape.iter().zip(strides) {
        let reach = (d as i128 - 1) * s as i128;
        if reach < 0 {
            lo += reach;
        } else {
            hi += reach;
        }
    }
    Some((lo, hi))
}
