//! Real Redis for the tests: a private `redis-server`, or a Redis Cluster, on free loopback
//! ports (used by the end-to-end tests and by `proxy/tests/store_behaviour.rs`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::{free_addr, listens_within, wait_for_listener, Process};

/// A private `redis-server` on a free loopback port, with persistence off; killed on drop.
pub struct RedisServer {
    pub addr: SocketAddr,
    pub process: Process,
    /// What every `redis-cli` call to it carries: TLS files, a user and password.
    cli_args: Vec<String>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        Self::start_at(free_addr())
    }

    /// Starts (or restarts, after a kill) a server on a given address.
    pub fn start_at(addr: SocketAddr) -> RedisServer {
        Self::start_with(addr, &[])
    }

    /// Starts a server with more settings (`["--maxmemory", "4mb"]`).
    pub fn start_with(addr: SocketAddr, settings: &[&str]) -> RedisServer {
        Self::start_custom(addr, settings, &[])
    }

    /// Starts a server with more settings (TLS only, ACL users, replication) whose `redis-cli`
    /// calls carry `cli_args` (`["--tls", "--cacert", …]`, `["--user", …, "--pass", …]`).
    pub fn start_custom(addr: SocketAddr, settings: &[&str], cli_args: &[&str]) -> RedisServer {
        let process = Process::spawn(
            "redis-server",
            Command::new(redis_server_path())
                .args(["--port", &addr.port().to_string()])
                .args(["--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .args(["--loglevel", "warning"])
                .args(settings)
                .stdout(Stdio::null()),
        );
        wait_for_listener(addr, Duration::from_secs(10));
        RedisServer {
            addr,
            process,
            cli_args: cli_args.iter().map(|a| (*a).to_owned()).collect(),
        }
    }

    /// A server whose user may not run functions (`FCALL`, `FUNCTION`): as an ACL from before
    /// the gateway used them, or a Redis before 7.0, leaves a node.
    pub fn start_without_functions() -> RedisServer {
        Self::start_with(
            free_addr(),
            &[
                "--user",
                "default",
                "on",
                "nopass",
                "~*",
                "&*",
                "+@all",
                "-fcall",
                "-function",
            ],
        )
    }

    pub fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// Runs one command with `redis-cli`; returns its output, failing the test if it cannot run.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = redis_cli()
            .args(["-p", &self.addr.port().to_string()])
            .args(&self.cli_args)
            .arg("--no-auth-warning")
            .args(args)
            .output()
            .expect("redis-cli runs");
        assert!(out.status.success(), "redis-cli {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
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
    dir: tempfile::TempDir,
}

/// How long a node may go unanswered before the others count it as failing: short, for quick
/// failovers, but not so short that a node starved of CPU on a loaded test machine is taken for
/// dead, or that one slow master makes an election round (two node timeouts) miss its votes.
const NODE_TIMEOUT_MS: &str = "2000";

impl RedisCluster {
    pub fn start(masters: usize, replicas: usize) -> RedisCluster {
        let dir = tempfile::tempdir().expect("cluster dir");
        let mut nodes = Vec::new();
        for _ in 0..masters * (1 + replicas) {
            let addr = free_addr();
            let port = addr.port().to_string();
            // A bus port of its own rather than the default port + 10,000, which may be taken
            // (or, past 55535, not a port at all).
            let bus_port = free_addr().port().to_string();
            let process = Process::spawn(
                "redis-server (cluster)",
                Command::new(redis_server_path())
                    .args(["--port", &port, "--bind", "127.0.0.1"])
                    .args(["--cluster-enabled", "yes", "--cluster-port", &bus_port])
                    .arg("--cluster-config-file")
                    .arg(dir.path().join(format!("nodes-{port}.conf")))
                    .args(["--cluster-node-timeout", NODE_TIMEOUT_MS])
                    // Sync replicas at once (the default waits 5 s to batch them): a replica
                    // that never synced cannot take over.
                    .args(["--repl-diskless-sync-delay", "0"])
                    // Promote a replica however long ago it last heard from its master: by
                    // default a replica rules itself out some ten node timeouts after its master
                    // went silent, so a takeover delayed that long by failed election rounds
                    // would never come.
                    .args(["--cluster-replica-validity-factor", "0"])
                    .args(["--save", "", "--appendonly", "no", "--loglevel", "notice"])
                    .arg("--dir")
                    .arg(dir.path())
                    // Each node's log, read back by `describe` when a test fails.
                    .arg("--logfile")
                    .arg(Self::log_path(dir.path(), addr))
                    .stdout(Stdio::null()),
            );
            nodes.push((addr, Some(process)));
        }
        let cluster = RedisCluster { nodes, dir };
        for (addr, _) in &cluster.nodes {
            if !listens_within(*addr, Duration::from_secs(10)) {
                panic!("a cluster node did not start\n{}", cluster.describe());
            }
        }
        let out = redis_cli()
            .arg("--cluster")
            .arg("create")
            .args(cluster.nodes.iter().map(|(a, _)| a.to_string()))
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
        cluster.wait_ok(Duration::from_secs(20));
        cluster
    }

    fn log_path(dir: &std::path::Path, addr: SocketAddr) -> PathBuf {
        dir.join(format!("node-{}.log", addr.port()))
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
                "cluster not ok within {timeout:?}\n{}",
                self.describe()
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

    /// The address of the master serving `key`'s slot, as the first live node that answers
    /// sees it; none during a failover, or when no node answers.
    pub fn master_of(&self, key: &str) -> Option<SocketAddr> {
        self.nodes
            .iter()
            .filter(|(_, p)| p.is_some())
            .find_map(|(addr, _)| {
                let slot: u16 = self
                    .cli(*addr, &["cluster", "keyslot", key])
                    .trim()
                    .parse()
                    .ok()?;
                master_of_slot(&self.cli(*addr, &["cluster", "nodes"]), slot)
            })
    }

    /// Waits until a master other than `old` serves `key`'s slot and the cluster is whole again,
    /// panicking with every node's view and log when it does not happen within `timeout`.
    pub fn wait_failover(&self, key: &str, old: SocketAddr, timeout: Duration) -> SocketAddr {
        let deadline = Instant::now() + timeout;
        loop {
            match self.master_of(key) {
                Some(new) if new != old => {
                    self.wait_ok(Duration::from_secs(20));
                    return new;
                }
                _ => {}
            }
            assert!(
                Instant::now() < deadline,
                "no replica took over from {old} within {timeout:?}\n{}",
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Every live node's view of the cluster and of its replication, and what every node (a
    /// killed one's too) logged about failures and elections: what a failed cluster test
    /// prints so the next reader can see why.
    pub fn describe(&self) -> String {
        const TOLD: [&str; 10] = [
            "FAIL",
            "fail",
            "lection",
            "epoch",
            "Epoch",
            "vote",
            "Cluster state",
            "promot",
            "ailover",
            "# ",
        ];
        let mut out = String::new();
        for (addr, process) in &self.nodes {
            if process.is_some() {
                out += &format!("--- {addr}: cluster nodes, cluster info, info replication\n");
                out += &self.cli(*addr, &["cluster", "nodes"]);
                for (section, args) in [
                    ("cluster", ["cluster", "info"]),
                    ("info", ["info", "replication"]),
                ] {
                    let text = self.cli(*addr, &args);
                    let lines: Vec<&str> = text
                        .lines()
                        .filter(|l| {
                            section == "info"
                                || l.starts_with("cluster_state")
                                || l.contains("epoch")
                        })
                        .filter(|l| !l.is_empty() && !l.starts_with('#'))
                        .collect();
                    out += &lines.join(" ");
                    out.push('\n');
                }
            }
            let text =
                std::fs::read_to_string(Self::log_path(self.dir.path(), *addr)).unwrap_or_default();
            let told: Vec<&str> = text
                .lines()
                .filter(|l| TOLD.iter().any(|t| l.contains(t)))
                .collect();
            out += &format!("--- {addr}: its log on failures and elections\n");
            for line in &told[told.len().saturating_sub(40)..] {
                out += line;
                out.push('\n');
            }
        }
        out
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

/// Who serves `slot` in a `cluster nodes` listing: the master, not failing or possibly failing,
/// with an address, whose ranges hold it.
fn master_of_slot(listing: &str, slot: u16) -> Option<SocketAddr> {
    listing.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let flags = *fields.get(2)?;
        if fields.len() < 9
            || !flags.split(',').any(|f| f == "master")
            || flags.contains("fail")
            || flags.contains("noaddr")
        {
            return None;
        }
        let serves = fields[8..].iter().any(|range| match range.split_once('-') {
            Some((a, b)) => {
                a.parse::<u16>().is_ok_and(|a| a <= slot)
                    && b.parse::<u16>().is_ok_and(|b| slot <= b)
            }
            None => range.parse::<u16>() == Ok(slot),
        });
        let host_port = fields[1].split('@').next()?;
        serves.then(|| host_port.parse().ok()).flatten()
    })
}

/// Redis exactly as `deploy/redis/redis.conf` ships it (AOF on, no eviction, ACL users written by
/// `deploy/redis/acl-users`), with only what a test must change given on the command line: the
/// port, the data directory, where the ACL file and the log are. Restartable on the same data.
pub struct ShippedRedis {
    pub addr: SocketAddr,
    pub dir: tempfile::TempDir,
    prefix: String,
    process: Option<Process>,
}

/// The users `deploy/redis/acl-users` defines.
pub const REDIS_USERS: [&str; 3] = ["default", "gateway", "admin"];

impl ShippedRedis {
    /// A server for the environment whose `key_prefix` is `prefix`.
    pub fn start(prefix: &str) -> ShippedRedis {
        let dir = tempfile::tempdir().expect("redis dir");
        let mut args = vec!["--prefix".to_owned(), prefix.to_owned()];
        for user in REDIS_USERS {
            let file = dir.path().join(format!("{user}.password"));
            std::fs::write(&file, format!("{}\n", Self::password_of(user, dir.path())))
                .expect("password file");
            args.push(format!("--{user}-password-file"));
            args.push(file.display().to_string());
        }
        let out = Command::new(repo_root().join("deploy/redis/acl-users"))
            .args(&args)
            .output()
            .expect("run deploy/redis/acl-users");
        assert!(out.status.success(), "acl-users: {out:?}");
        std::fs::write(dir.path().join("users.acl"), &out.stdout).expect("users.acl");
        let mut redis = ShippedRedis {
            addr: free_addr(),
            dir,
            prefix: prefix.to_owned(),
            process: None,
        };
        redis.restart();
        redis
    }

    /// A password per user and server, URL-safe, in the test's own directory's name.
    fn password_of(user: &str, dir: &std::path::Path) -> String {
        let salt: String = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .collect();
        format!("{user}-{salt}-0123456789abcdef")
    }

    /// `user`'s password.
    pub fn password(&self, user: &str) -> String {
        Self::password_of(user, self.dir.path())
    }

    /// `redis://user:password@addr/`.
    pub fn url(&self, user: &str) -> String {
        format!(
            "redis://{user}:{}@{}/",
            Self::password_of(user, self.dir.path()),
            self.addr
        )
    }

    /// Starts the server (again) on its data directory.
    pub fn restart(&mut self) {
        assert!(self.process.is_none(), "already running");
        let dir = self.dir.path();
        let process = Process::spawn(
            "redis-server (shipped config)",
            Command::new(redis_server_path())
                .arg(repo_root().join("deploy/redis/redis.conf"))
                .args(["--port", &self.addr.port().to_string()])
                .args(["--bind", "127.0.0.1"])
                .arg("--dir")
                .arg(dir)
                .arg("--aclfile")
                .arg(dir.join("users.acl"))
                .arg("--logfile")
                .arg(dir.join("redis.log"))
                .stdout(Stdio::null()),
        );
        wait_for_listener(self.addr, Duration::from_secs(10));
        // Listening comes before the AOF is loaded; PING answers LOADING until it is.
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.cli(&["PING"]) != "PONG" {
            assert!(Instant::now() < deadline, "redis never finished loading");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.process = Some(process);
    }

    /// SIGTERM, as `systemctl stop` does, and waits for the exit (Redis flushes the AOF).
    pub fn terminate(&mut self) {
        let process = self.process.take().expect("running");
        process.signal(15);
        assert_eq!(process.wait_exit(Duration::from_secs(10)), Some(0));
    }

    /// SIGKILL, as a crash or the OOM killer would.
    pub fn kill(&mut self) {
        self.process.take().expect("running").kill_hard();
    }

    /// One command as the default user (the operator's).
    pub fn cli(&self, args: &[&str]) -> String {
        self.cli_as("default", args)
    }

    /// One command as `user`; a refusal comes back as its error text.
    pub fn cli_as(&self, user: &str, args: &[&str]) -> String {
        let out = redis_cli()
            .args(["-p", &self.addr.port().to_string(), "--user", user])
            .env("REDISCLI_AUTH", Self::password_of(user, self.dir.path()))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The server's log, across restarts.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }

    /// The registry's hash of key records.
    pub fn registry_records(&self) -> String {
        format!("{}:{{registry}}:keys", self.prefix)
    }
}

/// The repository's root (this crate is `tests/`), read when the test runs: `cargo test` and
/// `cargo nextest` set `CARGO_MANIFEST_DIR` for it. Never `env!`: the build cache serves a test
/// binary built in another clone, and a path compiled in would read that clone's files.
pub fn repo_root() -> PathBuf {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .expect("CARGO_MANIFEST_DIR: run the tests through cargo test or cargo nextest");
    PathBuf::from(manifest)
        .parent()
        .expect("tests/ is inside the repository")
        .to_owned()
}

/// From `INFO commandstats` output: `command`'s calls and how many of them failed
/// (`(0, 0)` when it never ran).
pub fn command_calls(stats: &str, command: &str) -> (u64, u64) {
    let field = |line: &str, name: &str| -> u64 {
        line.split([':', ','])
            .find_map(|f| f.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
            .unwrap_or(0)
    };
    let prefix = format!("cmdstat_{command}:");
    stats
        .lines()
        .find(|l| l.starts_with(&prefix))
        .map(|l| (field(l, "calls"), field(l, "failed_calls")))
        .unwrap_or((0, 0))
}
