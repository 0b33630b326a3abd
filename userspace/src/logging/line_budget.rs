//! A bound on how many lines of one kind are written a second, for lines a
//! peer or an application can cause in bulk (refused connections): the
//! rest are counted, and the next line written says how many were left
//! out.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

#[derive(Debug)]
pub struct LineBudget {
    per_second: u32,
    /// (start of the current second, lines written in it, lines left out
    /// since the last one written).
    state: Mutex<(Instant, u32, u64)>,
}

impl LineBudget {
    pub fn new(per_second: u32) -> Self {
        Self {
            per_second,
            state: Mutex::new((Instant::now(), 0, 0)),
        }
    }

    /// `Some(lines left out before this one)` when a line may be written.
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    fn allow_at(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if now.saturating_duration_since(s.0) >= Duration::from_secs(1) {
            s.0 = now;
            s.1 = 0;
        }
        if s.1 < self.per_second {
            s.1 += 1;
            Some(std::mem::take(&mut s.2))
        } else {
            s.2 += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_past_the_budget_are_counted_and_named_by_the_next_second() {
        let budget = LineBudget::new(3);
        let start = Instant::now();
        let first: Vec<Option<u64>> = (0..5).map(|_| budget.allow_at(start)).collect();
        assert_eq!(first, [Some(0), Some(0), Some(0), None, None]);
        let later = start + Duration::from_millis(999);
        assert_eq!(budget.allow_at(later), None, "still the same second");
        let next = start + Duration::from_secs(1);
        assert_eq!(budget.allow_at(next), Some(3), "three were left out");
        assert_eq!(budget.allow_at(next), Some(0));
    }
}
