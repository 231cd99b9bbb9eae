use std::process::ExitCode;

use clap::Parser;

/// mimalloc returns freed memory to the system and keeps per-thread caches: the big transient
/// allocations of loading a large keys file do not stay resident, and the hot path allocates
/// without contention (`base::alloc`: asked for plain blocks where they are aligned enough).
#[global_allocator]
static GLOBAL: proxy::base::alloc::MiMalloc = proxy::base::alloc::MiMalloc;

fn main() -> ExitCode {
    proxy::ops::commands::run(proxy::ops::cli::Cli::parse())
}
