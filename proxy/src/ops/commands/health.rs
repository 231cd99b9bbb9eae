//! `pet-gateway health [--ready]`: the admin listener's `/healthz` or `/readyz` as an exit code,
//! for probes that cannot run curl (the container image has none) or send the admin token.

use crate::config::{Config, Env, Overrides};
use crate::ops::admin_client::AdminClient;
use crate::ops::cli::AdminArgs;

/// Ok when the gateway answers 200; otherwise why, which `run` prints before exiting 1. Only
/// the admin listener's settings are read: a probe must not fail because a backend's name
/// does not resolve or a keys file is unreadable (the gateway's own `/readyz` says so).
pub fn health(admin: &AdminArgs, ready: bool) -> Result<(), String> {
    let path = if ready { "/readyz" } else { "/healthz" };
    let over = Overrides::default().with("admin_listen", admin.admin_listen.as_deref());
    let env = Env::process().only(&["admin_listen", "admin_token", "admin_hosts"]);
    let settings =
        Config::load_admin(admin.config.as_deref(), &env, &over).map_err(|e| e.to_string())?;
    let client = AdminClient::at(settings.admin_listen, settings.admin_token);
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
