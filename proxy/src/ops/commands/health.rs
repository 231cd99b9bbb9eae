//! `pet-gateway health [--ready]`: the admin listener's `/healthz` or `/readyz` as an exit code,
//! for probes that cannot run curl (the container image has none) or send the admin token.

use crate::ops::cli::AdminArgs;
use crate::ops::commands::bans::admin_of;

/// Ok when the gateway answers 200; otherwise why, which `run` prints before exiting 1.
pub fn health(admin: &AdminArgs, ready: bool) -> Result<(), String> {
    let path = if ready { "/readyz" } else { "/healthz" };
    let client = admin_of(admin)?;
    let (status, body) = client.call("GET", path)?;
    match status {
        200 => Ok(()),
        401 => Err(format!(
            "the gateway at {} wants the admin token (401): set admin_token in the config or \
             PET_GATEWAY_ADMIN_TOKEN",
            client.addr
        )),
        _ => Err(format!("{path} answered {status}: {}", body.trim_end())),
    }
}
