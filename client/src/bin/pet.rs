//! `pet`: the pet adoption API from the command line, on `pet-client` (so it waits and retries
//! as the interface asks). Key from `PET_API_KEY`, base URL from `PET_API_URL`; JSON on stdout,
//! errors on stderr with a non-zero exit.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use pet_client::{Client, NewPet, PetStatus, RetryPolicy};

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
    /// Where the key's quota stands (spends none of it).
    Quota,
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
    let result = runtime.block_on(async {
        match cli.command {
            Command::Quota => client.quota().await.map(serde_json::to_value),
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
