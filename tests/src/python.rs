//! Receivers written in Python on the packages of the ecosystem they stand for (`standardwebhooks`,
//! `opentelemetry-proto`), installed by scripts/test into `target/tools/venv`: a test that
//! checks our output with them shares no code with what it checks.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::process::Process;
use crate::redis::repo_root;

/// A script of `tests/` listening on a loopback port of its own.
pub struct PythonServer {
    pub process: Process,
    pub port: u16,
}

impl PythonServer {
    /// Starts `tests/<script>` with `args` and `--port-file`, once `module` is importable from
    /// the venv (a clear message otherwise), and waits for its port.
    pub fn start(dir: &Path, script: &str, module: &str, args: &[String]) -> PythonServer {
        let python = venv_python();
        let ready = std::process::Command::new(&python)
            .args(["-c", &format!("import {module}")])
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            ready,
            "the Python package of `{module}` is missing from {}: run scripts/test, which installs it",
            python.display()
        );
        let port_file = dir.join(format!("{script}.port"));
        let mut cmd = std::process::Command::new(&python);
        cmd.arg(repo_root().join("tests").join(script))
            .args(args)
            .arg("--port-file")
            .arg(&port_file);
        let process = Process::spawn(script, &mut cmd);
        let port = (0..200)
            .find_map(|_| {
                std::thread::sleep(Duration::from_millis(50));
                std::fs::read_to_string(&port_file)
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("{script} did not listen within 10 s"));
        PythonServer { process, port }
    }
}

fn venv_python() -> PathBuf {
    repo_root().join("target/tools/venv/bin/python")
}
