//! Regions (issue 48, the book's "Regions"): the region a node belongs to and the global store
//! every region shares. A fleet without regions sets neither and is unchanged.

use super::store::ON_STORE_ERROR;
use crate::base::redis::RedisAccess;
use crate::config::model::{ConfigError, Region};
use crate::config::setting::{Kind, Layers, Preset, Row, Setting, Sourced};
use crate::quota::admission::OnStoreError;

const REGION: Setting<String> = Setting::new(
    "region",
    Kind::Text,
    Preset::Absent("none: one region, no global store"),
    "the region this node belongs to (letters, digits and `-`, up to 32): its `redis_url` is \
     the region's own Redis, and it admits only out of the units the global store \
     (`global_store_url`) granted the region, so that every region together stays within each \
     limit",
    |v| {
        let name = v.text()?;
        let fits = !name.is_empty()
            && name.len() <= 32
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
        if fits {
            Ok(name)
        } else {
            Err("must be 1 to 32 letters, digits or `-`".to_owned())
        }
    },
)
.value_name("NAME");
const GLOBAL_STORE_URL: Setting<String> = Setting::new(
    "global_store_url",
    Kind::Text,
    Preset::Absent("none"),
    "with `region`: the global store's Redis, shared by every region, in `redis_url`'s forms \
     (one Redis or Sentinels, with TLS or not; not a Cluster), reached with the same user, \
     password and TLS files as `redis_url`",
    |v| {
        let url = v.text()?;
        match RedisAccess::from_url(&url) {
            Ok(a) if a.is_cluster() => Err("a Redis Cluster cannot be the global store".to_owned()),
            Ok(_) => Ok(url),
            Err(e) => Err(format!("not a usable Redis URL: {e}")),
        }
    },
)
.value_name("URL");
const GLOBAL_STORE_REPLICAS: Setting<u32> = Setting::new(
    "global_store_replicas",
    Kind::Int,
    Preset::Value("0"),
    "replicas of the global store that must acknowledge a grant (`WAIT`) before the region \
     spends it: every replica Sentinel may promote, so that a failover never grants twice \
     (0 to 16)",
    |v| {
        let n: u32 = v.int()?;
        if n <= 16 {
            Ok(n)
        } else {
            Err("must be from 0 to 16".to_owned())
        }
    },
)
.value_name("N");

pub const SETTINGS: &[Row] = &[REGION.row, GLOBAL_STORE_URL.row, GLOBAL_STORE_REPLICAS.row];

/// The region, if any; a half-made set-up is refused, naming the setting that is missing or
/// in the way.
pub fn validate(
    l: &Layers,
    redis_url: Option<&Sourced<String>>,
) -> Result<Option<Region>, ConfigError> {
    let region = l.get(&REGION)?;
    let global = l.get(&GLOBAL_STORE_URL)?;
    let replicas = l.required(&GLOBAL_STORE_REPLICAS)?;
    let (region, global) = match (region, global) {
        (None, None) => return Ok(None),
        (None, Some(global)) => {
            return Err(global.error(
                "names a global store for regions: set `region` too (or remove it)".to_owned(),
            ))
        }
        (Some(region), None) => {
            return Err(region.error(
                "a region admits only what the global store grants it: set `global_store_url` \
                 too"
                .to_owned(),
            ))
        }
        (Some(region), Some(global)) => (region, global),
    };
    if redis_url.is_none() {
        return Err(region.error(
            "each region counts in a Redis of its own, shared by its nodes: set `redis_url` too"
                .to_owned(),
        ));
    }
    let cluster =
        |u: &Sourced<String>| RedisAccess::from_url(&u.value).is_ok_and(|a| a.is_cluster());
    if redis_url.is_some_and(cluster) {
        return Err(region.error(
            "a region's Redis cannot be a Redis Cluster (its client sends a call again after a \
             lost connection, and units held must be added once): give `redis_url` one Redis or \
             its Sentinels"
                .to_owned(),
        ));
    }
    let on_error = l.required(&ON_STORE_ERROR)?;
    if on_error.value != OnStoreError::Closed {
        return Err(on_error.error(
            "a region admits only out of units the global store granted it, and a node that \
             decides alone when its region's Redis fails would pass the limit: set it to \
             `closed`"
                .to_owned(),
        ));
    }
    let access = super::redis_access::validate(l, Some(&global))?
        .ok_or_else(|| global.error("is empty".to_owned()))?;
    if access.is_sentinel() && replicas.value == 0 {
        return Err(replicas.error(
            "the global store is behind Sentinels, which may promote a replica that lacks the \
             last grants: set it to the number of replicas Sentinel may promote, so that each \
             grant is spent only once they have it"
                .to_owned(),
        ));
    }
    Ok(Some(Region {
        name: region.value,
        global: access,
        replicas: replicas.value,
    }))
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, Env, Overrides};

    fn load(text: &str) -> Result<Config, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gw.toml");
        std::fs::write(&path, text).unwrap();
        Config::load(Some(&path), &Env::default(), &Overrides::default()).map_err(|e| e.to_string())
    }

    const WHOLE: &str = "region = \"eu-west\"\nredis_url = \"redis://127.0.0.1:6379\"\n\
                         global_store_url = \"redis://10.0.0.9:6379\"\non_store_error = \"closed\"\n";

    #[test]
    fn a_whole_region_loads_and_no_region_changes_nothing() {
        let c = load(WHOLE).unwrap();
        let region = c.region.unwrap();
        assert_eq!(region.name, "eu-west");
        assert_eq!(region.replicas, 0);
        assert!(load("redis_url = \"redis://127.0.0.1:6379\"\n")
            .unwrap()
            .region
            .is_none());
    }

    #[test]
    fn a_half_made_region_is_refused_naming_the_setting_and_the_file() {
        let cases = [
            (
                WHOLE.replace("global_store_url", "#"),
                "`region`",
                "global_store_url",
            ),
            (
                WHOLE.replace("region = ", "#"),
                "`global_store_url`",
                "set `region`",
            ),
            (WHOLE.replace("redis_url = ", "#"), "`region`", "redis_url"),
            (
                WHOLE.replace("\"closed\"", "\"local\""),
                "`on_store_error`",
                "closed",
            ),
            (WHOLE.replace("eu-west", "eu:west"), "`region`", "letters"),
            (
                WHOLE.replace("redis://10.0.0.9:6379", "redis+cluster://10.0.0.9:6379"),
                "`global_store_url`",
                "Cluster",
            ),
            (
                WHOLE.replace("redis://127.0.0.1:6379", "redis+cluster://127.0.0.1:6379"),
                "`region`",
                "Cluster",
            ),
            (
                WHOLE.replace("redis://10.0.0.9:6379", "redis+sentinel://10.0.0.9:26379/g")
                    + "global_store_replicas = 0\n",
                "`global_store_replicas`",
                "Sentinel",
            ),
        ];
        for (text, setting, says) in cases {
            let e = load(&text).unwrap_err();
            assert!(e.contains(setting) && e.contains(says), "{text}: {e}");
            assert!(e.contains("gw.toml"), "the file is named: {e}");
        }
    }
}
