//! Redis as production runs it, for the tests: a certificate authority made with the `openssl`
//! command (certificates for `127.0.0.1`), and `redis-sentinel` processes watching a primary,
//! all on free loopback ports.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::{wait_for_listener, Process};
use crate::redis::redis_cli;

/// A throw-away certificate authority made by `openssl`, in a directory of the test's.
pub struct OpensslCa {
    pub cert: PathBuf,
    key: PathBuf,
    dir: PathBuf,
}

fn openssl(args: &[&str], dir: &Path) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("run openssl (installed with the system)");
    assert!(out.status.success(), "openssl {args:?}: {out:?}");
}

impl OpensslCa {
    /// A CA named `name` (its files `<name>-ca.pem`, `<name>-ca.key` in `dir`).
    pub fn new(dir: &Path, name: &str) -> OpensslCa {
        let cert = dir.join(format!("{name}-ca.pem"));
        let key = dir.join(format!("{name}-ca.key"));
        openssl(
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN={name} test CA"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
                "-keyout",
                &key.to_string_lossy(),
                "-out",
                &cert.to_string_lossy(),
            ],
            dir,
        );
        OpensslCa {
            cert,
            key,
            dir: dir.to_owned(),
        }
    }

    /// A certificate and key (PEM) signed by this CA for `127.0.0.1` and `localhost`, good for a
    /// server and for a client: `(cert, key)`.
    pub fn issue(&self, name: &str) -> (PathBuf, PathBuf) {
        let cert = self.dir.join(format!("{name}.pem"));
        let key = self.dir.join(format!("{name}.key"));
        let csr = self.dir.join(format!("{name}.csr"));
        let ext = self.dir.join(format!("{name}.ext"));
        std::fs::write(
            &ext,
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        .expect("write the extensions file");
        let s = |p: &Path| p.to_string_lossy().into_owned();
        openssl(
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
                &s(&key),
                "-out",
                &s(&csr),
            ],
            &self.dir,
        );
        openssl(
            &[
                "x509",
                "-req",
                "-in",
                &s(&csr),
                "-CA",
                &s(&self.cert),
                "-CAkey",
                &s(&self.key),
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &s(&ext),
                "-out",
                &s(&cert),
            ],
            &self.dir,
        );
        (cert, key)
    }
}

/// `redis-server`'s arguments for TLS only on `addr` (no plain port), with `cert`/`key` and the
/// CA that verifies clients; `clients` is `tls-auth-clients` (`no`, `yes`, `optional`).
pub fn tls_settings(
    addr: SocketAddr,
    ca: &Path,
    cert: &Path,
    key: &Path,
    clients: &str,
) -> Vec<String> {
    let s = |p: &Path| p.to_string_lossy().into_owned();
    [
        "--port",
        "0",
        "--tls-port",
        &addr.port().to_string(),
        "--tls-cert-file",
        &s(cert),
        "--tls-key-file",
        &s(key),
        "--tls-ca-cert-file",
        &s(ca),
        "--tls-auth-clients",
        clients,
        "--tls-replication",
        "yes",
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .collect()
}

/// A `redis-sentinel` on a free loopback port; its config file, which Sentinel rewrites, in a
/// directory of the test's. Killed on drop.
pub struct RedisSentinel {
    pub addr: SocketAddr,
    pub process: Process,
    cli_args: Vec<String>,
}

impl RedisSentinel {
    /// Starts one with `config` (its `sentinel monitor` line and the like) on `addr`; its
    /// `redis-cli` calls carry `cli_args` (TLS files, the Sentinels' password).
    pub fn start(dir: &Path, addr: SocketAddr, config: &str, cli_args: &[&str]) -> RedisSentinel {
        let file = dir.join(format!("sentinel-{}.conf", addr.port()));
        let listen = if config.lines().any(|l| l.starts_with("tls-port")) {
            String::new()
        } else {
            format!("port {}\n", addr.port())
        };
        std::fs::write(
            &file,
            format!("bind 127.0.0.1\n{listen}dir {}\n{config}\n", dir.display()),
        )
        .expect("write the sentinel config");
        let process = Process::spawn(
            "redis-sentinel",
            Command::new(redis_sentinel_path())
                .arg(&file)
                .args(["--loglevel", "warning"])
                .stdout(Stdio::null()),
        );
        wait_for_listener(addr, Duration::from_secs(10));
        RedisSentinel {
            addr,
            process,
            cli_args: cli_args.iter().map(|a| (*a).to_owned()).collect(),
        }
    }

    pub fn cli(&self, args: &[&str]) -> String {
        let out = redis_cli()
            .args(["-h", "127.0.0.1", "-p", &self.addr.port().to_string()])
            .args(&self.cli_args)
            .arg("--no-auth-warning")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The primary this Sentinel names for `master` now.
    pub fn master_addr(&self, master: &str) -> Option<SocketAddr> {
        let out = self.cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", master]);
        let mut lines = out.lines();
        let (host, port) = (lines.next()?, lines.next()?);
        format!("{host}:{port}").parse().ok()
    }

    /// Waits until this Sentinel names `want` as `master`'s primary.
    pub fn wait_master(&self, master: &str, want: SocketAddr, within: Duration) -> Duration {
        let started = Instant::now();
        while self.master_addr(master) != Some(want) {
            assert!(
                started.elapsed() < within,
                "the Sentinel did not name {want} within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        started.elapsed()
    }
}

fn redis_sentinel_path() -> PathBuf {
    redis_cli_dir()
        .map(|d| d.join("redis-sentinel"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "redis-sentinel is not installed: run scripts/test, which installs it, or \
                 `apt-get install redis-sentinel`"
            )
        })
}

fn redis_cli_dir() -> Option<PathBuf> {
    let cli = redis_cli();
    let program = PathBuf::from(cli.get_program());
    if program.is_absolute() {
        return program.parent().map(Path::to_owned);
    }
    std::env::var_os("PATH")
        .and_then(|p| std::env::split_paths(&p).find(|d| d.join("redis-sentinel").exists()))
}
