//! Conformance: schemathesis generates requests from `openapi.yaml` (valid and invalid ones),
//! sends them through the real gateway to the real backend with a valid key, and checks every
//! response against the document (status codes, headers, bodies, content types).

use std::process::Command;

use e2e::Fixture;

#[test]
fn schemathesis_finds_no_response_that_breaks_the_document() {
    let root = e2e::repo_root();
    let st = root.join("target/tools/venv/bin/st");
    assert!(
        st.exists(),
        "schemathesis is missing at {}: run scripts/test, which installs it",
        st.display()
    );
    // Limits that never bind: this run is about the document, not quotas.
    let f = Fixture::with_plan("unlimited", 10_000_000, 1_000_000_000);
    let key = f.issue("unlimited");
    let backend = f.backend();
    let gw = f.gateway(&f.spec(backend.addr));

    let out = Command::new(&st)
        .arg("--config-file")
        .arg(root.join("tests/schemathesis.toml"))
        .arg("run")
        .arg(root.join("openapi.yaml"))
        .args(["--url", &gw.url("/v1")])
        .args(["--header", &format!("Authorization: Bearer {key}")])
        .args(["--max-examples", "50", "--no-color"])
        .current_dir(f.dir.path())
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
        report.contains("Tested: 5"),
        "every operation was exercised:\n{report}"
    );
    assert!(!report.contains(&key[4..]), "the key is not echoed");
}
