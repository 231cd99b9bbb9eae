//! The embedded store's top consumers' index: per period (a UTC day or month), each holder's
//! units and the same pairs ordered by units, so the heaviest N are read in O(N log n) rather
//! than by sorting every holder. Periods that ended are dropped as newer ones are written.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use super::TopWindow;

#[derive(Default)]
struct Period {
    used: HashMap<Arc<str>, u64>,
    /// `(used, holder)` of every holder of `used`: iterated from the end, heaviest first.
    ranked: BTreeSet<(u64, Arc<str>)>,
}

impl Period {
    fn add(&mut self, holder: &Arc<str>, units: u64) {
        let used = self.used.entry(Arc::clone(holder)).or_insert(0);
        if *used > 0 {
            self.ranked.remove(&(*used, Arc::clone(holder)));
        }
        *used = used.saturating_add(units);
        self.ranked.insert((*used, Arc::clone(holder)));
    }
}

/// Every period still current, by window and index.
#[derive(Default)]
pub(super) struct Ranking {
    periods: HashMap<(TopWindow, u64), Period>,
}

impl Ranking {
    /// Adds `entries` to day `day` and month `month`, and drops the periods before them.
    pub fn add(&mut self, day: u64, month: u64, entries: &[(Arc<str>, u64)]) {
        self.periods.retain(|&(window, index), _| match window {
            TopWindow::Day => index >= day,
            TopWindow::Month => index >= month,
        });
        for key in [(TopWindow::Day, day), (TopWindow::Month, month)] {
            let period = self.periods.entry(key).or_default();
            for (holder, units) in entries.iter().filter(|(_, u)| *u > 0) {
                period.add(holder, *units);
            }
        }
    }

    /// The `limit` heaviest holders of period `index` of `window`.
    pub fn top(&self, window: TopWindow, index: u64, limit: usize) -> Vec<(String, u64)> {
        self.periods
            .get(&(window, index))
            .map(|p| {
                p.ranked
                    .iter()
                    .rev()
                    .take(limit)
                    .map(|(used, holder)| (holder.to_string(), *used))
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(list: &[(&str, u64)]) -> Vec<(Arc<str>, u64)> {
        list.iter().map(|&(h, u)| (Arc::from(h), u)).collect()
    }

    #[test]
    fn holders_rank_by_their_sum_and_ended_periods_go() {
        let mut r = Ranking::default();
        r.add(10, 1, &entries(&[("a", 3), ("b", 5)]));
        r.add(10, 1, &entries(&[("a", 4)]));
        assert_eq!(
            r.top(TopWindow::Day, 10, 5),
            vec![("a".to_owned(), 7), ("b".to_owned(), 5)]
        );
        assert_eq!(r.top(TopWindow::Day, 10, 1).len(), 1);
        r.add(11, 1, &entries(&[("b", 1)]));
        assert!(r.top(TopWindow::Day, 10, 5).is_empty(), "day 10 ended");
        assert_eq!(r.top(TopWindow::Day, 11, 5), vec![("b".to_owned(), 1)]);
        assert_eq!(r.top(TopWindow::Month, 1, 5)[0], ("a".to_owned(), 7));
        assert_eq!(r.top(TopWindow::Month, 1, 5)[1], ("b".to_owned(), 6));
    }
}
