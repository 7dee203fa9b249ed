//! The situations that made people build idemgate, as timed schedules of HTTP and gRPC
//! calls. The demo plays each against the backend directly and through the gateway; the
//! end-to-end tests play them and assert on the outcome and on the backend's ground truth.
//!
//! A scenario is data ([`Call`]s with send offsets), so the same schedule runs anywhere;
//! [`play`] sends every call at its offset, concurrently, and records what came back.

use idemgate_rig::backend::grpc;
use idemgate_rig::backend::{SEQ_HEADER, Stats, WORK_HEADER};
use std::time::{Duration, Instant};
use tonic::Code;

/// One HTTP call of a scenario, or one unary gRPC call of the backend's `pay.Payments`.
#[derive(Debug, Clone)]
pub struct Call {
    pub method: reqwest::Method,
    pub path: String,
    /// Request headers (a gRPC call's metadata).
    pub headers: Vec<(String, String)>,
    pub body: Option<serde_json::Value>,
    /// A gRPC call: the method of `pay.Payments` and its request's text (`path` names it too).
    pub grpc: Option<(&'static str, String)>,
    /// When to send it, from the scenario's start.
    pub at: Duration,
    /// The client gives up after this long (its response is lost), if set.
    pub give_up_after: Option<Duration>,
}

impl Call {
    pub fn post(path: impl Into<String>, at_ms: u64) -> Self {
        Call {
            method: reqwest::Method::POST,
            path: path.into(),
            headers: Vec::new(),
            body: None,
            grpc: None,
            at: Duration::from_millis(at_ms),
            give_up_after: None,
        }
    }

    /// A unary gRPC call of `pay.Payments/<method>` carrying `text`.
    pub fn grpc(method: &'static str, text: impl Into<String>, at_ms: u64) -> Self {
        Call {
            grpc: Some((method, text.into())),
            ..Call::post(format!("/{}/{method}", grpc::SERVICE), at_ms)
        }
    }

    pub fn header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_string(), value.into()));
        self
    }

    pub fn json(mut self, body: serde_json::Value) -> Self {
        self.body = Some(body);
        self
    }

    pub fn give_up_after(mut self, ms: u64) -> Self {
        self.give_up_after = Some(Duration::from_millis(ms));
        self
    }
}

/// What one call got back.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// `None` when the client gave up or the connection failed. A gRPC call that ended with
    /// a status is 200 (gRPC answers ride on HTTP 200), its status in [`Outcome::grpc`]
    /// (tonic reports a failed connection as a status too: `UNAVAILABLE`).
    pub status: Option<u16>,
    /// A gRPC call's status code.
    pub grpc: Option<Code>,
    /// The gateway answered with a stored response (`Idempotent-Replayed: true`).
    pub replayed: bool,
    /// The wait hint: `Retry-After` (seconds), or a gRPC refusal's `grpc-retry-pushback-ms`.
    pub retry_after: Option<String>,
    /// The response body; a gRPC call's answer text or its status message.
    pub body: String,
    pub latency: Duration,
}

/// A named schedule of calls.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: &'static str,
    pub what: &'static str,
    pub calls: Vec<Call>,
}

/// The outcomes of one scenario run (in call order) and the backend's ground truth after it.
#[derive(Debug, Clone)]
pub struct Run {
    pub outcomes: Vec<Outcome>,
    pub backend: Stats,
}

impl Run {
    pub fn count(&self, status: u16) -> usize {
        self.outcomes
            .iter()
            .filter(|o| o.status == Some(status))
            .count()
    }

    /// Calls answered 2xx, or gRPC calls that ended `OK`.
    pub fn succeeded(&self) -> usize {
        self.outcomes
            .iter()
            .filter(|o| {
                o.status.is_some_and(|s| (200..300).contains(&s))
                    && o.grpc.is_none_or(|code| code == Code::Ok)
            })
            .count()
    }

    /// Calls refused while another held their key: 409, or gRPC `ABORTED`.
    pub fn refused(&self) -> usize {
        self.count(409)
            + self
                .outcomes
                .iter()
                .filter(|o| o.grpc == Some(Code::Aborted))
                .count()
    }

    pub fn replays(&self) -> usize {
        self.outcomes.iter().filter(|o| o.replayed).count()
    }

    /// Latency percentile (0..=100) over the calls that got an answer.
    pub fn latency(&self, percentile: usize) -> Duration {
        let mut answered: Vec<Duration> = self
            .outcomes
            .iter()
            .filter(|o| o.status.is_some())
            .map(|o| o.latency)
            .collect();
        answered.sort();
        match answered.len() {
            0 => Duration::ZERO,
            n => answered[((n - 1) * percentile.min(100)) / 100],
        }
    }
}

/// Four "attach tool" calls for one agent within 43 ms (the timestamps of the incident
/// that started it all): without serialization, read-modify-write loses updates.
pub fn attach_tools(agent: &str) -> Scenario {
    let tools = [
        ("web_search", 0),
        ("davinci", 3),
        ("file_read", 34),
        ("naver_news", 43),
    ];
    Scenario {
        name: "attach tools",
        what: "4 calls attach tools to one agent within 43 ms",
        calls: tools
            .iter()
            .enumerate()
            .map(|(i, (tool, at))| {
                Call::post(format!("/agents/{agent}/tools"), *at)
                    .header("x-user-id", "demo-user")
                    .header(SEQ_HEADER, i.to_string())
                    .json(serde_json::json!({ "tool": tool }))
            })
            .collect(),
    }
}

/// A double-click on "start bot": the second call arrives 30 ms later, while the first
/// is still spawning the engine.
pub fn double_click(bot: &str) -> Scenario {
    Scenario {
        name: "double-click start",
        what: "2 'start bot' calls 30 ms apart while the engine spawns",
        calls: [0, 30]
            .iter()
            .map(|&at| {
                Call::post(format!("/bots/{bot}/start"), at).header("x-user-id", "demo-user")
            })
            .collect(),
    }
}

/// A payment whose response is lost (the client gives up), retried with the same
/// Idempotency-Key while the first is still running and once more after it finished.
pub fn payment_retry(key: &str) -> Scenario {
    let pay = |at: u64| {
        Call::post("/payments", at)
            .header("x-user-id", "demo-user")
            .header("idempotency-key", key)
            .json(serde_json::json!({ "amount": 4200 }))
    };
    Scenario {
        name: "payment retry",
        what: "a payment whose response is lost, retried twice with the same key",
        calls: vec![pay(0).give_up_after(40), pay(60), pay(600)],
    }
}

/// A provider delivers one order event twice at once (its first attempt timed out on its
/// side) and once more after the first was processed; the event id is in the JSON body.
pub fn webhook_redelivery(event: &str) -> Scenario {
    let deliver = |at: u64| {
        Call::post("/webhooks/orders", at)
            .header(SEQ_HEADER, at.to_string())
            .json(serde_json::json!({ "id": event, "type": "order.paid", "order": "ord_7" }))
    };
    Scenario {
        name: "webhook redelivery",
        what: "one order event delivered 3 times: twice at once, once after",
        calls: vec![deliver(0), deliver(20), deliver(600)],
    }
}

/// `n` concurrent calls on one resource, each working `work_ms` at the backend.
pub fn burst(agent: &str, n: usize, work_ms: u64) -> Scenario {
    Scenario {
        name: "burst",
        what: "concurrent calls on one resource",
        calls: (0..n)
            .map(|i| {
                Call::post(format!("/agents/{agent}/tools"), i as u64)
                    .header("x-user-id", "demo-user")
                    .header(SEQ_HEADER, i.to_string())
                    .header(WORK_HEADER, work_ms.to_string())
                    .json(serde_json::json!({ "tool": format!("tool-{i}") }))
            })
            .collect(),
    }
}

/// A gRPC client hedges a slow `Charge` (gRFC A6 hedging: another attempt every 50 ms while
/// none has answered, three in all) and, once the first answered, retries it again: one
/// `idempotency-key` throughout, each attempt 300 ms of work at the backend.
pub fn grpc_hedged_charge(key: &str) -> Scenario {
    let charge = |at: u64| {
        Call::grpc("Charge", "4200", at)
            .header("x-user-id", "demo-user")
            .header("idempotency-key", key)
            .header(WORK_HEADER, "300")
    };
    Scenario {
        name: "gRPC hedged charge",
        what: "a gRPC Charge hedged 3 times 50 ms apart, retried once after it answered",
        calls: vec![charge(0), charge(50), charge(100), charge(600)],
    }
}

/// Plays `scenario` against `base` (e.g. `http://127.0.0.1:10000`) and reads the backend's
/// stats from `backend` afterwards. Every call is bounded by `max_call` (no hang).
pub async fn play(
    client: &reqwest::Client,
    base: &str,
    backend: &str,
    scenario: &Scenario,
    max_call: Duration,
) -> anyhow::Result<Run> {
    // One HTTP/2 connection for the scenario's gRPC calls, as a gRPC client keeps.
    let channel = match scenario.calls.iter().any(|c| c.grpc.is_some()) {
        true => Some(grpc::connect(base.to_owned(), max_call).await?),
        false => None,
    };
    let started = Instant::now();
    let calls = scenario.calls.iter().cloned().map(|call| {
        let client = client.clone();
        let channel = channel.clone();
        let url = format!("{base}{}", call.path);
        tokio::spawn(async move {
            tokio::time::sleep_until((started + call.at).into()).await;
            match (channel, &call.grpc) {
                (Some(channel), Some((method, text))) => {
                    send_grpc(channel, method, text, &call, max_call).await
                }
                _ => send(&client, url, call, max_call).await,
            }
        })
    });
    let mut outcomes = Vec::with_capacity(scenario.calls.len());
    for handle in futures::future::join_all(calls).await {
        outcomes.push(handle?);
    }
    let backend = client
        .get(format!("{backend}/stats"))
        .timeout(max_call)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    Ok(Run { outcomes, backend })
}

async fn send(client: &reqwest::Client, url: String, call: Call, max_call: Duration) -> Outcome {
    let mut request = client
        .request(call.method, url)
        .timeout(call.give_up_after.unwrap_or(max_call).min(max_call));
    for (name, value) in &call.headers {
        request = request.header(name, value);
    }
    if let Some(body) = &call.body {
        request = request.json(body);
    }
    let sent = Instant::now();
    match request.send().await {
        Ok(response) => {
            let status = response.status().as_u16();
            let grpc = None;
            let header = |name: &str| {
                response
                    .headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            };
            let replayed = header("idempotent-replayed").is_some_and(|v| v == "true");
            let retry_after = header("retry-after");
            let body = response.text().await.unwrap_or_default();
            Outcome {
                status: Some(status),
                grpc,
                replayed,
                retry_after,
                body,
                latency: sent.elapsed(),
            }
        }
        Err(_) => Outcome {
            status: None,
            grpc: None,
            replayed: false,
            retry_after: None,
            body: String::new(),
            latency: sent.elapsed(),
        },
    }
}

async fn send_grpc(
    channel: tonic::transport::Channel,
    method: &str,
    text: &str,
    call: &Call,
    max_call: Duration,
) -> Outcome {
    let deadline = call.give_up_after.unwrap_or(max_call).min(max_call);
    let sent = Instant::now();
    let answer = grpc::call(channel, method, text, &call.headers, deadline).await;
    let latency = sent.elapsed();
    match answer {
        Ok(body) => Outcome {
            status: Some(200),
            grpc: Some(Code::Ok),
            replayed: false,
            retry_after: None,
            body,
            latency,
        },
        // The client's own deadline: it gave up, as an HTTP client that times out.
        Err(status) if status.code() == Code::DeadlineExceeded && latency >= deadline => Outcome {
            status: None,
            grpc: None,
            replayed: false,
            retry_after: None,
            body: String::new(),
            latency,
        },
        Err(status) => Outcome {
            status: Some(200),
            grpc: Some(status.code()),
            replayed: grpc::replayed(&status),
            retry_after: grpc::pushback_ms(&status).map(|ms| format!("{ms}ms")),
            body: status.message().to_owned(),
            latency,
        },
    }
}
