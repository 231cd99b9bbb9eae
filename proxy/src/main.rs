use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    proxy::commands::run(proxy::cli::Cli::parse())
}
