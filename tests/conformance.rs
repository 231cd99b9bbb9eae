//! Conformance: schemathesis generates requests from `openapi.yaml` (valid and invalid ones),
//! sends them through the real gateway to the real backend with a valid key, and checks every
//! response against the document (status codes, headers, bodies, content types).

use std::path::Path;
use std::process::Command;

use e2e::{issue_key, write_plan, Backend, GatewayProcess, GatewaySpec};

#[test]
fn schemathesis_finds_no_response_that_breaks_the_document() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let st = root.join("target/tools/venv/bin/st");
    assert!(
        st.exists(),
        "schemathesis is missing at {}: run scripts/test, which installs it",
        st.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let plans = dir.path().join("plans");
    // Limits that never bind: this run is about the document, not quotas.
    write_plan(&plans, "unlimited", 10_000_000, 1_000_000_000);
    let keys = dir.path().join("keys.toml");
    let key = issue_key(&keys, &plans, "unlimited");
    let backend = Backend::start(&dir.path().join("pets.db"));
    let gw = GatewayProcess::start(dir.path(), &GatewaySpec::new(backend.addr, &keys, &plans));

    let out = Command::new(&st)
        .arg("--config-file")
        .arg(root.join("tests/schemathesis.toml"))
        .arg("run")
        .arg(root.join("openapi.yaml"))
        .args(["--url", &gw.url("/v1")])
        .args(["--header", &format!("Authorization: Bearer {key}")])
        .args(["--max-examples", "50", "--no-color"])
        .current_dir(dir.path())
        .output()
        .expect("run schemathesis");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "schemathesis found problems:\n{report}"
    );
    assert!(
        report.contains("Tested: 4"),
        "every operation was exercised:\n{report}"
    );
    assert!(!report.contains(&key[4..]), "the key is not echoed");
}
