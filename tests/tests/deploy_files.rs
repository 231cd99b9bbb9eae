//! The files operators deploy are checked by the tools that will read them: `promtool` for the
//! Prometheus configuration and alert rules, `systemd-analyze verify` for the service units
//! (where systemd is installed).

use std::path::PathBuf;
use std::process::Command;

use e2e::{bin_path, promtool};

fn deploy() -> PathBuf {
    e2e::repo_root().join("deploy")
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
    // `check config` also loads the rule files the config names; the fleet's Prometheus ("To
    // production", step 4) has the admin token beside it, and its targets (files it may lack).
    let etc = tempfile::tempdir().unwrap();
    for file in ["prometheus.yml", "alerts.yml"] {
        std::fs::copy(
            deploy().join("prometheus").join(file),
            etc.path().join(file),
        )
        .unwrap();
    }
    std::fs::write(etc.path().join("pet-admin-token"), "a-token-of-the-fleet").unwrap();
    let text = run_ok(
        Command::new(promtool())
            .args(["check", "config"])
            .arg(etc.path().join("prometheus.yml")),
    );
    assert!(text.contains("rules found"), "{text}");
    // The local fleet's (deploy/compose.yaml), with its token file where the container has it.
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin-token");
    std::fs::write(&token, "a-token-of-the-fleet").unwrap();
    let fleet = std::fs::read_to_string(deploy().join("prometheus/fleet.yml"))
        .unwrap()
        .replace("/run/secrets/admin-token", token.to_str().unwrap());
    assert!(
        fleet.contains(token.to_str().unwrap()),
        "the token file is named"
    );
    std::fs::write(dir.path().join("fleet.yml"), fleet).unwrap();
    std::fs::copy(
        deploy().join("prometheus/alerts.yml"),
        dir.path().join("alerts.yml"),
    )
    .unwrap();
    run_ok(
        Command::new(promtool())
            .args(["check", "config"])
            .arg(dir.path().join("fleet.yml")),
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

/// A core dump of either service holds what its memory held: the gateway's keys' hashes, the
/// admin token, Redis passwords, the registry's signing key. Every shipped unit turns dumps off.
#[test]
fn every_systemd_unit_turns_core_dumps_off() {
    let mut units = 0;
    for entry in std::fs::read_dir(deploy().join("systemd")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("service") {
            continue;
        }
        units += 1;
        let text = std::fs::read_to_string(&path).unwrap();
        let service = text
            .split("\n[")
            .find(|section| section.starts_with("Service]"))
            .unwrap_or_else(|| panic!("{} has no [Service] section", path.display()));
        assert!(
            service.lines().any(|l| l.trim() == "LimitCORE=0"),
            "{} must set LimitCORE=0 in [Service]: a core dump holds keys and secrets",
            path.display()
        );
    }
    assert!(units >= 2, "the units were found: {units}");
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

/// `PetGatewayShedding` pages once requests have been shed for a minute, not for a moment's
/// shedding, and not for 429s of keys' own concurrency (their callers' business, not an
/// overloaded backend): promtool's rule tests on the shipped rule.
#[test]
fn the_shedding_alert_fires_after_a_minute_of_503s_and_not_for_concurrency_429s() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        deploy().join("prometheus/alerts.yml"),
        dir.path().join("alerts.yml"),
    )
    .unwrap();
    let series = |reason: &str, values: &str| {
        format!(
            "      - series: 'pet_gateway_overload_refusals_total{{environment=\"production\",instance=\"gw1:9090\",reason=\"{reason}\",priority=\"normal\"}}'\n        values: '{values}'\n"
        )
    };
    let tests = format!(
        "rule_files:\n  - alerts.yml\nevaluation_interval: 15s\ntests:\n\
         \x20 - interval: 15s\n    input_series:\n{}{}\
         \x20   alert_rule_test:\n\
         \x20     - eval_time: 30s\n        alertname: PetGatewayShedding\n        exp_alerts: []\n\
         \x20     - eval_time: 3m\n        alertname: PetGatewayShedding\n        exp_alerts:\n\
         \x20         - exp_labels:\n              severity: page\n              environment: production\n\
         \x20           exp_annotations:\n              summary: \"production has been shedding requests (503 overloaded) for a minute\"\n\
         \x20             description: \"The backends are at their limit (upstream_max_in_flight) and requests wait past upstream_queue_timeout_ms. Add backend capacity, or find the keys filling it (the console's top consumers; 429 concurrency_limited by plan). The runbook says how to tell the two apart.\"\n\
         \x20             runbook_url: \"operating/runbooks.html#petgatewayshedding\"\n\
         \x20 - interval: 15s\n    input_series:\n{}\
         \x20   alert_rule_test:\n\
         \x20     - eval_time: 5m\n        alertname: PetGatewayShedding\n        exp_alerts: []\n",
        series("queue_timeout", "0+10x20"),
        series("queue_full", "0x20"),
        series("concurrency", "0+50x20"),
    );
    std::fs::write(dir.path().join("tests.yml"), tests).unwrap();
    run_ok(
        Command::new(promtool())
            .args(["test", "rules"])
            .arg(dir.path().join("tests.yml")),
    );
}

/// The two-stage build (Containerfile.source, not built here: no Rust image can be pulled)
/// makes the same image as Containerfile: its last stage is Containerfile's, but for where the
/// binaries and files come from.
#[test]
fn the_source_build_ends_in_the_same_image_as_the_packaged_one() {
    let read = |name: &str| std::fs::read_to_string(deploy().join("container").join(name)).unwrap();
    let last_stage = |text: &str| {
        let at = text
            .find("ARG BASE=debian:bookworm-slim")
            .expect("the runtime stage");
        text[at..].to_owned()
    };
    let packaged = last_stage(&read("Containerfile"));
    let from_source = last_stage(&read("Containerfile.source")).replace(
        "COPY --from=build /context/bin/pet-gateway /context/bin/pet-backend /usr/local/bin/\n\
         COPY --from=build /context/etc/ /etc/pet-gateway/\n",
        "COPY bin/pet-gateway bin/pet-backend /usr/local/bin/\nCOPY etc/ /etc/pet-gateway/\n",
    );
    assert_eq!(from_source, packaged);
}
