//! The requests waiting for a place at the backend, in the order places are handed out:
//! strictly by level (a higher level's waiters always go first), and within a level round-robin
//! over the quota holders (a key, or a customer's keys together) with requests waiting, each
//! holder's own requests in arrival order. So a heavy key waits behind its own requests, not
//! behind everyone's: with a light key and a heavy one waiting, places alternate between them
//! however many the heavy one has queued.
//!
//! Plain data, no locking and no time: [`super::places`] holds it under its lock.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::priority::Level;

/// A waiter's number: unique, and growing with arrival (the newest has the largest).
pub type Ticket = u64;

#[derive(Debug)]
struct Tier<W> {
    /// The holders with requests waiting at this level, in turn order.
    turn: VecDeque<Arc<str>>,
    /// Each holder's waiters, oldest first.
    waiting: HashMap<Arc<str>, VecDeque<(Ticket, W)>>,
}

impl<W> Default for Tier<W> {
    fn default() -> Self {
        Tier {
            turn: VecDeque::new(),
            waiting: HashMap::new(),
        }
    }
}

#[derive(Debug)]
pub struct FairQueue<W> {
    tiers: [Tier<W>; Level::COUNT],
    len: usize,
    by_level: [usize; Level::COUNT],
    next: Ticket,
}

impl<W> Default for FairQueue<W> {
    fn default() -> Self {
        FairQueue {
            tiers: Default::default(),
            len: 0,
            by_level: [0; Level::COUNT],
            next: 0,
        }
    }
}

impl<W> FairQueue<W> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Waiters of each level, lowest first.
    pub fn by_level(&self) -> [usize; Level::COUNT] {
        self.by_level
    }

    /// Adds a waiter of `holder` at `level`; returns its ticket.
    pub fn push(&mut self, holder: &Arc<str>, level: Level, waiter: W) -> Ticket {
        let ticket = self.next;
        self.next += 1;
        let tier = &mut self.tiers[level.index()];
        match tier.waiting.get_mut(holder) {
            Some(queue) => queue.push_back((ticket, waiter)),
            None => {
                tier.waiting
                    .insert(Arc::clone(holder), VecDeque::from([(ticket, waiter)]));
                tier.turn.push_back(Arc::clone(holder));
            }
        }
        self.len += 1;
        self.by_level[level.index()] += 1;
        ticket
    }

    /// The highest level with waiters, if any.
    pub fn top(&self) -> Option<Level> {
        Level::ALL
            .into_iter()
            .rev()
            .find(|l| self.by_level[l.index()] > 0)
    }

    /// The next waiter of `level`: the oldest of the holder whose turn it is, who then goes to
    /// the back of the turn if it has more waiting.
    pub fn pop(&mut self, level: Level) -> Option<(Ticket, W)> {
        let tier = &mut self.tiers[level.index()];
        let holder = tier.turn.pop_front()?;
        let queue = tier.waiting.get_mut(&holder)?;
        let next = queue.pop_front();
        if queue.is_empty() {
            tier.waiting.remove(&holder);
        } else {
            tier.turn.push_back(holder);
        }
        if next.is_some() {
            self.len -= 1;
            self.by_level[level.index()] -= 1;
        }
        next
    }

    /// Takes out the waiter `ticket` of `holder` at `level` (it gave up); `None` when it is no
    /// longer waiting (a place or a refusal reached it first).
    pub fn remove(&mut self, holder: &str, level: Level, ticket: Ticket) -> Option<W> {
        let tier = &mut self.tiers[level.index()];
        let queue = tier.waiting.get_mut(holder)?;
        let at = queue.iter().position(|(t, _)| *t == ticket)?;
        let (_, waiter) = queue.remove(at)?;
        if queue.is_empty() {
            tier.waiting.remove(holder);
            tier.turn.retain(|h| &**h != holder);
        }
        self.len -= 1;
        self.by_level[level.index()] -= 1;
        Some(waiter)
    }

    /// Who is pushed out when the queue is full and `holder` arrives at `level`: the newest
    /// waiter of the holder with the most waiting at the lowest level below `level`; else, at
    /// `level` itself, the newest of the holder with the most waiting if that is more than one
    /// above what `holder` has (so a full queue is shared out, and a heavy key that filled it
    /// cannot keep everyone else out); else nobody, and the newcomer is refused.
    pub fn victim(&self, holder: &str, level: Level) -> Option<(Arc<str>, Level, Ticket)> {
        if let Some(lower) = Level::ALL
            .into_iter()
            .take_while(|l| *l < level)
            .find(|l| self.by_level[l.index()] > 0)
        {
            return self.heaviest(lower).map(|(h, t, _)| (h, lower, t));
        }
        let tier = &self.tiers[level.index()];
        let own = tier.waiting.get(holder).map_or(0, VecDeque::len);
        let (heavy, ticket, count) = self.heaviest(level)?;
        (count > own + 1).then_some((heavy, level, ticket))
    }

    /// The holder with the most waiters at `level` (the newest waiting breaking ties), its
    /// newest waiter's ticket and how many it has waiting.
    fn heaviest(&self, level: Level) -> Option<(Arc<str>, Ticket, usize)> {
        self.tiers[level.index()]
            .waiting
            .iter()
            .filter_map(|(holder, queue)| Some((holder, queue.back()?.0, queue.len())))
            .max_by_key(|(_, ticket, count)| (*count, *ticket))
            .map(|(holder, ticket, count)| (Arc::clone(holder), ticket, count))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(q: &mut FairQueue<&'static str>) -> Vec<&'static str> {
        let mut out = Vec::new();
        while let Some(level) = q.top() {
            out.push(q.pop(level).unwrap().1);
        }
        out
    }

    #[test]
    fn a_heavy_holder_waits_behind_its_own_requests_and_levels_are_strict() {
        let mut q = FairQueue::default();
        let (heavy, light, other): (Arc<str>, Arc<str>, Arc<str>) =
            ("heavy".into(), "light".into(), "other".into());
        for name in ["h1", "h2", "h3", "h4"] {
            q.push(&heavy, Level::Normal, name);
        }
        q.push(&light, Level::Normal, "l1");
        q.push(&light, Level::Normal, "l2");
        q.push(&other, Level::Critical, "c1");
        q.push(&heavy, Level::Low, "x1");
        assert_eq!(q.len(), 8);
        assert_eq!(q.by_level(), [1, 6, 0, 1]);
        assert_eq!(
            order(&mut q),
            ["c1", "h1", "l1", "h2", "l2", "h3", "h4", "x1"]
        );
        assert!(q.is_empty());
    }

    #[test]
    fn a_waiter_that_gives_up_leaves_and_a_full_queue_pushes_out_the_lowest_first() {
        let mut q = FairQueue::default();
        let (a, b, c): (Arc<str>, Arc<str>, Arc<str>) = ("a".into(), "b".into(), "c".into());
        let t1 = q.push(&a, Level::Low, "a1");
        let t2 = q.push(&b, Level::Low, "b1");
        let t3 = q.push(&a, Level::Normal, "a2");
        // Equal at the lowest level: the newest goes.
        assert_eq!(
            q.victim("c", Level::Normal),
            Some((Arc::clone(&b), Level::Low, t2))
        );
        assert_eq!(q.remove("b", Level::Low, t2), Some("b1"));
        assert_eq!(q.remove("b", Level::Low, t2), None, "gone already");
        assert_eq!(
            q.victim("c", Level::High),
            Some((Arc::clone(&a), Level::Low, t1))
        );
        assert_eq!(q.remove("a", Level::Low, t1), Some("a1"));
        // Nobody lower, and `a` has a single waiter at this level: the newcomer is refused.
        assert_eq!(q.victim("c", Level::Normal), None);
        assert_eq!(q.victim("c", Level::Low), None);
        assert_eq!(
            q.victim("c", Level::High),
            Some((Arc::clone(&a), Level::Normal, t3))
        );
        assert_eq!(order(&mut q), ["a2"]);
        assert_eq!(q.by_level(), [0; 4]);
        let _ = c;
    }

    #[test]
    fn a_full_queue_taken_by_one_holder_makes_room_for_the_others() {
        let mut q = FairQueue::default();
        let (heavy, light): (Arc<str>, Arc<str>) = ("heavy".into(), "light".into());
        let tickets: Vec<Ticket> = (0..4).map(|_| q.push(&heavy, Level::Normal, "h")).collect();
        // The heavy holder's newest waiter goes for a light newcomer...
        assert_eq!(
            q.victim("light", Level::Normal),
            Some((Arc::clone(&heavy), Level::Normal, tickets[3]))
        );
        // ...but not for one of its own, nor for a lower level.
        assert_eq!(q.victim("heavy", Level::Normal), None);
        assert_eq!(q.victim("light", Level::Low), None);
        q.remove("heavy", Level::Normal, tickets[3]);
        q.push(&light, Level::Normal, "l1");
        q.push(&light, Level::Normal, "l2");
        // 3 against 2: the light one's third would only swap the imbalance, so it is refused.
        assert_eq!(q.victim("light", Level::Normal), None);
        assert_eq!(
            q.victim("third", Level::Normal),
            Some((heavy, Level::Normal, tickets[2]))
        );
    }
}
