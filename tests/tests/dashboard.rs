//! The Grafana dashboard and the alert rules, checked against a real Prometheus: a `prometheus`
//! server scrapes a real gateway (Redis store) and a real backend on loopback every second while
//! traffic exercises every panel (admitted, refused, banned, unauthenticated requests, a reload,
//! a quota-store outage); then every panel's expression goes through Prometheus's query API and
//! must parse and return data, every alert rule must evaluate without error, and the
//! store-fallback alert must fire during the outage.

use std::path::Path;
use std::time::{Duration, Instant};

use e2e::{
    free_addr, prometheus_server, write_plan, Backend, Fixture, GatewayProcess, Process,
    RedisServer,
};
use serde_json::Value;

const ENV: &str = "dash";

struct Prometheus {
    addr: std::net::SocketAddr,
    _process: Process,
}

impl Prometheus {
    /// Scrapes `gateway_admin` and `backend` every second, with the shipped alert rules (their
    /// `for` shortened to 2 s so that the test need not wait minutes; expressions and labels as
    /// shipped).
    fn start(
        dir: &Path,
        gateway_admin: std::net::SocketAddr,
        backend: std::net::SocketAddr,
    ) -> Prometheus {
        let shipped = e2e::repo_root().join("deploy/prometheus/alerts.yml");
        let rules = std::fs::read_to_string(shipped).expect("alerts.yml");
        let rules: String = rules
            .lines()
            .map(|l| match l.trim_start().strip_prefix("for: ") {
                Some(_) => format!("{}for: 2s", &l[..l.len() - l.trim_start().len()]),
                None => l.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("\n");
        std::fs::write(dir.join("alerts.yml"), rules).unwrap();
        std::fs::write(
            dir.join("prometheus.yml"),
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - alerts.yml\n\
                 scrape_configs:\n\
                 \x20 - job_name: pet-gateway\n    static_configs:\n      - targets: [\"{gateway_admin}\"]\n        labels:\n          environment: {ENV}\n\
                 \x20 - job_name: pet-backend\n    static_configs:\n      - targets: [\"{backend}\"]\n        labels:\n          environment: {ENV}\n"
            ),
        )
        .unwrap();
        let addr = free_addr();
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let process = Process::spawn(
            "prometheus",
            std::process::Command::new(prometheus_server())
                .arg(format!(
                    "--config.file={}",
                    dir.join("prometheus.yml").display()
                ))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.join("tsdb").display()
                ))
                .arg(format!("--web.listen-address={addr}"))
                .current_dir(dir)
                .stdout(log.try_clone().unwrap())
                .stderr(log),
        );
        e2e::wait_for_listener(addr, Duration::from_secs(20));
        Prometheus {
            addr,
            _process: process,
        }
    }

    async fn api(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let query: String = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(query)
            .finish();
        let resp = reqwest::Client::new()
            .get(format!("http://{}/api/v1/{path}?{query}", self.addr))
            .send()
            .await
            .expect("prometheus answers");
        resp.json().await.expect("a JSON answer")
    }

    /// Runs `expr` at the current time; returns the result vector.
    async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let v = self.api("query", &[("query", expr)]).await;
        if v["status"] != "success" {
            return Err(format!("{}: {}", v["errorType"], v["error"]));
        }
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }
}

/// Every panel's expressions, with Grafana's variables as a dashboard would send them.
fn panel_queries() -> Vec<(String, String)> {
    let path = e2e::repo_root().join("deploy/grafana/pet-gateway.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"]
                .as_str()
                .expect("a PromQL expression")
                .replace("$env", ENV)
                .replace("$__rate_interval", "1m");
            out.push((panel["title"].as_str().unwrap().to_owned(), expr));
        }
    }
    out
}

async fn send(client: &reqwest::Client, url: &str, key: &str) -> u16 {
    client
        .get(url)
        .bearer_auth(key)
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_and_alert_works_on_a_real_prometheus() {
    let s = Fixture::new(5, 1_000);
    write_plan(&s.plans, "pro", 100_000, 1_000_000);
    let free = s.issue("free");
    let pro = s.issue("pro");
    let redis = RedisServer::start();
    let backend = Backend::start(&s.dir.path().join("pets.db"));
    let mut spec = s.spec(backend.addr);
    spec.environment = ENV.into();
    spec.redis_url = Some(redis.url());
    spec.extra = "store_timeout_ms = 100\nreload_interval_ms = 200\n[ban]\nstrikes = 2\n".into();
    let gw = GatewayProcess::start(s.dir.path(), &spec);
    let prom = Prometheus::start(s.dir.path(), gw.admin, backend.addr);
    let client = reqwest::Client::new();
    let pets = gw.url("/v1/pets");

    // Traffic for every panel, spread over several scrapes.
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(4) {
        assert_eq!(send(&client, &pets, &pro).await, 200);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Not across a minute's turn, which would give the free key a fresh window.
    e2e::fresh_minute(Duration::from_secs(15));
    let mut refused = 0;
    for _ in 0..12 {
        if send(&client, &pets, &free).await == 429 {
            refused += 1;
        }
    }
    assert!(refused >= 7, "the free key is refused, then banned");
    for bad in ["pet_nope", "not-a-key-at-all"] {
        assert_eq!(send(&client, &pets, bad).await, 401);
    }
    // A reload: a new plan file.
    write_plan(&s.plans, "business", 1_000, 100_000);

    // A quota-store outage: the breaker opens, requests are decided locally.
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "40000", "ALL"]), "OK");
    let outage = Instant::now();
    let mut fired = false;
    while outage.elapsed() < Duration::from_secs(30) {
        send(&client, &pets, &pro).await;
        let alerts = prom.api("alerts", &[]).await;
        fired |= alerts["data"]["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|a| {
                a["labels"]["alertname"] == "PetGatewayStoreFallback" && a["state"] == "firing"
            });
        if fired {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(fired, "PetGatewayStoreFallback fires during the outage");
    assert_eq!(redis.cli(&["CLIENT", "UNPAUSE"]), "OK");
    // A few more scrapes after the outage, with traffic again.
    let after = Instant::now();
    while after.elapsed() < Duration::from_secs(3) {
        send(&client, &pets, &pro).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The dashboard's environment variable finds this environment.
    let values = prom
        .api(
            "label/environment/values",
            &[("match[]", "pet_gateway_requests_total")],
        )
        .await;
    assert!(
        values["data"].as_array().unwrap().iter().any(|v| v == ENV),
        "{values}"
    );
    // Every panel parses and returns data.
    let queries = panel_queries();
    assert!(queries.len() >= 14, "{} panel queries", queries.len());
    let mut empty = Vec::new();
    for (title, expr) in &queries {
        match prom.query(expr).await {
            Err(e) => panic!("panel `{title}`: `{expr}` does not evaluate: {e}"),
            Ok(result) if result.is_empty() => empty.push(format!("{title}: {expr}")),
            Ok(_) => {}
        }
    }
    assert!(
        empty.is_empty(),
        "panels without data:\n{}",
        empty.join("\n")
    );
    // And the data is what the traffic did, not only series created at zero.
    for (what, expr) in [
        ("bans", "sum(pet_gateway_bans_total{environment=\"dash\"})"),
        (
            "429s",
            "sum(pet_gateway_rate_limited_total{environment=\"dash\"})",
        ),
        (
            "401s",
            "sum(pet_gateway_auth_failures_total{environment=\"dash\"})",
        ),
        (
            "store errors",
            "sum(pet_gateway_store_errors_total{environment=\"dash\"})",
        ),
        (
            "reloads",
            "sum(pet_gateway_config_reloads_total{environment=\"dash\",result=\"applied\"})",
        ),
        (
            "fallback",
            "max(max_over_time(pet_gateway_store_fallback{environment=\"dash\"}[5m]))",
        ),
        (
            "active keys",
            "sum(pet_gateway_keys{environment=\"dash\",status=\"active\"})",
        ),
        (
            "backend requests",
            "sum(pet_backend_requests_total{environment=\"dash\"})",
        ),
        (
            "batches",
            "sum(pet_gateway_store_batch_size_count{environment=\"dash\"})",
        ),
    ] {
        let result = prom.query(expr).await.unwrap();
        let value: f64 = result
            .first()
            .and_then(|r| r["value"][1].as_str())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        assert!(value > 0.0, "{what}: `{expr}` is {value}");
    }
    // Every alert rule evaluates.
    let rules = prom.api("rules", &[]).await;
    let mut checked = 0;
    for group in rules["data"]["groups"].as_array().expect("rule groups") {
        for rule in group["rules"].as_array().expect("rules") {
            assert_eq!(
                rule["health"], "ok",
                "rule {}: {}",
                rule["name"], rule["lastError"]
            );
            checked += 1;
        }
    }
    let shipped = std::fs::read_to_string(e2e::repo_root().join("deploy/prometheus/alerts.yml"))
        .expect("deploy/prometheus/alerts.yml")
        .matches("- alert:")
        .count();
    assert_eq!(checked, shipped, "every shipped alert rule evaluated");
}
