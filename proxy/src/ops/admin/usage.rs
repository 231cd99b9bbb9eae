//! `GET /usage/top?window=day|month&limit=N`: the quota holders (keys, and customers, whose
//! keys share one quota) that spent the most units in the current UTC day or month, heaviest
//! first. One read of the store's top consumers' index (`QuotaStore::top`), whatever the number
//! of keys; each key's plan and limit come from the keys and plans in force.

use std::collections::HashSet;

use http::Response;
use serde::{Deserialize, Serialize};

use super::reply::{error, json_response};
use super::Admin;
use crate::http::responses::ErrorCode;
use crate::keys::index::customer_of;
use crate::quota::store::TopWindow;

/// The most entries one answer carries.
pub const MAX_LIMIT: usize = 1_000;
const DEFAULT_LIMIT: usize = 10;

/// One quota holder: a key (`key_id`, its `plan`, and its `limit` of the window's length), or
/// a customer (`customer`; its keys may be of several plans, so no plan or limit).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopEntry {
    pub key_id: Option<String>,
    pub customer: Option<String>,
    pub plan: Option<String>,
    /// Units spent in the period, as of the last flush of every node (up to a second behind).
    pub used: u64,
    pub limit: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Top {
    pub window: String,
    pub entries: Vec<TopEntry>,
}

/// The query string's window and limit, or why it is refused.
pub fn top_query(query: Option<&str>) -> Result<(TopWindow, usize), String> {
    let (mut window, mut limit) = (TopWindow::Day, DEFAULT_LIMIT);
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        match name {
            "window" => {
                window = TopWindow::parse(value)
                    .ok_or_else(|| format!("window: `{value}` is not day or month"))?
            }
            "limit" => {
                limit = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_LIMIT).contains(n))
                    .ok_or_else(|| format!("limit: `{value}` is not a number from 1 to 1000"))?
            }
            _ => return Err(format!("unknown parameter `{name}`: use window and limit")),
        }
    }
    Ok((window, limit))
}

impl Admin {
    pub(super) async fn usage_top(&self, query: Option<&str>) -> Response<Vec<u8>> {
        let (window, limit) = match top_query(query) {
            Ok(asked) => asked,
            Err(e) => return error(400, ErrorCode::InvalidRequest, &e),
        };
        match self.store.top(window, limit).await {
            Ok((_, ranked)) => {
                let top = Top {
                    window: window.name().to_owned(),
                    entries: self.top_entries(window, ranked),
                };
                json_response(200, serde_json::to_vec(&top).unwrap_or_default())
            }
            Err(e) => error(503, ErrorCode::Internal, &format!("quota store: {e}")),
        }
    }

    /// The ranked holders with each key's plan and limit (a key no longer in force has
    /// neither).
    fn top_entries(&self, window: TopWindow, ranked: Vec<(String, u64)>) -> Vec<TopEntry> {
        let snapshot = self.catalog.snapshot();
        let ids: HashSet<&str> = ranked
            .iter()
            .map(|(holder, _)| holder.as_str())
            .filter(|holder| customer_of(holder).is_none())
            .collect();
        let keys = snapshot.keys.by_ids(&ids);
        ranked
            .iter()
            .map(|(holder, used)| match customer_of(holder) {
                Some(customer) => TopEntry {
                    key_id: None,
                    customer: Some(customer.to_owned()),
                    plan: None,
                    used: *used,
                    limit: None,
                },
                None => {
                    let key = keys.get(holder.as_str());
                    TopEntry {
                        key_id: Some(holder.clone()),
                        customer: None,
                        plan: key.map(|k| k.plan.to_string()),
                        used: *used,
                        limit: key
                            .and_then(|k| snapshot.limits_of(k))
                            .and_then(|l| l.enforced_limit(window.every())),
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_defaults_to_the_day_and_ten_and_refuses_anything_else() {
        assert_eq!(top_query(None), Ok((TopWindow::Day, 10)));
        assert_eq!(
            top_query(Some("window=month&limit=1000")),
            Ok((TopWindow::Month, 1000))
        );
        for bad in [
            "limit=0",
            "limit=1001",
            "limit=x",
            "window=week",
            "window=",
            "other=1",
        ] {
            assert!(top_query(Some(bad)).is_err(), "{bad}");
        }
    }
}
