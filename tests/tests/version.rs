//! The project's version is one: `[workspace.package] version` in `Cargo.toml`, what
//! `pet-gateway --version` and `pet-backend --version` print, and the newest entry of
//! `CHANGELOG.md`. A release that bumps one and forgets another would tell operators two stories.

use std::process::Command;

use e2e::{bin_path, repo_root};

/// `version = "X.Y.Z"` under `[workspace.package]` of the workspace's manifest.
fn workspace_version() -> String {
    let manifest = std::fs::read_to_string(repo_root().join("Cargo.toml")).expect("Cargo.toml");
    let section = manifest
        .split("[workspace.package]")
        .nth(1)
        .expect("Cargo.toml has a [workspace.package] section");
    let line = section
        .lines()
        .take_while(|l| !l.starts_with('['))
        .find_map(|l| l.strip_prefix("version = "))
        .expect("[workspace.package] names a version");
    line.trim().trim_matches('"').to_owned()
}

fn printed_version(binary: &str) -> String {
    let out = Command::new(bin_path(binary))
        .arg("--version")
        .output()
        .expect("run --version");
    assert!(out.status.success(), "{binary} --version: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn binaries_print_the_workspace_version() {
    let version = workspace_version();
    assert_eq!(
        printed_version("pet-gateway"),
        format!("pet-gateway {version}")
    );
    assert_eq!(
        printed_version("pet-backend"),
        format!("pet-backend {version}")
    );
}

#[test]
fn the_changelog_s_newest_entry_is_the_workspace_version() {
    let log = std::fs::read_to_string(repo_root().join("CHANGELOG.md")).expect("CHANGELOG.md");
    let newest = log
        .lines()
        .find_map(|l| l.strip_prefix("## ["))
        .and_then(|l| l.split(']').next())
        .expect("CHANGELOG.md has a `## [X.Y.Z]` entry");
    assert_eq!(newest, workspace_version());
}

/// The Kubernetes manifests run the images `scripts/container` tags with the version: a bump
/// that leaves them behind would deploy the release before it.
#[test]
fn the_kubernetes_manifests_name_the_workspace_version_s_images() {
    let version = workspace_version();
    let mut seen = 0;
    let mut stack = vec![repo_root().join("deploy/kubernetes")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read deploy/kubernetes") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("a manifest");
            for line in text.lines().map(str::trim) {
                let tag = line
                    .strip_prefix("newTag: ")
                    .map(|t| t.trim_matches('"'))
                    .or_else(|| {
                        let image = line.strip_prefix("image: pet-")?;
                        image.split_once(':').map(|(_, tag)| tag)
                    });
                if let Some(tag) = tag {
                    assert_eq!(tag, version, "{}: `{line}`", path.display());
                    seen += 1;
                }
            }
        }
    }
    assert!(seen >= 7, "found {seen} image tags under deploy/kubernetes");
}
