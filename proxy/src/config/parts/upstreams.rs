//! The backends, how the gateway talks to them, and how much it sends them at once.

use std::time::Duration;

use super::values::{at_least_one, choice, millis, parse_choice};
use crate::config::model::ConfigError;
use crate::config::setting::{Kind, Layers, Preset, Row, Setting, Value};
use crate::upstream::adaptive::AutoBounds;
use crate::upstream::names::UpstreamAddr;
use crate::upstream::places::{Limit, PlaceSettings};
use crate::upstream::priority::{Level, Priorities};

const UPSTREAMS: Setting<Vec<UpstreamAddr>> = Setting::new(
    "upstreams",
    Kind::Texts,
    Preset::Value("127.0.0.1:8081"),
    "backends (`ip:port` or `host:port`), used round-robin with passive health (see Faults); a \
     host name is looked up at start, again when a connection to it fails (at most once a \
     second) and every `upstream_resolve_interval_secs`",
    |v| {
        let list = v.texts()?;
        if list.is_empty() {
            return Err("needs at least one backend address".to_owned());
        }
        list.iter().map(|u| UpstreamAddr::parse(u)).collect()
    },
)
.flag("--upstream", "ADDR")
.env("PET_GATEWAY_UPSTREAM");
const UPSTREAM_RESOLVE_INTERVAL_SECS: Setting<Duration> = Setting::new(
    "upstream_resolve_interval_secs",
    Kind::Int,
    Preset::Value("30"),
    "how often backends given by host name are looked up again, so one that moved (a \
     restarted container) is followed; 0: only when a connection to it fails",
    |v| Ok(Duration::from_secs(v.int()?)),
);
const UPSTREAM_KEEPALIVE_POOL_SIZE: Setting<usize> = Setting::new(
    "upstream_keepalive_pool_size",
    Kind::Int,
    Preset::Value("128"),
    "idle backend connections kept for reuse, per thread (all threads together: this × `threads`); past it the least recently used one is closed. An idle connection is closed after 60 s, or within a second of its backend closing it",
    |v| at_least_one(v.int()?),
);
const UPSTREAM_CONNECT_TIMEOUT_MS: Setting<Duration> = Setting::new(
    "upstream_connect_timeout_ms",
    Kind::Int,
    Preset::Value("1000"),
    "connecting to a backend (then 502)",
    millis,
);
const UPSTREAM_READ_TIMEOUT_MS: Setting<Duration> = Setting::new(
    "upstream_read_timeout_ms",
    Kind::Int,
    Preset::Value("10000"),
    "waiting for a backend's answer (then 504)",
    millis,
);

/// `upstream_max_in_flight` before the bounds of `"auto"` join it.
#[derive(Debug, Clone, Copy)]
enum MaxInFlight {
    Off,
    Fixed(u32),
    Auto,
}

const UPSTREAM_MAX_IN_FLIGHT: Setting<MaxInFlight> = Setting::new(
    "upstream_max_in_flight",
    Kind::Number,
    Preset::Value("1024"),
    "requests this node sends each backend at once: a number (about the backend's workers; see \
     deploy/README.md, \"Sizing the backend's places\"), `\"auto\"` (follows the backend's \
     latency, between `upstream_auto_min` and `upstream_auto_max`), or `\"off\"` (no limit, no \
     queue); past it requests wait for a place (see Overload). The default only bounds a pile-up: \
     the shipped configs size it",
    |v| match v.text()?.trim() {
        "off" => Ok(MaxInFlight::Off),
        "auto" => Ok(MaxInFlight::Auto),
        text => match text.parse::<u32>() {
            Ok(n) if n >= 1 => Ok(MaxInFlight::Fixed(n)),
            _ => Err(format!(
                "`{text}` is not a number of requests from 1, \"auto\" or \"off\""
            )),
        },
    },
)
.value_name("N|auto|off");
const UPSTREAM_AUTO_MIN: Setting<u32> = Setting::new(
    "upstream_auto_min",
    Kind::Int,
    Preset::Value("2"),
    "with `upstream_max_in_flight = \"auto\"`: the fewest places a backend keeps (and the \
     concurrency its latency without a queue is measured at, every 30 s)",
    |v| at_least_one(v.int()?),
);
const UPSTREAM_AUTO_MAX: Setting<u32> = Setting::new(
    "upstream_auto_max",
    Kind::Int,
    Preset::Value("1000"),
    "with `upstream_max_in_flight = \"auto\"`: the most places a backend gets",
    |v| at_least_one(v.int()?),
);
const UPSTREAM_QUEUE_TIMEOUT_MS: Setting<Duration> = Setting::new(
    "upstream_queue_timeout_ms",
    Kind::Int,
    Preset::Computed("`1000`, or half of `upstream_read_timeout_ms` when that is less"),
    "the longest a request waits for a place at a backend (then 503 `overloaded`, nothing sent); \
     less than `upstream_read_timeout_ms`",
    millis,
);
const UPSTREAM_QUEUE_MAX: Setting<usize> = Setting::new(
    "upstream_queue_max",
    Kind::Int,
    Preset::Value("1024"),
    "requests waiting for a place at once, on this node; past it a newcomer pushes out the \
     newest waiter of the heaviest holder at the lowest level below its own, or at its own level \
     one of a holder with at least two more waiting than its own, and that one gets 503 \
     `overloaded`; else the newcomer does. 0: none wait",
    Value::int,
);
const UPSTREAM_RESERVED_SHARE: Setting<u32> = Setting::new(
    "upstream_reserved_share",
    Kind::Number,
    Preset::Value("0.1"),
    "the share of each backend's places kept for `critical` requests (0 to 0.9): the other \
     levels take a place only while fewer than the rest are taken",
    |v| {
        let text = v.text()?;
        match text.trim().parse::<f64>() {
            Ok(share) if (0.0..=0.9).contains(&share) => Ok((share * 1000.0).round() as u32),
            _ => Err(format!("`{text}` is not a share from 0 to 0.9")),
        }
    },
)
.value_name("SHARE");

/// One row per operation of `[upstream_priority]`: a name the table may not hold is refused by
/// the file's reader, naming it.
macro_rules! priority_row {
    ($name:ident, $key:literal, $default:literal) => {
        const $name: Setting<Level> = Setting::new(
            concat!("upstream_priority.", $key),
            choice::<Level>(),
            Preset::Value($default),
            concat!(
                "the level of `",
                $key,
                "` requests waiting for a place (`low`, `normal`, `high`, `critical`), before \
                 their plan's `priority` moves it"
            ),
            parse_choice,
        )
        .value_name("LEVEL");
    };
}
priority_row!(PRIORITY_LIST_PETS, "listPets", "normal");
priority_row!(PRIORITY_CREATE_PET, "createPet", "critical");
priority_row!(PRIORITY_GET_PET, "getPet", "normal");
priority_row!(PRIORITY_LIST_ORDERS, "listOrders", "low");

const PRIORITIES: [(&Setting<Level>, &str); 4] = [
    (&PRIORITY_LIST_PETS, "listPets"),
    (&PRIORITY_CREATE_PET, "createPet"),
    (&PRIORITY_GET_PET, "getPet"),
    (&PRIORITY_LIST_ORDERS, "listOrders"),
];

pub const SETTINGS: &[Row] = &[
    UPSTREAMS.row,
    UPSTREAM_RESOLVE_INTERVAL_SECS.row,
    UPSTREAM_KEEPALIVE_POOL_SIZE.row,
    UPSTREAM_CONNECT_TIMEOUT_MS.row,
    UPSTREAM_READ_TIMEOUT_MS.row,
    UPSTREAM_MAX_IN_FLIGHT.row,
    UPSTREAM_AUTO_MIN.row,
    UPSTREAM_AUTO_MAX.row,
    UPSTREAM_QUEUE_TIMEOUT_MS.row,
    UPSTREAM_QUEUE_MAX.row,
    UPSTREAM_RESERVED_SHARE.row,
    PRIORITY_LIST_PETS.row,
    PRIORITY_CREATE_PET.row,
    PRIORITY_GET_PET.row,
    PRIORITY_LIST_ORDERS.row,
];

pub struct Upstreams {
    pub upstreams: Vec<UpstreamAddr>,
    pub upstream_resolve_interval: Duration,
    pub upstream_keepalive_pool_size: usize,
    pub upstream_connect_timeout: Duration,
    pub upstream_read_timeout: Duration,
    pub places: PlaceSettings,
    pub priorities: Priorities,
}

pub fn validate(l: &Layers) -> Result<Upstreams, ConfigError> {
    let read_timeout = l.value(&UPSTREAM_READ_TIMEOUT_MS)?;
    let default_wait = Duration::from_millis(1_000)
        .min(read_timeout / 2)
        .max(Duration::from_millis(1));
    let queue_timeout = l.or(
        &UPSTREAM_QUEUE_TIMEOUT_MS,
        Value::Int(default_wait.as_millis() as u64),
    )?;
    if queue_timeout.value >= read_timeout {
        return Err(queue_timeout.error(format!(
            "{} ms is not less than upstream_read_timeout_ms ({} ms): a request would wait for \
             a place longer than the backend is given to answer",
            queue_timeout.value.as_millis(),
            read_timeout.as_millis()
        )));
    }
    let min = l.value(&UPSTREAM_AUTO_MIN)?;
    let max = l.required(&UPSTREAM_AUTO_MAX)?;
    if max.value < min {
        return Err(max.error(format!(
            "{} is less than upstream_auto_min ({min})",
            max.value
        )));
    }
    let limit = match l.value(&UPSTREAM_MAX_IN_FLIGHT)? {
        MaxInFlight::Off => Limit::Off,
        MaxInFlight::Fixed(n) => Limit::Fixed(n),
        MaxInFlight::Auto => Limit::Auto(AutoBounds {
            min,
            max: max.value,
        }),
    };
    let mut priorities = Priorities::default();
    for (setting, operation) in PRIORITIES {
        priorities.set(operation, l.value(setting)?);
    }
    Ok(Upstreams {
        upstreams: l.value(&UPSTREAMS)?,
        upstream_resolve_interval: l.value(&UPSTREAM_RESOLVE_INTERVAL_SECS)?,
        upstream_keepalive_pool_size: l.value(&UPSTREAM_KEEPALIVE_POOL_SIZE)?,
        upstream_connect_timeout: l.value(&UPSTREAM_CONNECT_TIMEOUT_MS)?,
        upstream_read_timeout: read_timeout,
        places: PlaceSettings {
            limit,
            queue_timeout: queue_timeout.value,
            queue_max: l.value(&UPSTREAM_QUEUE_MAX)?,
            reserved_permille: l.value(&UPSTREAM_RESERVED_SHARE)?,
        },
        priorities,
    })
}
