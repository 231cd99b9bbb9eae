//! How many requests this node sends each backend at once (`upstream_max_in_flight`: a number,
//! `"auto"`, or `"off"`), and who goes next when they are all taken. A request takes a
//! [`Place`] at a backend before it is sent and gives it back when the backend's answer has
//! arrived whole (or the request failed); with none free it waits, at most
//! `upstream_queue_timeout_ms`, in the [`FairQueue`]: by level, then round-robin over the quota
//! holders waiting, so one key's burst waits behind itself. Past the wait, or when
//! `upstream_queue_max` wait already and nobody of a lower level can be pushed out, it is shed
//! ([`Shed`]: 503 `overloaded`), and nothing reaches the backend.
//!
//! `upstream_reserved_share` of each backend's places are kept for `critical` requests: the
//! others take a place only while fewer than the rest are taken (Stripe's reserve for critical
//! requests), so a flood of reads never holds every place a write needs.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use prometheus::IntGauge;
use tokio::sync::oneshot;

use super::adaptive::{AutoBounds, Gradient};
use super::priority::Level;
use super::queue::{FairQueue, Ticket};
use super::rotation::Rotation;
use crate::base::metrics::METRICS;

/// How many places each backend has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// No limit and no queue: every request goes at once (the behaviour of a proxy without
    /// this, such as open-source nginx without `max_conns`).
    Off,
    Fixed(u32),
    /// Follows the backend's latency, within bounds ([`super::adaptive`]).
    Auto(AutoBounds),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaceSettings {
    pub limit: Limit,
    /// The longest a request waits for a place (HAProxy's `timeout queue`).
    pub queue_timeout: Duration,
    /// The most requests waiting at once, on this node.
    pub queue_max: usize,
    /// The share of each backend's places kept for `critical` requests, in thousandths (0 to
    /// 900; `upstream_reserved_share` 0.1 is 100).
    pub reserved_permille: u32,
}

/// Why a request got no place: 503 `overloaded`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// It waited `upstream_queue_timeout_ms`.
    QueueTimeout,
    /// The queue was full: pushed out by a newcomer of a higher level or of a lighter holder
    /// (see [`FairQueue::victim`]), or refused on arrival.
    QueueFull,
}

impl Shed {
    /// The `reason` label of `pet_gateway_overload_refusals_total`.
    pub fn reason(self) -> &'static str {
        match self {
            Shed::QueueTimeout => "queue_timeout",
            Shed::QueueFull => "queue_full",
        }
    }
}

pub struct Places {
    rotation: Arc<Rotation>,
    settings: PlaceSettings,
    state: Mutex<State>,
    in_flight: [IntGauge; Level::COUNT],
    queued: [IntGauge; Level::COUNT],
    limits: Vec<IntGauge>,
}

struct Backend {
    in_flight: usize,
    fixed: usize,
    auto: Option<Gradient>,
}

impl Backend {
    fn limit(&self) -> usize {
        self.auto.as_ref().map_or(self.fixed, Gradient::limit)
    }
}

struct State {
    backends: Vec<Backend>,
    queue: FairQueue<Waiter>,
}

struct Waiter {
    reply: oneshot::Sender<Grant>,
}

#[derive(Debug)]
enum Grant {
    Place { backend: usize, epoch: u32 },
    Shed,
}

/// A request's place at a backend, given back when dropped. It reports the backend's latency
/// (when [`Place::answered`] was told it) to the adaptive limit.
pub struct Place {
    places: Arc<Places>,
    backend: usize,
    level: Level,
    epoch: u32,
    /// How long it waited for the place.
    pub waited: Duration,
    latency: Option<Duration>,
}

impl std::fmt::Debug for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Place")
            .field("backend", &self.backend)
            .field("level", &self.level)
            .finish()
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // Counters and a queue: a panic elsewhere leaves them usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Places {
    pub fn new(rotation: Arc<Rotation>, settings: PlaceSettings) -> Arc<Places> {
        let now = Instant::now();
        let backends = (0..rotation.len())
            .map(|_| Backend {
                in_flight: 0,
                fixed: match settings.limit {
                    Limit::Fixed(n) => n.max(1) as usize,
                    _ => usize::MAX,
                },
                auto: match settings.limit {
                    Limit::Auto(bounds) => Some(Gradient::new(bounds, now)),
                    _ => None,
                },
            })
            .collect::<Vec<_>>();
        let labels = rotation.labels();
        let limits = labels
            .iter()
            .map(|a| METRICS.upstream_limit.with_label_values(&[a]))
            .collect::<Vec<_>>();
        // Without a limit there is none to show (the series stays out of the export).
        if settings.limit == Limit::Off {
            for a in &labels {
                let _ = METRICS.upstream_limit.remove_label_values(&[a]);
            }
        }
        for (gauge, b) in limits.iter().zip(&backends) {
            if b.limit() != usize::MAX {
                gauge.set(b.limit() as i64);
            }
        }
        let gauges =
            |vec: &prometheus::IntGaugeVec| Level::ALL.map(|l| vec.with_label_values(&[l.name()]));
        Arc::new(Places {
            rotation,
            settings,
            state: Mutex::new(State {
                backends,
                queue: FairQueue::default(),
            }),
            in_flight: gauges(&METRICS.upstream_in_flight),
            queued: gauges(&METRICS.upstream_queue),
            limits,
        })
    }

    pub fn rotation(&self) -> &Arc<Rotation> {
        &self.rotation
    }

    pub fn settings(&self) -> &PlaceSettings {
        &self.settings
    }

    /// A place at a backend for a request of `holder` at `level`: at once when one is free,
    /// else after waiting in the queue, or [`Shed`].
    pub async fn acquire(self: &Arc<Self>, holder: &Arc<str>, level: Level) -> Result<Place, Shed> {
        if self.settings.limit == Limit::Off {
            let backend = self.rotation.pick(None);
            return Ok(self.place(backend, level, 0, Duration::ZERO));
        }
        let started = Instant::now();
        let (answer, ticket, shed) = {
            let mut state = lock(&self.state);
            if let Some(backend) = self.room(&state, level) {
                let epoch = state.take(backend);
                drop(state);
                return Ok(self.place(backend, level, epoch, Duration::ZERO));
            }
            state.saturated();
            let mut shed = None;
            if state.queue.len() >= self.settings.queue_max {
                match state.queue.victim(holder, level) {
                    Some((h, l, t)) => shed = state.queue.remove(&h, l, t),
                    None => return Err(Shed::QueueFull),
                }
            }
            let (reply, answer) = oneshot::channel();
            let ticket = state.queue.push(holder, level, Waiter { reply });
            self.show_queue(&state);
            (answer, ticket, shed)
        };
        if let Some(pushed_out) = shed {
            let _ = pushed_out.reply.send(Grant::Shed);
        }
        let mut waiting = Waiting {
            places: Arc::clone(self),
            holder: Arc::clone(holder),
            level,
            ticket,
            answer: Some(answer),
        };
        let outcome = waiting.wait(self.settings.queue_timeout).await;
        METRICS
            .upstream_queue_wait
            .observe(started.elapsed().as_secs_f64());
        match outcome {
            Some(Grant::Place { backend, epoch }) => {
                Ok(self.place(backend, level, epoch, started.elapsed()))
            }
            Some(Grant::Shed) => Err(Shed::QueueFull),
            None => Err(Shed::QueueTimeout),
        }
    }

    fn place(
        self: &Arc<Self>,
        backend: usize,
        level: Level,
        epoch: u32,
        waited: Duration,
    ) -> Place {
        self.in_flight[level.index()].inc();
        Place {
            places: Arc::clone(self),
            backend,
            level,
            epoch,
            waited,
            latency: None,
        }
    }

    /// The backend, in this request's turn, with a place for `level`: among the healthy ones
    /// while any is healthy (a full healthy backend is waited for, not skipped for one that
    /// refuses connections), else among all.
    fn room(&self, state: &State, level: Level) -> Option<usize> {
        let any_healthy = (0..self.rotation.len()).any(|i| self.rotation.healthy(i));
        self.rotation
            .in_turn()
            .filter(|&i| !any_healthy || self.rotation.healthy(i))
            .find(|&i| state.backends[i].in_flight < self.cap(&state.backends[i], level))
    }

    /// The places of `backend` that `level` may take: all for `critical`, the rest less the
    /// reserve for any other (the share of the limit, rounded to the nearest place: a limit of
    /// two keeps none at 10 %, one of five keeps one), at least one.
    fn cap(&self, backend: &Backend, level: Level) -> usize {
        let limit = backend.limit();
        if level == Level::Critical || limit == usize::MAX {
            return limit;
        }
        let permille = self.settings.reserved_permille.min(1000) as usize;
        let kept = (limit.saturating_mul(permille) + 500) / 1000;
        limit.saturating_sub(kept).max(1)
    }

    /// Gives back a place (`latency`: the backend's answer time, when it answered) and hands
    /// free places to the waiters.
    fn release(self: &Arc<Self>, backend: usize, level: Level, sample: Option<(u32, Duration)>) {
        self.in_flight[level.index()].dec();
        if self.settings.limit == Limit::Off {
            return;
        }
        let grants = {
            let mut state = lock(&self.state);
            let b = &mut state.backends[backend];
            b.in_flight = b.in_flight.saturating_sub(1);
            let changed = match (&mut b.auto, sample) {
                (Some(g), Some((epoch, latency))) => g.sample(epoch, latency, Instant::now()),
                (Some(g), None) => g.tick(Instant::now()),
                _ => false,
            };
            if changed {
                self.limits[backend].set(b.limit() as i64);
            }
            self.dispatch(&mut state)
        };
        self.send(grants);
    }

    /// Hands free places to waiters, highest level first: returns whom to tell, to be told
    /// once the lock is let go.
    fn dispatch(&self, state: &mut State) -> Vec<(Waiter, Grant)> {
        let mut grants = Vec::new();
        while let Some(level) = state.queue.top() {
            // Places a level may take grow with the level: if the highest waiting has none,
            // nobody has.
            let Some(backend) = self.room(state, level) else {
                break;
            };
            let Some((_, waiter)) = state.queue.pop(level) else {
                break;
            };
            let epoch = state.take(backend);
            grants.push((waiter, Grant::Place { backend, epoch }));
        }
        if !grants.is_empty() {
            self.show_queue(state);
        }
        grants
    }

    /// Tells waiters their places; a place whose waiter has gone (given up that very moment)
    /// is given back.
    fn send(self: &Arc<Self>, grants: Vec<(Waiter, Grant)>) {
        for (waiter, grant) in grants {
            if let Err(Grant::Place { backend, .. }) = waiter.reply.send(grant) {
                self.give_back_unused(backend);
            }
        }
    }

    /// A place granted to nobody (its waiter gone) goes back.
    fn give_back_unused(self: &Arc<Self>, backend: usize) {
        let grants = {
            let mut state = lock(&self.state);
            let b = &mut state.backends[backend];
            b.in_flight = b.in_flight.saturating_sub(1);
            self.dispatch(&mut state)
        };
        self.send(grants);
    }

    fn show_queue(&self, state: &State) {
        for (gauge, n) in self.queued.iter().zip(state.queue.by_level()) {
            gauge.set(n as i64);
        }
    }

    /// Every backend's limit now (`usize::MAX`: none), for the console.
    pub fn limits(&self) -> Vec<usize> {
        lock(&self.state)
            .backends
            .iter()
            .map(Backend::limit)
            .collect()
    }

    /// Requests waiting for a place now.
    pub fn queued(&self) -> usize {
        lock(&self.state).queue.len()
    }
}

impl State {
    /// Takes a place at `backend`; returns the epoch the request's latency counts in.
    fn take(&mut self, backend: usize) -> u32 {
        let b = &mut self.backends[backend];
        b.in_flight += 1;
        match &mut b.auto {
            Some(g) => {
                if b.in_flight >= g.limit() {
                    g.saturated();
                }
                g.epoch()
            }
            None => 0,
        }
    }

    /// Every adaptive limit was reached: a request waits.
    fn saturated(&mut self) {
        for b in &mut self.backends {
            if let Some(g) = &mut b.auto {
                g.saturated();
            }
        }
    }
}

impl Place {
    /// The backend this place is at (its index in the rotation).
    pub fn backend(&self) -> usize {
        self.backend
    }

    pub fn level(&self) -> Level {
        self.level
    }

    /// The backend answered after `latency` (or timed out after it): what the adaptive limit
    /// learns from, reported when the place is given back.
    pub fn answered(&mut self, latency: Duration) {
        self.latency = Some(latency);
    }

    /// A retry goes to another backend: the place moves there (over that backend's limit if it
    /// has no free one: the request was admitted once, and a retry is rare).
    pub fn move_to(&mut self, backend: usize) {
        if backend == self.backend || self.places.settings.limit == Limit::Off {
            self.backend = backend;
            return;
        }
        let grants = {
            let mut state = lock(&self.places.state);
            let old = &mut state.backends[self.backend];
            old.in_flight = old.in_flight.saturating_sub(1);
            state.backends[backend].in_flight += 1;
            self.places.dispatch(&mut state)
        };
        self.backend = backend;
        self.places.send(grants);
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let sample = self.latency.map(|l| (self.epoch, l));
        self.places.release(self.backend, self.level, sample);
    }
}

/// A request waiting in the queue. Should its wait end without a place (the deadline, or its
/// task dropped), it leaves the queue; a place that reached it at that very moment goes back.
struct Waiting {
    places: Arc<Places>,
    holder: Arc<str>,
    level: Level,
    ticket: Ticket,
    answer: Option<oneshot::Receiver<Grant>>,
}

impl Waiting {
    /// Out of the queue; false when it was no longer there (its grant was already sent).
    fn leave_queue(&self) -> bool {
        let mut state = lock(&self.places.state);
        let removed = state
            .queue
            .remove(&self.holder, self.level, self.ticket)
            .is_some();
        self.places.show_queue(&state);
        removed
    }

    /// The grant, or `None` when the deadline passed first.
    async fn wait(&mut self, timeout: Duration) -> Option<Grant> {
        let answer = self.answer.as_mut()?;
        match tokio::time::timeout(timeout, answer).await {
            Ok(Ok(grant)) => {
                self.answer = None;
                Some(grant)
            }
            // The sender went without a word: cannot happen while the queue holds it.
            Ok(Err(_)) => {
                self.answer = None;
                None
            }
            Err(_) => {
                if self.leave_queue() {
                    self.answer = None;
                    return None;
                }
                // Popped that very moment: its answer is on its way. The receiver stays in
                // `self` while awaited, so a request dropped here still gives the place back.
                let grant = self.answer.as_mut()?.await.ok();
                self.answer = None;
                grant
            }
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let Some(mut answer) = self.answer.take() else {
            return;
        };
        if !self.leave_queue() {
            // Closed first, so a grant sent after this look fails at the sender, which gives
            // the place back itself; one sent before is found here.
            answer.close();
            if let Ok(Grant::Place { backend, .. }) = answer.try_recv() {
                self.places.give_back_unused(backend);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn places(n: u32, queue_max: usize, reserved_permille: u32) -> Arc<Places> {
        let rotation = Arc::new(Rotation::new(vec!["127.0.0.1:1"
            .parse::<std::net::SocketAddr>()
            .unwrap()
            .into()]));
        Places::new(
            rotation,
            PlaceSettings {
                limit: Limit::Fixed(n),
                queue_timeout: Duration::from_secs(5),
                queue_max,
                reserved_permille,
            },
        )
    }

    fn holder(name: &str) -> Arc<str> {
        Arc::from(name)
    }

    #[tokio::test]
    async fn places_go_round_robin_by_holder_and_a_heavy_holder_waits_behind_itself() {
        let p = places(1, 100, 0);
        let first = p.acquire(&holder("heavy"), Level::Normal).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, n) in [("heavy", 4), ("light", 2)] {
            for i in 0..n {
                let (p, order) = (Arc::clone(&p), Arc::clone(&order));
                tasks.push(tokio::spawn(async move {
                    let place = p.acquire(&holder(name), Level::Normal).await.unwrap();
                    order.lock().unwrap().push(format!("{name}{i}"));
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    drop(place);
                }));
                tokio::task::yield_now().await;
            }
        }
        while p.queued() < 6 {
            tokio::task::yield_now().await;
        }
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        assert_eq!(
            order,
            ["heavy0", "light0", "heavy1", "light1", "heavy2", "heavy3"]
        );
        assert_eq!(p.state.lock().unwrap().backends[0].in_flight, 0);
    }

    #[tokio::test]
    async fn the_reserve_is_kept_for_critical_and_a_full_queue_sheds_the_lowest_newest() {
        let p = places(4, 2, 250);
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(p.acquire(&holder("a"), Level::Normal).await.unwrap());
        }
        // The fourth place is the reserve: a normal request waits, a critical one goes.
        let (p2, p3) = (Arc::clone(&p), Arc::clone(&p));
        let waiting_low = tokio::spawn(async move { p2.acquire(&holder("b"), Level::Low).await });
        while p.queued() < 1 {
            tokio::task::yield_now().await;
        }
        held.push(p.acquire(&holder("c"), Level::Critical).await.unwrap());
        let waiting_normal =
            tokio::spawn(async move { p3.acquire(&holder("d"), Level::Normal).await });
        while p.queued() < 2 {
            tokio::task::yield_now().await;
        }
        // Full: a high one pushes the newest low one out; another low one is refused at once.
        let p4 = Arc::clone(&p);
        let waiting_high = tokio::spawn(async move { p4.acquire(&holder("e"), Level::High).await });
        assert_eq!(waiting_low.await.unwrap().unwrap_err(), Shed::QueueFull);
        assert_eq!(
            p.acquire(&holder("f"), Level::Low).await.unwrap_err(),
            Shed::QueueFull
        );
        // A freed place goes to the highest level waiting (once below the reserve).
        drop(held.remove(0));
        drop(held.remove(0));
        let high = waiting_high.await.unwrap().unwrap();
        assert_eq!(high.level(), Level::High);
        drop(high);
        let normal = waiting_normal.await.unwrap().unwrap();
        drop(normal);
        drop(held);
        assert_eq!(p.state.lock().unwrap().backends[0].in_flight, 0);
        assert_eq!(p.queued(), 0);
    }

    #[tokio::test]
    async fn a_wait_past_its_deadline_is_shed_and_a_dropped_waiter_leaves_nothing_behind() {
        let rotation = Arc::new(Rotation::new(vec!["127.0.0.1:1"
            .parse::<std::net::SocketAddr>()
            .unwrap()
            .into()]));
        let p = Places::new(
            rotation,
            PlaceSettings {
                limit: Limit::Fixed(1),
                queue_timeout: Duration::from_millis(30),
                queue_max: 10,
                reserved_permille: 0,
            },
        );
        let held = p.acquire(&holder("a"), Level::Normal).await.unwrap();
        assert_eq!(
            p.acquire(&holder("b"), Level::Normal).await.unwrap_err(),
            Shed::QueueTimeout
        );
        assert_eq!(p.queued(), 0);
        // A waiter whose task is dropped (a stop) leaves the queue.
        let p2 = Arc::clone(&p);
        let task = tokio::spawn(async move { p2.acquire(&holder("c"), Level::Normal).await });
        while p.queued() < 1 {
            tokio::task::yield_now().await;
        }
        task.abort();
        let _ = task.await;
        assert_eq!(p.queued(), 0);
        drop(held);
        assert_eq!(p.state.lock().unwrap().backends[0].in_flight, 0);
        // And the place is free for the next.
        let again = p.acquire(&holder("d"), Level::Normal).await.unwrap();
        assert_eq!(again.backend(), 0);
    }
}
