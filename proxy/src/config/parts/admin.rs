//! The admin listener, and the token that guards it once it is reachable from other hosts.

use std::net::SocketAddr;

use super::values::socket_addr;
use crate::config::model::ConfigError;
use crate::config::setting::{Kind, Layers, Preset, Row, Setting, Value};
use crate::http::auth::MAX_TOKEN_LEN;

const ADMIN_LISTEN: Setting<SocketAddr> = Setting::new(
    "admin_listen",
    Kind::Text,
    Preset::Value("127.0.0.1:9090"),
    "admin listener (`/healthz`); an address reachable from other hosts needs `admin_token` \
     (`check` and `serve` refuse it otherwise)",
    socket_addr,
)
.value_name("ADDR");
const ADMIN_TOKEN: Setting<String> = Setting::new(
    "admin_token",
    Kind::Text,
    Preset::Absent("none"),
    "when set (32 to 256 of `A-Za-z0-9-._~+/`, of at least two of lower case, upper case, \
     digits and symbols, not a repeated pattern: `openssl rand -base64 32`; `check` and `serve` \
     refuse a weaker one), every admin request must carry `Authorization: Bearer <admin_token>` (compared as \
     SHA-256 digests in constant time; 401 otherwise; over plain HTTP, so off loopback put it \
     behind TLS or a tunnel); the `keys` and `bans` commands send it from the same config or \
     variable. Never a flag: flags show in `ps`",
    token,
)
.secret();

const ADMIN_HOSTS: Setting<Vec<String>> = Setting::new(
    "admin_hosts",
    Kind::Texts,
    Preset::Value(""),
    "host names the admin listener answers to besides `localhost` and IP addresses (its \
     `Host` header is checked on every request, so no web page can reach it through a name \
     of its own pointed at this machine: DNS rebinding), e.g. `gw1.internal`",
    |v| {
        let hosts = v.texts()?;
        for h in &hosts {
            let ok = !h.trim_end_matches('.').is_empty()
                && h.len() <= 253
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
            if !ok {
                return Err(format!("`{h}` is not a host name"));
            }
        }
        Ok(hosts
            .into_iter()
            .map(|h| h.trim_end_matches('.').to_ascii_lowercase())
            .collect())
    },
)
.flag("--admin-host", "NAME");

pub const SETTINGS: &[Row] = &[ADMIN_LISTEN.row, ADMIN_TOKEN.row, ADMIN_HOSTS.row];

pub struct Admin {
    pub admin_listen: SocketAddr,
    pub admin_token: Option<String>,
    pub admin_hosts: Vec<String>,
}

pub fn validate(l: &Layers) -> Result<Admin, ConfigError> {
    let admin_listen = l.required(&ADMIN_LISTEN)?;
    let admin_token = l.get(&ADMIN_TOKEN)?.map(|t| t.value);
    if admin_token.is_none() && !admin_listen.value.ip().is_loopback() {
        return Err(admin_listen.error(format!(
            "{} is reachable from other hosts: set admin_token (in the file or \
             PET_GATEWAY_ADMIN_TOKEN), which every admin request must then carry, or listen \
             on loopback",
            admin_listen.value
        )));
    }
    Ok(Admin {
        admin_listen: admin_listen.value,
        admin_token,
        admin_hosts: l.value(&ADMIN_HOSTS)?,
    })
}

/// The shortest admin token taken: 32 characters of even one class (hex digits) hold 128 bits
/// when random, and no word or phrase a person picks is that long and still typed whole.
const MIN_TOKEN_LEN: usize = 32;

/// What a bearer token may hold (RFC 6750 token68), or no request could match; and what is
/// strong enough to guard the admin API: long, of more than one kind of character, and not a
/// few characters repeated (`password12345678`, `aaaa…` and `abcabc…` are refused; what
/// `openssl rand -base64 32` or `-hex 32` makes passes).
fn token(v: Value) -> Result<String, String> {
    let t = v.text()?;
    let body = t.trim_end_matches('=');
    let token68 = !body.is_empty()
        && body.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'+' | b'/')
        });
    let distinct = t.bytes().collect::<std::collections::HashSet<u8>>().len();
    let classes = [
        u8::is_ascii_lowercase,
        u8::is_ascii_uppercase,
        u8::is_ascii_digit,
        |b: &u8| !b.is_ascii_alphanumeric(),
    ]
    .iter()
    .filter(|class| body.bytes().any(|b| class(&b)))
    .count();
    if (MIN_TOKEN_LEN..=MAX_TOKEN_LEN).contains(&t.len())
        && token68
        && distinct >= 8
        && classes >= 2
    {
        Ok(t)
    } else {
        Err(format!(
            "too weak or not a token: must be {MIN_TOKEN_LEN} to {MAX_TOKEN_LEN} of A-Z, a-z, \
             0-9, `-._~+/` (then any `=`), of at least two of lower case, upper case, digits \
             and symbols, not a repeated pattern; make one with `openssl rand -base64 32`"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(t: &str) -> Result<String, String> {
        token(Value::Text(t.to_owned()))
    }

    #[test]
    fn weak_tokens_are_refused_and_generated_ones_pass() {
        for weak in [
            "password12345678",
            "s3cret-admin-token-0123",
            "abcdefghijklmnopqrstuvwxyzabcdef",
            "01234567012345670123456701234567",
            "abcabcabcabcabcabcabcabcabcabcabc1",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "has a space in it 0123456789abcdefghij",
            "",
        ] {
            let e = check(weak).err().unwrap_or_else(|| panic!("{weak} passed"));
            assert!(e.contains("openssl rand"), "{e}");
            assert!(
                !e.contains(weak) || weak.is_empty(),
                "the error names no token: {e}"
            );
        }
        for strong in [
            // `openssl rand -base64 32`, `-base64 33` (scripts/fleet), `-hex 32`, `-hex 16`.
            "q0Vv3m6rK2n8Yx1TQw7cRz5pL4sJd9HbFgUa0eNi1Ko=",
            "Zm9vYmFyYmF6cXV4cXV1eGNvcmdlZ3JhdWx0Z2FycGx5",
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
            "5d41402abc4b2a76b9719d911017c592",
        ] {
            assert_eq!(check(strong).as_deref(), Ok(strong), "{strong}");
        }
    }
}
