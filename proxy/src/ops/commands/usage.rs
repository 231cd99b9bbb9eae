//! `pet-gateway usage top`, through the running gateway's admin listener (`GET /usage/top`).

use crate::ops::admin::usage::{Top, TopEntry};
use crate::ops::cli::UsageCommand;
use crate::ops::commands::bans::admin_of;
use crate::ops::commands::output::table;

pub fn usage_command(cmd: UsageCommand) -> Result<(), String> {
    match cmd {
        UsageCommand::Top {
            admin,
            window,
            limit,
            json,
        } => {
            let client = admin_of(&admin)?;
            let (status, body) =
                client.call("GET", &format!("/usage/top?window={window}&limit={limit}"))?;
            if status != 200 {
                return Err(format!("the gateway answered {status}: {body}"));
            }
            if json {
                println!("{}", body.trim_end());
                return Ok(());
            }
            let top: Top = serde_json::from_str(&body)
                .map_err(|e| format!("unexpected answer from the gateway: {e}"))?;
            print!("{}", top_table(&top.entries));
            Ok(())
        }
    }
}

/// Rank, holder (a key id, or `customer:<name>`), plan, units used, limit; `-` where none.
fn top_table(entries: &[TopEntry]) -> String {
    let dash = || "-".to_owned();
    let rows = entries.iter().enumerate().map(|(i, e)| {
        let holder = match (&e.key_id, &e.customer) {
            (Some(id), _) => id.clone(),
            (None, Some(c)) => format!("customer:{c}"),
            (None, None) => dash(),
        };
        [
            (i + 1).to_string(),
            holder,
            e.plan.clone().unwrap_or_else(dash),
            e.used.to_string(),
            e.limit.map_or_else(dash, |l| l.to_string()),
        ]
    });
    table(
        ["RANK", "HOLDER", "PLAN", "USED", "LIMIT"],
        [4, 24, 12, 12],
        rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_customer_shows_by_name_without_plan_or_limit() {
        let entries = [
            TopEntry {
                key_id: None,
                customer: Some("acme".to_owned()),
                plan: None,
                used: 12,
                limit: None,
            },
            TopEntry {
                key_id: Some("k1".to_owned()),
                customer: None,
                plan: Some("pro".to_owned()),
                used: 3,
                limit: Some(1000),
            },
        ];
        let t = top_table(&entries);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[1].starts_with("1    customer:acme"), "{t}");
        assert!(lines[1].ends_with("12           -"), "{t}");
        assert!(
            lines[2].contains(" pro ") && lines[2].ends_with("1000"),
            "{t}"
        );
    }
}
