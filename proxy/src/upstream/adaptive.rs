//! `upstream_max_in_flight = "auto"`: a backend's limit follows what it can take, measured from
//! its latency, the way Envoy's adaptive concurrency filter and Netflix's concurrency-limits do
//! it: a gradient controller comparing the latency of requests sent now against a minimum
//! measured from time to time at low concurrency.
//!
//! - **Measuring** (at the start, then every [`REMEASURE`]): the limit drops to its lower
//!   bound until [`MEASURE_SAMPLES`] requests sent during the measurement have answered; the
//!   median of their latencies is the backend's latency without a queue (`min_rtt`). Only
//!   requests sent during it count, not those sent before at a higher concurrency.
//! - **Running**: every window ([`WINDOW`], at least [`WINDOW_SAMPLES`] answers), the median
//!   latency of the window's answers, `rtt`, against `min_rtt`: above it by more than
//!   [`TOLERANCE`], requests queue inside the backend, and the limit shrinks by
//!   `(1 + TOLERANCE) × min_rtt / rtt` (at most halved at once); within it, and the limit was
//!   reached during the window (requests waited for a place), it grows by [`GROWTH`]. A
//!   backend with more workers than requests waiting is not probed further: there is nothing
//!   to learn.
//!
//! With a backend of `W` workers, a limit above `W` makes requests queue there, the latency
//! grows in proportion, and the next window takes the limit back to about `1.1 W`; below `W`
//! nothing queues and the limit grows. It settles between `W` and `1.25 W` (the test in this
//! file runs a model backend; `bench/overload` measures a real one).

use std::time::{Duration, Instant};

/// How long a window of samples lasts at least.
pub const WINDOW: Duration = Duration::from_millis(250);
/// Answers a window needs before it moves the limit.
pub const WINDOW_SAMPLES: usize = 8;
/// Latency above the measured minimum that counts as no queue (noise, a busier moment).
pub const TOLERANCE: f64 = 0.1;
/// How much a saturated limit grows per window while the latency stays near the minimum.
pub const GROWTH: f64 = 1.25;
/// How often the minimum is measured again (a backend that got slower for good).
pub const REMEASURE: Duration = Duration::from_secs(30);
/// Answers sent during a measurement that make its median.
pub const MEASURE_SAMPLES: usize = 16;
/// A measurement ends after this long with what it has (a slow or idle backend).
pub const MEASURE_MAX: Duration = Duration::from_secs(2);
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

    /// An answer of a request sent in `epoch` took `rtt`; returns whether the limit changed.
    pub fn sample(&mut self, epoch: u32, rtt: Duration, now: Instant) -> bool {
        if epoch != self.epoch {
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
                let enough = self.samples.len() >= MEASURE_SAMPLES;
                if enough || now.duration_since(since) >= MEASURE_MAX {
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
                } else if now.duration_since(self.window_started) >= MEASURE_MAX {
                    // Too few answers to say anything: start over.
                    self.start_window(now);
                }
            }
        }
        self.limit() != before
    }

    fn adjust(&mut self) {
        let (Some(min_rtt), Some(rtt)) = (self.min_rtt, median(&mut self.samples)) else {
            return;
        };
        let (min, max) = (
            f64::from(self.bounds.min.max(1)),
            f64::from(self.bounds.max.max(self.bounds.min).max(1)),
        );
        let allowed = min_rtt.as_secs_f64() * (1.0 + TOLERANCE);
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
    fn the_limit_never_leaves_its_bounds() {
        let mut now = Instant::now();
        let mut g = Gradient::new(AutoBounds { min: 5, max: 12 }, now);
        run(&mut g, &mut now, 100.0, Duration::from_millis(5), 2_000);
        assert_eq!(g.limit(), 12);
        run(&mut g, &mut now, 1.0, Duration::from_millis(5), 2_000);
        assert_eq!(g.limit(), 5);
    }
}
