//! The bytes every workload sends: position `i` of a stream holds
//! `i mod 251`. 251 is prime, so a lost, repeated or reordered chunk (of any
//! length that is not a multiple of 251) shows up as a mismatch, and checking
//! is a `memcmp` against a precomputed buffer.

pub const PERIOD: usize = 251;
/// The longest slice [`Pattern::at`] returns.
pub const MAX_SLICE: usize = 64 * 1024;

pub struct Pattern {
    buf: Vec<u8>,
}

impl Default for Pattern {
    fn default() -> Self {
        Self::new()
    }
}

impl Pattern {
    pub fn new() -> Pattern {
        let len = MAX_SLICE + PERIOD;
        Pattern {
            buf: (0..len).map(|i| (i % PERIOD) as u8).collect(),
        }
    }

    /// The `len` bytes of the stream from position `pos` (`len <=
    /// MAX_SLICE`).
    pub fn at(&self, pos: u64, len: usize) -> &[u8] {
        let start = (pos % PERIOD as u64) as usize;
        &self.buf[start..start + len.min(MAX_SLICE)]
    }

    /// True if `data` is the stream's content from position `pos`.
    pub fn check(&self, pos: u64, data: &[u8]) -> bool {
        let mut pos = pos;
        for chunk in data.chunks(MAX_SLICE) {
            if chunk != self.at(pos, chunk.len()) {
                return false;
            }
            pos += chunk.len() as u64;
        }
        true
    }
}

/// Where request `k` of a request/response exchange starts in the pattern:
/// consecutive requests differ, so a stale or duplicated response is caught
/// even with 1-byte messages.
pub fn request_offset(k: u64) -> u64 {
    k.wrapping_mul(7)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_continue_the_stream() {
        let p = Pattern::new();
        let whole: Vec<u8> = (0..200_000u64).map(|i| (i % 251) as u8).collect();
        assert!(p.check(0, &whole));
        assert!(p.check(1000, &whole[1000..]));
        assert_eq!(p.at(70_000, 3), &whole[70_000..70_003]);
        let mut bad = whole.clone();
        bad[150_000] ^= 1;
        assert!(!p.check(0, &bad));
        // A dropped byte shifts everything after it.
        let mut shifted = whole[..5000].to_vec();
        shifted.extend_from_slice(&whole[5001..6000]);
        assert!(!p.check(0, &shifted));
    }
}
