//! `pet-gateway bans list|lift`, through the running gateway's admin listener.

use crate::config::Overrides;
use crate::ops::admin::bans::Bans;
use crate::ops::admin_client::AdminClient;
use crate::ops::cli::{AdminArgs, BansCommand};
use crate::ops::commands::output::table;

pub fn admin_of(args: &AdminArgs) -> Result<AdminClient, String> {
    let over = Overrides::default().with("admin_listen", args.admin_listen.as_deref());
    Ok(AdminClient::of(&super::load_for_admin(
        args.config.as_deref(),
        &over,
    )?))
}

pub fn fetch_bans(admin: &AdminClient) -> Result<Bans, String> {
    let (status, body) = admin.call("GET", "/bans")?;
    if status != 200 {
        return Err(format!("the gateway answered {status}: {body}"));
    }
    serde_json::from_str(&body).map_err(|e| format!("unexpected answer from the gateway: {e}"))
}

/// When the gateway's list says `id` is banned: until when (RFC 3339).
pub fn ban_of<'a>(bans: Option<&'a Bans>, id: &str) -> Option<&'a str> {
    bans?
        .bans
        .iter()
        .find(|b| b.key_id == id)
        .map(|b| b.until_utc.as_str())
}

pub fn bans_command(cmd: BansCommand) -> Result<(), String> {
    match cmd {
        BansCommand::List { admin } => {
            let bans = fetch_bans(&admin_of(&admin)?)?;
            let rows = bans.bans.iter().map(|b| {
                [b.key_id.as_str(), b.plan.as_str(), b.until_utc.as_str()].map(str::to_owned)
            });
            print!("{}", table(["ID", "PLAN", "UNTIL"], [18, 12], rows));
            Ok(())
        }
        BansCommand::Lift { admin, id } => {
            let client = admin_of(&admin)?;
            let (status, body) = client.call("POST", &format!("/bans/{id}/lift"))?;
            if status != 200 {
                return Err(format!("the gateway answered {status}: {body}"));
            }
            let lifted = body.contains("\"lifted\":true");
            println!(
                "{}",
                if lifted {
                    format!("lifted the ban of {id}")
                } else {
                    format!("{id} was not banned")
                }
            );
            Ok(())
        }
    }
}
