//! The process: the deployment's name, its threads, and how it reloads and stops.

use std::time::Duration;

use super::values::{at_least_one, millis};
use crate::config::model::ConfigError;
use crate::config::setting::{Kind, Layers, Preset, Row, Setting, Value};

pub const ENVIRONMENT: Setting<String> = Setting::new(
    "environment",
    Kind::Text,
    Preset::Value("local"),
    "name of the deployment, in logs",
    |v| {
        let e = v.text()?;
        if e.is_empty() {
            Err("must not be empty".to_owned())
        } else {
            Ok(e)
        }
    },
)
.value_name("NAME");
const THREADS: Setting<usize> = Setting::new(
    "threads",
    Kind::Int,
    Preset::Computed("number of CPUs"),
    "proxy worker threads",
    |v| at_least_one(v.int()?),
);
// Off by default: measured cheaper per request (bench/RESULTS.md).
const WORK_STEALING: Setting<bool> = Setting::new(
    "work_stealing",
    Kind::Bool,
    Preset::Value("false"),
    "whether idle proxy threads take work queued on busy ones (pingora's work stealing); off \
     measured 9-14 % less CPU per request (bench/RESULTS.md)",
    Value::bool,
);
const RELOAD_INTERVAL_MS: Setting<Duration> = Setting::new(
    "reload_interval_ms",
    Kind::Int,
    Preset::Value("500"),
    "how often the keys file, plans and TLS certificate are checked for edits",
    millis,
);
const GRACE_PERIOD_SECS: Setting<u64> = Setting::new(
    "grace_period_secs",
    Kind::Int,
    Preset::Value("10"),
    "after SIGTERM or SIGQUIT: the listeners close at once, in-flight requests get this long to \
     finish, and kept-alive connections are answered with Connection: close, idle ones kept open \
     for its first half",
    Value::int,
);
const SHUTDOWN_TIMEOUT_SECS: Setting<u64> = Setting::new(
    "shutdown_timeout_secs",
    Kind::Int,
    Preset::Value("30"),
    "then how long background work gets to stop",
    Value::int,
);

pub const SETTINGS: &[Row] = &[
    ENVIRONMENT.row,
    THREADS.row,
    WORK_STEALING.row,
    RELOAD_INTERVAL_MS.row,
    GRACE_PERIOD_SECS.row,
    SHUTDOWN_TIMEOUT_SECS.row,
];

pub struct Runtime {
    pub environment: String,
    pub threads: usize,
    pub work_stealing: bool,
    pub reload_interval: Duration,
    pub grace_period_secs: u64,
    pub shutdown_timeout_secs: u64,
}

pub fn validate(l: &Layers) -> Result<Runtime, ConfigError> {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    Ok(Runtime {
        environment: l.value(&ENVIRONMENT)?,
        threads: l.or(&THREADS, Value::Int(cpus as u64))?.value,
        work_stealing: l.value(&WORK_STEALING)?,
        reload_interval: l.value(&RELOAD_INTERVAL_MS)?,
        grace_period_secs: l.value(&GRACE_PERIOD_SECS)?,
        shutdown_timeout_secs: l.value(&SHUTDOWN_TIMEOUT_SECS)?,
    })
}
