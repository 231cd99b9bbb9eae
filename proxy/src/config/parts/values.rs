//! The value checks several parts share.

use std::net::SocketAddr;
use std::time::Duration;

use clap::builder::PossibleValue;
use clap::ValueEnum;

use crate::config::setting::{Kind, Value};

pub fn at_least_one<T: PartialEq + From<u8>>(v: T) -> Result<T, String> {
    if v == T::from(0) {
        Err("must be at least 1".into())
    } else {
        Ok(v)
    }
}

pub fn millis(v: Value) -> Result<Duration, String> {
    at_least_one(v.int::<u64>()?).map(Duration::from_millis)
}

/// `host:port`, resolved once at start-up.
pub fn socket_addr(v: Value) -> Result<SocketAddr, String> {
    crate::upstream::names::UpstreamAddr::parse(&v.text()?).map(|u| u.addr)
}

/// The kind of a setting that is one of `E`'s names.
pub const fn choice<E: ValueEnum>() -> Kind {
    Kind::Choice(possible_values::<E>)
}

fn possible_values<E: ValueEnum>() -> Vec<PossibleValue> {
    E::value_variants()
        .iter()
        .filter_map(ValueEnum::to_possible_value)
        .collect()
}

/// One of `E`'s names, exactly (case-sensitive), as clap checks the flag.
pub fn parse_choice<E: ValueEnum>(v: Value) -> Result<E, String> {
    let v = v.text()?;
    E::from_str(&v, false).map_err(|_| {
        let names: Vec<String> = possible_values::<E>()
            .iter()
            .map(|p| p.get_name().to_owned())
            .collect();
        format!("`{v}` is not one of {}", names.join(", "))
    })
}
