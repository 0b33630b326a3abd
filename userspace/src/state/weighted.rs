//! Choosing among endpoints (or waypoint replicas) by capacity, as a pure
//! function of a connection counter.
//!
//! Interleaved weighted round robin: the counter walks rounds; round `r`
//! visits, in order, every candidate whose weight is greater than `r`. Over
//! any `sum of weights` consecutive picks each candidate is chosen exactly
//! its weight's worth of times, heavy candidates are spread through the
//! cycle rather than bunched, and equal weights give plain round robin
//! (the behaviour before weights). No state is kept, so concurrent
//! connections need nothing but the counter they already share.

/// The candidate for connection number `n` among `items`, weighted by
/// `weight`; `None` when `items` is empty.
///
/// A weight of 0 takes nothing while another candidate has weight; if
/// every weight is 0 they share equally (refusing traffic because every
/// endpoint says "capacity 0" would be worse than ignoring the weights).
/// Weights are divided by their greatest common divisor first, so
/// `{2, 2}` is the same round robin as `{1, 1}`.
pub fn weighted_pick<T>(items: &[T], weight: impl Fn(&T) -> u32, n: usize) -> Option<&T> {
    weighted_pick_counted(items, weight, n).map(|(item, _)| item)
}

/// [`weighted_pick`], with how many of the picks `0..n` took the same
/// candidate: a counter of its own, for a second choice inside it (a
/// replica of the chosen waypoint) that walks evenly instead of
/// repeating the first choice's pattern.
pub fn weighted_pick_counted<T>(
    items: &[T],
    weight: impl Fn(&T) -> u32,
    n: usize,
) -> Option<(&T, usize)> {
    let first = weight(items.first()?);
    // The common case (every capacity 1, or all equal): plain round robin,
    // with no allocation on the connection's path.
    if items.iter().all(|i| weight(i) == first) {
        return Some((items.get(n % items.len())?, n / items.len()));
    }
    let mut weights: Vec<u64> = items.iter().map(|i| u64::from(weight(i))).collect();
    if weights.iter().all(|w| *w == 0) {
        weights.iter_mut().for_each(|w| *w = 1);
    }
    let divisor = weights.iter().copied().fold(0, gcd);
    weights.iter_mut().for_each(|w| *w /= divisor);
    let total: u64 = weights.iter().sum();
    let k = (n as u64) % total;
    // Picks made in rounds 0..t.
    let made_before = |t: u64| -> u64 { weights.iter().map(|w| (*w).min(t)).sum() };
    // The round holding pick k: the smallest t with made_before(t + 1) > k.
    let (mut low, mut high) = (0u64, weights.iter().copied().max().unwrap_or(1) - 1);
    while low < high {
        let mid = low + (high - low) / 2;
        if made_before(mid + 1) > k {
            high = mid;
        } else {
            low = mid + 1;
        }
    }
    let round = low;
    let offset = k - made_before(round);
    let index = weights
        .iter()
        .enumerate()
        .filter(|(_, w)| **w > round)
        .nth(usize::try_from(offset).ok()?)
        .map(|(i, _)| i)?;
    // Each earlier cycle took it its weight's worth of times; this cycle,
    // once in each round before this one.
    let cycles = (n as u64) / total;
    let before = cycles.saturating_mul(weights[index]).saturating_add(round);
    Some((
        items.get(index)?,
        usize::try_from(before).unwrap_or(usize::MAX),
    ))
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn picks(weights: &[u32], n: usize) -> String {
        let items: Vec<(char, u32)> = weights
            .iter()
            .enumerate()
            .map(|(i, w)| ((b'a' + i as u8) as char, *w))
            .collect();
        (0..n)
            .map(|k| weighted_pick(&items, |(_, w)| *w, k).map_or('-', |(c, _)| *c))
            .collect()
    }

    #[test]
    fn equal_weights_are_round_robin() {
        assert_eq!(picks(&[1, 1, 1], 7), "abcabca");
        assert_eq!(picks(&[5, 5], 4), "abab", "scaled down by the gcd");
    }

    #[test]
    fn weights_are_honoured_exactly_and_interleaved() {
        assert_eq!(picks(&[3, 1], 8), "abaaabaa");
        assert_eq!(picks(&[2, 1, 3], 6), "abcacc");
        let long = picks(&[1, 2, 7], 1000);
        let count = |c| long.chars().filter(|x| *x == c).count();
        assert_eq!((count('a'), count('b'), count('c')), (100, 200, 700));
    }

    #[test]
    fn zero_weight_gets_nothing_unless_all_are_zero() {
        assert_eq!(picks(&[0, 1, 0, 2], 6), "bddbdd");
        assert_eq!(picks(&[0, 0], 4), "abab");
        assert_eq!(picks(&[], 2), "--");
    }

    #[test]
    fn each_pick_says_how_often_its_candidate_was_taken_before() {
        for weights in [&[1u32, 1, 1][..], &[3, 1], &[2, 1, 3], &[0, 2, 5]] {
            let items: Vec<(usize, u32)> = weights.iter().copied().enumerate().collect();
            let mut taken = vec![0usize; items.len()];
            for n in 0..200 {
                let ((i, _), before) =
                    weighted_pick_counted(&items, |(_, w)| *w, n).expect("a candidate");
                assert_eq!(before, taken[*i], "weights {weights:?}, pick {n}");
                taken[*i] += 1;
            }
        }
    }

    #[test]
    fn huge_weights_do_not_overflow_or_stall() {
        let s = picks(&[u32::MAX, u32::MAX - 1], 3);
        assert_eq!(s.len(), 3);
        assert_eq!(&s[..2], "ab");
    }
}
