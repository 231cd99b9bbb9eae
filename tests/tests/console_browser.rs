//! The operator console in a real browser (issue 25): headless Chromium through chromedriver,
//! against a real gateway, backend and keys file. Screenshots of every page at both widths go
//! to `target/console-screenshots/` for a person to look at.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use e2e::{Browser, Fixture, GatewayProcess};
use serde_json::{json, Value};

const TOKEN: &str = "console-test-token-0123456789abcdef";

fn console_gateway(f: &Fixture, upstream: std::net::SocketAddr, extra: &str) -> GatewayProcess {
    let mut spec = f.spec(upstream);
    spec.env
        .push(("PET_GATEWAY_ADMIN_TOKEN".to_owned(), TOKEN.to_owned()));
    spec.extra = extra.to_owned();
    f.gateway(&spec)
}

/// Where the screenshots go, for a person to look at.
fn shots() -> PathBuf {
    e2e::repo_root().join("target/console-screenshots")
}

/// Opens the console and signs in with the token.
async fn signed_in(browser: &Browser, gw: &GatewayProcess, page: &str) {
    browser
        .goto(&gw.admin_url(&format!("/console/#/{page}")))
        .await;
    browser.type_into("#token", TOKEN).await;
    browser.click("#login-form button[type=submit]").await;
    browser.find("main h2").await;
}

async fn admin(gw: &GatewayProcess, method: reqwest::Method, path: &str, body: Value) -> Value {
    reqwest::Client::new()
        .request(method, gw.admin_url(path))
        .bearer_auth(TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_with_a_message_and_the_right_one_signs_in() {
    let f = Fixture::new(60, 1_000);
    f.issue("free");
    let backend = f.backend();
    let gw = console_gateway(&f, backend.addr, "");
    let browser = Browser::start(1280).await;
    browser.goto(&gw.admin_url("/console/#/overview")).await;
    browser
        .type_into("#token", "not-the-token-at-all-000")
        .await;
    browser.click("#login-form button[type=submit]").await;
    browser.wait_text("#login-error", "refused").await;
    browser
        .screenshot(&shots().join("sign-in-refused-1280.png"))
        .await;
    let label = browser.text_of("label[for=token]").await;
    assert_eq!(label, "Admin token");
    browser.type_into("#token", TOKEN).await;
    browser.click("#login-form button[type=submit]").await;
    browser.wait_text("main h2", "Overview").await;
    browser.wait_text("main", "Requests per second").await;
    // The token lives in this tab only: no cookie was ever set.
    let cookies = browser.run("return document.cookie;", json!([])).await;
    assert_eq!(cookies, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_issued_on_the_page_works_and_revoked_there_is_refused_within_a_second() {
    let f = Fixture::new(60, 1_000);
    f.issue("free");
    let backend = f.backend();
    let gw = console_gateway(&f, backend.addr, "");
    let browser = Browser::start(1280).await;
    signed_in(&browser, &gw, "keys").await;
    browser.type_into("#issue-name", "from the console").await;
    browser
        .click("form[aria-label='Issue a key'] button[type=submit]")
        .await;
    let shown = browser.wait_text("main h2", "Issued").await;
    let key = browser.text_of("#new-key").await;
    assert!(!key.is_empty(), "{shown}");
    assert!(browser.text_of("#copy-key").await.contains("Copy"));
    assert_eq!(gw.status(&key).await, 200);

    let id = shown
        .split_whitespace()
        .nth(1)
        .expect("Issued <id> on plan …")
        .to_owned();
    browser
        .goto(&gw.admin_url(&format!("/console/#/keys?q={id}")))
        .await;
    browser.wait_text("main tbody", &id).await;
    browser.click("main tbody button.danger").await;
    let asked = browser.accept().await;
    assert!(
        asked.contains(&id),
        "the confirmation names the key: {asked}"
    );
    let started = Instant::now();
    loop {
        if gw.status(&key).await == 401 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "still admitted a second later"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A rotation from the page shows the successor's key once, and that key works at the
/// gateway; "Back to keys" then draws the keys page again, though the hash already named it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_rotated_on_the_page_shows_its_successor_once_and_it_works() {
    let f = Fixture::new(60, 1_000);
    let old = f.issue("free");
    let old_id = e2e::first_key_id(&f.keys);
    let backend = f.backend();
    let gw = console_gateway(&f, backend.addr, "");
    let browser = Browser::start(1280).await;
    signed_in(&browser, &gw, "keys").await;
    browser.wait_text("main tbody", &old_id).await;
    browser.click("main tbody button").await;
    let asked = browser.accept().await;
    assert!(
        asked.contains("Rotate") && asked.contains(&old_id),
        "{asked}"
    );
    let shown = browser.wait_text("main h2", "Rotated").await;
    let key = browser.text_of("#new-key").await;
    assert!(
        !key.is_empty() && key != old,
        "the successor's key: {shown}"
    );
    browser
        .screenshot(&shots().join("key-shown-once-1280.png"))
        .await;
    assert_eq!(gw.status(&key).await, 200, "the shown key works");
    assert_eq!(gw.status(&old).await, 200, "the old one, for its overlap");
    browser.click("#back-to-keys").await;
    browser.wait_text("main h2", "Keys").await;
    browser.wait_text("main tbody", &old_id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ban_shows_on_the_bans_page_and_lifting_it_there_admits_the_key_again() {
    // A one-second window, so that a lifted key has room again a second later.
    let f = Fixture::new(60, 1_000);
    std::fs::write(
        f.plans.join("free.toml"),
        "[[window]]\nevery = \"1s\"\nlimit = 2\n[[window]]\nevery = \"1d\"\nlimit = 1000\n",
    )
    .unwrap();
    let key = f.issue("free");
    let key_id = e2e::first_key_id(&f.keys);
    let backend = f.backend();
    let gw = console_gateway(&f, backend.addr, "[ban]\nstrikes = 1\n");
    let code = |key: String| {
        let url = gw.url("/v1/pets");
        async move {
            let resp = reqwest::Client::new()
                .get(url)
                .bearer_auth(key)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let body: Value = resp.json().await.unwrap_or(Value::Null);
            (status, body["code"].as_str().unwrap_or_default().to_owned())
        }
    };
    let mut banned = false;
    for _ in 0..50 {
        if code(key.clone()).await.1 == "api_key_banned" {
            banned = true;
            break;
        }
    }
    assert!(banned, "the key kept sending after its 429s and was banned");
    let browser = Browser::start(1280).await;
    // The keys page's status filter finds it ("banned until …"), with its actions.
    signed_in(&browser, &gw, "keys?status=banned").await;
    let row = browser.wait_text("main tbody", &key_id).await;
    assert!(
        row.contains("banned until") && row.contains("Revoke"),
        "{row}"
    );
    browser.goto(&gw.admin_url("/console/#/bans")).await;
    browser.wait_text("main tbody", &key_id).await;
    browser.click("main tbody button").await;
    let asked = browser.accept().await;
    assert!(asked.contains(&key_id), "{asked}");
    browser.wait_text("main", "No key is banned").await;
    // Lifted: a second later its window has room, and the gateway admits it.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        code(key.clone()).await,
        (200, String::new()),
        "admitted again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_named_with_html_shows_the_characters_and_runs_nothing() {
    let f = Fixture::new(60, 1_000);
    f.issue("free");
    let backend = f.backend();
    let audit = f.dir.path().join("audit.log");
    let gw = console_gateway(
        &f,
        backend.addr,
        &format!("audit_log = \"{}\"\n", audit.display()),
    );
    let name = "<img src=x onerror=alert(1)>";
    let issued = admin(
        &gw,
        reqwest::Method::POST,
        "/keys",
        json!({"plan": "free", "name": name}),
    )
    .await;
    let id = issued["id"].as_str().expect("issued").to_owned();
    let browser = Browser::start(1280).await;
    signed_in(&browser, &gw, "keys").await;
    let row = browser.wait_text("main tbody", &id).await;
    assert!(row.contains(name), "the name as text: {row}");
    let images = browser
        .run(
            "return document.querySelectorAll('main img').length;",
            json!([]),
        )
        .await;
    assert_eq!(images, 0);
    assert!(browser.dialog().await.is_none(), "no script ran");
    browser
        .goto(&gw.admin_url(&format!("/console/#/keys/{id}")))
        .await;
    browser.wait_text("main dl", name).await;
    assert!(browser.dialog().await.is_none());
    // Its history: issued through the admin API.
    let history = browser.wait_text("#history", "issue").await;
    assert!(history.contains("admin"), "{history}");
}

/// Every page at 390 and 1280 pixels: it renders, nothing spills sideways, and each page is
/// reached from its link by the keyboard alone. Screenshots for a person.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_reads_at_both_widths_and_is_reached_by_keyboard() {
    let f = Fixture::new(60, 1_000);
    let key = f.issue("free");
    let key_id = e2e::first_key_id(&f.keys);
    let backend = f.backend();
    let gw = console_gateway(&f, backend.addr, "");
    assert_eq!(gw.status(&key).await, 200);
    let shots = shots();
    // Each page's title, and what its content shows: the key, its plan, its windows.
    let pages = [
        ("overview", "Overview".to_owned(), "Quota store"),
        ("keys", "Keys".to_owned(), key_id.as_str()),
        (
            &*format!("keys/{key_id}"),
            format!("Key {key_id}"),
            "minute",
        ),
        ("bans", "Bans".to_owned(), "No key is banned"),
        ("top", "Top consumers".to_owned(), key_id.as_str()),
        ("plans", "Plans".to_owned(), "minute: 60"),
    ];
    for width in [390u32, 1280] {
        let browser = Browser::start(width).await;
        signed_in(&browser, &gw, "overview").await;
        let laid_out = browser.run("return window.innerWidth;", json!([])).await;
        assert_eq!(
            laid_out,
            json!(width),
            "the page is laid out {width} pixels wide"
        );
        for (page, title, shows) in &pages {
            browser
                .goto(&gw.admin_url(&format!("/console/#/{page}")))
                .await;
            browser.wait_text("main h2", title).await;
            let text = browser.wait_text("main", shows).await;
            assert!(
                !text.contains("[object"),
                "{page}: a list drawn as text: {text}"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
            let spill = browser
                .run(
                    "return document.documentElement.scrollWidth - window.innerWidth;",
                    json!([]),
                )
                .await;
            assert!(
                spill.as_i64().unwrap_or(0) <= 1,
                "{page} at {width}px spills by {spill}"
            );
            // Every control is reached by Tab and named for a screen reader: a field by its
            // label, a button or link by its text.
            let unnamed = browser
                .run(
                    "const shown = [...document.querySelectorAll('button, a[href], input, select')]\
                       .filter((e) => e.offsetParent !== null);\
                     return [shown.length, shown\
                       .filter((e) => e.tabIndex < 0 || !((e.labels && e.labels.length) \
                         || e.getAttribute('aria-label') || e.textContent.trim()))\
                       .map((e) => e.outerHTML.slice(0, 80))];",
                    json!([]),
                )
                .await;
            assert!(
                unnamed[0].as_u64().unwrap_or(0) >= 5,
                "{page}: the nav's links at least"
            );
            assert_eq!(
                unnamed[1],
                json!([]),
                "{page} at {width}px: controls without a name"
            );
            let name = if page.starts_with("keys/") {
                "key"
            } else {
                page
            };
            let file = format!("{name}-{width}.png");
            browser.screenshot(&shots.join(file)).await;
        }
        // The keyboard alone: focus the Bans link by Tab from the top, Enter follows it.
        browser.goto(&gw.admin_url("/console/#/overview")).await;
        browser.find("main h2").await;
        browser
            .run(
                "document.activeElement && document.activeElement.blur(); document.body.focus();",
                json!([]),
            )
            .await;
        let mut reached = false;
        for _ in 0..8 {
            browser.keys("\u{E004}").await;
            let focused = browser
                .run("return document.activeElement.textContent;", json!([]))
                .await;
            if focused == "Bans" {
                browser.keys("\u{E007}").await;
                browser.wait_text("main h2", "Bans").await;
                reached = true;
                break;
            }
        }
        assert!(reached, "the Bans link is reached by Tab at {width}px");
    }
}

/// With no token at all (the loopback default), no other site can act or read: a foreign
/// `Origin`, `Sec-Fetch-Site: cross-site` or a rebound `Host` is refused before anything runs;
/// tools that send none of these pass, and the console's files need no token while its data
/// does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_sites_and_rebound_names_are_refused_and_only_the_files_go_without_token() {
    let f = Fixture::new(60, 1_000);
    f.issue("free");
    let backend = f.backend();
    let open = f.gateway(&f.spec(backend.addr));
    e2e::wait_for_listener(open.admin, Duration::from_secs(10));
    let client = reqwest::Client::new();
    let port = open.admin.port();
    let attempts: [(&str, &str, &str); 3] = [
        ("POST", "origin", "https://evil.example"),
        ("POST", "sec-fetch-site", "cross-site"),
        (
            "GET",
            "host",
            &*Box::leak(format!("evil.example:{port}").into_boxed_str()),
        ),
    ];
    for (method, header, value) in attempts {
        let resp = client
            .request(method.parse().unwrap(), open.admin_url("/keys"))
            .header(header, value)
            .json(&json!({"plan": "free"}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 403, "{header}: {value}");
    }
    // A rebound page cannot read the probes either: over plain http its same-origin GET
    // carries neither Origin nor Sec-Fetch-Site, only its own name.
    for path in ["/metrics", "/readyz", "/healthz"] {
        let rebound = client
            .get(open.admin_url(path))
            .header("host", format!("evil.example:{port}"))
            .send()
            .await
            .unwrap();
        assert_eq!(rebound.status(), 403, "{path}");
    }
    // Prometheus by an address, or by a name listed in admin_hosts.
    let scrape = client.get(open.admin_url("/metrics")).send().await.unwrap();
    assert_eq!(scrape.status(), 200);
    let mut named = f.spec(backend.addr);
    named.extra = "admin_hosts = [\"gw1.internal\"]\n".to_owned();
    let named = f.gateway(&named);
    e2e::wait_for_listener(named.admin, Duration::from_secs(10));
    let scrape = client
        .get(named.admin_url("/metrics"))
        .header("host", format!("gw1.internal:{}", named.admin.port()))
        .send()
        .await
        .unwrap();
    assert_eq!(scrape.status(), 200, "a listed name");
    let listed: Value = client
        .get(open.admin_url("/keys"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        listed.as_array().map(Vec::len),
        Some(1),
        "nothing was issued"
    );

    let guarded = console_gateway(&f, backend.addr, "");
    e2e::wait_for_listener(guarded.admin, Duration::from_secs(10));
    let page = client
        .get(guarded.admin_url("/console/"))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let csp = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        csp.contains("frame-ancestors 'none'") && !csp.contains("unsafe-inline"),
        "{csp}"
    );
    assert_eq!(page.headers()["referrer-policy"], "no-referrer");
    assert!(page.headers().get("set-cookie").is_none());
    let data = client
        .get(guarded.admin_url("/overview"))
        .send()
        .await
        .unwrap();
    assert_eq!(data.status(), 401);
}

/// The keys page's one call: records found by name or customer, filtered by status, a page at
/// a time, each active one with its usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_search_finds_filters_and_pages_with_usage_in_one_call() {
    let f = Fixture::new(60, 1_000);
    let first = f.issue("free");
    let backend = f.backend();
    let gw = console_gateway(&f, backend.addr, "");
    for i in 0..12 {
        let customer = if i % 3 == 0 { Some("acme") } else { None };
        let mut body = json!({"plan": "free", "name": format!("svc-{i:02}")});
        if let Some(c) = customer {
            body["customer"] = c.into();
        }
        let issued = admin(&gw, reqwest::Method::POST, "/keys", body).await;
        assert!(issued["id"].is_string(), "{issued}");
    }
    // The key's day usage is read back below: not across midnight UTC.
    e2e::fresh_day(Duration::from_secs(10));
    assert_eq!(gw.status(&first).await, 200);
    let search = |q: &str| {
        let url = gw.admin_url(&format!("/key-search?{q}"));
        async move {
            reqwest::Client::new()
                .get(url)
                .bearer_auth(TOKEN)
                .send()
                .await
                .unwrap()
        }
    };
    let all: Value = search("per_page=5").await.json().await.unwrap();
    assert_eq!(all["total"], 13);
    assert_eq!(all["keys"].as_array().unwrap().len(), 5);
    let third: Value = search("per_page=5&page=3").await.json().await.unwrap();
    assert_eq!(third["keys"].as_array().unwrap().len(), 3);
    let named: Value = search("q=SVC-0").await.json().await.unwrap();
    assert_eq!(named["total"], 10, "svc-00 … svc-09");
    let acme: Value = search("q=acme").await.json().await.unwrap();
    assert_eq!(acme["total"], 4);
    let exact: Value = search("customer=acme").await.json().await.unwrap();
    assert_eq!(exact["total"], 4);
    assert_eq!(
        search("customer=acm").await.json::<Value>().await.unwrap()["total"],
        0
    );
    let one_id = acme["keys"][0]["id"].as_str().unwrap();
    let by_id: Value = search(&format!("id={one_id}")).await.json().await.unwrap();
    assert_eq!(by_id["total"], 1);
    assert_eq!(by_id["keys"][0]["id"], one_id);
    let used: Value = search("q=").await.json().await.unwrap();
    let with_usage = used["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["usage"]["day"] == 1)
        .expect("the key used once shows its usage");
    assert_eq!(with_usage["status"], "active");
    let id = used["keys"][1]["id"].as_str().unwrap().to_owned();
    let revoked = admin(
        &gw,
        reqwest::Method::POST,
        &format!("/keys/{id}/revoke"),
        json!({}),
    )
    .await;
    assert!(revoked.is_object());
    let gone: Value = search("status=revoked").await.json().await.unwrap();
    assert_eq!(gone["total"], 1, "the change is seen: {gone}");
    assert!(
        gone["keys"][0].get("usage").is_none(),
        "no usage for a revoked key"
    );
    assert_eq!(search("per_page=0").await.status(), 400);
    assert_eq!(search("sort=name").await.status(), 400);
}

/// After a keys change the search never waits long for the records to be read again: it
/// answers at once from those it had, marked stale, and soon from the new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_search_answers_stale_while_the_records_are_read_again() {
    use std::fmt::Write;
    let f = Fixture::new(60, 1_000);
    f.issue("free");
    // Many more records, so that reading them takes a while.
    let mut text = std::fs::read_to_string(&f.keys).unwrap();
    for i in 0..60_000 {
        let _ = write!(
            text,
            "\n[[key]]\nid = \"bulk_{i:06}\"\nplan = \"free\"\nsha256 = \"{i:064x}\"\n\
             created_at = \"2026-01-01T00:00:00Z\"\n"
        );
    }
    std::fs::write(&f.keys, text).unwrap();
    let backend = f.backend();
    let gw = console_gateway(&f, backend.addr, "");
    let search = |q: String| {
        let url = gw.admin_url(&format!("/key-search?{q}"));
        async move {
            let started = Instant::now();
            let v: Value = reqwest::Client::new()
                .get(url)
                .bearer_auth(TOKEN)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            (v, started.elapsed())
        }
    };
    let (first, _) = search("q=bulk_000001".into()).await;
    assert_eq!(first["total"], 1);
    assert_eq!(first["stale"], false);
    let issued = admin(
        &gw,
        reqwest::Method::POST,
        "/keys",
        json!({"plan": "free", "name": "fresh-one"}),
    )
    .await;
    assert!(issued["id"].is_string());
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let (found, took) = search("q=fresh-one".into()).await;
        assert!(took < Duration::from_secs(5), "a search waited {took:?}");
        if found["stale"] == false {
            assert_eq!(found["total"], 1, "the new key, once fresh: {found}");
            break;
        }
        assert_eq!(
            found["total"], 0,
            "a stale answer is the records from before"
        );
        assert!(Instant::now() < until, "never fresh again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The overview's chart (issue 32): drawn by the page itself from the gateway's own history of
/// the last 15 minutes (`GET /overview/history`, a sample every 5 s), no script from elsewhere:
/// requests answered, refused and shed, and the requests at the backends with their limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_charts_the_last_minutes_from_the_gateways_own_history() {
    let f = Fixture::new(60, 1_000);
    let key = f.issue("free");
    let backend = f.backend();
    let gw = console_gateway(&f, backend.addr, "upstream_max_in_flight = 16\n");
    // The refusals come from passing the minute's 60 within one minute (about 2 s of traffic
    // on a quiet machine, much more on a loaded one): a minute boundary in between would split
    // them and leave none refused.
    e2e::fresh_minute(Duration::from_secs(40));
    // Traffic across two samples: answered requests, and refusals (past the minute's 60). The
    // 70 are counted, not timed (a loaded machine answers slower), then the traffic goes on
    // slowly until the sampler (every 5 s) has taken the refusals and 11 s have passed.
    let started = Instant::now();
    let mut sent = 0;
    while sent < 70 {
        gw.status(&key).await;
        sent += 1;
        assert!(
            started.elapsed() < Duration::from_secs(35),
            "70 requests took over 35 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused_by = Instant::now();
    while started.elapsed() < Duration::from_secs(11)
        || refused_by.elapsed() < Duration::from_secs(6)
    {
        gw.status(&key).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let history = reqwest::Client::new()
        .get(gw.admin_url("/overview/history"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    let samples = history["samples"].as_array().unwrap();
    assert!(!samples.is_empty(), "{history}");
    assert_eq!(history["every"], 5);
    let sum = |k: &str| samples.iter().map(|s| s[k].as_f64().unwrap()).sum::<f64>();
    assert!(sum("admitted") > 0.0 && sum("refused") > 0.0, "{history}");
    assert!(samples.iter().all(|s| s["limit"] == 16.0), "{history}");

    let browser = Browser::start(1280).await;
    signed_in(&browser, &gw, "overview").await;
    browser
        .find("svg.chart polyline[data-series=admitted]")
        .await;
    let label = browser
        .run(
            "return document.querySelector('section[aria-label=\"At the backends\"] svg').getAttribute('aria-label');",
            json!([]),
        )
        .await;
    assert!(
        label.as_str().is_some_and(|l| l.contains("limit 16")),
        "{label}"
    );
    let lines = browser
        .run(
            "return document.querySelectorAll('svg.chart polyline').length;",
            json!([]),
        )
        .await;
    assert_eq!(lines, 5, "answered, refused, shed; in flight, limit");
    browser
        .screenshot(&shots().join("overview-chart-1280.png"))
        .await;
}
