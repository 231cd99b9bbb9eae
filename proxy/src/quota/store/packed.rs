//! How the embedded store keeps a key's [`KeyState`] in little memory: a million keys of a
//! large node each hold one. A state is worked on whole ([`KeyState`], on the stack, room for
//! six windows) and kept packed: its eight fixed fields and a layout id inline in the map's
//! entry (40 bytes), and its windows' instance and count (8 bytes each) in one run of the
//! shard's slab, as many as its windows. The windows' lengths are not kept per key: a layout id
//! names the list of lengths, which a shard keeps once for every key that has it (the keys of
//! one plan share one). So a key costs 40 bytes and 8 per window of its own, not room for six.
//!
//! Runs freed by evicted keys are reused by keys of the same number of windows; the slab does
//! not shrink, so it holds the most windows the shard held at once.

use std::collections::HashMap;
use std::sync::Arc;

use crate::keys::limits::MAX_WINDOWS;
use crate::quota::rules::{KeyState, Slot};

/// One key as a shard keeps it.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// `strike_window`, `strikes`, `ban_until`, `ban_level`, `level_until`, `last_admitted`,
    /// `refused_day`, `refused`.
    fixed: [u32; 8],
    /// Its window lengths: `layouts[layout]`; 0 is no window.
    layout: u16,
    /// Its first (instance, count) pair in the slab.
    at: u32,
}

#[derive(Debug)]
pub(super) struct PackedStates {
    /// By key id: ids the fleet issued, not a client's bytes, so a fast hash (foldhash, seeded
    /// per process, not from the OS's randomness) rather than SipHash, on every decision. Never
    /// key it by anything a client sends.
    keys: HashMap<Arc<str>, Entry, foldhash::fast::RandomState>,
    /// Window lengths (`Every::code`) in slot order, by layout id; 0 is the empty list.
    layouts: Vec<Box<[u32]>>,
    /// (instance, count) of every key's windows, a run per key.
    slab: Vec<[u32; 2]>,
    /// Runs given back, by length (index 0: one window).
    free: [Vec<u32>; MAX_WINDOWS],
}

impl Default for PackedStates {
    fn default() -> Self {
        PackedStates {
            keys: HashMap::default(),
            layouts: vec![Box::from([])],
            slab: Vec::new(),
            free: Default::default(),
        }
    }
}

impl PackedStates {
    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }

    /// The state of `key`, if the shard holds one.
    pub(super) fn get(&self, key: &str) -> Option<KeyState> {
        self.keys.get(key).map(|e| self.unpack(e))
    }

    /// Runs `change` on the state of `key` (a fresh one when there is none) and keeps the result.
    pub(super) fn update<T>(
        &mut self,
        key: &Arc<str>,
        change: impl FnOnce(&mut KeyState) -> T,
    ) -> T {
        let entry = self.keys.get(&**key).copied();
        let mut state = entry.map_or_else(KeyState::default, |e| self.unpack(&e));
        let out = change(&mut state);
        let packed = self.pack(entry, &state);
        match self.keys.get_mut(&**key) {
            Some(e) => *e = packed,
            None => {
                self.keys.insert(Arc::clone(key), packed);
            }
        }
        out
    }

    /// Changes the state of `key` only if the shard holds one.
    pub(super) fn update_existing(
        &mut self,
        key: &str,
        change: impl FnOnce(&mut KeyState) -> bool,
    ) -> bool {
        let Some(entry) = self.keys.get(key).copied() else {
            return false;
        };
        let mut state = self.unpack(&entry);
        let out = change(&mut state);
        let packed = self.pack(Some(entry), &state);
        if let Some(e) = self.keys.get_mut(key) {
            *e = packed;
        }
        out
    }

    /// Keeps the keys whose state `keep` says to, and gives back the runs of the others.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&KeyState) -> bool) {
        let PackedStates {
            keys,
            layouts,
            slab,
            free,
        } = self;
        keys.retain(|_, e| {
            let kept = keep(&unpack(layouts, slab, e));
            if !kept {
                give_back(free, layouts, e);
            }
            kept
        });
    }

    pub(super) fn shrink_to_fit(&mut self) {
        self.keys.shrink_to_fit();
    }

    fn unpack(&self, e: &Entry) -> KeyState {
        unpack(&self.layouts, &self.slab, e)
    }

    /// `state` as an entry, in `old`'s run when it has as many windows.
    fn pack(&mut self, old: Option<Entry>, state: &KeyState) -> Entry {
        let codes: Vec<u32> = state.slots().iter().map(|s| s.every).collect();
        let layout = self.layout_of(&codes);
        let len = self.layouts[usize::from(layout)].len();
        let at = match old {
            Some(e) if self.layouts[usize::from(e.layout)].len() == len => e.at,
            other => {
                if let Some(e) = other {
                    give_back(&mut self.free, &self.layouts, &e);
                }
                self.take_run(len)
            }
        };
        for (j, slot) in state.slots().iter().take(len).enumerate() {
            self.slab[at as usize + j] = [slot.window, slot.count];
        }
        let f = state;
        Entry {
            fixed: [
                f.strike_window,
                f.strikes,
                f.ban_until,
                f.ban_level,
                f.level_until,
                f.last_admitted,
                f.refused_day,
                f.refused,
            ],
            layout,
            at,
        }
    }

    /// The id of a list of window lengths, made when new. Should a shard ever see more distinct
    /// lists than ids (65,535 orders of lengths), the state is kept without its windows and said
    /// once: counts of those keys start again (over-admission), nothing fails.
    fn layout_of(&mut self, codes: &[u32]) -> u16 {
        if let Some(i) = self.layouts.iter().position(|l| **l == *codes) {
            return i as u16;
        }
        match u16::try_from(self.layouts.len()) {
            Ok(id) if id < u16::MAX => {
                self.layouts.push(Box::from(codes));
                id
            }
            _ => {
                tracing::error!(
                    "the embedded quota store has seen more window layouts than it can name: \
                     counts of keys with new ones start again"
                );
                0
            }
        }
    }

    /// A run of `len` pairs: a freed one, or new at the slab's end.
    fn take_run(&mut self, len: usize) -> u32 {
        if len == 0 {
            return 0;
        }
        if let Some(at) = self.free[len - 1].pop() {
            return at;
        }
        let at = self.slab.len();
        self.slab.resize(at + len, [0, 0]);
        u32::try_from(at).unwrap_or(u32::MAX)
    }
}

fn unpack(layouts: &[Box<[u32]>], slab: &[[u32; 2]], e: &Entry) -> KeyState {
    let [strike_window, strikes, ban_until, ban_level, level_until, last_admitted, refused_day, refused] =
        e.fixed;
    let mut state = KeyState {
        strike_window,
        strikes,
        ban_until,
        ban_level,
        level_until,
        last_admitted,
        refused_day,
        refused,
        ..KeyState::default()
    };
    let codes = layouts.get(usize::from(e.layout)).map_or(&[][..], |l| l);
    for (j, &every) in codes.iter().enumerate().take(MAX_WINDOWS) {
        let [window, count] = slab.get(e.at as usize + j).copied().unwrap_or([0, 0]);
        state.slots[j] = Slot {
            every,
            window,
            count,
        };
    }
    state.len = codes.len().min(MAX_WINDOWS) as u8;
    state
}

fn give_back(free: &mut [Vec<u32>; MAX_WINDOWS], layouts: &[Box<[u32]>], e: &Entry) {
    let len = layouts.get(usize::from(e.layout)).map_or(0, |l| l.len());
    if len > 0 {
        free[len - 1].push(e.at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::limits::{Every, Limits, WindowLimit};
    use crate::quota::rules::BanPolicy;

    #[test]
    fn states_come_back_as_they_went_in_and_runs_are_reused() {
        let mut packed = PackedStates::default();
        let two = Limits::minute_day(5, 100).unwrap();
        let four = Limits::new(&[
            WindowLimit::new(Every::Secs(1), 3).unwrap(),
            WindowLimit::new(Every::MINUTE, 5).unwrap(),
            WindowLimit::new(Every::DAY, 100).unwrap(),
            WindowLimit::new(Every::Month, 1000).unwrap(),
        ])
        .unwrap();
        let ban = BanPolicy::default();
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        let mut mirror = KeyState::default();
        for i in 0..7 {
            let limits = if i < 3 { &two } else { &four };
            let v = packed.update(&a, |s| s.acquire(1_000_000 + i, limits, 1, &ban));
            assert_eq!(
                v,
                mirror.acquire(1_000_000 + i, limits, 1, &ban),
                "request {i}"
            );
            assert_eq!(packed.get("a"), Some(mirror));
        }
        packed.update(&b, |s| s.acquire(1_000_000, &two, 1, &ban));
        // `a` moved from two windows to four: its old run went back and `b` took it.
        assert_eq!(packed.slab.len(), 2 + 4);
        packed.retain(|s| s.slots().len() != 4);
        assert_eq!((packed.len(), packed.get("a")), (1, None));
        packed.update(&a, |s| s.acquire(1_000_000, &four, 1, &ban));
        assert_eq!(packed.slab.len(), 6, "the freed run of four is used again");
        assert!(std::mem::size_of::<Entry>() <= 40);
    }
}
