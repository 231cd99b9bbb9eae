//! A real browser for the console tests: Debian's headless Chromium driven by its
//! `chromedriver` over the W3C WebDriver protocol (JSON over HTTP, a few calls spoken here with
//! reqwest rather than a client crate), on a free loopback port, gone with the test.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::process::{free_addr, wait_for_listener, Process};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

pub struct Browser {
    http: reqwest::Client,
    /// `http://127.0.0.1:<port>/session/<id>`.
    session: String,
    /// Where chromedriver listens, and the session's id: the session is ended when dropped,
    /// which closes Chromium (killing chromedriver alone would leave it running).
    driver_addr: std::net::SocketAddr,
    session_id: String,
    _profile: tempfile::TempDir,
    _driver: Process,
}

impl Browser {
    /// A headless Chromium `width` pixels wide.
    pub async fn start(width: u32) -> Browser {
        let addr = free_addr();
        let driver = Process::spawn(
            "chromedriver",
            Command::new("chromedriver")
                .arg(format!("--port={}", addr.port()))
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
        wait_for_listener(addr, Duration::from_secs(20));
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("an HTTP client");
        let profile = tempfile::tempdir().expect("a profile folder");
        let mut options = json!({
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", format!("--window-size={width},900"),
                     format!("--user-data-dir={}", profile.path().display())],
        });
        // Headless Chromium keeps a window at least 500 pixels wide: a phone's width is a
        // viewport of that width, emulated (what a phone's browser lays out in).
        if width < 500 {
            options["mobileEmulation"] = json!({
                "deviceMetrics": {"width": width, "height": 844, "pixelRatio": 1.0},
            });
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": options,
        }}});
        let base = format!("http://{addr}");
        let created: Value = http
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .expect("chromedriver answers")
            .json()
            .await
            .expect("a session");
        let id = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {created}"))
            .to_owned();
        Browser {
            http,
            session: format!("{base}/session/{id}"),
            driver_addr: addr,
            session_id: id,
            _profile: profile,
            _driver: driver,
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut req = self.http.request(method, format!("{}{path}", self.session));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let v: Value = req
            .send()
            .await
            .expect("chromedriver answers")
            .json()
            .await
            .expect("JSON");
        v["value"].clone()
    }

    /// As [`Browser::call`], failing the test on a WebDriver error (a click that did not land
    /// must not pass silently).
    async fn must(&self, path: &str, body: Value) -> Value {
        let v = self.post(path, body).await;
        if let Some(e) = v.get("error") {
            panic!("WebDriver {path}: {e}: {}", v["message"]);
        }
        v
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    pub async fn goto(&self, url: &str) {
        self.post("/url", json!({ "url": url })).await;
    }

    /// Runs `script` (a function body) with `args`; its return value.
    pub async fn run(&self, script: &str, args: Value) -> Value {
        self.post("/execute/sync", json!({ "script": script, "args": args }))
            .await
    }

    /// The first element matching `css`, waited for up to 10 s.
    pub async fn find(&self, css: &str) -> String {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let v = self
                .post("/element", json!({"using": "css selector", "value": css}))
                .await;
            if let Some(id) = v[ELEMENT].as_str() {
                return id.to_owned();
            }
            assert!(Instant::now() < until, "no element `{css}` appeared: {v}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits up to 10 s for `css`'s text to contain `text`; the text.
    pub async fn wait_text(&self, css: &str, text: &str) -> String {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let got = self.text_of(css).await;
            if got.contains(text) {
                return got;
            }
            assert!(
                Instant::now() < until,
                "`{css}` never said `{text}`; it says `{got}`"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The visible text of every element matching `css`, joined (empty when there is none).
    pub async fn text_of(&self, css: &str) -> String {
        self.run(
            "return [...document.querySelectorAll(arguments[0])].map(e => e.innerText).join('\\n');",
            json!([css]),
        )
        .await
        .as_str()
        .unwrap_or_default()
        .to_owned()
    }

    pub async fn click(&self, css: &str) {
        let id = self.find(css).await;
        self.must(&format!("/element/{id}/click"), json!({})).await;
    }

    pub async fn type_into(&self, css: &str, text: &str) {
        let id = self.find(css).await;
        self.must(&format!("/element/{id}/clear"), json!({})).await;
        self.must(&format!("/element/{id}/value"), json!({ "text": text }))
            .await;
    }

    /// Types `text` as key presses on whatever has focus (`\u{E004}` is Tab, `\u{E007}` Enter):
    /// the keyboard alone.
    pub async fn keys(&self, text: &str) {
        let actions: Vec<Value> = text
            .chars()
            .flat_map(|c| {
                let k = c.to_string();
                [
                    json!({"type": "keyDown", "value": k}),
                    json!({"type": "keyUp", "value": k}),
                ]
            })
            .collect();
        self.post(
            "/actions",
            json!({"actions": [{"type": "key", "id": "keyboard", "actions": actions}]}),
        )
        .await;
    }

    /// The text of an open `confirm`/`alert`, if one is open.
    pub async fn dialog(&self) -> Option<String> {
        let v = self.call(reqwest::Method::GET, "/alert/text", None).await;
        v.as_str().map(str::to_owned)
    }

    /// Accepts the open dialog, waited for up to 5 s; its text.
    pub async fn accept(&self) -> String {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(text) = self.dialog().await {
                self.post("/alert/accept", json!({})).await;
                return text;
            }
            assert!(Instant::now() < until, "no dialog opened");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A PNG of the window, written to `path`.
    pub async fn screenshot(&self, path: &std::path::Path) {
        use base64::Engine;
        let v = self.call(reqwest::Method::GET, "/screenshot", None).await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(v.as_str().expect("a screenshot"))
            .expect("base64");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("screenshot folder");
        }
        std::fs::write(path, png).expect("screenshot written");
    }
}

impl Drop for Browser {
    /// Ends the session (Chromium exits), in plain blocking HTTP: a drop cannot await.
    fn drop(&mut self) {
        use std::io::{Read, Write};
        let Ok(mut s) =
            std::net::TcpStream::connect_timeout(&self.driver_addr, Duration::from_secs(2))
        else {
            return;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
        let _ = write!(
            s,
            "DELETE /session/{} HTTP/1.1\r\nHost: {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.session_id, self.driver_addr
        );
        // chromedriver answers once Chromium has quit; it may keep the connection open.
        let mut answer = Vec::new();
        let mut buf = [0u8; 1024];
        while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
    }
}
