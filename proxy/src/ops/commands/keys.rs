//! `pet-gateway keys …`: issue, list, show, reset usage, import, rotate and revoke. Changes go
//! through the key service ([`crate::keys::service::KeyService`]), the one the admin API uses;
//! what only the running gateway knows (usage, bans) is asked of its admin listener.

use std::path::PathBuf;

use super::bans::{ban_of, fetch_bans};
use super::output::{self, table};
use crate::config::{Config, KeysSource};
use crate::keys::plans::Plans;
use crate::keys::record::{KeysFile, NewKey};
use crate::keys::service::{KeyService, KeyStore};
use crate::ops::admin::bans::Bans;
use crate::ops::admin_client::AdminClient;
use crate::ops::cli::{KeyFiles, KeysCommand};

pub fn keys_command(cmd: KeysCommand) -> Result<(), String> {
    match cmd {
        KeysCommand::Issue { files, key } => issue(files, key),
        KeysCommand::List {
            files,
            admin_listen,
            json,
        } => list(files, admin_listen, json),
        KeysCommand::Show {
            files,
            admin_listen,
            json,
            id,
        } => show(files, admin_listen, json, id),
        KeysCommand::ResetUsage {
            files,
            admin_listen,
            id,
        } => reset_usage(files, admin_listen, id),
        KeysCommand::Import { files, from } => import(files, from),
        KeysCommand::Rotate { files, overlap, id } => rotate(files, overlap, id),
        KeysCommand::Revoke {
            files,
            admin_listen,
            id,
        } => revoke(files, admin_listen, id),
    }
}

fn issue(files: KeyFiles, new: NewKey) -> Result<(), String> {
    let config = key_config(&files, None)?;
    let plans = Plans::load_dir(&config.plans_dir).map_err(|e| e.to_string())?;
    let own = new.options()?;
    let changed = key_service(&config)?
        .issue(&plans, &new.plan, new.name.as_deref(), &own)
        .map_err(|e| e.to_string())?;
    let (record, key) = changed.value;
    println!(
        "issued {} (plan {}) in {}; the key is shown only now:",
        record.id,
        record.plan,
        where_keys(&config)
    );
    println!("{key}");
    // After the key is shown: a failed audit line must not lose a key already made.
    changed.audit.map_err(String::from)
}

fn list(files: KeyFiles, admin_listen: Option<String>, json: bool) -> Result<(), String> {
    let config = key_config(&files, admin_listen.as_deref())?;
    let file = key_service(&config)?.list().map_err(|e| e.to_string())?;
    // The table first, whole; a note about it after, on its own line, so that a
    // terminal showing both streams never runs the note into the last row.
    let admin = AdminClient::of(&config);
    let (bans, mut note) = match fetch_bans(&admin) {
        Ok(bans) => (Some(bans), None),
        Err(e) => (None, Some(format!("note: ban status unknown: {e}"))),
    };
    if bans.is_some() && config.keys_source == KeysSource::Store {
        note = registry_disagreement(&admin);
    }
    let now = crate::base::clock::unix_now();
    if json {
        println!("{}", list_json(&config, &file, bans.as_ref(), now));
        return Ok(());
    }
    let rows = file.keys.iter().map(|k| {
        [
            k.id.clone(),
            k.plan.clone(),
            k.status(ban_of(bans.as_ref(), &k.id), now),
            k.created_at.clone(),
            k.name.as_deref().unwrap_or("-").to_owned(),
        ]
    });
    print!(
        "{}",
        table(
            ["ID", "PLAN", "STATUS", "CREATED", "NAME"],
            [18, 12, 32, 22],
            rows
        )
    );
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    if let Some(note) = note {
        eprintln!("\n{note}");
    }
    Ok(())
}

/// What the node says of its replica when it and the registry disagree (repairing, or
/// serving its snapshot): the list above is the registry's, and may not be what it serves.
fn registry_disagreement(admin: &AdminClient) -> Option<String> {
    let (_, body) = admin.call("GET", "/readyz").ok()?;
    let ready: serde_json::Value = serde_json::from_str(&body).ok()?;
    let keys = ready["checks"]["keys"].as_str()?;
    (keys != "registry")
        .then(|| format!("note: the gateway and the registry disagree; the gateway's keys: {keys}"))
}

/// Every key as JSON with, while the gateway answers, its usage as `keys show` gives it.
fn list_json(config: &Config, file: &KeysFile, bans: Option<&Bans>, now: u64) -> serde_json::Value {
    let admin = AdminClient::of(config);
    // Usage from the running gateway (one call per key still in use), when it
    // answers; otherwise `usage` is null and `usage_error` says why.
    let mut reachable = bans.is_some();
    let list: Vec<serde_json::Value> = file
        .keys
        .iter()
        .map(|k| {
            let status = k.status(ban_of(bans, &k.id), now);
            let mut v = k.to_json(&status, bans.is_some());
            v["usage"] = serde_json::Value::Null;
            if reachable && k.revoked_at.is_none() && status != "expired" {
                match admin.call("GET", &format!("/keys/{}", k.id)) {
                    Ok((200, body)) => {
                        let live: serde_json::Value =
                            serde_json::from_str(&body).unwrap_or_default();
                        v["usage"] = live["usage"].clone();
                        v["limits"] = live["limits"].clone();
                    }
                    Ok((code, _)) => v["usage_error"] = format!("gateway answered {code}").into(),
                    Err(e) => {
                        reachable = false;
                        v["usage_error"] = e.into();
                    }
                }
            }
            v
        })
        .collect();
    serde_json::Value::Array(list)
}

fn show(
    files: KeyFiles,
    admin_listen: Option<String>,
    json: bool,
    id: String,
) -> Result<(), String> {
    let config = key_config(&files, admin_listen.as_deref())?;
    let file = key_service(&config)?.list().map_err(|e| e.to_string())?;
    let record = file.get(&id).map_err(|e| e.to_string())?;
    let admin = AdminClient::of(&config);
    let bans = fetch_bans(&admin).ok();
    let status = record.status(
        ban_of(bans.as_ref(), &record.id),
        crate::base::clock::unix_now(),
    );
    let mut shown = record.to_json(&status, bans.is_some());
    // What the running gateway knows: the limits in force and the usage.
    let live = admin
        .call("GET", &format!("/keys/{id}"))
        .and_then(|(code, body)| match code {
            200 => serde_json::from_str::<serde_json::Value>(&body)
                .map_err(|e| format!("unexpected answer from the gateway: {e}")),
            404 => Err("the gateway does not accept this key".to_owned()),
            other => Err(format!("the gateway answered {other}: {body}")),
        });
    let usage_note = match live {
        Ok(live) => {
            shown["limits"] = live["limits"].clone();
            shown["usage"] = live["usage"].clone();
            live["usage_error"].as_str().map(str::to_owned)
        }
        Err(e) => Some(e),
    };
    if json {
        shown["usage_error"] = serde_json::json!(usage_note);
        println!("{shown}");
        return Ok(());
    }
    print_shown(&shown);
    if let Some(note) = usage_note {
        eprintln!("\nnote: usage unknown: {note}");
    }
    Ok(())
}

/// `keys show` for people: the record's fields, then its usage.
fn print_shown(shown: &serde_json::Value) {
    let field = |name: &str| match &shown[name] {
        serde_json::Value::Null => "-".to_owned(),
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    for name in [
        "id",
        "name",
        "plan",
        "status",
        "created_at",
        "expires_at",
        "revoked_at",
        "customer",
    ] {
        println!("{}", output::field(name, &field(name)));
    }
    let usage = &shown["usage"];
    if usage.is_object() {
        // The first form's line where the key has a minute and a day, then every window.
        let limits = &shown["limits"];
        if limits["per_minute"].is_u64() && limits["per_day"].is_u64() {
            let line = format!(
                "{} of {} this minute, {} of {} today (UTC)",
                usage["minute"], limits["per_minute"], usage["day"], limits["per_day"]
            );
            println!("{}", output::field("usage", &line));
        }
        for w in usage["windows"].as_array().into_iter().flatten() {
            let reset = w["reset"]
                .as_u64()
                .map_or("-".to_owned(), crate::base::clock::rfc3339);
            let shadow = if w["shadow"] == true { " (shadow)" } else { "" };
            let line = format!("{} of {}, resets {reset}{shadow}", w["used"], w["limit"]);
            let name = format!("window {}", w["name"].as_str().unwrap_or("?"));
            println!("{}", output::field(&name, &line));
        }
        println!(
            "{}",
            output::field("429s today", &usage["refused_today"].to_string())
        );
        println!(
            "{}",
            output::field("last used", usage["last_used"].as_str().unwrap_or("-"))
        );
    }
}

fn reset_usage(files: KeyFiles, admin_listen: Option<String>, id: String) -> Result<(), String> {
    let config = key_config(&files, admin_listen.as_deref())?;
    let file = key_service(&config)?.list().map_err(|e| e.to_string())?;
    file.get(&id).map_err(|e| e.to_string())?;
    let (code, body) = AdminClient::of(&config).call("POST", &format!("/keys/{id}/reset-usage"))?;
    if code != 200 {
        return Err(format!("the gateway answered {code}: {body}"));
    }
    // The gateway writes the audit line (who: admin): the change is made there.
    println!("reset the usage of {id} for this minute and this UTC day");
    Ok(())
}

fn import(files: KeyFiles, from: Option<PathBuf>) -> Result<(), String> {
    let config = key_config(&files, None)?;
    let service = key_service(&config)?;
    let KeyStore::Registry(registry) = &service.store else {
        return Err(
            "keys import copies a keys file into the key registry: run it with \
             keys_source = \"store\" (and redis_url) in the config or \
             PET_GATEWAY_KEYS_SOURCE=store"
                .into(),
        );
    };
    let from = from.unwrap_or_else(|| config.keys_file.clone());
    let file = KeysFile::load(&from).map_err(|e| e.to_string())?;
    let (added, kept) = registry.import(&file.keys).map_err(|e| e.to_string())?;
    println!(
        "imported {added} key(s) from {} into {}; {kept} were there already and keep \
         the registry's version",
        from.display(),
        where_keys(&config)
    );
    for record in &file.keys {
        service.audit("import", record)?;
    }
    Ok(())
}

fn rotate(files: KeyFiles, overlap: String, id: String) -> Result<(), String> {
    let config = key_config(&files, None)?;
    let overlap =
        crate::base::clock::parse_duration(&overlap).map_err(|e| format!("--overlap: {e}"))?;
    let changed = key_service(&config)?
        .rotate(&id, overlap)
        .map_err(|e| e.to_string())?;
    let (old, new, key) = changed.value;
    println!(
        "rotated {} to {} (plan {}, one quota); {} works until {}; the new key is \
         shown only now:",
        old.id,
        new.id,
        new.plan,
        old.id,
        old.expires_at.as_deref().unwrap_or("?")
    );
    println!("{key}");
    changed.audit.map_err(String::from)
}

fn revoke(files: KeyFiles, admin_listen: Option<String>, id: String) -> Result<(), String> {
    let config = key_config(&files, admin_listen.as_deref())?;
    let changed = key_service(&config)?
        .revoke(&id)
        .map_err(|e| e.to_string())?;
    changed.audit?;
    let record = changed.value;
    println!(
        "revoked {} (plan {}) in {} at {}",
        record.id,
        record.plan,
        where_keys(&config),
        record.revoked_at.as_deref().unwrap_or("?")
    );
    if config.keys_source == KeysSource::Store {
        // In the registry: every node applies it from the change feed within a second.
        println!("in force: the registry holds it; every node applies it within a second");
        return Ok(());
    }
    confirm_revoked(&AdminClient::of(&config), &config.keys_file, &record.id)
        .map_err(|why| format!("the revocation is NOT confirmed in force: {why}"))?;
    println!(
        "in force: the gateway at {} refuses {} now",
        config.admin_listen, record.id
    );
    Ok(())
}

pub(super) fn key_config(files: &KeyFiles, admin_listen: Option<&str>) -> Result<Config, String> {
    let over = files.overrides.0.clone().with("admin_listen", admin_listen);
    super::load_for_admin(files.config.as_deref(), &over)
}

/// The key service for the `keys` commands: the keys file or the registry
/// (`keys_source = "store"`), changes audited as the OS user.
fn key_service(config: &Config) -> Result<KeyService, String> {
    let store = match config.registry_redis() {
        Some(redis) => KeyStore::Registry(std::sync::Arc::new(crate::ops::wiring::open_registry(
            config,
            redis,
            std::time::Duration::from_secs(2),
            true,
        )?)),
        _ => KeyStore::File(config.keys_file.clone()),
    };
    Ok(KeyService {
        store,
        api_key_prefix: config.api_key_prefix.clone(),
        audit_log: config.audit_log.clone(),
        who: crate::keys::audit::os_user(),
        changes: crate::ops::wiring::key_changes(config),
    })
}

/// Where the keys are, for messages.
fn where_keys(config: &Config) -> String {
    match config.keys_source {
        KeysSource::Store => format!("the key registry ({})", config.key_prefix),
        KeysSource::File => config.keys_file.display().to_string(),
    }
}

/// Asks the running gateway to reload its keys now, checks that it serves this keys file, and
/// whether it still accepts `id`.
fn confirm_revoked(
    admin: &AdminClient,
    keys_file: &std::path::Path,
    id: &str,
) -> Result<(), String> {
    let addr = admin.addr;
    let (status, body) = admin.call("POST", "/reload")?;
    if status != 200 {
        return Err(format!("the gateway answered {status} to a reload: {body}"));
    }
    let answer: serde_json::Value = serde_json::from_str(&body)
        .map_err(|e| format!("unexpected answer from the gateway: {e}"))?;
    let mine = std::fs::canonicalize(keys_file).unwrap_or(keys_file.to_owned());
    let Some(served) = answer["keys_file"].as_str() else {
        return Err(format!(
            "the gateway at {addr} does not say which keys file it serves (an older version?)"
        ));
    };
    if std::path::Path::new(served) != mine {
        return Err(format!(
            "the gateway at {addr} serves the keys file {served}, not {}; give the right \
             --admin-listen or --config",
            mine.display()
        ));
    }
    if let Some(reason) = answer["keys_refused"].as_str() {
        return Err(format!(
            "the gateway at {addr} refuses the keys file and keeps its previous keys: {reason}"
        ));
    }
    let (status, body) = admin.call("GET", &format!("/keys/{id}"))?;
    match status {
        404 => Ok(()),
        200 => Err(format!(
            "the gateway at {addr} still accepts {id} after reloading"
        )),
        other => Err(format!("the gateway answered {other}: {body}")),
    }
}
