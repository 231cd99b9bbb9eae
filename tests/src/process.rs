//! Processes of the tests: locating the workspace's binaries and the system's tools, free
//! loopback ports, and child processes that are killed when the test lets go of them, so a
//! failing test never leaves a server behind.

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};
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

/// Where test ports are picked: below the kernel's ephemeral range (from 32768), so no other
/// process's `bind(0)` or outgoing connection is handed a port a test was given, and below
/// 20000 so a Redis Cluster node's bus port (its port + 10000) stays out of both.
const TEST_PORTS: std::ops::Range<u16> = 10_000..20_000;

/// A loopback address nobody listens on at the moment of asking, and given to no other test
/// process running now nor before by this one. Picked from [`TEST_PORTS`] and held by a lock on
/// `<tmp>/pet-e2e-ports/<port>` while this process lives: nextest runs tests in processes of
/// their own, and a port one of them was given (its gateway's admin port, say, bound a moment
/// later by the gateway) must not be handed to another meanwhile.
pub fn free_addr() -> SocketAddr {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    static HELD: Mutex<Vec<std::fs::File>> = Mutex::new(Vec::new());
    let dir = std::env::temp_dir().join("pet-e2e-ports");
    std::fs::create_dir_all(&dir).expect("make the test ports' lock folder");
    let span = u64::from(TEST_PORTS.end - TEST_PORTS.start);
    for n in 0..5_000u64 {
        let port = TEST_PORTS.start + u16::try_from(pick(n) % span).expect("within the span");
        let mut given = GIVEN.lock().unwrap_or_else(PoisonError::into_inner);
        if given.contains(&port) {
            continue;
        }
        let Ok(lock) = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(port.to_string()))
        else {
            continue;
        };
        if lock.try_lock().is_err() || TcpListener::bind(("127.0.0.1", port)).is_err() {
            continue;
        }
        given.insert(port);
        HELD.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(lock);
        return SocketAddr::from(([127, 0, 0, 1], port));
    }
    panic!("no free test port in {TEST_PORTS:?} after 5,000 picks");
}

/// A number that differs between picks and between processes (no random crate here).
fn pick(n: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(n);
    h.write_u32(std::process::id());
    h.finish()
}

/// Waits until something accepts connections on `addr`.
pub fn wait_for_listener(addr: SocketAddr, timeout: Duration) {
    assert!(
        listens_within(addr, timeout),
        "nothing listens on {addr} after {timeout:?}"
    );
}

/// Whether something accepts connections on `addr` within `timeout`.
pub fn listens_within(addr: SocketAddr, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
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
    /// Its stderr (the access log at `info`), when started by [`Backend::start_logged`].
    pub log: Option<PathBuf>,
}

impl Backend {
    pub fn start(db: &Path) -> Backend {
        Self::start_at(free_addr(), db)
    }

    pub fn start_at(addr: SocketAddr, db: &Path) -> Backend {
        Self::start_with(addr, db, &[])
    }

    /// With further command-line arguments.
    pub fn start_with(addr: SocketAddr, db: &Path, args: &[&str]) -> Backend {
        Self::spawn(addr, db, args, None)
    }

    /// With its access log (`RUST_LOG=info`) written to `log`.
    pub fn start_logged(db: &Path, log: &Path) -> Backend {
        Self::spawn(free_addr(), db, &[], Some(log))
    }

    fn spawn(addr: SocketAddr, db: &Path, args: &[&str], log: Option<&Path>) -> Backend {
        let mut cmd = Command::new(bin_path("pet-backend"));
        cmd.arg("--listen")
            .arg(addr.to_string())
            .arg("--db")
            .arg(db)
            .args(args);
        match log {
            Some(path) => {
                let file = std::fs::File::create(path).expect("backend log file");
                cmd.env("RUST_LOG", "info").stderr(file);
            }
            None => {
                cmd.env("RUST_LOG", "warn");
            }
        }
        let process = Process::spawn("pet-backend", &mut cmd);
        wait_for_listener(addr, Duration::from_secs(10));
        Backend {
            addr,
            process,
            log: log.map(Path::to_owned),
        }
    }

    pub fn log_text(&self) -> String {
        self.log
            .as_deref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// The `prometheus` server, from Debian's `prometheus` package (scripts/test installs it).
pub fn prometheus_server() -> PathBuf {
    for candidate in ["/usr/bin/prometheus", "/usr/local/bin/prometheus"] {
        if Path::new(candidate).exists() {
            return PathBuf::from(candidate);
        }
    }
    panic!("prometheus is not installed: run scripts/test, which installs it, or `apt-get install prometheus`")
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

/// Puts every thread of this test process (and so the processes it starts next, which inherit
/// it) ahead of the machine's other work: nice -10, where the user may (root, as CI is). For a
/// test whose subject is latency (a controller that reads it, a deadline of a few ms): a CPU hog
/// beside the run adds its own to every hop, which the subject rightly reads as load. Returns
/// whether it took; a user who may not raise a priority runs the test as it is.
pub fn ahead_of_the_machine() -> bool {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return false;
    };
    let mut all = true;
    for task in tasks.flatten() {
        let tid = task.file_name();
        let raised = Command::new("renice")
            .args(["-n", "-10", "-p"])
            .arg(&tid)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        all &= raised;
    }
    all
}
