//! `upstream_max_in_flight = "auto"`: a backend's limit follows what it can take, measured from
//! its latency, the way Envoy's adaptive concurrency filter and Netflix's concurrency-limits do
//! it: a gradient controller comparing the latency of requests sent now against a minimum
//! measured from time to time at low concurrency.
//!
//! - **Measuring** (at the start, then every [`REMEASURE`]): the limit drops to its lower
//!   bound until [`MEASURE_SAMPLES`] requests sent during the measurement have answered (or
//!   [`MEASURE_MAX`] has passed and [`MEASURE_LEAST`] have); the median of their latencies is the backend's
//!   latency without a queue (`min_rtt`). Only requests sent during it count, not those sent
//!   before at a higher concurrency.
//! - **Running**: every window ([`WINDOW`], and at least [`WINDOW_SAMPLES`] answers), the mean
//!   latency of the answers that came in it (a timed-out request's counts as the time it was
//!   given; none counts more than twice what is allowed, so a few slow ones cannot hold the
//!   limit down), `rtt`, against `min_rtt`. Every answer that came counts, whenever its request was
//!   sent: counting only requests sent during the window would leave the slow ones (those that
//!   queued in the backend) to later windows and see less queue than there is, and a backend
//!   answering in seconds would give a window nothing. The mean, not the median: requests of
//!   equal cost sent together are served in rounds, so with up to twice the workers' number in
//!   flight most answers still take one service time, and only the mean (Little's law: in
//!   flight over throughput) sees the queue. Above `min_rtt` by more than
//!   [`TOLERANCE`], requests queue inside the backend, and the limit shrinks by
//!   `(1 + TOLERANCE) × min_rtt / rtt` (at most halved at once); within it, and the limit was
//!   reached during the window (requests waited for a place), it grows by [`GROWTH`] (a place
//!   at least). A
//!   backend with more workers than requests waiting is not probed further: there is nothing
//!   to learn.
//!
//! With a backend of `W` workers, a limit above `W` makes requests queue there, the latency
//! grows in proportion, and the next window takes the limit back to about `1.1 W`; below `W`
//! nothing queues and the limit grows. It settles between `W` and `1.25 W` (the tests in this
//! file run model backends; `bench/overload.py` measures a real one). Places kept for `critical`
//! requests (`upstream_reserved_share`) sit idle while none comes, so the backend is only
//! full once the other levels' places are: with a reserve of `R` places the limit settles
//! about `R` higher.

use std::time::{Duration, Instant};

/// How long a window of samples lasts at least.
pub const WINDOW: Duration = Duration::from_millis(250);
/// Answers a window needs before it moves the limit.
pub const WINDOW_SAMPLES: usize = 8;
/// Latency above the measured minimum that counts as no queue (noise, a busier moment).
pub const TOLERANCE: f64 = 0.1;
/// How much a saturated limit grows per window while the latency stays near the minimum.
pub const GROWTH: f64 = 1.1;
/// How often the minimum is measured again (a backend that got slower for good).
pub const REMEASURE: Duration = Duration::from_secs(30);
/// Answers sent during a measurement that make its median.
pub const MEASURE_SAMPLES: usize = 16;
/// A measurement ends after this long with what it has (a slow or idle backend), once it has
/// [`MEASURE_LEAST`] answers.
pub const MEASURE_MAX: Duration = Duration::from_secs(2);
/// The fewest answers a measurement ends on.
pub const MEASURE_LEAST: usize = 4;
/// Samples kept per window: enough for a median.
const KEEP: usize = 256;

/// The bounds of an adaptive limit (`upstream_auto_min`, `upstream_auto_max`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AutoBounds {
    pub min: u32,
    pub max: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Measuring { since: Instant, resume: u64 },
    Running,
}

/// One backend's adaptive limit.
#[derive(Debug)]
pub struct Gradient {
    bounds: AutoBounds,
    /// The running limit (kept through a measurement, which holds the limit at the minimum).
    limit: f64,
    phase: Phase,
    /// Grows at each change of phase: a sample of a request sent in another phase is ignored.
    epoch: u32,
    min_rtt: Option<Duration>,
    next_measure: Instant,
    window_started: Instant,
    /// Latencies of the answers come in this measurement or window.
    samples: Vec<Duration>,
    saturated: bool,
}

impl Gradient {
    /// Starts measuring at once; then runs from twice the lower bound.
    pub fn new(bounds: AutoBounds, now: Instant) -> Gradient {
        let min = f64::from(bounds.min.max(1));
        Gradient {
            bounds,
            limit: (2.0 * min).min(f64::from(bounds.max.max(bounds.min))),
            phase: Phase::Measuring {
                since: now,
                resume: 0,
            },
            epoch: 0,
            min_rtt: None,
            next_measure: now + REMEASURE,
            window_started: now,
            samples: Vec::with_capacity(KEEP),
            saturated: false,
        }
    }

    /// The places the backend may have now.
    pub fn limit(&self) -> usize {
        match self.phase {
            Phase::Measuring { .. } => self.bounds.min.max(1) as usize,
            Phase::Running => self.limit.floor().max(1.0) as usize,
        }
    }

    /// The epoch a request granted now belongs to (its sample counts only in it).
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// The measured latency without a queue, when known.
    pub fn min_rtt(&self) -> Option<Duration> {
        self.min_rtt
    }

    /// The limit was reached: a request waited for a place.
    pub fn saturated(&mut self) {
        self.saturated = true;
    }

    /// An answer of a request sent in `epoch` took `rtt`; returns whether the limit changed. A
    /// measurement takes only requests sent during it (not those sent before at a higher
    /// concurrency); a running window takes any.
    pub fn sample(&mut self, epoch: u32, rtt: Duration, now: Instant) -> bool {
        if epoch != self.epoch && self.phase != Phase::Running {
            return false;
        }
        if self.samples.len() < KEEP {
            self.samples.push(rtt);
        }
        self.tick(now)
    }

    /// Ends a measurement or a window that is due; returns whether the limit changed.
    pub fn tick(&mut self, now: Instant) -> bool {
        let before = self.limit();
        match self.phase {
            Phase::Measuring { since, resume } => {
                // Never ended on one or two answers: a backend slower than the measurement's
                // bound (or booting, its first connections slow) would leave a minimum of one
                // odd answer, and the limit would run on it until the next measurement.
                let enough = self.samples.len() >= MEASURE_SAMPLES
                    || (self.samples.len() >= MEASURE_LEAST
                        && now.duration_since(since) >= MEASURE_MAX);
                if enough {
                    if let Some(median) = median(&mut self.samples) {
                        self.min_rtt = Some(median);
                    }
                    if resume > 0 {
                        self.limit = resume as f64;
                    }
                    self.next_measure = now + REMEASURE;
                    self.phase = Phase::Running;
                    self.start_window(now);
                }
            }
            Phase::Running if now >= self.next_measure => {
                let resume = self.limit.floor().max(1.0) as u64;
                self.phase = Phase::Measuring { since: now, resume };
                self.start_window(now);
            }
            Phase::Running => {
                let due = now.duration_since(self.window_started) >= WINDOW
                    && self.samples.len() >= WINDOW_SAMPLES;
                if due {
                    self.adjust();
                    self.start_window(now);
                }
            }
        }
        self.limit() != before
    }

    fn adjust(&mut self) {
        let Some(min_rtt) = self.min_rtt else {
            return;
        };
        let (min, max) = (
            f64::from(self.bounds.min.max(1)),
            f64::from(self.bounds.max.max(self.bounds.min).max(1)),
        );
        let allowed = min_rtt.as_secs_f64() * (1.0 + TOLERANCE);
        // Each answer counts at most twice what is allowed, which already halves the limit (the
        // most it moves at once): a few slow requests (one key's, a slow operation, timeouts)
        // cannot drag the mean of the fast ones below the backend's worth.
        let cap = Duration::from_secs_f64(2.0 * allowed);
        let Some(rtt) = mean(self.samples.iter().map(|s| (*s).min(cap))) else {
            return;
        };
        let rtt = rtt.as_secs_f64().max(f64::MIN_POSITIVE);
        if rtt > allowed {
            let gradient = (allowed / rtt).max(0.5);
            self.limit = (self.limit * gradient).max(min);
        } else if self.saturated {
            self.limit = (self.limit * GROWTH).max(self.limit + 1.0).min(max);
        }
    }

    fn start_window(&mut self, now: Instant) {
        self.epoch = self.epoch.wrapping_add(1);
        self.window_started = now;
        self.samples.clear();
        self.saturated = false;
    }
}

/// The mean of `samples`, if any.
fn mean(samples: impl ExactSizeIterator<Item = Duration>) -> Option<Duration> {
    let n = u32::try_from(samples.len()).ok().filter(|n| *n > 0)?;
    Some(samples.sum::<Duration>() / n)
}

/// The median of `samples` (reordered), if any.
fn median(samples: &mut [Duration]) -> Option<Duration> {
    if samples.is_empty() {
        return None;
    }
    let mid = samples.len() / 2;
    let (_, m, _) = samples.select_nth_unstable(mid);
    Some(*m)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend of `workers` workers each taking `service` a request, kept busy by more
    /// demand than it can serve (the gateway's queue is never empty): with `limit` requests
    /// in flight, each waits for a worker in turn, so the median answer takes `service ×
    /// max(1, limit / workers)`, give or take `noise`. Runs `steps` answers through `g`.
    fn run(g: &mut Gradient, now: &mut Instant, workers: f64, service: Duration, steps: usize) {
        let mut wiggle = 0u32;
        for _ in 0..steps {
            let limit = g.limit() as f64;
            let factor = (limit / workers).max(1.0);
            wiggle = (wiggle + 7) % 11;
            let noise = 1.0 + (f64::from(wiggle) - 5.0) / 100.0;
            let rtt = service.mul_f64(factor * noise);
            // Answers arrive at the backend's rate: `min(limit, workers)` per `rtt`.
            let gap = rtt.div_f64(limit.min(workers).max(1.0));
            *now += gap;
            g.saturated();
            let epoch = g.epoch();
            g.sample(epoch, rtt, *now);
        }
    }

    #[test]
    fn the_limit_follows_the_backends_workers_each_way() {
        let start = Instant::now();
        let mut now = start;
        let bounds = AutoBounds { min: 1, max: 1000 };
        let mut g = Gradient::new(bounds, now);
        let service = Duration::from_millis(25);
        for workers in [4.0, 2.0, 8.0, 32.0, 3.0] {
            // 10 s of answers at the backend's rate.
            let steps = (10.0 * workers / service.as_secs_f64()) as usize;
            let changed_at = now;
            run(&mut g, &mut now, workers, service, steps);
            let limit = g.limit() as f64;
            assert!(
                (0.75 * workers..=1.5 * workers).contains(&limit),
                "{workers} workers: limit {limit} after {:?}",
                now - changed_at
            );
        }
    }

    /// Requests of equal cost served in rounds, as a backend of `workers` workers does with
    /// requests that all take `service`: with `limit` in flight, the `i`th of a round waits
    /// `i / workers` services before its own. Most answers take one service time until the
    /// limit is twice the workers.
    /// Returns the limits each round of the last half ran at.
    fn run_in_rounds(
        g: &mut Gradient,
        now: &mut Instant,
        workers: usize,
        service: Duration,
    ) -> Vec<usize> {
        let rounds = (10.0 / service.as_secs_f64()) as usize;
        let mut limits = Vec::new();
        for round in 0..rounds {
            if round >= rounds / 2 {
                limits.push(g.limit());
            }
            let limit = g.limit();
            let round = service * limit.div_ceil(workers) as u32;
            for i in 0..limit {
                *now += round / limit as u32;
                g.saturated();
                let epoch = g.epoch();
                g.sample(epoch, service * (1 + (i / workers) as u32), *now);
            }
        }
        limits
    }

    #[test]
    fn requests_served_in_rounds_do_not_hide_the_backends_queue() {
        let mut now = Instant::now();
        let mut g = Gradient::new(AutoBounds { min: 1, max: 1000 }, now);
        for workers in [4usize, 2, 8, 32] {
            let limits = run_in_rounds(&mut g, &mut now, workers, Duration::from_millis(25));
            let (least, most) = (limits.iter().min(), limits.iter().max());
            let w = workers as f64;
            let within =
                |l: Option<&usize>| l.is_some_and(|&l| (0.75 * w..=1.5 * w).contains(&(l as f64)));
            assert!(
                within(least) && within(most),
                "{workers} workers: the limit ran between {least:?} and {most:?}"
            );
        }
    }

    #[test]
    fn a_measurement_holds_the_lower_bound_then_resumes_the_limit() {
        let mut now = Instant::now();
        let mut g = Gradient::new(AutoBounds { min: 3, max: 100 }, now);
        assert_eq!(g.limit(), 3, "measuring first");
        run(&mut g, &mut now, 20.0, Duration::from_millis(10), 4_000);
        let running = g.limit();
        assert!(running > 10, "grew to the backend: {running}");
        // Samples of requests sent before a measurement do not count in it.
        now += REMEASURE;
        g.tick(now);
        assert_eq!(g.limit(), 3);
        let stale = g.epoch().wrapping_sub(1);
        assert!(!g.sample(stale, Duration::from_secs(5), now));
        run(
            &mut g,
            &mut now,
            20.0,
            Duration::from_millis(10),
            MEASURE_SAMPLES,
        );
        assert!(g.limit() >= running, "{} resumed", g.limit());
        assert_eq!(g.min_rtt().map(|d| d.as_millis()), Some(10));
    }

    #[test]
    fn a_backend_turned_slow_past_seconds_still_shrinks_the_limit() {
        let mut now = Instant::now();
        let mut g = Gradient::new(AutoBounds { min: 2, max: 100 }, now);
        run(&mut g, &mut now, 36.0, Duration::from_millis(50), 3_000);
        let before = g.limit();
        assert!(before >= 30, "{before}");
        // Eight workers left, each answer 2.5 s: answers come one at a time, seconds apart,
        // every one of a request sent in an earlier window.
        for _ in 0..200 {
            let limit = g.limit() as f64;
            let rtt = Duration::from_millis(2_500).mul_f64((limit / 8.0).max(1.0));
            now += rtt.div_f64(limit.min(8.0));
            g.saturated();
            let stale = g.epoch().wrapping_sub(3);
            g.sample(stale, rtt, now);
        }
        assert!(g.limit() <= 12, "{} after the backend slowed", g.limit());
    }

    #[test]
    fn a_measurement_short_of_answers_waits_for_a_few() {
        let mut now = Instant::now();
        let mut g = Gradient::new(AutoBounds { min: 2, max: 100 }, now);
        now += MEASURE_MAX * 3;
        g.tick(now);
        assert_eq!(g.limit(), 2, "still measuring");
        assert!(g.min_rtt().is_none());
        // A first answer slowed by a new connection does not make the minimum on its own.
        let epoch = g.epoch();
        g.sample(epoch, Duration::from_secs(9), now);
        for _ in 1..MEASURE_LEAST {
            assert!(g.min_rtt().is_none(), "ended on too few answers");
            now += Duration::from_secs(4);
            g.sample(epoch, Duration::from_secs(4), now);
        }
        assert_eq!(g.min_rtt(), Some(Duration::from_secs(4)));
        assert_eq!(g.limit(), 4, "running from twice the lower bound");
    }

    #[test]
    fn a_few_slow_requests_do_not_hold_the_limit_down() {
        let mut now = Instant::now();
        let mut g = Gradient::new(AutoBounds { min: 4, max: 256 }, now);
        let service = Duration::from_millis(20);
        // 32 workers; each window also brings five answers of 2 s (one key's slow requests).
        let mut slowed = None;
        for _ in 0..20_000 {
            let limit = g.limit() as f64;
            let rtt = service.mul_f64((limit / 32.0).max(1.0));
            now += rtt.div_f64(limit.min(32.0));
            g.saturated();
            let epoch = g.epoch();
            g.sample(epoch, rtt, now);
            if slowed != Some(g.epoch()) {
                slowed = Some(g.epoch());
                for _ in 0..5 {
                    g.sample(g.epoch().wrapping_sub(1), Duration::from_secs(2), now);
                }
            }
        }
        assert!(g.limit() >= 24, "{} with 32 workers", g.limit());
    }

    #[test]
    fn the_limit_never_leaves_its_bounds() {
        let mut now = Instant::now();
        let mut g = Gradient::new(AutoBounds { min: 5, max: 12 }, now);
        run(&mut g, &mut now, 100.0, Duration::from_millis(5), 2_000);
        assert_eq!(g.limit(), 12);
        // One worker under a lower bound of 5: the measurement itself runs 5 at once, so the
        // latency it finds already holds a queue of 4, and the limit stays near the bound.
        run(&mut g, &mut now, 1.0, Duration::from_millis(5), 2_000);
        assert!((5..=6).contains(&g.limit()), "{}", g.limit());
    }
}
