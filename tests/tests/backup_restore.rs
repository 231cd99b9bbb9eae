//! The book's backup and restore procedures, tried: `scripts/backup-drill` backs up the shipped
//! Redis (its AOF directory) and pet-backend's SQLite database while they serve, wipes them,
//! restores, and compares what comes back with what was backed up. The chapter shows the
//! drill's own lines, so a procedure that stops working fails here, not at an operator's restore.

use std::process::Command;
use std::time::Duration;

use e2e::bin_path;

#[test]
fn the_backup_drill_restores_redis_and_the_backend_database_whole() {
    let mut cmd = Command::new("timeout");
    // Bounded: a server that never comes up fails the test instead of hanging the run.
    cmd.arg(Duration::from_secs(120).as_secs().to_string())
        .arg(e2e::repo_root().join("scripts/backup-drill"))
        .env("PET_BACKEND", bin_path("pet-backend"));
    let out = cmd.output().expect("run scripts/backup-drill");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the backup drill failed:\n{text}");
    assert!(text.contains("54 keys restored"), "{text}");
    assert!(text.contains("20 pets restored"), "{text}");
}
