//! `pet-gateway serve`: logging set up, the config's warnings logged, then the gateway runs.

use crate::base::log_sink::{LogSink, SinkGuard};
use crate::config::{Env, LogFormat};
use crate::http::access_log;
use crate::ops::cli::ServeArgs;

/// The most log bytes held for a slow stderr before lines are dropped (and counted).
const LOG_BUFFER: usize = 16 * 1024 * 1024;

/// Logs go to standard error through a background writer (`base::log_sink`): a slow or blocked
/// stderr (a full pipe, a stalled journald) must never stall a proxy thread inside a request.
/// When the buffer is full, lines are dropped rather than waited for. The access log writes its
/// lines into the same sink itself (`http::access_log`). Keep the guard alive until exit:
/// dropping it writes what is buffered.
fn init_logging(format: LogFormat) -> Result<SinkGuard, String> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let (sink, guard) = LogSink::start(std::io::stderr(), LOG_BUFFER)
        .map_err(|e| format!("cannot start the log writer thread: {e}"))?;
    sink.install();
    access_log::set_format(match format {
        LogFormat::Json => access_log::Format::Json,
        LogFormat::Text => access_log::Format::Text,
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(sink);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
    };
    Ok(guard)
}

pub fn serve(args: ServeArgs) -> Result<(), String> {
    let c = &args.config;
    let config = super::load(c.config.as_deref(), &c.overrides)?;
    crate::config::events_ready(&config)?;
    let _flush_on_exit = init_logging(config.log_format)?;
    let unknown = Env::process().unknown();
    for warning in config.warnings().into_iter().chain(unknown) {
        tracing::warn!("{warning}");
    }
    // Before anything listens: a stop signal from here on is a graceful stop.
    let signals = crate::ops::stop_signals::StopSignals::register()
        .map_err(|e| format!("cannot register the stop signals' handlers: {e}"))?;
    crate::ops::server::run(config, args.upgrade, signals).map_err(|e| e.to_string())
}
