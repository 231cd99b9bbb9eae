//! The harness the end-to-end tests share: locating the workspace's binaries, picking free
//! loopback ports, and child processes that are killed when the test lets go of them, so a
//! failing test never leaves a server behind.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Path of a binary of this workspace, built by the same `cargo test`/`cargo nextest` run
/// (the test command builds every binary first).
pub fn bin_path(name: &str) -> PathBuf {
    // Test executables live in target/<profile>/deps; the binaries one level up.
    let exe = std::env::current_exe().expect("the test executable has a path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executable is inside target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the workspace's binaries first (`cargo build --workspace --bins`)",
        path.display()
    );
    path
}

/// A loopback address nobody listens on at the moment of asking.
pub fn free_addr() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral loopback port");
    l.local_addr().expect("local address of a bound socket")
}

/// Waits until something accepts connections on `addr`.
pub fn wait_for_listener(addr: SocketAddr, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        assert!(
            Instant::now() < deadline,
            "nothing listens on {addr} after {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A child process that is killed (SIGKILL) and reaped when dropped.
pub struct Process {
    child: Option<Child>,
    name: String,
}

impl Process {
    pub fn spawn(name: &str, cmd: &mut Command) -> Process {
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Process {
            child: Some(child),
            name: name.to_owned(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or_default()
    }

    /// SIGKILL, as a crash or the OOM killer would: no chance to flush or clean up.
    pub fn kill_hard(mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends a signal by number (15 = SIGTERM) through the `kill` utility.
    pub fn signal(&self, signal: i32) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} {} failed", self.name);
    }

    /// Waits for the process to exit on its own and returns its exit code.
    pub fn wait_exit(mut self, timeout: Duration) -> Option<i32> {
        let mut child = self.child.take().expect("process still owned");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait().expect("poll child") {
                return status.code();
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{} did not exit within {timeout:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A running `pet-backend` on a free port with its database at `db`.
pub struct Backend {
    pub addr: SocketAddr,
    pub process: Process,
}

impl Backend {
    pub fn start(db: &Path) -> Backend {
        Self::start_at(free_addr(), db)
    }

    pub fn start_at(addr: SocketAddr, db: &Path) -> Backend {
        let process = Process::spawn(
            "pet-backend",
            Command::new(bin_path("pet-backend"))
                .arg("--listen")
                .arg(addr.to_string())
                .arg("--db")
                .arg(db)
                .env("RUST_LOG", "warn"),
        );
        wait_for_listener(addr, Duration::from_secs(10));
        Backend { addr, process }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// A private `redis-server` on a free loopback port, with persistence off; killed on drop.
pub struct RedisServer {
    pub addr: SocketAddr,
    pub process: Process,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        Self::start_at(free_addr())
    }

    /// Starts (or restarts, after a kill) a server on a given address.
    pub fn start_at(addr: SocketAddr) -> RedisServer {
        let process = Process::spawn(
            "redis-server",
            Command::new(redis_server_path())
                .args(["--port", &addr.port().to_string()])
                .args(["--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .args(["--loglevel", "warning"])
                .stdout(Stdio::null()),
        );
        wait_for_listener(addr, Duration::from_secs(10));
        RedisServer { addr, process }
    }

    pub fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }
}

fn redis_server_path() -> PathBuf {
    for dir in std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
    {
        let candidate = dir.join("redis-server");
        if candidate.exists() {
            return candidate;
        }
    }
    panic!("redis-server is not installed: run scripts/test, which installs it, or `apt-get install redis-server`")
}

/// Sleeps, if needed, so that at least `margin` seconds remain in the current UTC minute: tests
/// that count within one minute window must not straddle two.
pub fn fresh_minute(margin: Duration) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970");
    let into_minute = Duration::from_millis((now.as_millis() % 60_000) as u64);
    let left = Duration::from_secs(60) - into_minute;
    if left < margin {
        std::thread::sleep(left + Duration::from_millis(50));
    }
}

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
    let out = gateway_cli(&[
        "keys",
        "issue",
        "--keys-file",
        &keys_file.to_string_lossy(),
        "--plans-dir",
        &plans_dir.to_string_lossy(),
        "--plan",
        plan,
    ]);
    assert!(
        out.status.success(),
        "keys issue failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout.lines().last().expect("a key line").trim().to_owned()
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
        let addr = free_addr();
        let admin = free_addr();
        let upstreams: Vec<String> = spec.upstreams.iter().map(|u| format!("\"{u}\"")).collect();
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
        toml.push_str(&spec.extra);
        let config = dir.join(format!("gateway-{}.toml", addr.port()));
        std::fs::write(&config, toml).expect("write gateway config");
        let log = dir.join(format!("gateway-{}.log", addr.port()));
        let log_file = std::fs::File::create(&log).expect("gateway log file");
        let process = Process::spawn(
            "pet-gateway",
            Command::new(bin_path("pet-gateway"))
                .arg("serve")
                .arg("--config")
                .arg(&config)
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(log_file),
        );
        wait_for_listener(addr, Duration::from_secs(10));
        GatewayProcess {
            addr,
            admin,
            log,
            config,
            process,
        }
    }

    /// Starts a second gateway on this one's config with `--upgrade`: it waits to receive the
    /// listening sockets, which the running one hands over on SIGQUIT.
    pub fn start_upgrade(&self) -> GatewayProcess {
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

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// An upstream that answers every request with 200 and the request's head as the body, so tests
/// can see exactly what the gateway forwarded. Thread per connection, keep-alive.
pub struct EchoUpstream {
    pub addr: SocketAddr,
}

impl EchoUpstream {
    pub fn start() -> EchoUpstream {
        Self::start_with_delay(Duration::ZERO)
    }

    /// Like `start`, but every answer waits `delay` first: an in-flight request to hold open.
    pub fn start_with_delay(delay: Duration) -> EchoUpstream {
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind echo upstream");
        let addr = listener.local_addr().expect("addr");
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
                    let mut writer = stream;
                    loop {
                        let mut head = String::new();
                        let mut length = 0usize;
                        loop {
                            let mut line = String::new();
                            match reader.read_line(&mut line) {
                                Ok(0) | Err(_) => return,
                                Ok(_) => {}
                            }
                            if let Some(v) =
                                line.to_ascii_lowercase().strip_prefix("content-length:")
                            {
                                length = v.trim().parse().unwrap_or(0);
                            }
                            if line == "\r\n" {
                                break;
                            }
                            head.push_str(&line);
                        }
                        let mut body = vec![0u8; length];
                        if reader.read_exact(&mut body).is_err() {
                            return;
                        }
                        std::thread::sleep(delay);
                        let response = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{head}",
                            head.len()
                        );
                        if writer.write_all(response.as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        EchoUpstream { addr }
    }
}

/// An upstream that accepts connections and reads requests but never answers: a hung backend.
pub struct SilentUpstream {
    pub addr: SocketAddr,
}

impl SilentUpstream {
    pub fn start() -> SilentUpstream {
        use std::io::Read;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind silent upstream");
        let addr = listener.local_addr().expect("addr");
        std::thread::spawn(move || {
            for mut stream in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut sink = [0u8; 4096];
                    // Read until the gateway gives up and closes; never write.
                    while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
                });
            }
        });
        SilentUpstream { addr }
    }
}

/// A throw-away certificate authority and a server certificate it signed for `localhost` and
/// `127.0.0.1`, written as PEM files.
pub struct TestCert {
    pub ca_der: Vec<u8>,
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCert {
    pub fn generate(ca_name: &str) -> TestCert {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, ca_name);
        let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");
        let key = KeyPair::generate().expect("server key");
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params
            .subject_alt_names
            .push(SanType::IpAddress(std::net::IpAddr::from([127, 0, 0, 1])));
        let cert = params
            .signed_by(&key, &Issuer::from_params(&ca, &ca_key))
            .expect("server certificate");
        TestCert {
            ca_der: ca_cert.der().to_vec(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    pub fn write(&self, cert: &Path, key: &Path) {
        std::fs::write(cert, &self.cert_pem).expect("write certificate");
        std::fs::write(key, &self.key_pem).expect("write key");
    }

    /// An HTTPS client that trusts only this CA and offers only `alpn` (b"h2", b"http/1.1").
    pub fn client(&self, alpn: &[&[u8]]) -> reqwest::Client {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(rustls::pki_types::CertificateDer::from(self.ca_der.clone()))
            .expect("trust the test CA");
        let mut tls = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .build()
            .expect("https client")
    }
}

/// `promtool`, from Debian's `prometheus` package (scripts/test installs it).
pub fn promtool() -> PathBuf {
    for candidate in ["/usr/bin/promtool", "/usr/local/bin/promtool"] {
        if Path::new(candidate).exists() {
            return PathBuf::from(candidate);
        }
    }
    panic!("promtool is not installed: run scripts/test, which installs it, or `apt-get install prometheus`")
}

/// `redis-cli`, from Debian's `redis-tools`.
pub fn redis_cli() -> Command {
    Command::new(
        redis_server_path()
            .parent()
            .map(|d| d.join("redis-cli"))
            .filter(|p| p.exists())
            .unwrap_or_else(|| PathBuf::from("redis-cli")),
    )
}

/// A local Redis Cluster: `masters` masters with `replicas` replicas each, on free loopback
/// ports, created with `redis-cli --cluster create`. A short node timeout makes failovers quick.
pub struct RedisCluster {
    pub nodes: Vec<(SocketAddr, Option<Process>)>,
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    pub fn start(masters: usize, replicas: usize) -> RedisCluster {
        let dir = tempfile::tempdir().expect("cluster dir");
        let mut nodes = Vec::new();
        for _ in 0..masters * (1 + replicas) {
            let addr = free_addr();
            let port = addr.port().to_string();
            let process = Process::spawn(
                "redis-server (cluster)",
                Command::new(redis_server_path())
                    .args(["--port", &port, "--bind", "127.0.0.1"])
                    .args(["--cluster-enabled", "yes"])
                    .arg("--cluster-config-file")
                    .arg(dir.path().join(format!("nodes-{port}.conf")))
                    .args(["--cluster-node-timeout", "1000"])
                    // Sync replicas at once (the default waits 5 s to batch them): a replica
                    // that never synced cannot take over.
                    .args(["--repl-diskless-sync-delay", "0"])
                    .args(["--save", "", "--appendonly", "no", "--loglevel", "warning"])
                    .arg("--dir")
                    .arg(dir.path())
                    .stdout(Stdio::null()),
            );
            nodes.push((addr, Some(process)));
        }
        for (addr, _) in &nodes {
            wait_for_listener(*addr, Duration::from_secs(10));
        }
        let out = redis_cli()
            .arg("--cluster")
            .arg("create")
            .args(nodes.iter().map(|(a, _)| a.to_string()))
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster { nodes, _dir: dir };
        cluster.wait_ok(Duration::from_secs(20));
        cluster
    }

    /// Waits until every live node reports `cluster_state:ok` and every live replica is in sync
    /// with its master.
    pub fn wait_ok(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let all_ok = self
                .nodes
                .iter()
                .filter(|(_, p)| p.is_some())
                .all(|(addr, _)| {
                    let replication = self.cli(*addr, &["info", "replication"]);
                    self.cli(*addr, &["cluster", "info"])
                        .contains("cluster_state:ok")
                        && (replication.contains("role:master")
                            || replication.contains("master_link_status:up"))
                });
            if all_ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "cluster not ok within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn cli(&self, addr: SocketAddr, args: &[&str]) -> String {
        let out = redis_cli()
            .args(["-h", "127.0.0.1", "-p", &addr.port().to_string()])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `redis+cluster://` URL naming every node.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(|(a, _)| a.to_string()).collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// The address of the master serving `key`'s slot, if one does (not during a failover).
    pub fn master_of(&self, key: &str) -> Option<SocketAddr> {
        let (first, _) = self
            .nodes
            .iter()
            .find(|(_, p)| p.is_some())
            .expect("a live node");
        let slot: u16 = self
            .cli(*first, &["cluster", "keyslot", key])
            .trim()
            .parse()
            .expect("slot number");
        for line in self.cli(*first, &["cluster", "nodes"]).lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 9 || !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let serves = fields[8..].iter().any(|range| match range.split_once('-') {
                Some((a, b)) => {
                    a.parse::<u16>().is_ok_and(|a| a <= slot)
                        && b.parse::<u16>().is_ok_and(|b| slot <= b)
                }
                None => range.parse::<u16>() == Ok(slot),
            });
            if serves {
                let host_port = fields[1].split('@').next().expect("address");
                return Some(host_port.parse().expect("node address"));
            }
        }
        None
    }

    /// SIGKILLs the node at `addr`.
    pub fn kill(&mut self, addr: SocketAddr) {
        let node = self
            .nodes
            .iter_mut()
            .find(|(a, _)| *a == addr)
            .expect("a node of this cluster");
        if let Some(p) = node.1.take() {
            p.kill_hard();
        }
    }
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

/// What most gateway tests start from: a temporary directory with a plans directory holding the
/// plan `free` at the given limits, and the path of a (not yet written) keys file.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub plans: PathBuf,
    pub keys: PathBuf,
}

impl Fixture {
    pub fn new(per_minute: u64, per_day: u64) -> Fixture {
        let dir = tempfile::tempdir().expect("temp dir");
        let plans = dir.path().join("plans");
        write_plan(&plans, "free", per_minute, per_day);
        let keys = dir.path().join("keys.toml");
        Fixture { dir, plans, keys }
    }

    /// Issues a key on `plan` through the real CLI.
    pub fn issue(&self, plan: &str) -> String {
        issue_key(&self.keys, &self.plans, plan)
    }
}
