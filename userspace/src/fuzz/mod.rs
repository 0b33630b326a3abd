//! Property-based fuzzing of every parser of outside input (issue 20
//! part 5): the HBONE CONNECT request, the workloads file, Kubernetes
//! objects as the watch delivers them, istiod's xDS resources, ZDS
//! messages, the container runtime's (CRI) answers.
//!
//! Why proptest on stable rather than cargo-fuzz on the nightly: the
//! nightly here only builds the eBPF programs (for a BPF target); a
//! libFuzzer build needs the nightly for the host with sanitizers, its own
//! target dir and a `fuzz/` crate outside `cargo test`, so it would run
//! nowhere by itself. proptest runs inside `cargo test` (the suite, CI,
//! `cargo xtask test`), reaches `pub(crate)` parsers without making them
//! public, shrinks a failure to a small input and records it in
//! `proptest-regressions/` (the corpus of what found something, replayed
//! first on every run). It builds with Rust 1.95 (its MSRV is 1.88).
//!
//! Each target starts from a valid input (a seed) and applies random edits
//! to its bytes (delete, insert interesting or random bytes, overwrite,
//! duplicate a piece): a mutational fuzzer, as libFuzzer's default, but
//! driven by proptest. The properties, for every target:
//!
//! - never a panic;
//! - an error names what was wrong (a field, an object, a resource);
//! - a bad item never half-applies (the whole file, response or object is
//!   refused, and what was held stays as it was).
//!
//! `cargo test -p shunt --lib fuzz` runs each target for its default case
//! count (seconds in all). By hand, longer:
//! `PROPTEST_CASES=100000 cargo test -p shunt --release --lib fuzz`.

mod cri;
mod hbone;
mod kube;
mod workloads;
mod xds;
mod zds;

use proptest::prelude::*;

/// One edit of a fuzzer's mutator. Positions are taken modulo the input's
/// length, so any edit applies to any input.
#[derive(Clone, Debug)]
pub(crate) enum Edit {
    Delete {
        at: usize,
        len: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Overwrite {
        at: usize,
        bytes: Vec<u8>,
    },
    /// Copies `len` bytes from `from` to `to` (duplicates a piece).
    Duplicate {
        from: usize,
        to: usize,
        len: usize,
    },
}

/// Bytes parsers trip on: type changes, boundaries, syntax of the formats
/// at hand (YAML, JSON, protobuf varints), invalid UTF-8.
fn interesting() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..8),
        Just(b"null".to_vec()),
        Just(b"-1".to_vec()),
        Just(b"0".to_vec()),
        Just(b"99999999999999999999".to_vec()),
        Just(b"65536".to_vec()),
        Just(b"\"\"".to_vec()),
        Just(b"[]".to_vec()),
        Just(b"{}".to_vec()),
        Just(b"true".to_vec()),
        Just(b"::".to_vec()),
        Just(b"\n- ".to_vec()),
        Just(b": ".to_vec()),
        Just(b"\xff\xfe".to_vec()),
        Just(b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01".to_vec()),
        Just(b"255.255.255.256".to_vec()),
        Just(b"[::1]:0".to_vec()),
        Just(b"/".to_vec()),
    ]
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), 1..16usize).prop_map(|(at, len)| Edit::Delete { at, len }),
        (any::<usize>(), interesting()).prop_map(|(at, bytes)| Edit::Insert { at, bytes }),
        (any::<usize>(), interesting()).prop_map(|(at, bytes)| Edit::Overwrite { at, bytes }),
        (any::<usize>(), any::<usize>(), 1..32usize).prop_map(|(from, to, len)| Edit::Duplicate {
            from,
            to,
            len
        }),
    ]
}

/// One to eight edits.
pub(crate) fn edits() -> impl Strategy<Value = Vec<Edit>> {
    prop::collection::vec(edit(), 1..8)
}

/// `seed` with `edits` applied.
pub(crate) fn mutate(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut out = seed.to_vec();
    for e in edits {
        let at = |p: usize, len: usize| if len == 0 { 0 } else { p % (len + 1) };
        match e {
            Edit::Delete { at: p, len } => {
                let start = at(*p, out.len());
                let end = (start + len).min(out.len());
                out.drain(start..end);
            }
            Edit::Insert { at: p, bytes } => {
                let start = at(*p, out.len());
                out.splice(start..start, bytes.iter().copied());
            }
            Edit::Overwrite { at: p, bytes } => {
                let start = at(*p, out.len());
                let end = (start + bytes.len()).min(out.len());
                out.splice(start..end, bytes.iter().copied());
            }
            Edit::Duplicate { from, to, len } => {
                if out.is_empty() {
                    continue;
                }
                let start = from % out.len();
                let end = (start + len).min(out.len());
                let piece: Vec<u8> = out[start..end].to_vec();
                let to = at(*to, out.len());
                out.splice(to..to, piece);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_apply_to_any_input() {
        let edits = vec![
            Edit::Delete { at: 99, len: 3 },
            Edit::Insert {
                at: 7,
                bytes: b"xy".to_vec(),
            },
            Edit::Overwrite {
                at: 0,
                bytes: b"Z".to_vec(),
            },
            Edit::Duplicate {
                from: 1,
                to: 0,
                len: 2,
            },
        ];
        assert_eq!(mutate(b"", &edits), b"yZy".to_vec());
        assert_eq!(mutate(b"abcdef", &edits), b"efZefxy".to_vec());
    }
}
