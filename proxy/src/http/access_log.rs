//! The access log line, the same fields and formats as `tracing`'s text and JSON lines, written
//! fast: formatted on the request's thread into a buffer of that thread's, reused from request
//! to request (integers by `itoa`, the timestamp's date and time made once a second), and
//! handed whole to the log's writer thread ([`crate::base::log_sink`]). Nothing is allocated
//! and no field goes through a `dyn` formatter on the way, where `tracing::info!` cost about
//! 9 µs of a request's CPU (bench/RESULTS.md).

use std::cell::RefCell;
use std::net::SocketAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::base::log_sink::LogSink;
use crate::http::trace::TraceContext;

/// One request's line.
pub struct Line<'a> {
    pub request_id: &'a str,
    pub trace: Option<TraceContext>,
    pub route: &'a str,
    pub key_id: Option<&'a str>,
    pub plan: Option<&'a str>,
    pub auth_failure: Option<&'a str>,
    pub status: u16,
    pub upstream: Option<SocketAddr>,
    pub upstream_us: Option<u64>,
    pub store_us: Option<u64>,
    /// How long it waited for a place at the backend, when it had to.
    pub queue_us: Option<u64>,
    pub duration_us: u64,
    pub store_degraded: bool,
    pub shadow_refused: Option<&'a str>,
    /// Its level when waiting for a place (an authenticated request's).
    pub priority: Option<&'a str>,
    /// Why it was refused to protect the backend: `concurrency` (429), `queue_timeout` or
    /// `queue_full` (503).
    pub overload: Option<&'a str>,
    pub error: Option<&'a str>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
}

thread_local! {
    static BUF: RefCell<Buf> = RefCell::new(Buf::default());
}

#[derive(Default)]
struct Buf {
    line: String,
    /// The second `stamp` is of, and `YYYY-MM-DDTHH:MM:SS` for it.
    second: u64,
    stamp: String,
}

static FORMAT: std::sync::OnceLock<Format> = std::sync::OnceLock::new();

/// The format of every access line of this process (set once, with the sink).
pub fn set_format(format: Format) {
    let _ = FORMAT.set(format);
}

/// Writes `line` to the installed sink; false when there is none (the caller logs through
/// `tracing` then).
pub fn write(line: &Line<'_>) -> bool {
    let Some(sink) = LogSink::installed() else {
        return false;
    };
    let format = FORMAT.get().copied().unwrap_or(Format::Text);
    BUF.with(|b| {
        let mut b = b.borrow_mut();
        let b = &mut *b;
        b.line.clear();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        if b.second != now.as_secs() || b.stamp.is_empty() {
            b.second = now.as_secs();
            b.stamp = crate::base::clock::rfc3339(b.second);
            b.stamp.pop(); // the `Z`
        }
        let mut out = Out {
            s: &mut b.line,
            format,
        };
        out.start(&b.stamp, now.subsec_micros());
        out.fields(line);
        out.end();
        sink.push(b.line.as_bytes());
    });
    true
}

/// A line being written.
struct Out<'a> {
    s: &'a mut String,
    format: Format,
}

impl Out<'_> {
    fn start(&mut self, stamp: &str, micros: u32) {
        let quoted = self.format == Format::Json;
        if quoted {
            self.s.push_str("{\"timestamp\":\"");
        }
        self.s.push_str(stamp);
        self.s.push('.');
        let digits = itoa::Buffer::new().format(micros).len();
        for _ in digits..6 {
            self.s.push('0');
        }
        self.s.push_str(itoa::Buffer::new().format(micros));
        self.s.push('Z');
        match self.format {
            Format::Json => self.s.push_str("\",\"level\":\"INFO\""),
            Format::Text => self.s.push_str("  INFO access:"),
        }
    }

    fn fields(&mut self, l: &Line<'_>) {
        self.shown("request_id", l.request_id);
        if let Some(t) = &l.trace {
            self.hex("trace_id", &t.trace_id);
            self.hex("span_id", &t.span_id);
            if let Some(p) = &t.parent_id {
                self.hex("parent_span_id", p);
            }
        }
        self.text("route", l.route);
        self.opt_text("key_id", l.key_id);
        self.opt_text("plan", l.plan);
        self.opt_text("auth_failure", l.auth_failure);
        self.number("status", u64::from(l.status));
        if let Some(addr) = l.upstream {
            self.address("upstream", addr);
        }
        if let Some(us) = l.upstream_us {
            self.number("upstream_us", us);
        }
        if let Some(us) = l.store_us {
            self.number("store_us", us);
        }
        if let Some(us) = l.queue_us {
            self.number("queue_us", us);
        }
        self.number("duration_us", l.duration_us);
        self.key("store_degraded");
        self.s
            .push_str(if l.store_degraded { "true" } else { "false" });
        self.opt_text("shadow_refused", l.shadow_refused);
        self.opt_text("priority", l.priority);
        self.opt_text("overload", l.overload);
        self.opt_text("error", l.error);
    }

    fn end(&mut self) {
        match self.format {
            Format::Json => self.s.push_str(",\"target\":\"access\"}\n"),
            Format::Text => self.s.push('\n'),
        }
    }

    /// The separator and `name=` (text) or `"name":` (JSON).
    fn key(&mut self, name: &str) {
        match self.format {
            Format::Json => {
                self.s.push_str(",\"");
                self.s.push_str(name);
                self.s.push_str("\":");
            }
            Format::Text => {
                self.s.push(' ');
                self.s.push_str(name);
                self.s.push('=');
            }
        }
    }

    fn number(&mut self, name: &str, n: u64) {
        self.key(name);
        self.s.push_str(itoa::Buffer::new().format(n));
    }

    /// A string shown as it is in text (tracing's `%` fields), quoted in JSON.
    fn shown(&mut self, name: &str, v: &str) {
        self.key(name);
        match self.format {
            Format::Json => self.quoted(v),
            Format::Text => self.s.push_str(v),
        }
    }

    /// A string quoted in both formats (tracing's `&str` fields).
    fn text(&mut self, name: &str, v: &str) {
        self.key(name);
        self.quoted(v);
    }

    fn opt_text(&mut self, name: &str, v: Option<&str>) {
        if let Some(v) = v {
            self.text(name, v);
        }
    }

    fn hex(&mut self, name: &str, bytes: &[u8]) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        self.key(name);
        self.s.push('"');
        for b in bytes {
            self.s.push(char::from(HEX[usize::from(b >> 4)]));
            self.s.push(char::from(HEX[usize::from(b & 15)]));
        }
        self.s.push('"');
    }

    /// An `ip:port` quoted, as `SocketAddr`'s `Display` writes it. IPv4 by hand: through
    /// `fmt` it was 2,300 of the line's 5,300 instructions (bench/instructions.py).
    fn address(&mut self, name: &str, addr: SocketAddr) {
        self.key(name);
        let SocketAddr::V4(v4) = addr else {
            self.s.push('"');
            let _ = std::fmt::Write::write_fmt(&mut self.s, format_args!("{addr}"));
            self.s.push('"');
            return;
        };
        self.s.push('"');
        for (i, octet) in v4.ip().octets().into_iter().enumerate() {
            if i > 0 {
                self.s.push('.');
            }
            self.s.push_str(itoa::Buffer::new().format(octet));
        }
        self.s.push(':');
        self.s.push_str(itoa::Buffer::new().format(v4.port()));
        self.s.push('"');
    }

    /// `"v"`, escaped as JSON (and as `tracing`'s Debug quoting, for what ids and names hold).
    /// Runs that need no escape are copied whole.
    fn quoted(&mut self, v: &str) {
        self.s.push('"');
        let mut from = 0;
        for (i, b) in v.bytes().enumerate() {
            let escape = match b {
                b'"' => "\\\"",
                b'\\' => "\\\\",
                b'\n' => "\\n",
                b'\r' => "\\r",
                b'\t' => "\\t",
                0..=0x1f => "",
                _ => continue,
            };
            // Every byte matched is ASCII, so `i` is a char boundary.
            self.s.push_str(&v[from..i]);
            if escape.is_empty() {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                self.s.push_str("\\u00");
                self.s.push(char::from(HEX[usize::from(b >> 4)]));
                self.s.push(char::from(HEX[usize::from(b & 15)]));
            } else {
                self.s.push_str(escape);
            }
            from = i + 1;
        }
        self.s.push_str(&v[from..]);
        self.s.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Line<'static> {
        Line {
            request_id: "r\"1",
            trace: None,
            route: "listPets",
            key_id: Some("key_ab"),
            plan: Some("free"),
            auth_failure: None,
            status: 200,
            upstream: Some("127.0.0.1:9000".parse().unwrap()),
            upstream_us: Some(120),
            store_us: Some(4),
            queue_us: Some(7),
            duration_us: 300,
            store_degraded: false,
            shadow_refused: Some("10s"),
            priority: Some("normal"),
            overload: None,
            error: None,
        }
    }

    fn render(format: Format) -> String {
        let mut s = String::new();
        let mut out = Out { s: &mut s, format };
        out.start("2026-11-25T08:00:00", 42);
        out.fields(&sample());
        out.end();
        s
    }

    #[test]
    fn addresses_read_as_display_writes_them() {
        for addr in [
            "127.0.0.1:9000",
            "10.255.0.7:65535",
            "0.0.0.0:0",
            "[::1]:8080",
            "[fe80::1]:1",
        ] {
            let addr: SocketAddr = addr.parse().unwrap();
            let mut s = String::new();
            Out {
                s: &mut s,
                format: Format::Json,
            }
            .address("upstream", addr);
            assert_eq!(s, format!(",\"upstream\":\"{addr}\""));
        }
    }

    #[test]
    fn every_string_comes_back_from_its_json_quoting() {
        let mut all_controls: String = (0u8..0x20).map(char::from).collect();
        all_controls.push_str("\"\\ é ✓ \u{7f} end");
        for v in [
            "",
            "plain",
            "a\"b\\c\nd\re\tf",
            "\u{1b}[31mred",
            all_controls.as_str(),
        ] {
            let mut s = String::new();
            Out {
                s: &mut s,
                format: Format::Json,
            }
            .quoted(v);
            let back: String = serde_json::from_str(&s).unwrap();
            assert_eq!(back, v);
            assert!(!s.bytes().any(|b| b < 0x20), "no raw control byte: {s:?}");
        }
    }

    #[test]
    fn json_lines_parse_and_carry_every_field() {
        let line = render(Format::Json);
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["timestamp"], "2026-11-25T08:00:00.000042Z");
        assert_eq!(v["request_id"], "r\"1");
        assert_eq!(v["upstream"], "127.0.0.1:9000");
        assert_eq!(
            (v["status"].clone(), v["store_degraded"].clone()),
            (200.into(), false.into())
        );
        assert_eq!(
            (v["target"].clone(), v["level"].clone()),
            ("access".into(), "INFO".into())
        );
        assert_eq!(v["shadow_refused"], "10s");
        assert_eq!(
            (v["queue_us"].clone(), v["priority"].clone()),
            (7.into(), "normal".into())
        );
        assert!(v.get("auth_failure").is_none() && v.get("overload").is_none());
    }

    #[test]
    fn text_lines_read_like_tracings() {
        let line = render(Format::Text);
        assert_eq!(
            line,
            "2026-11-25T08:00:00.000042Z  INFO access: request_id=r\"1 route=\"listPets\" \
             key_id=\"key_ab\" plan=\"free\" status=200 upstream=\"127.0.0.1:9000\" \
             upstream_us=120 store_us=4 queue_us=7 duration_us=300 store_degraded=false \
             shadow_refused=\"10s\" priority=\"normal\"\n"
        );
    }
}
