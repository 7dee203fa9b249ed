//! The demo backend: three services that break under duplicate or concurrent calls, the
//! way the services that motivated idemgate did. It is deliberately naive — no locks, no
//! idempotency — and keeps ground truth about the damage so tests and the demo can count it.
//!
//! - `POST /bots/{bot}/start` spawns an engine (~1 s). It checks "already running" before
//!   spawning, which stops sequential repeats but not a double-click: two calls inside the
//!   spawn window both start an engine.
//! - `POST /agents/{agent}/tools` (`{"tool": "..."}`) reads the agent's config, works, writes
//!   it back with the tool appended: concurrent calls overwrite each other (lost updates).
//! - `POST /payments` (`{"amount": n}`) charges once per call; the `Idempotency-Key` header is
//!   only recorded, to count double charges.
//! - `POST /webhooks/orders` (`{"id": "evt_…", "type": "order.paid"}`) is a provider's event
//!   delivery: it ships the order on every delivery (as long as a payment takes), so an event
//!   delivered twice ships twice.
//! - gRPC `pay.Payments` ([`grpc`]), on the same port (h2c beside HTTP/1.1): `Charge` charges
//!   as `POST /payments` does, `Attach` attaches a tool as `POST /agents/{agent}/tools` does.
//!
//! Every mutating call honours a fencing token (`x-fencing-token`): a write carrying a token
//! lower than one already seen for the same resource is refused with 409, the way a store
//! that checks fencing tokens refuses a holder whose lease ran out.
//!
//! Test knobs: `x-demo-work-ms` overrides the work time, `x-demo-seq` labels a call in the
//! recorded execution order, `x-demo-status` answers that status without executing, and
//! `x-demo-detach` runs the call's work to the end even if the client goes away (as a backend
//! that hands work to a job it does not cancel); without it, a client that disconnects
//! cancels the call before it commits.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub mod grpc;

/// Header carrying the fencing token idemgate stamps on forwarded requests.
pub const FENCING_HEADER: &str = "x-fencing-token";
/// Header a degraded gateway marks the calls it lets through with.
pub const DEGRADED_HEADER: &str = "x-idemgate-degraded";
/// Header naming a call in [`Stats::order`].
pub const SEQ_HEADER: &str = "x-demo-seq";
/// Header overriding the work time of one call, in milliseconds.
pub const WORK_HEADER: &str = "x-demo-work-ms";
/// Header making the backend answer that status without executing anything.
pub const STATUS_HEADER: &str = "x-demo-status";
/// Header (any value) making a call finish its work even after its client went away.
pub const DETACH_HEADER: &str = "x-demo-detach";

/// How long each service works by default.
#[derive(Debug, Clone, Copy)]
pub struct Timings {
    pub bot_spawn: Duration,
    pub attach: Duration,
    pub payment: Duration,
}

impl Default for Timings {
    fn default() -> Self {
        Timings {
            bot_spawn: Duration::from_millis(1000),
            attach: Duration::from_millis(50),
            payment: Duration::from_millis(100),
        }
    }
}

/// Ground truth about what the backend executed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Calls that ran their work (refused and forced-status calls excluded).
    pub executions: u64,
    /// Per resource, the calls that started their work, whether or not they finished or
    /// committed it (a call cancelled or failed midway counts): what ran at all.
    pub started: BTreeMap<String, u64>,
    pub engines_started: u64,
    /// Engines started for a bot that already had one: the double-click damage.
    pub duplicate_engines: u64,
    pub tool_attaches: u64,
    /// Attaches whose write overwrote another attach made since their read.
    pub lost_updates: u64,
    pub charges: u64,
    /// Charges beyond the first for one (caller, Idempotency-Key).
    pub double_charges: u64,
    /// Webhook deliveries processed (orders shipped).
    pub webhook_events: u64,
    /// Deliveries processed for an event id already processed: the duplicate-delivery damage.
    pub duplicate_events: u64,
    /// Writes refused because their fencing token was older than one already seen.
    pub stale_refused: u64,
    /// Calls a degraded gateway let through unguarded (`x-idemgate-degraded` set: the
    /// sidecar was unreachable and the failure mode is `open` or `local`).
    pub degraded: u64,
    /// Highest number of calls executing at once on one resource (1 = never overlapped).
    pub max_overlap: u32,
    /// Per resource, the `x-demo-seq` labels in the order their work started.
    pub order: BTreeMap<String, Vec<String>>,
    /// Per resource, the fencing tokens of the writes that went through, in order.
    pub fences: BTreeMap<String, Vec<u64>>,
    /// Per resource, when each committed call started and finished its work, in
    /// microseconds since the backend started: hand-off gaps and overlaps are read off it.
    pub spans: BTreeMap<String, Vec<(u64, u64)>>,
    /// Each agent's tools as stored.
    pub agent_tools: BTreeMap<String, Vec<String>>,
}

#[derive(Default)]
struct Ledger {
    stats: Stats,
    running_bots: BTreeMap<String, u64>,
    agent_versions: BTreeMap<String, u64>,
    charges_per_key: BTreeMap<(String, String), u64>,
    deliveries_per_event: BTreeMap<String, u64>,
    in_flight: BTreeMap<String, u32>,
    highest_fence: BTreeMap<String, u64>,
}

/// The backend's state, shared by its handlers.
pub struct Backend {
    timings: Timings,
    epoch: Instant,
    ledger: Mutex<Ledger>,
}

impl Backend {
    pub fn new(timings: Timings) -> Arc<Self> {
        Arc::new(Backend {
            timings,
            epoch: Instant::now(),
            ledger: Mutex::new(Ledger::default()),
        })
    }

    pub fn stats(&self) -> Stats {
        self.ledger().stats.clone()
    }

    pub fn reset(&self) {
        *self.ledger() = Ledger::default();
    }

    fn micros(&self, at: Instant) -> u64 {
        u64::try_from(at.duration_since(self.epoch).as_micros()).unwrap_or(u64::MAX)
    }

    /// A poisoned lock only means a handler panicked mid-update; the counters are still
    /// the best ground truth there is, so keep serving them.
    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The backend's routes.
pub fn router(backend: Arc<Backend>) -> Router {
    Router::new()
        .route("/bots/{bot}/start", post(start_bot))
        .route("/agents/{agent}/tools", post(attach_tool))
        .route("/payments", post(pay))
        .route("/webhooks/orders", post(webhook))
        .route_service(
            &format!("/{}/{{method}}", grpc::SERVICE),
            grpc::Payments::new(Arc::clone(&backend)),
        )
        .route("/stats", get(stats))
        .route("/reset", post(reset))
        .with_state(backend)
}

/// Serves the backend on `listener` until `shutdown` resolves: HTTP/1.1 and HTTP/2 (h2c, the
/// gRPC service's transport) on the one port, told apart by the HTTP/2 connection preface.
pub async fn serve(
    listener: tokio::net::TcpListener,
    backend: Arc<Backend>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(backend))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn stats(State(backend): State<Arc<Backend>>) -> Json<Stats> {
    Json(backend.stats())
}

async fn reset(State(backend): State<Arc<Backend>>) -> StatusCode {
    backend.reset();
    StatusCode::NO_CONTENT
}

/// One call's bookkeeping: overlap and order on entry, released on drop so an aborted
/// call (client gone, handler future dropped) does not count as running forever.
struct Execution<'a> {
    backend: &'a Backend,
    resource: String,
    fence: Option<u64>,
    started: Instant,
}

impl<'a> Execution<'a> {
    fn begin(backend: &'a Backend, resource: String, headers: &HeaderMap) -> Self {
        let fence = header(headers, FENCING_HEADER).and_then(|v| v.parse().ok());
        let mut ledger = backend.ledger();
        *ledger.stats.started.entry(resource.clone()).or_default() += 1;
        let running = ledger.in_flight.entry(resource.clone()).or_default();
        *running += 1;
        let running = *running;
        ledger.stats.max_overlap = ledger.stats.max_overlap.max(running);
        if headers.contains_key(DEGRADED_HEADER) {
            ledger.stats.degraded += 1;
        }
        if let Some(seq) = header(headers, SEQ_HEADER) {
            ledger
                .stats
                .order
                .entry(resource.clone())
                .or_default()
                .push(seq);
        }
        Execution {
            backend,
            resource,
            fence,
            started: Instant::now(),
        }
    }

    /// Checks the fencing token at write time and counts the execution.
    fn commit(&self, ledger: &mut Ledger) -> Result<(), StaleFence> {
        if let Some(fence) = self.fence {
            let highest = ledger
                .highest_fence
                .entry(self.resource.clone())
                .or_default();
            if fence < *highest {
                ledger.stats.stale_refused += 1;
                return Err(StaleFence {
                    fence,
                    highest: *highest,
                });
            }
            *highest = fence;
            ledger
                .stats
                .fences
                .entry(self.resource.clone())
                .or_default()
                .push(fence);
        }
        ledger.stats.executions += 1;
        let span = (
            self.backend.micros(self.started),
            self.backend.micros(Instant::now()),
        );
        ledger
            .stats
            .spans
            .entry(self.resource.clone())
            .or_default()
            .push(span);
        Ok(())
    }
}

/// A write whose fencing token is older than one already written: answered 409.
struct StaleFence {
    fence: u64,
    highest: u64,
}

impl IntoResponse for StaleFence {
    fn into_response(self) -> Response {
        problem(
            StatusCode::CONFLICT,
            "stale fencing token",
            format!(
                "token {} is older than {} already written",
                self.fence, self.highest
            ),
        )
    }
}

impl Drop for Execution<'_> {
    fn drop(&mut self) {
        let mut ledger = self.backend.ledger();
        if let Some(running) = ledger.in_flight.get_mut(&self.resource) {
            *running = running.saturating_sub(1);
        }
    }
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn work_time(headers: &HeaderMap, default: Duration) -> Duration {
    header(headers, WORK_HEADER)
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(default)
}

/// `x-demo-status`: answer with that status and execute nothing.
fn forced_status(headers: &HeaderMap) -> Option<Response> {
    let status = header(headers, STATUS_HEADER)?.parse().ok()?;
    let status = StatusCode::from_u16(status).ok()?;
    Some(problem(status, "forced by x-demo-status", String::new()))
}

fn problem(status: StatusCode, title: &str, detail: String) -> Response {
    let body = serde_json::json!({ "title": title, "status": status.as_u16(), "detail": detail });
    (
        status,
        [("content-type", "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

/// Runs `work` as the request's own future (dropped, so cancelled, when the client goes
/// away) or, with `x-demo-detach`, as a task that outlives the client.
async fn detachable<F>(detach: bool, work: F) -> Response
where
    F: std::future::Future<Output = Response> + Send + 'static,
{
    if detach {
        tokio::spawn(work).await.unwrap_or_else(|_| {
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "detached work failed",
                String::new(),
            )
        })
    } else {
        work.await
    }
}

async fn start_bot(
    State(backend): State<Arc<Backend>>,
    Path(bot): Path<String>,
    headers: HeaderMap,
) -> Response {
    detachable(
        headers.contains_key(DETACH_HEADER),
        run_start_bot(backend, bot, headers),
    )
    .await
}

async fn run_start_bot(backend: Arc<Backend>, bot: String, headers: HeaderMap) -> Response {
    if let Some(forced) = forced_status(&headers) {
        return forced;
    }
    let exec = Execution::begin(&backend, format!("bot:{bot}"), &headers);
    if backend.ledger().running_bots.contains_key(&bot) {
        return problem(
            StatusCode::CONFLICT,
            "bot already running",
            format!("bot {bot} has an engine"),
        );
    }
    tokio::time::sleep(work_time(&headers, backend.timings.bot_spawn)).await;
    let mut ledger = backend.ledger();
    if let Err(stale) = exec.commit(&mut ledger) {
        return stale.into_response();
    }
    ledger.stats.engines_started += 1;
    let engines = ledger.running_bots.entry(bot.clone()).or_default();
    *engines += 1;
    let engine = *engines;
    if engine > 1 {
        ledger.stats.duplicate_engines += 1;
    }
    (
        StatusCode::CREATED,
        Json(serde_json::json!({ "bot": bot, "engine": engine, "status": "running" })),
    )
        .into_response()
}

#[derive(Deserialize)]
struct Attach {
    tool: String,
}

async fn attach_tool(
    State(backend): State<Arc<Backend>>,
    Path(agent): Path<String>,
    headers: HeaderMap,
    Json(attach): Json<Attach>,
) -> Response {
    detachable(
        headers.contains_key(DETACH_HEADER),
        run_attach_tool(backend, agent, headers, attach),
    )
    .await
}

async fn run_attach_tool(
    backend: Arc<Backend>,
    agent: String,
    headers: HeaderMap,
    attach: Attach,
) -> Response {
    if let Some(forced) = forced_status(&headers) {
        return forced;
    }
    let attaching = ToolAttach::begin(&backend, agent.clone(), &headers);
    tokio::time::sleep(work_time(&headers, backend.timings.attach)).await;
    match attaching.write(attach.tool) {
        Ok(tools) => Json(serde_json::json!({ "agent": agent, "tools": tools })).into_response(),
        Err(stale) => stale.into_response(),
    }
}

/// One tool attach: the agent's tools read when it begins, written back with the tool
/// appended when it ends — a lost update when another attach wrote in between.
struct ToolAttach<'a> {
    exec: Execution<'a>,
    agent: String,
    tools: Vec<String>,
    read_version: u64,
}

impl<'a> ToolAttach<'a> {
    fn begin(backend: &'a Backend, agent: String, headers: &HeaderMap) -> Self {
        let exec = Execution::begin(backend, format!("agent:{agent}"), headers);
        let ledger = backend.ledger();
        let tools = ledger
            .stats
            .agent_tools
            .get(&agent)
            .cloned()
            .unwrap_or_default();
        let read_version = ledger.agent_versions.get(&agent).copied().unwrap_or(0);
        drop(ledger);
        ToolAttach {
            exec,
            agent,
            tools,
            read_version,
        }
    }

    /// Writes the tools read with `tool` appended (the fencing token checked): the tools
    /// as written.
    fn write(mut self, tool: String) -> Result<Vec<String>, StaleFence> {
        self.tools.push(tool);
        let mut ledger = self.exec.backend.ledger();
        self.exec.commit(&mut ledger)?;
        let version = ledger.agent_versions.entry(self.agent.clone()).or_default();
        if *version != self.read_version {
            // Someone wrote since our read: this write silently drops their tool.
            ledger.stats.lost_updates += 1;
        }
        *ledger.agent_versions.entry(self.agent.clone()).or_default() += 1;
        ledger.stats.tool_attaches += 1;
        ledger
            .stats
            .agent_tools
            .insert(self.agent.clone(), self.tools.clone());
        Ok(self.tools)
    }
}

#[derive(Deserialize)]
struct Payment {
    amount: u64,
}

async fn pay(
    State(backend): State<Arc<Backend>>,
    headers: HeaderMap,
    Json(payment): Json<Payment>,
) -> Response {
    detachable(
        headers.contains_key(DETACH_HEADER),
        run_pay(backend, headers, payment),
    )
    .await
}

async fn run_pay(backend: Arc<Backend>, headers: HeaderMap, payment: Payment) -> Response {
    if let Some(forced) = forced_status(&headers) {
        return forced;
    }
    let charging = Charge::begin(&backend, &headers);
    tokio::time::sleep(work_time(&headers, backend.timings.payment)).await;
    match charging.book() {
        Ok(id) => (
            StatusCode::CREATED,
            Json(
                serde_json::json!({ "payment": id, "amount": payment.amount, "status": "charged" }),
            ),
        )
            .into_response(),
        Err(stale) => stale.into_response(),
    }
}

/// One charge for a caller (`x-user-id`) and its `Idempotency-Key`, begun before the
/// payment's work and booked after it: a second booking for the pair is a double charge.
struct Charge<'a> {
    exec: Execution<'a>,
    caller: String,
    key: String,
}

impl<'a> Charge<'a> {
    fn begin(backend: &'a Backend, headers: &HeaderMap) -> Self {
        let caller = header(headers, "x-user-id").unwrap_or_default();
        let key = header(headers, "idempotency-key").unwrap_or_default();
        let exec = Execution::begin(backend, format!("payment:{caller}:{key}"), headers);
        Charge { exec, caller, key }
    }

    /// Books the charge (the fencing token checked): its payment id.
    fn book(self) -> Result<u64, StaleFence> {
        let mut ledger = self.exec.backend.ledger();
        self.exec.commit(&mut ledger)?;
        ledger.stats.charges += 1;
        let id = ledger.stats.charges;
        if !self.key.is_empty() {
            let charges = ledger
                .charges_per_key
                .entry((self.caller.clone(), self.key.clone()))
                .or_default();
            *charges += 1;
            if *charges > 1 {
                ledger.stats.double_charges += 1;
            }
        }
        Ok(id)
    }
}

async fn webhook(
    State(backend): State<Arc<Backend>>,
    headers: HeaderMap,
    Json(event): Json<serde_json::Value>,
) -> Response {
    detachable(
        headers.contains_key(DETACH_HEADER),
        run_webhook(backend, headers, event),
    )
    .await
}

async fn run_webhook(
    backend: Arc<Backend>,
    headers: HeaderMap,
    event: serde_json::Value,
) -> Response {
    if let Some(forced) = forced_status(&headers) {
        return forced;
    }
    let id = match event.get("id") {
        Some(serde_json::Value::String(id)) => id.clone(),
        Some(other) => other.to_string(),
        None => String::new(),
    };
    let exec = Execution::begin(&backend, format!("event:{id}"), &headers);
    tokio::time::sleep(work_time(&headers, backend.timings.payment)).await;
    let mut ledger = backend.ledger();
    if let Err(stale) = exec.commit(&mut ledger) {
        return stale.into_response();
    }
    ledger.stats.webhook_events += 1;
    let shipment = ledger.stats.webhook_events;
    let deliveries = ledger.deliveries_per_event.entry(id.clone()).or_default();
    *deliveries += 1;
    if *deliveries > 1 {
        ledger.stats.duplicate_events += 1;
    }
    Json(serde_json::json!({ "event": id, "shipment": shipment, "status": "shipped" }))
        .into_response()
}
