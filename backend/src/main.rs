use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;

/// The pet adoption backend: serves the interface on SQLite. Meant to sit behind pet-gateway,
/// which authenticates and rate-limits; it does neither itself.
#[derive(Parser)]
#[command(name = "pet-backend", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "PET_BACKEND_LISTEN", default_value = "127.0.0.1:8081")]
    listen: SocketAddr,
    /// SQLite database file; its directory is created when missing.
    #[arg(long, env = "PET_BACKEND_DB", default_value = "./data/pets.db")]
    db: PathBuf,
    /// From this instant (RFC 3339) `GET /v1/pets/{petId}` answers 410 Gone; the interface's
    /// date by default.
    #[arg(long, env = "PET_BACKEND_GET_PET_SUNSET", default_value = "2030-12-05T00:00:00Z",
          value_parser = parse_instant)]
    get_pet_sunset: SystemTime,
}

/// An RFC 3339 instant (`2030-12-05T00:00:00Z`, or with an offset) as a `SystemTime`.
fn parse_instant(text: &str) -> Result<SystemTime, String> {
    let at = chrono::DateTime::parse_from_rfc3339(text.trim()).map_err(|e| {
        format!("`{text}` is not an RFC 3339 instant such as 2030-12-05T00:00:00Z: {e}")
    })?;
    let secs = u64::try_from(at.timestamp()).map_err(|_| format!("`{text}` is before 1970"))?;
    // The `Sunset` header is an HTTP date, which ends with the year 9999.
    if secs >= 253_402_300_800 {
        return Err(format!("`{text}` is past the year 9999"));
    }
    Ok(UNIX_EPOCH + Duration::from_secs(secs))
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pet-backend: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let store = match backend::PetStore::open(&args.db) {
            Ok(store) => store,
            Err(e) => {
                eprintln!("pet-backend: {e}");
                return ExitCode::FAILURE;
            }
        };
        let listener = match tokio::net::TcpListener::bind(args.listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("pet-backend: cannot listen on {}: {e}", args.listen);
                return ExitCode::FAILURE;
            }
        };
        tracing::info!(listen = %args.listen, db = %args.db.display(),
            get_pet_sunset = %httpdate::fmt_http_date(args.get_pet_sunset), "pet-backend serving");
        let settings = backend::Settings::new(args.get_pet_sunset);
        backend::run_with(listener, store, settings, backend::shutdown_signal()).await;
        ExitCode::SUCCESS
    })
}
