//! Running `pet-gateway`: its config (`GatewaySpec`), the process, its command line, plan files
//! and keys, the `Fixture` most gateway tests start from, and small helpers on its responses.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::{bin_path, free_addr, wait_for_listener, Backend, Process};
use crate::tls::TestCert;

/// Writes a plan file `<name>.toml` into `dir`.
pub fn write_plan(dir: &Path, name: &str, per_minute: u64, per_day: u64) {
    std::fs::create_dir_all(dir).expect("plans dir");
    std::fs::write(
        dir.join(format!("{name}.toml")),
        format!("requests_per_minute = {per_minute}\nrequests_per_day = {per_day}\n"),
    )
    .expect("write plan");
}

/// Runs `pet-gateway` with `args` to completion.
pub fn gateway_cli(args: &[&str]) -> std::process::Output {
    Command::new(bin_path("pet-gateway"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run pet-gateway")
}

/// Issues a key through the real CLI and returns it (the last line of its output).
pub fn issue_key(keys_file: &Path, plans_dir: &Path, plan: &str) -> String {
    issue_key_with(keys_file, plans_dir, plan, &[]).1
}

/// The same with further flags of `keys issue` (`--customer acme`): the key's id and the key.
pub fn issue_key_with(
    keys_file: &Path,
    plans_dir: &Path,
    plan: &str,
    more: &[&str],
) -> (String, String) {
    let (keys, plans) = (keys_file.to_string_lossy(), plans_dir.to_string_lossy());
    let mut args = vec![
        "keys",
        "issue",
        "--keys-file",
        &keys,
        "--plans-dir",
        &plans,
        "--plan",
        plan,
    ];
    args.extend_from_slice(more);
    let out = gateway_cli(&args);
    assert!(
        out.status.success(),
        "keys issue failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let id = stdout
        .split_whitespace()
        .nth(1)
        .expect("`issued <id> ...`")
        .to_owned();
    let key = stdout.lines().last().expect("a key line").trim().to_owned();
    (id, key)
}

/// How to start one gateway process; written to a config file the gateway reads.
#[derive(Debug, Clone)]
pub struct GatewaySpec {
    pub environment: String,
    pub upstreams: Vec<SocketAddr>,
    pub redis_url: Option<String>,
    pub key_prefix: String,
    pub keys_file: PathBuf,
    pub plans_dir: PathBuf,
    /// More TOML for the config file (top-level keys first, then tables such as `[ban]`).
    pub extra: String,
    /// Environment variables of the process (secrets such as `PET_GATEWAY_REDIS_PASSWORD`).
    pub env: Vec<(String, String)>,
    /// Backends given by `host:port`, in place of `upstreams`.
    pub upstream_names: Vec<String>,
    /// The process runs in a mount namespace of its own where this file is `/etc/hosts`
    /// (`unshare`, as root): a test moves a host name by rewriting it in place.
    pub hosts_file: Option<PathBuf>,
}

impl GatewaySpec {
    pub fn new(upstream: SocketAddr, keys_file: &Path, plans_dir: &Path) -> GatewaySpec {
        GatewaySpec {
            environment: "test".to_owned(),
            upstreams: vec![upstream],
            redis_url: None,
            key_prefix: "pet:test".to_owned(),
            keys_file: keys_file.to_owned(),
            plans_dir: plans_dir.to_owned(),
            extra: String::new(),
            env: Vec::new(),
            upstream_names: Vec::new(),
            hosts_file: None,
        }
    }
}

/// A running `pet-gateway serve`; its log (standard error) goes to `log`.
pub struct GatewayProcess {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub log: PathBuf,
    pub config: PathBuf,
    pub process: Process,
}

impl GatewayProcess {
    pub fn start(dir: &Path, spec: &GatewaySpec) -> GatewayProcess {
        let gateway = GatewayProcess::spawn(dir, spec);
        wait_for_listener(gateway.addr, Duration::from_secs(10));
        gateway
    }

    /// Starts a gateway and returns at once, before it listens: for what must hold from its
    /// first moment (a stop signal while it starts).
    pub fn spawn(dir: &Path, spec: &GatewaySpec) -> GatewayProcess {
        let (addr, admin, config) = write_config(dir, spec);
        let log = dir.join(format!("gateway-{}.log", addr.port()));
        let process = spawn_serve(&config, &log, spec);
        GatewayProcess {
            addr,
            admin,
            log,
            config,
            process,
        }
    }

    /// Starts a gateway that is expected to refuse to start: waits for it to exit and returns
    /// its exit code and its standard error (the log and the one-line error).
    pub fn start_refused(dir: &Path, spec: &GatewaySpec) -> (Option<i32>, String) {
        let (addr, _, config) = write_config(dir, spec);
        let log = dir.join(format!("gateway-{}.log", addr.port()));
        let process = spawn_serve(&config, &log, spec);
        let code = process.wait_exit(Duration::from_secs(20));
        (code, std::fs::read_to_string(&log).unwrap_or_default())
    }

    /// Starts a second gateway on this one's config with `--upgrade` and returns once it waits
    /// to receive the listening sockets (its upgrade socket exists), which the running one
    /// hands over on SIGQUIT. A SIGQUIT sent earlier would find no one to take the sockets: the
    /// old gateway would close them, and the port would be free for any other process.
    pub fn start_upgrade(&self) -> GatewayProcess {
        let upgrade_sock = self
            .config
            .parent()
            .expect("config in a directory")
            .join(format!("upgrade-{}.sock", self.addr.port()));
        let log = self.log.with_extension("upgrade.log");
        let log_file = std::fs::File::create(&log).expect("gateway log file");
        let process = Process::spawn(
            "pet-gateway (upgrade)",
            Command::new(bin_path("pet-gateway"))
                .arg("serve")
                .arg("--upgrade")
                .arg("--config")
                .arg(&self.config)
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(log_file),
        );
        let started = std::time::Instant::now();
        while !upgrade_sock.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "the upgrading gateway never listened on {}",
                upgrade_sock.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        GatewayProcess {
            addr: self.addr,
            admin: self.admin,
            log,
            config: self.config.clone(),
            process,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    /// The admin listener's `/metrics`, whole.
    async fn metrics_text(&self) -> String {
        reqwest::get(self.admin_url("/metrics"))
            .await
            .expect("admin listener answers")
            .text()
            .await
            .expect("a metrics body")
    }

    /// The value of an unlabelled metric on the admin listener's `/metrics`.
    pub async fn metric(&self, name: &str) -> f64 {
        let text = self.metrics_text().await;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /metrics"))
    }

    /// The sum of every series of metric `name` (each label set), 0 when it has none yet: a
    /// labelled counter appears only once counted.
    pub async fn metric_sum(&self, name: &str) -> f64 {
        let text = self.metrics_text().await;
        text.lines()
            .filter_map(|l| {
                let rest = l.strip_prefix(name)?;
                let value = match rest.strip_prefix('{') {
                    Some(labelled) => labelled.split_once("} ")?.1,
                    None => rest.strip_prefix(' ')?,
                };
                value.trim().parse::<f64>().ok()
            })
            .sum()
    }

    /// The sum of the series of metric `name` whose labels hold `labels` (`reason="concurrency"`).
    pub async fn metric_sum_where(&self, name: &str, labels: &str) -> f64 {
        let text = self.metrics_text().await;
        text.lines()
            .filter_map(|l| {
                let (set, value) = l.strip_prefix(name)?.strip_prefix('{')?.split_once("} ")?;
                set.contains(labels)
                    .then(|| value.trim().parse::<f64>().ok())?
            })
            .sum()
    }

    /// Waits until the unlabelled metric `name` reads `want`: for what the gateway counts a
    /// moment after the change a test can see (a fsync, a reload, then the count).
    pub async fn metric_reaches(&self, name: &str, want: f64, within: Duration) {
        let started = Instant::now();
        loop {
            let now = self.metric(name).await;
            if now == want {
                return;
            }
            assert!(
                started.elapsed() < within,
                "{name} is {now}, not {want}, after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops it by SIGTERM and waits (30 s at most) for it to exit: its exit code (none when a
    /// signal ended it) and its whole log.
    pub fn stop(self) -> (Option<i32>, String) {
        self.process.signal(15);
        let code = Process::wait_exit(self.process, Duration::from_secs(30));
        (code, std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// What `GET /v1/rate_limit` answers `key`: the store's own count of its quota.
    pub async fn rate_limit(&self, key: &str) -> serde_json::Value {
        reqwest::Client::new()
            .get(self.url("/v1/rate_limit"))
            .bearer_auth(key)
            .send()
            .await
            .expect("the gateway answers")
            .json()
            .await
            .expect("a JSON body")
    }

    /// The status of `GET /v1/pets` with `key`.
    pub async fn status(&self, key: &str) -> u16 {
        reqwest::Client::new()
            .get(self.url("/v1/pets"))
            .bearer_auth(key)
            .send()
            .await
            .expect("the gateway answers")
            .status()
            .as_u16()
    }
}

/// Waits until every node answers `want` for `key`; returns how long the slowest took.
pub async fn all_reach<'a>(
    nodes: impl IntoIterator<Item = &'a GatewayProcess>,
    key: &str,
    want: u16,
    within: Duration,
) -> Duration {
    let started = Instant::now();
    let mut pending: Vec<&GatewayProcess> = nodes.into_iter().collect();
    while !pending.is_empty() {
        let mut still = Vec::new();
        for gw in pending {
            if gw.status(key).await != want {
                still.push(gw);
            }
        }
        pending = still;
        assert!(
            pending.is_empty() || started.elapsed() < within,
            "{} node(s) never answered {want} within {within:?}",
            pending.len()
        );
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    started.elapsed()
}

/// Waits until `check` holds, for at most `within`.
pub async fn eventually(within: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let started = Instant::now();
    while !check() {
        assert!(started.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The key a `keys issue` printed, alone on its last line (the command must have succeeded).
pub fn issued(out: &std::process::Output) -> String {
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .expect("keys issue printed the key")
        .trim()
        .to_owned()
}

/// `pet-gateway keys ARGS --config CONFIG`.
pub fn keys_cli(config: &Path, args: &[&str]) -> std::process::Output {
    let mut all = vec!["keys"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--config", config.to_str().expect("a UTF-8 path")]);
    gateway_cli(&all)
}

/// Writes `spec` as a config file in `dir` (on fresh ports), for commands such as `check`.
pub fn write_gateway_config(dir: &Path, spec: &GatewaySpec) -> PathBuf {
    write_config(dir, spec).2
}

/// Writes `spec` as a config file in `dir`, on fresh ports: the public and admin addresses
/// and the file.
fn write_config(dir: &Path, spec: &GatewaySpec) -> (SocketAddr, SocketAddr, PathBuf) {
    let addr = free_addr();
    let admin = free_addr();
    let upstreams: Vec<String> = if spec.upstream_names.is_empty() {
        spec.upstreams.iter().map(|u| format!("\"{u}\"")).collect()
    } else {
        spec.upstream_names
            .iter()
            .map(|u| format!("\"{u}\""))
            .collect()
    };
    let mut toml = format!(
        "environment = \"{}\"\nlisten = \"{addr}\"\nadmin_listen = \"{admin}\"\n\
         upstreams = [{}]\nkey_prefix = \"{}\"\nkeys_file = \"{}\"\nplans_dir = \"{}\"\n",
        spec.environment,
        upstreams.join(", "),
        spec.key_prefix,
        spec.keys_file.display(),
        spec.plans_dir.display(),
    );
    if let Some(url) = &spec.redis_url {
        toml.push_str(&format!("redis_url = \"{url}\"\n"));
    }
    // In the test's own directory: the default under /tmp is named by environment and port,
    // and a port is reused by later tests.
    let upgrade_sock = dir.join(format!("upgrade-{}.sock", addr.port()));
    toml.push_str(&format!("upgrade_sock = \"{}\"\n", upgrade_sock.display()));
    toml.push_str(&spec.extra);
    let config = dir.join(format!("gateway-{}.toml", addr.port()));
    std::fs::write(&config, toml).expect("write gateway config");
    (addr, admin, config)
}

/// `pet-gateway serve --config FILE`, its standard error into `log`, with `spec`'s variables.
fn spawn_serve(config: &Path, log: &Path, spec: &GatewaySpec) -> Process {
    let log_file = std::fs::File::create(log).expect("gateway log file");
    let mut command = match &spec.hosts_file {
        None => Command::new(bin_path("pet-gateway")),
        Some(hosts) => {
            let mut c = Command::new("unshare");
            c.args([
                "--mount",
                "sh",
                "-c",
                "mount --bind \"$0\" /etc/hosts && exec \"$@\"",
            ])
            .arg(hosts)
            .arg(bin_path("pet-gateway"));
            c
        }
    };
    Process::spawn(
        "pet-gateway",
        command
            .arg("serve")
            .arg("--config")
            .arg(config)
            .env("RUST_LOG", "info")
            .envs(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(log_file),
    )
}

/// Sends `total` concurrent requests with `key`, spread round-robin over `gateways`, each on a
/// fresh connection; returns how many got each status.
pub async fn burst(
    gateways: &[GatewayProcess],
    key: &str,
    total: usize,
) -> std::collections::HashMap<u16, usize> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let tasks: Vec<_> = (0..total)
        .map(|i| {
            let url = gateways[i % gateways.len()].url("/v1/pets");
            let client = client.clone();
            let key = key.to_owned();
            tokio::spawn(async move {
                let resp = client
                    .get(url)
                    .bearer_auth(key)
                    .send()
                    .await
                    .expect("request");
                resp.status().as_u16()
            })
        })
        .collect();
    let mut counts = std::collections::HashMap::new();
    for t in tasks {
        *counts.entry(t.await.expect("request task")).or_insert(0) += 1;
    }
    counts
}

/// The id of the first key in a keys file.
pub fn first_key_id(keys_file: &Path) -> String {
    std::fs::read_to_string(keys_file)
        .expect("keys file")
        .lines()
        .find_map(|l| l.strip_prefix("id = \""))
        .map(|l| l.trim_end_matches('"').to_owned())
        .expect("a key id")
}

/// What every gateway test starts from: a temporary directory with a plans directory holding
/// one plan, the path of a (not yet written) keys file, and a database path for the backend.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub plans: PathBuf,
    pub keys: PathBuf,
}

impl Fixture {
    /// The plan `free` at the given limits.
    pub fn new(per_minute: u64, per_day: u64) -> Fixture {
        Self::with_plan("free", per_minute, per_day)
    }

    /// One plan `name` at the given limits.
    pub fn with_plan(name: &str, per_minute: u64, per_day: u64) -> Fixture {
        let dir = tempfile::tempdir().expect("temp dir");
        let plans = dir.path().join("plans");
        write_plan(&plans, name, per_minute, per_day);
        let keys = dir.path().join("keys.toml");
        Fixture { dir, plans, keys }
    }

    /// Issues a key on `plan` through the real CLI.
    pub fn issue(&self, plan: &str) -> String {
        issue_key(&self.keys, &self.plans, plan)
    }

    /// A key of `plan` issued with further flags (`--customer acme`): its id and the key.
    pub fn issue_with(&self, plan: &str, more: &[&str]) -> (String, String) {
        issue_key_with(&self.keys, &self.plans, plan, more)
    }

    /// A `pet-backend` with its database in this fixture's directory.
    pub fn backend(&self) -> Backend {
        Backend::start(&self.dir.path().join("pets.db"))
    }

    /// A gateway config on this fixture's keys and plans, forwarding to `upstream`.
    pub fn spec(&self, upstream: SocketAddr) -> GatewaySpec {
        GatewaySpec::new(upstream, &self.keys, &self.plans)
    }

    /// A gateway config like [`Fixture::spec`] whose public listener speaks TLS (HTTP/2 and
    /// HTTP/1.1) with a certificate signed by `cert`'s authority.
    pub fn tls_spec(&self, upstream: SocketAddr, cert: &TestCert) -> GatewaySpec {
        let cert_path = self.dir.path().join("cert.pem");
        let key_path = self.dir.path().join("key.pem");
        cert.write(&cert_path, &key_path);
        let mut spec = self.spec(upstream);
        spec.extra = format!(
            "tls_cert = \"{}\"\ntls_key = \"{}\"\n",
            cert_path.display(),
            key_path.display()
        );
        spec
    }

    /// Starts a gateway from `spec` with its config and log in this fixture's directory.
    pub fn gateway(&self, spec: &GatewaySpec) -> GatewayProcess {
        GatewayProcess::start(self.dir.path(), spec)
    }
}

/// A response header as text, if present.
pub fn header(resp: &reqwest::Response, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .map(|v| v.to_str().expect("header is visible ASCII").to_owned())
}
