//! The files operators deploy are checked by the tools that will read them: `promtool` for the
//! Prometheus configuration and alert rules, `systemd-analyze verify` for the service units
//! (where systemd is installed).

use std::path::{Path, PathBuf};
use std::process::Command;

use e2e::{bin_path, promtool};

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run checker");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

#[test]
fn prometheus_rules_and_scrape_config_pass_promtool() {
    run_ok(
        Command::new(promtool())
            .args(["check", "rules"])
            .arg(deploy().join("prometheus/alerts.yml")),
    );
    // `check config` also loads the rule files the config names.
    run_ok(
        Command::new(promtool())
            .args(["check", "config"])
            .arg(deploy().join("prometheus/prometheus.yml")),
    );
}

#[test]
fn systemd_units_pass_systemd_analyze_verify() {
    let Ok(analyze) = which("systemd-analyze") else {
        eprintln!("systemd-analyze is not installed here; skipping (scripts/test installs it)");
        return;
    };
    // verify insists that ExecStart binaries exist: point the units at this checkout's builds.
    let dir = tempfile::tempdir().unwrap();
    for unit in ["pet-gateway@.service", "pet-backend@.service"] {
        let text = std::fs::read_to_string(deploy().join("systemd").join(unit)).unwrap();
        let text = text
            .replace(
                "/usr/local/bin/pet-gateway",
                &bin_path("pet-gateway").to_string_lossy(),
            )
            .replace(
                "/usr/local/bin/pet-backend",
                &bin_path("pet-backend").to_string_lossy(),
            );
        let instance = unit.replace("@.service", "@production.service");
        std::fs::write(dir.path().join(unit), &text).unwrap();
        let out = run_ok(
            Command::new(&analyze)
                .arg("verify")
                .arg(
                    dir.path()
                        .join(unit)
                        .to_string_lossy()
                        .replace(unit, &instance),
                )
                .env("SYSTEMD_UNIT_PATH", format!("{}:", dir.path().display())),
        );
        assert!(!out.to_lowercase().contains("unknown"), "{unit}: {out}");
    }
}

fn which(name: &str) -> Result<PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(name))
                .find(|c| c.exists())
        })
        .ok_or(())
}
