use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!("pet-gateway is not built yet; run pet-backend directly (see README.md)");
    ExitCode::FAILURE
}
