//! The webhook's thread: it takes the spool's lock, then posts its segments oldest first, one
//! segment a batch. A 2xx deletes the segment. A failure (no connection, a 5xx, 408 or 429, an
//! answer that is not HTTP, a deadline) keeps it and waits (exponential backoff from 1 s to
//! 5 min, with jitter so a fleet does not retry in step) before trying it again, for
//! [`RETRY_FOR`] from the segment's making; then, like a 4xx the receiver means (anything else
//! from 400 to 499), the segment goes to the dead-letter file, logged and counted. Ids stay the
//! same across retries, so a receiver drops what it already has.

use std::fs::File;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::post::{post, tls_config, WebhookUrl};
use super::spool::{Segment, Spool};
use super::{Signer, Webhook};
use crate::base::clock::{unix_now, unix_now_ms};
use crate::base::metrics::METRICS;
use crate::events::cloud::gateway_event;

/// How long a batch is retried before it goes to the dead letters.
pub const RETRY_FOR: Duration = Duration::from_secs(24 * 3600);
const TICK: Duration = Duration::from_secs(1);
const FIRST_BACKOFF: f64 = 1.0;
const MAX_BACKOFF: f64 = 300.0;
/// How long a stop waits for a POST in flight (the segment is kept and posted again later).
const STOP_WAIT: Duration = Duration::from_secs(3);

/// What the receiver made of a batch.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Delivered,
    /// Try again later.
    Retry(String),
    /// The receiver refused it for good.
    Rejected(u16),
}

struct Delivery {
    spool: Spool,
    url: WebhookUrl,
    tls: Option<Arc<rustls::ClientConfig>>,
    signer: Signer,
    /// The spool's id (this node's when the spool has none): with a batch's segment name, its
    /// `webhook-id`.
    id_prefix: String,
    lock: Option<File>,
    failures: u32,
    next_try: Instant,
}

/// Stops the thread when dropped; what it has not delivered stays in the spool.
pub struct DeliveryHandle {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

pub fn start(webhook: &Webhook, node_id: &str) -> Result<DeliveryHandle, String> {
    let tls = if webhook.url.https {
        Some(tls_config()?)
    } else {
        None
    };
    let spool = Spool::new(&webhook.spool_dir, webhook.spool_max_bytes);
    let mut delivery = Delivery {
        id_prefix: id_prefix(&spool, node_id),
        spool,
        url: webhook.url.clone(),
        tls,
        signer: webhook.signer()?,
        lock: None,
        failures: 0,
        next_try: Instant::now(),
    };
    let stop = Arc::new((Mutex::new(false), Condvar::new()));
    let signal = Arc::clone(&stop);
    let thread = std::thread::Builder::new()
        .name("events-webhook".into())
        .spawn(move || delivery.run(&signal))
        .map_err(|e| e.to_string())?;
    Ok(DeliveryHandle {
        stop,
        thread: Some(thread),
    })
}

impl Delivery {
    fn run(&mut self, signal: &(Mutex<bool>, Condvar)) {
        let stopped = || *signal.0.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            let round = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.round(&stopped);
            }));
            if round.is_err() {
                tracing::error!("a round of the webhook thread panicked; it goes on");
            }
            let guard = signal.0.lock().unwrap_or_else(PoisonError::into_inner);
            if *guard {
                return;
            }
            let guard = signal
                .1
                .wait_timeout(guard, TICK)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            if *guard {
                return;
            }
        }
    }

    /// Delivers what it can now: nothing without the lock, or while backing off.
    fn round(&mut self, stopped: &dyn Fn() -> bool) {
        if self.lock.is_none() {
            match self.spool.try_lock() {
                Ok(Some(lock)) => {
                    tracing::info!(spool = %self.spool.dir().display(), "delivering the spool's events");
                    self.spool.clean_leftovers();
                    self.lock = Some(lock);
                }
                Ok(None) => return, // another process delivers (an upgrade's predecessor)
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open the spool's lock");
                    return;
                }
            }
        }
        let segments = match self.spool.segments() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the spool");
                return;
            }
        };
        let mut pending: usize = segments.iter().map(|s| s.events).sum();
        // Segment names cap their count at a batch's, so this cannot overflow.
        METRICS
            .events_pending
            .with_label_values(&["webhook"])
            .set(pending as i64);
        for seg in segments {
            if stopped() || Instant::now() < self.next_try {
                return;
            }
            if !self.one(&seg) {
                return;
            }
            pending -= seg.events;
            METRICS
                .events_pending
                .with_label_values(&["webhook"])
                .set(pending as i64);
        }
    }

    /// One segment: false when it stays (the receiver failed; wait before the next try).
    fn one(&mut self, seg: &Segment) -> bool {
        // Only the gateway's own events are signed: a line written into the spool by anyone
        // else (it is a folder others may write, for the keys commands) goes nowhere.
        let read = Spool::read(seg).and_then(|l| Ok((kinds(&l)?, l)));
        let (kinds, lines) = match read {
            Ok(read) => read,
            // Gone already (another holder before this one, or an operator): nothing to do.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return true,
            Err(e) => {
                tracing::error!(error = %e, segment = %seg.path.display(), "a spooled batch cannot be read, or holds what is not the gateway's events; set aside as .unreadable");
                if self.spool.set_aside(seg).is_err() {
                    self.failed();
                    return false;
                }
                METRICS
                    .events_dead_lettered
                    .with_label_values(&["unreadable"])
                    .inc_by(seg.events as u64);
                return true;
            }
        };
        match self.send(seg, &lines) {
            Outcome::Delivered => {
                self.failures = 0;
                for kind in kinds {
                    METRICS
                        .events_delivered
                        .with_label_values(&["webhook", kind])
                        .inc();
                }
                if let Err(e) = std::fs::remove_file(&seg.path) {
                    // It will be posted again (a receiver drops the duplicates by id), after a
                    // wait rather than every second.
                    tracing::warn!(error = %e, "cannot remove a delivered batch from the spool");
                    self.failed();
                    return false;
                }
                true
            }
            Outcome::Rejected(status) => {
                self.give_up(seg, "rejected", &format!("the receiver answered {status}"));
                // A receiver refusing everything for a while (a deploy, a secret being
                // rotated) costs one batch a wait, not the whole spool at once.
                self.failed();
                false
            }
            Outcome::Retry(why) => {
                METRICS
                    .events_delivery_failures
                    .with_label_values(&["webhook"])
                    .inc();
                // Tried at least once, however old its name says it is (a clock stepped
                // forward, a spool adopted late).
                if unix_now_ms().saturating_sub(seg.created_ms) > RETRY_FOR.as_millis() as u64 {
                    self.give_up(seg, "expired", &format!("its retries ran out ({why})"));
                    return true;
                }
                tracing::warn!(
                    receiver = %self.url.text,
                    failures = self.failures + 1,
                    "cannot deliver events: {why}; they stay in the spool and are tried again"
                );
                self.failed();
                false
            }
        }
    }

    fn send(&self, seg: &Segment, lines: &[u8]) -> Outcome {
        let body = batch_body(lines);
        let signed = self
            .signer
            .headers(&batch_id(&self.id_prefix, seg), unix_now(), &body);
        match post(&self.url, self.tls.as_ref(), &signed, &body) {
            Ok(status) => outcome(status),
            Err(e) => Outcome::Retry(e.to_string()),
        }
    }

    fn failed(&mut self) {
        self.failures = self.failures.saturating_add(1);
        self.next_try = Instant::now() + backoff(self.failures, rand::random::<f64>());
    }

    fn give_up(&mut self, seg: &Segment, reason: &'static str, why: &str) {
        match self.spool.dead_letter(seg) {
            Ok(()) => {
                METRICS
                    .events_dead_lettered
                    .with_label_values(&[reason])
                    .inc_by(seg.events as u64);
                tracing::error!(
                    events = seg.events,
                    receiver = %self.url.text,
                    "events not delivered ({why}): moved to the spool's dead-letter file"
                );
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot move undeliverable events to the dead-letter file");
                self.failed();
            }
        }
    }
}

fn outcome(status: u16) -> Outcome {
    match status {
        200..=299 => Outcome::Delivered,
        408 | 429 => Outcome::Retry(format!("the receiver answered {status}")),
        400..=499 => Outcome::Rejected(status),
        _ => Outcome::Retry(format!("the receiver answered {status}")),
    }
}

/// The wait after `failures` failures in a row: 1 s doubling to 5 min, times a jitter of 0.5
/// to 1 (`unit` in 0..1).
fn backoff(failures: u32, unit: f64) -> Duration {
    let exp = FIRST_BACKOFF * 2f64.powi(failures.saturating_sub(1).min(30) as i32);
    Duration::from_secs_f64(exp.min(MAX_BACKOFF) * (0.5 + unit.clamp(0.0, 1.0) / 2.0))
}

/// NDJSON lines as the JSON array a `cloudevents-batch+json` body is.
pub fn batch_body(lines: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(lines.len() + 2);
    body.push(b'[');
    for (i, line) in lines
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .enumerate()
    {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(line);
    }
    body.push(b']');
    body
}

/// The type of each of a batch's lines, or an error naming the first that is not one of the
/// gateway's events.
fn kinds(lines: &[u8]) -> std::io::Result<Vec<&'static str>> {
    lines
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .enumerate()
        .map(|(i, line)| {
            gateway_event(line).map_err(|why| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("line {}: {why}", i + 1),
                )
            })
        })
        .collect()
}

impl Drop for DeliveryHandle {
    fn drop(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap_or_else(PoisonError::into_inner) = true;
        cv.notify_all();
        let Some(thread) = self.thread.take() else {
            return;
        };
        let deadline = Instant::now() + STOP_WAIT;
        while !thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if thread.is_finished() {
            let _ = thread.join();
        }
    }
}

/// The spool's id, or this node's when it cannot be read or made (said once, at start).
fn id_prefix(spool: &Spool, node_id: &str) -> String {
    spool.id().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "the webhook's spool has no id of its own; batches are named by the node_id");
        node_id.to_owned()
    })
}

/// A batch's `webhook-id`: its spool's id and its name there (`<spool id>/<created ms>-<pid>-
/// <seq>-<events>`), the same on every retry and after a restart, and never another spool's,
/// so that a receiver can drop the duplicates by it.
fn batch_id(prefix: &str, seg: &Segment) -> String {
    let name = seg
        .path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    format!("{prefix}/{}", name.trim_end_matches(".events"))
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::webhook::{Scheme, WebhookSecret};

    const USAGE_LINE: &[u8] = b"{\"specversion\":\"1.0\",\"id\":\"n.1.2.3\",\"source\":\"pet-gateway/production/n\",\"type\":\"pet.usage.v1\",\"data\":{}}\n";

    #[test]
    fn statuses_are_delivered_retried_or_rejected() {
        assert_eq!(outcome(200), Outcome::Delivered);
        assert_eq!(outcome(204), Outcome::Delivered);
        assert!(matches!(outcome(500), Outcome::Retry(_)));
        assert!(matches!(outcome(503), Outcome::Retry(_)));
        assert!(matches!(outcome(408), Outcome::Retry(_)));
        assert!(matches!(outcome(429), Outcome::Retry(_)));
        assert!(matches!(outcome(302), Outcome::Retry(_)));
        assert_eq!(outcome(400), Outcome::Rejected(400));
        assert_eq!(outcome(401), Outcome::Rejected(401));
        assert_eq!(outcome(413), Outcome::Rejected(413));
    }

    #[test]
    fn backoff_doubles_to_five_minutes_with_jitter() {
        assert_eq!(backoff(1, 1.0), Duration::from_secs(1));
        assert_eq!(backoff(1, 0.0), Duration::from_millis(500));
        assert_eq!(backoff(4, 1.0), Duration::from_secs(8));
        assert_eq!(backoff(20, 1.0), Duration::from_secs(300));
        assert_eq!(backoff(u32::MAX, 0.0), Duration::from_secs(150));
    }

    #[test]
    fn a_batch_is_a_json_array_of_its_lines() {
        let body = batch_body(b"{\"a\":1}\n{\"b\":2}\n");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v, serde_json::json!([{"a": 1}, {"b": 2}]));
        assert_eq!(batch_body(b""), b"[]");
    }

    #[test]
    fn only_the_gateways_events_are_posted() {
        let batch = USAGE_LINE.to_vec();
        assert_eq!(kinds(&batch).unwrap(), vec!["pet.usage.v1"]);
        for bad in [
            &b"not json"[..],
            br#"{"specversion":"1.0","id":"x","source":"pet-gateway/p/n","type":"com.evil.v1"}"#,
            br#"{"specversion":"1.0","id":"x","source":"elsewhere/p/n","type":"pet.usage.v1"}"#,
            br#"{"specversion":"0.3","id":"x","source":"pet-gateway/p/n","type":"pet.usage.v1"}"#,
        ] {
            let mut lines = batch.clone();
            lines.extend_from_slice(bad);
            lines.push(b'\n');
            let e = kinds(&lines).unwrap_err();
            assert!(e.to_string().starts_with("line 2:"), "{e}");
        }
    }

    #[test]
    fn a_forged_batch_in_the_spool_is_set_aside_unsent() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::new(dir.path(), 1 << 20);
        spool
            .write(b"{\"type\":\"anything\",\"amount\":1}\n", 1)
            .unwrap();
        let seg = spool.segments().unwrap().remove(0);
        // A receiver that would take anything: nothing may reach it.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let mut d = Delivery {
            spool,
            url: WebhookUrl::parse(&format!("http://{}/", listener.local_addr().unwrap())).unwrap(),
            tls: None,
            signer: Signer::new(
                Scheme::Pet,
                &WebhookSecret::new(b"a-test-secret-0123456789abcdef0123".to_vec()).unwrap(),
                None,
            )
            .unwrap(),
            id_prefix: "node".to_owned(),
            lock: None,
            failures: 0,
            next_try: Instant::now(),
        };
        assert!(d.one(&seg), "set aside, the next batch goes on");
        assert!(d.spool.segments().unwrap().is_empty());
        assert!(listener.accept().is_err(), "nothing was posted");
    }

    #[test]
    fn a_batch_older_than_the_retries_goes_to_the_dead_letters_after_a_failed_try() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::new(dir.path(), 1 << 20);
        spool.write(USAGE_LINE, 1).unwrap();
        let seg = spool.segments().unwrap().remove(0);
        let old = Segment {
            created_ms: seg.created_ms - RETRY_FOR.as_millis() as u64 - 1,
            ..seg
        };
        // An address nothing listens on: the attempt fails, and then its age sends it on.
        let mut d = Delivery {
            spool,
            url: WebhookUrl::parse("http://127.0.0.1:9/").unwrap(),
            tls: None,
            signer: Signer::new(
                Scheme::Pet,
                &WebhookSecret::new(b"a-test-secret-0123456789abcdef0123".to_vec()).unwrap(),
                None,
            )
            .unwrap(),
            id_prefix: "node".to_owned(),
            lock: None,
            failures: 0,
            next_try: Instant::now(),
        };
        assert!(d.one(&old));
        assert!(d.spool.segments().unwrap().is_empty());
        let dead = std::fs::read_to_string(dir.path().join(super::super::spool::DEAD_LETTER));
        assert_eq!(dead.unwrap().as_bytes(), USAGE_LINE);
    }
}
