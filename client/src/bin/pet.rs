//! `pet`: the pet adoption API from the command line, on `pet-client` (so it waits and retries
//! as the interface asks). Key from `PET_API_KEY`, base URL from `PET_API_URL`; JSON on stdout
//! (`pet quota` prints one line per window, or the JSON body with `--json`), errors on stderr
//! with a non-zero exit.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use pet_client::{Client, NewPet, PetStatus, Quota, RetryPolicy};

#[derive(Parser)]
#[command(
    name = "pet",
    version,
    about = "The pet adoption API from the command line"
)]
struct Cli {
    /// The API key.
    #[arg(long, env = "PET_API_KEY", hide_env_values = true)]
    key: String,
    /// The API's base URL.
    #[arg(long, env = "PET_API_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// How long a command may take in all, waits for the rate limit included (seconds).
    #[arg(long, default_value_t = 120)]
    deadline: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Animals.
    Pets {
        #[command(subcommand)]
        command: PetsCommand,
    },
    /// Where the key's quota stands (spends none of it): the plan, one line per window (its
    /// name, the units remaining of its limit, when it resets) and any ban.
    Quota {
        /// Print the answer as JSON instead.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum PetsCommand {
    /// One page of animals, or every page with --all.
    List {
        #[arg(long)]
        status: Option<String>,
        /// Follow every page.
        #[arg(long)]
        all: bool,
    },
    /// Add an animal.
    Create {
        #[arg(long)]
        name: String,
        #[arg(long)]
        category: i64,
        #[arg(long)]
        status: Option<String>,
    },
    /// One animal (deprecated by the interface: prefer `pets list`).
    Get { id: i64 },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pet: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let policy = RetryPolicy {
        deadline: Duration::from_secs(cli.deadline),
        ..RetryPolicy::default()
    };
    let client = match Client::with_policy(&cli.url, &cli.key, policy) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("pet: {e}");
            return ExitCode::from(2);
        }
    };
    if let Command::Quota { json: false } = cli.command {
        return match runtime.block_on(client.quota()) {
            Ok(quota) => {
                print!("{}", quota_text(&quota, pet_client::unix_now()));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("pet: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let result = runtime.block_on(async {
        match cli.command {
            Command::Quota { .. } => client.quota().await.map(serde_json::to_value),
            Command::Pets { command } => match command {
                PetsCommand::List { status, all: true } => client
                    .list_all(status.as_deref())
                    .await
                    .map(serde_json::to_value),
                PetsCommand::List { status, all: false } => client
                    .list_pets(status.as_deref(), None)
                    .await
                    .map(|p| serde_json::to_value(p.pets)),
                PetsCommand::Create {
                    name,
                    category,
                    status,
                } => client
                    .create_pet(&NewPet {
                        name,
                        category_id: category,
                        status: status.map(PetStatus::from),
                    })
                    .await
                    .map(serde_json::to_value),
                PetsCommand::Get { id } => client.get_pet(id).await.map(serde_json::to_value),
            },
        }
    });
    match result {
        Ok(Ok(value)) => {
            println!("{value}");
            ExitCode::SUCCESS
        }
        Ok(Err(e)) => {
            eprintln!("pet: cannot print the answer: {e}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("pet: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `pet quota`'s text: the plan, a line per window (of either form of the body), the requests in
/// flight when the plan bounds them, and the ban.
///
/// ```text
/// plan free
/// second      4 of 5 left, resets 2026-01-01 00:00:01 UTC (in 1s)
/// month       0 of 9000 left, resets 2026-02-01 00:00:00 UTC (in 31d)
/// concurrency 1 of 5 in flight
/// ban         none
/// ```
fn quota_text(quota: &Quota, now: u64) -> String {
    let windows = quota.all_windows();
    let concurrency = quota.concurrency.map(|_| "concurrency".len());
    let width = windows
        .iter()
        .map(|w| w.name.len())
        .chain([3])
        .chain(concurrency)
        .max()
        .unwrap_or(3);
    let mut out = format!("plan {}\n", quota.plan);
    for w in &windows {
        out.push_str(&format!(
            "{:width$} {} of {} left, resets {} (in {})\n",
            w.name,
            w.remaining,
            w.limit,
            utc(w.reset),
            span(w.reset.saturating_sub(now)),
        ));
    }
    if windows.is_empty() {
        out.push_str("(no windows)\n");
    }
    if let Some(c) = quota.concurrency {
        out.push_str(&format!(
            "{:width$} {} of {} in flight\n",
            "concurrency", c.in_flight, c.limit
        ));
    }
    match quota.ban {
        Some(ban) => out.push_str(&format!(
            "{:width$} until {} (in {})\n",
            "ban",
            utc(ban.until),
            span(ban.until.saturating_sub(now))
        )),
        None => out.push_str(&format!("{:width$} none\n", "ban")),
    }
    out
}

/// Unix seconds as `YYYY-MM-DD HH:MM:SS UTC`.
fn utc(secs: u64) -> String {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Days to a civil date (Howard Hinnant's algorithm), for days from 1970 on.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3_600,
        rest % 3_600 / 60,
        rest % 60
    )
}

/// A wait in its two largest units: `42s`, `3m 5s`, `6h 12m`, `31d`, `2d 4h`.
fn span(secs: u64) -> String {
    let units = [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)];
    let parts: Vec<String> = units
        .iter()
        .enumerate()
        .skip_while(|&(k, &(_, n))| secs < n && k < units.len() - 1)
        .take(2)
        .filter_map(|(k, &(unit, n))| {
            let bigger = if k == 0 { u64::MAX } else { units[k - 1].1 };
            let value = secs % bigger / n;
            (value > 0 || secs == 0).then(|| format!("{value}{unit}"))
        })
        .collect();
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_spans_read_as_people_write_them() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_767_225_600), "2026-01-01 00:00:00 UTC");
        assert_eq!(utc(1_709_164_799), "2024-02-28 23:59:59 UTC");
        assert_eq!(utc(1_709_251_199), "2024-02-29 23:59:59 UTC");
        assert_eq!(span(0), "0s");
        assert_eq!(span(42), "42s");
        assert_eq!(span(185), "3m 5s");
        assert_eq!(span(3_600), "1h");
        assert_eq!(span(22_320), "6h 12m");
        assert_eq!(span(31 * 86_400), "31d");
        assert_eq!(span(2 * 86_400 + 4 * 3_600 + 59), "2d 4h");
    }
}
