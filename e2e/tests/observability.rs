//! The shipped dashboard and alerting rules (`envoy/observability/`) query only what exists:
//! a live gateway running the shipped `envoy/envoy.yaml` and a real sidecar on Redis serve a
//! few scenarios, then every metric selector of every dashboard query and alert expression
//! must match a sample of the gateway's `/stats/prometheus` or the sidecar's `/metrics`.

use idemgate_demo::scenarios;
use idemgate_e2e::client::http;
use idemgate_e2e::live::{Demo, shipped};
use idemgate_e2e::stack::Stack;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

fn observability_dir() -> PathBuf {
    idemgate_host::target_dir().join("../envoy/observability")
}

/// Every `expr` of the dashboard's panels, wherever it is nested.
fn dashboard_queries() -> Vec<String> {
    fn collect(value: &serde_json::Value, out: &mut Vec<String>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, value) in map {
                    match (key.as_str(), value) {
                        ("expr", serde_json::Value::String(expr)) => out.push(expr.clone()),
                        _ => collect(value, out),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| collect(v, out)),
            _ => {}
        }
    }
    let text = std::fs::read_to_string(observability_dir().join("dashboard.json"))
        .expect("envoy/observability/dashboard.json");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut out = Vec::new();
    collect(&dashboard, &mut out);
    out
}

fn alert_expressions() -> Vec<String> {
    let text = std::fs::read_to_string(observability_dir().join("alerts.yaml"))
        .expect("envoy/observability/alerts.yaml");
    let rules: serde_json::Value = serde_norway::from_str(&text).expect("the rules are YAML");
    rules["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .filter_map(|r| r["expr"].as_str().map(str::to_owned))
        .collect()
}

/// One metric selector of a query: the metric name and its equality matchers. Regex and
/// negative matchers, and matchers on `job`/`instance` (target labels Prometheus adds when
/// it scrapes) are left out: they cannot be checked against one scrape.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Selector {
    name: String,
    labels: Vec<(String, String)>,
}

/// The selectors of idemgate's and the process's metrics in a PromQL expression.
fn selectors(expr: &str) -> Vec<Selector> {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    while i < chars.len() {
        let c = chars[i];
        if c == '"' {
            // A string outside a selector (a label_replace argument): skip it.
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            continue;
        }
        if !is_ident(c) {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && is_ident(chars[i]) {
            i += 1;
        }
        let name: String = chars[start..i].iter().collect();
        if !(name.starts_with("idemgate_") || name.starts_with("process_")) {
            continue;
        }
        let mut labels = Vec::new();
        if chars.get(i) == Some(&'{') {
            let close = chars[i..]
                .iter()
                .position(|c| *c == '}')
                .expect("closed selector")
                + i;
            let body: String = chars[i + 1..close].iter().collect();
            for matcher in body.split(',').map(str::trim).filter(|m| !m.is_empty()) {
                let Some((label, value)) = matcher.split_once('=') else {
                    panic!("matcher `{matcher}` in `{expr}`");
                };
                let (label, value) = (label.trim(), value.trim());
                if label.ends_with('!')
                    || value.starts_with('~')
                    || ["job", "instance"].contains(&label)
                {
                    continue;
                }
                labels.push((label.to_owned(), value.trim_matches('"').to_owned()));
            }
            i = close + 1;
        }
        out.push(Selector { name, labels });
    }
    out
}

/// The samples of a Prometheus text exposition: name → the label sets it has.
fn samples(text: &str) -> BTreeMap<String, Vec<BTreeMap<String, String>>> {
    let mut out: BTreeMap<String, Vec<BTreeMap<String, String>>> = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let (series, _value) = line.rsplit_once(' ').expect("`series value`");
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').expect("closed label set");
                let labels = body
                    .split("\",")
                    .filter(|p| !p.is_empty())
                    .filter_map(|pair| {
                        let (k, v) = pair.split_once('=')?;
                        Some((k.to_owned(), v.trim_matches('"').to_owned()))
                    })
                    .collect();
                (name, labels)
            }
            None => (series, BTreeMap::new()),
        };
        out.entry(name.to_owned()).or_default().push(labels);
    }
    out
}

#[test]
fn every_metric_the_dashboard_and_alerts_query_is_exposed() {
    let stack = Stack::start();
    let demo = Demo::start();
    let gateway = shipped(demo.addr, stack.addr, 2);
    // Queued calls (hand-offs, waits), a rejected double-click, a replayed payment.
    for scenario in [
        scenarios::attach_tools("agent-observed"),
        scenarios::double_click("bot-observed"),
        scenarios::payment_retry("user-observed"),
    ] {
        demo.play(&gateway, &scenario);
    }
    let admin = gateway
        .gateway()
        .admin_address()
        .expect("the shipped config has an admin");
    let envoy = http(admin, "GET", "/stats/prometheus", &[], "");
    let sidecar = http(stack.addr, "GET", "/metrics", &[], "");
    assert_eq!((envoy.status, sidecar.status), (200, 200));
    let mut exposed = samples(&envoy.body);
    for (name, sets) in samples(&sidecar.body) {
        exposed.entry(name).or_default().extend(sets);
    }

    let queries: Vec<(String, String)> = dashboard_queries()
        .into_iter()
        .map(|q| ("dashboard".to_owned(), q))
        .chain(
            alert_expressions()
                .into_iter()
                .map(|q| ("alerts".to_owned(), q)),
        )
        .collect();
    assert!(
        queries.len() > 20,
        "the dashboard and the alerts were read: {queries:?}"
    );
    let mut checked = BTreeSet::new();
    let mut missing = Vec::new();
    for (source, query) in &queries {
        let found = selectors(query);
        assert!(
            !found.is_empty(),
            "{source}: no idemgate metric in `{query}`"
        );
        for selector in found {
            let matches = exposed.get(&selector.name).is_some_and(|sets| {
                sets.iter().any(|set| {
                    selector
                        .labels
                        .iter()
                        .all(|(k, v)| set.get(k).is_some_and(|have| have == v))
                })
            });
            if !matches {
                missing.push(format!("{source}: {selector:?} in `{query}`"));
            }
            checked.insert(selector.name);
        }
    }
    assert!(
        missing.is_empty(),
        "not exposed by a live gateway and sidecar:\n{}",
        missing.join("\n")
    );
    // Both sides were queried (a scrape of the wrong endpoint would leave one empty).
    assert!(
        checked.iter().any(|n| n.starts_with("idemgate_requests_")),
        "{checked:?}"
    );
    assert!(
        checked
            .iter()
            .any(|n| n.starts_with("idemgate_sidecar_store_")),
        "{checked:?}"
    );
    assert!(checked.contains("process_cpu_seconds_total"), "{checked:?}");
}

#[test]
fn the_selector_reader_finds_names_and_equality_matchers() {
    let found = selectors(
        r#"histogram_quantile(0.99, sum by (le) (rate(idemgate_sidecar_handoff_seconds_bucket{job=~"$sidecar_job"}[5m])))
           / sum(rate(idemgate_sidecar_claims_total{outcome="queue_full", job="x", kind!="a"}[5m])) + label_replace(up, "idemgate_fake", "", "", "")"#,
    );
    assert_eq!(
        found,
        [
            Selector {
                name: "idemgate_sidecar_handoff_seconds_bucket".into(),
                labels: vec![],
            },
            Selector {
                name: "idemgate_sidecar_claims_total".into(),
                labels: vec![("outcome".into(), "queue_full".into())],
            },
        ]
    );
}
