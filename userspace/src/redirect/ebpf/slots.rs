//! Which per-pod slots are taken, kept in memory beside `SHUNT_ENROLLED`.
//!
//! Finding a free slot by walking the pinned map (a `get_next_key` and a
//! lookup per entry) made every enrolment cost O(pods) system calls: at
//! 1,000 pods that walk was most of an enrolment. The redirector is the
//! map's only writer, so it reads the map once when it opens it (a previous
//! agent's entries included: their slots stay taken until they are
//! re-enrolled or removed as stale) and from then on marks a slot taken
//! wherever it writes an entry and free wherever it removes one.

use aya::maps::{HashMap as BpfHashMap, MapData};
use shunt_common::{MAX_PODS, PodSlot};

/// One flag per slot: taken or free.
pub(super) struct SlotTable {
    taken: Vec<bool>,
}

impl SlotTable {
    /// The slots the entries of `enrolled` name (read once, at load).
    /// Entries naming a slot out of range are ignored: they cannot be
    /// handed out anyway.
    pub fn from_map(enrolled: &BpfHashMap<MapData, u64, PodSlot>) -> Self {
        let mut table = Self {
            taken: vec![false; MAX_PODS as usize],
        };
        for (_, pod) in enrolled.iter().filter_map(Result::ok) {
            table.take(pod.slot);
        }
        table
    }

    /// The lowest free slot (not yet taken: see [`SlotTable::take`]).
    pub fn lowest_free(&self) -> Option<u32> {
        self.taken
            .iter()
            .position(|taken| !taken)
            .and_then(|slot| u32::try_from(slot).ok())
    }

    pub fn take(&mut self, slot: u32) {
        if let Some(taken) = self.taken.get_mut(slot as usize) {
            *taken = true;
        }
    }

    pub fn free(&mut self, slot: u32) {
        if let Some(taken) = self.taken.get_mut(slot as usize) {
            *taken = false;
        }
    }

    /// How many slots are taken.
    #[cfg(test)]
    pub fn taken(&self) -> usize {
        self.taken.iter().filter(|t| **t).count()
    }

    #[cfg(test)]
    pub fn empty() -> Self {
        Self {
            taken: vec![false; MAX_PODS as usize],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hands_out_the_lowest_free_slot_and_reuses_freed_ones() {
        let mut slots = SlotTable::empty();
        assert_eq!(slots.lowest_free(), Some(0));
        slots.take(0);
        slots.take(1);
        slots.take(3);
        assert_eq!(slots.lowest_free(), Some(2));
        slots.take(2);
        assert_eq!(slots.lowest_free(), Some(4));
        slots.free(1);
        assert_eq!(slots.lowest_free(), Some(1));
        assert_eq!(slots.taken(), 3);
        // Out of range: ignored, never a panic.
        slots.take(MAX_PODS);
        slots.free(MAX_PODS + 7);
        assert_eq!(slots.taken(), 3);
    }

    #[test]
    fn a_full_table_has_no_free_slot() {
        let mut slots = SlotTable::empty();
        for slot in 0..MAX_PODS {
            slots.take(slot);
        }
        assert_eq!(slots.lowest_free(), None);
        slots.free(MAX_PODS - 1);
        assert_eq!(slots.lowest_free(), Some(MAX_PODS - 1));
    }
}
