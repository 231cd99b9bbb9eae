//! The limits outside the plans: unauthenticated requests per client, and bans of keys that keep
//! sending after a 429.

use super::values::at_least_one;
use crate::config::model::ConfigError;
use crate::config::setting::{Kind, Layers, Preset, Row, Setting, Value};
use crate::quota::rules::BanPolicy;
use crate::quota::unauth::UnauthSettings;

const UNAUTHENTICATED_PER_MINUTE: Setting<u32> = Setting::new(
    "unauthenticated_per_minute",
    Kind::Int,
    Preset::Value("60"),
    "requests per minute one client may make with a missing or invalid key (then 429)",
    |v| at_least_one(v.int()?),
);
const UNAUTHENTICATED_IPV6_PREFIX: Setting<u8> = Setting::new(
    "unauthenticated_ipv6_prefix",
    Kind::Int,
    Preset::Value("64"),
    "an IPv6 client is its network of this many bits (one host usually holds a whole /64)",
    |v| {
        let p = v.int()?;
        if (1..=128).contains(&p) {
            Ok(p)
        } else {
            Err(format!("must be 1 to 128 bits (got {p})"))
        }
    },
);
const UNAUTHENTICATED_MAX_TRACKED: Setting<usize> = Setting::new(
    "unauthenticated_max_tracked",
    Kind::Int,
    Preset::Value("100000"),
    "clients the unauthenticated limit remembers at most; past that the longest-tracked are \
     forgotten first (bounded memory under a flood from many addresses)",
    |v| {
        let n = v.int()?;
        if n >= 16 {
            Ok(n)
        } else {
            Err(format!("must be at least 16 (got {n})"))
        }
    },
);
const TRUSTED_PROXIES: Setting<Vec<ipnet::IpNet>> = Setting::new(
    "trusted_proxies",
    Kind::Texts,
    Preset::Value(""),
    "addresses or networks (`[\"10.0.0.0/8\"]`) of load balancers whose `X-Forwarded-For` names \
     the client, for the unauthenticated limit; the right-most address in it that is not itself \
     trusted is the client; from any other peer the header is ignored",
    |v| v.texts()?.iter().map(|n| parse_net(n)).collect(),
)
.value_name("NET");
const BAN_STRIKES: Setting<u64> = Setting::new(
    "ban.strikes",
    Kind::Int,
    Preset::Of(|| Value::Int(BanPolicy::default().strikes)),
    "refused requests allowed in one minute; the next one bans the key",
    Value::int,
);
const BAN_DURATIONS_SECS: Setting<Vec<u64>> = Setting::new(
    "ban.durations_secs",
    Kind::Ints,
    Preset::Of(|| Value::Ints(BanPolicy::default().durations)),
    "ban lengths by level; the last repeats",
    |v| {
        let d = v.ints()?;
        if d.is_empty() || d.contains(&0) {
            Err("needs at least one duration, each at least 1 second".to_owned())
        } else {
            Ok(d)
        }
    },
)
.value_name("SECS");
const BAN_DECAY_SECS: Setting<u64> = Setting::new(
    "ban.decay_secs",
    Kind::Int,
    Preset::Of(|| Value::Int(BanPolicy::default().decay_secs)),
    "quiet time after a ban's end before the level starts over",
    Value::int,
);

pub const SETTINGS: &[Row] = &[
    UNAUTHENTICATED_PER_MINUTE.row,
    UNAUTHENTICATED_IPV6_PREFIX.row,
    UNAUTHENTICATED_MAX_TRACKED.row,
    TRUSTED_PROXIES.row,
    BAN_STRIKES.row,
    BAN_DURATIONS_SECS.row,
    BAN_DECAY_SECS.row,
];

pub struct Limits {
    pub unauthenticated: UnauthSettings,
    pub ban: BanPolicy,
}

pub fn validate(l: &Layers) -> Result<Limits, ConfigError> {
    Ok(Limits {
        unauthenticated: UnauthSettings {
            per_minute: l.value(&UNAUTHENTICATED_PER_MINUTE)?,
            ipv6_prefix: l.value(&UNAUTHENTICATED_IPV6_PREFIX)?,
            max_tracked: l.value(&UNAUTHENTICATED_MAX_TRACKED)?,
            trusted_proxies: l.value(&TRUSTED_PROXIES)?,
        },
        ban: BanPolicy {
            strikes: l.value(&BAN_STRIKES)?,
            durations: l.value(&BAN_DURATIONS_SECS)?,
            decay_secs: l.value(&BAN_DECAY_SECS)?,
        },
    })
}

/// `10.0.0.0/8`, `2001:db8::/32`, or one address (`10.1.2.3`, a /32 or /128).
fn parse_net(text: &str) -> Result<ipnet::IpNet, String> {
    let text = text.trim();
    text.parse::<ipnet::IpNet>()
        .or_else(|_| text.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
        .map_err(|_| format!("`{text}` is not an address or a network (`10.0.0.0/8`)"))
}
