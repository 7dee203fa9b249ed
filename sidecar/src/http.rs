//! The HTTP API: routes, request decoding and limits, bearer authentication, problem+json
//! errors, admin, health and metrics endpoints. Protocol logic lives in [`crate::locks`].
//!
//! Every protocol answer is 200 with a framed body (`idemgate_wire::encode`); everything
//! else is an RFC 9457 problem. Nothing answers 200 unless the store agreed.

use crate::config::Config;
use crate::heads;
use crate::locks::{LockError, Locks};
use crate::metrics::{Metrics, StoreVerb};
use crate::store::{Store, StoreError};
use crate::telemetry::{self, timed_store_call};
use axum::Router;
use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{ConnectInfo, FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use idemgate_wire::{
    AbortRequest, ClaimOutcome, ClaimRequest, CompleteRequest, FieldError, LeaveRequest,
    OwnerOutcome, Problem, RateRequest, RenewRequest, paths, problem_types,
};
use serde::Deserialize;
use std::net::SocketAddr;
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tokio::sync::watch;
use tokio::time::Instant;

/// Room for the JSON head on top of the stored body limit (headers are limited separately).
const HEAD_ALLOWANCE: usize = 64 * 1024;
/// What a client is told to wait before retrying after a transient failure.
const RETRY_AFTER_MS: u64 = 1000;
/// Admin listing default and ceiling.
const LIST_DEFAULT: usize = 100;
const LIST_MAX: usize = 10_000;

pub(crate) struct App<S> {
    pub locks: Locks<S>,
    pub config: Arc<Config>,
    pub metrics: Arc<Metrics>,
    pub shutting_down: watch::Receiver<bool>,
}

type AppState<S> = State<Arc<App<S>>>;

const ADMIN_KEYS: &str = "/admin/v1/keys";
const ADMIN_KEY: &str = "/admin/v1/keys/{*key}";
const ADMIN_RELEASE: &str = "/admin/v1/release";
const HEALTHZ: &str = "/healthz";
const READYZ: &str = "/readyz";
const METRICS: &str = "/metrics";

/// The API as one service: the router, with every request's latency observed by route and
/// status. Observation (and authentication, see [`Authorized`]) is plain code rather than
/// middleware layers: each `from_fn` layer boxes every request's future and clones the inner
/// service, which showed up as several percent of the sidecar's CPU under load.
#[derive(Clone)]
pub(crate) struct Api {
    router: Router,
    metrics: Arc<Metrics>,
}

impl Api {
    pub(crate) fn new<S: Store>(app: Arc<App<S>>) -> Self {
        Api {
            metrics: Arc::clone(&app.metrics),
            router: router(app),
        }
    }

    pub(crate) async fn handle(self, req: Request<hyper::body::Incoming>) -> Response {
        use tower::ServiceExt;
        use tracing::Instrument;
        let route = route_label(req.uri().path());
        let started = Instant::now();
        let span =
            telemetry::verb_of(route).map(|verb| telemetry::request_span(verb, req.headers()));
        let answer = self.router.oneshot(req.map(Body::new));
        // The store clock is for the span's attributes: a span that records nothing (no
        // request id or trace to carry, nothing exported) goes without it, since its
        // task-local is swapped in and out on every poll of the request.
        let (response, store_time) = match &span {
            Some(span) if !span.is_disabled() => {
                telemetry::store_clock(answer)
                    .instrument(span.clone())
                    .await
            }
            _ => (answer.await, std::time::Duration::ZERO),
        };
        let response = match response {
            Ok(response) => response,
            Err(never) => match never {},
        };
        if let Some(span) = &span {
            telemetry::finish(span, response.status(), store_time);
        }
        self.metrics.observe_request(
            route,
            response.status().as_str(),
            started.elapsed().as_secs_f64(),
        );
        response
    }
}

/// The route pattern a path is served by (the metrics label), without running the router.
fn route_label(path: &str) -> &'static str {
    match path {
        paths::CLAIM => paths::CLAIM,
        paths::COMPLETE => paths::COMPLETE,
        paths::ABORT => paths::ABORT,
        paths::LEAVE => paths::LEAVE,
        paths::RENEW => paths::RENEW,
        paths::RATE => paths::RATE,
        ADMIN_KEYS => ADMIN_KEYS,
        ADMIN_RELEASE => ADMIN_RELEASE,
        HEALTHZ => HEALTHZ,
        READYZ => READYZ,
        METRICS => METRICS,
        p if p
            .strip_prefix(ADMIN_KEYS)
            .is_some_and(|k| k.len() > 1 && k.starts_with('/')) =>
        {
            ADMIN_KEY
        }
        _ => "unmatched",
    }
}

fn router<S: Store>(app: Arc<App<S>>) -> Router {
    Router::new()
        .route(paths::CLAIM, post(claim::<S>))
        .route(paths::COMPLETE, post(complete::<S>))
        .route(paths::ABORT, post(abort::<S>))
        .route(paths::LEAVE, post(leave::<S>))
        .route(paths::RENEW, post(renew::<S>))
        .route(paths::RATE, post(rate::<S>))
        .route(ADMIN_KEYS, get(list_keys::<S>))
        .route(ADMIN_KEY, get(inspect_key::<S>))
        .route(ADMIN_RELEASE, post(force_release::<S>))
        .route(HEALTHZ, get(|| async { "ok\n" }))
        .route(READYZ, get(ready::<S>))
        .route(METRICS, get(metrics::<S>))
        .fallback(|| async {
            problem(
                StatusCode::NOT_FOUND,
                problem_types::NOT_FOUND,
                "no such endpoint",
                None,
            )
        })
        .method_not_allowed_fallback(|| async {
            problem(
                StatusCode::METHOD_NOT_ALLOWED,
                problem_types::BAD_REQUEST,
                "method not allowed",
                None,
            )
        })
        .with_state(app)
}

// === problems ===

/// A problem+json answer (boxed: it travels in `Err` variants).
pub(crate) struct Rejection(Box<Problem>);

type Answer = Result<Response, Rejection>;

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (
            status,
            [(header::CONTENT_TYPE, idemgate_wire::PROBLEM_CONTENT_TYPE)],
            serde_json::to_vec(&*self.0).unwrap_or_default(),
        )
            .into_response();
        if let Some(ms) = self.0.retry_after_ms {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(ms.div_ceil(1000).max(1)),
            );
        }
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

fn problem_with_retry(
    status: StatusCode,
    type_uri: &str,
    title: &str,
    detail: Option<String>,
    retry_after_ms: Option<u64>,
) -> Rejection {
    Rejection(Box::new(Problem {
        type_uri: type_uri.to_owned(),
        title: title.to_owned(),
        status: status.as_u16(),
        detail,
        retry_after_ms,
    }))
}

fn problem(status: StatusCode, type_uri: &str, title: &str, detail: Option<String>) -> Rejection {
    problem_with_retry(status, type_uri, title, detail, None)
}

fn bad_request(detail: String) -> Rejection {
    problem(
        StatusCode::BAD_REQUEST,
        problem_types::BAD_REQUEST,
        "malformed request",
        Some(detail),
    )
}

fn field_problem(err: FieldError) -> Rejection {
    if err.too_large {
        problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            problem_types::TOO_LARGE,
            "request field too large",
            Some(err.to_string()),
        )
    } else {
        bad_request(err.to_string())
    }
}

impl<S: Store> App<S> {
    fn store_error(&self, err: &StoreError) -> Rejection {
        let kind = if err.is_transient() {
            "transient"
        } else {
            "permanent"
        };
        self.metrics.store_errors.with_label_values(&[kind]).inc();
        if err.is_transient() {
            tracing::warn!(%err, "store unavailable");
        } else {
            tracing::error!(%err, "store failed");
        }
        // Both kinds are 503 so the filter's fail-open/closed policy applies; only a
        // transient one invites a retry.
        problem_with_retry(
            StatusCode::SERVICE_UNAVAILABLE,
            problem_types::STORE_UNAVAILABLE,
            "lock store unavailable",
            Some(format!("{kind} store error")),
            err.is_transient().then_some(RETRY_AFTER_MS),
        )
    }

    fn lock_error(&self, err: LockError) -> Rejection {
        match err {
            LockError::Store(err) => self.store_error(&err),
            LockError::ShuttingDown => shutting_down(),
        }
    }
}

fn shutting_down() -> Rejection {
    problem_with_retry(
        StatusCode::SERVICE_UNAVAILABLE,
        problem_types::SHUTTING_DOWN,
        "sidecar shutting down",
        Some("retry on another instance".into()),
        Some(RETRY_AFTER_MS),
    )
}

// === authentication ===

/// Proof that the request carries the configured bearer token (always, without one): the
/// first extractor of every `/v1` and `/admin` handler, so a wrong token is refused before
/// anything else is looked at.
struct Authorized;

impl<S: Store> FromRequestParts<Arc<App<S>>> for Authorized {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<App<S>>) -> Result<Self, Rejection> {
        let Some(expected) = &app.config.auth_token else {
            return Ok(Authorized);
        };
        let given = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| bearer_token(v.as_bytes()))
            .unwrap_or_default();
        // Constant time in the token's content (a length mismatch fails fast, which only
        // reveals the length).
        if bool::from(given.ct_eq(expected.as_bytes())) {
            Ok(Authorized)
        } else {
            Err(problem(
                StatusCode::UNAUTHORIZED,
                problem_types::UNAUTHORIZED,
                "missing or wrong bearer token",
                None,
            ))
        }
    }
}

/// The token of a `Bearer` credential. The scheme is case-insensitive and followed by one
/// or more spaces (RFC 9110 §11.4, RFC 6750 §2.1): `bearer t`, `BEARER  t` carry `t`.
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer";
    let scheme = value.get(..SCHEME.len())?;
    let rest = value.get(SCHEME.len()..)?;
    if !scheme.eq_ignore_ascii_case(SCHEME) || rest.first() != Some(&b' ') {
        return None;
    }
    let start = rest.iter().position(|b| *b != b' ')?;
    rest.get(start..)
}

// === protocol ===

/// Reads the whole body, refusing more than the configured limit allows.
///
/// By hand rather than with `axum::body::to_bytes`: a protocol body is one DATA frame with
/// the end of the stream on it, which this returns as it came (no copy, no list of frames to
/// collect it in) and without polling the stream again to learn that it ended. That was
/// about a third of reading it, on every request (`benchmarks/sidecar.notes.md`).
/// The HTTP hop alone reads its bodies here too, so that the benchmarks' baseline is the
/// sidecar's own HTTP stack.
async fn read_body(limit: usize, req: Request) -> Result<Bytes, Rejection> {
    use axum::body::HttpBody as _;
    use http_body_util::BodyExt;
    let too_large = || {
        problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            problem_types::TOO_LARGE,
            "request body too large",
            Some(format!("at most {limit} bytes")),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let mut body = req.into_body();
    // The first data frame as it came, and the frames joined once a second one arrives.
    let mut first = Bytes::new();
    let mut joined = bytes::BytesMut::new();
    while !body.is_end_stream() {
        let Some(frame) = body.frame().await else {
            break;
        };
        let frame =
            frame.map_err(|err| bad_request(format!("cannot read the request body: {err}")))?;
        // Trailers carry nothing the protocol reads.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if first.len() + joined.len() + data.len() > limit {
            return Err(too_large());
        }
        if first.is_empty() && joined.is_empty() {
            first = data;
        } else {
            joined.extend_from_slice(&std::mem::take(&mut first));
            joined.extend_from_slice(&data);
        }
    }
    Ok(if joined.is_empty() {
        first
    } else {
        joined.freeze()
    })
}

fn framed<T: serde::Serialize>(head: &T, payload: &[u8]) -> Response {
    protocol_answer(idemgate_wire::encode(head, payload))
}

/// A claim's answer: a grant's head written by hand (`heads`), anything else through serde.
fn framed_claim(outcome: &ClaimOutcome, payload: &[u8]) -> Response {
    match heads::claim_head(outcome) {
        Some(head) if payload.is_empty() => protocol_answer(head),
        _ => framed(outcome, payload),
    }
}

/// A complete's, abort's, leave's or renewal's answer: `released` as a constant (`heads`),
/// anything else through serde.
fn framed_owner(outcome: &OwnerOutcome) -> Response {
    match heads::owner_head(outcome) {
        Some(head) => protocol_answer(head),
        None => framed(outcome, &[]),
    }
}

fn protocol_answer(frame: impl Into<Body>) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, idemgate_wire::CONTENT_TYPE)],
        frame.into(),
    )
        .into_response()
}

/// The longest request body read: the largest stored body and the head beside it.
fn body_limit(config: &Config) -> usize {
    config.limits.max_body.saturating_add(HEAD_ALLOWANCE)
}

/// Decodes a framed request; `with_payload` says whether a payload may follow the head.
fn decode<'a, T: Deserialize<'a>>(
    frame: &'a [u8],
    with_payload: bool,
) -> Result<(T, &'a [u8]), Rejection> {
    let (head, payload) =
        idemgate_wire::decode::<T>(frame).map_err(|e| bad_request(e.to_string()))?;
    if !with_payload && !payload.is_empty() {
        return Err(bad_request("this request takes no payload".into()));
    }
    Ok((head, payload))
}

async fn claim<S: Store>(State(app): AppState<S>, _: Authorized, req: Request) -> Answer {
    let frame = read_body(body_limit(&app.config), req).await?;
    let (req, _): (ClaimRequest, _) = decode(&frame, false)?;
    app.config.limits.claim(&req).map_err(field_problem)?;
    let (outcome, payload) = app.locks.claim(&req).await.map_err(|e| app.lock_error(e))?;
    Ok(framed_claim(&outcome, &payload))
}

async fn rate<S: Store>(State(app): AppState<S>, _: Authorized, req: Request) -> Answer {
    let frame = read_body(body_limit(&app.config), req).await?;
    let (req, _): (RateRequest, _) = decode(&frame, false)?;
    req.validate(app.config.limits.max_key_len)
        .map_err(field_problem)?;
    let outcome = timed_store_call(
        &app.metrics,
        StoreVerb::Rate,
        crate::rate::check(app.locks.store().as_ref(), &req),
    )
    .await
    .map_err(|e| app.store_error(&e))?;
    let limited = outcome.results.iter().any(|r| !r.allowed);
    let label = if limited { "limited" } else { "allowed" };
    telemetry::outcome(label);
    app.metrics.rate_decisions.with_label_values(&[label]).inc();
    Ok(framed(&outcome, &[]))
}

async fn complete<S: Store>(State(app): AppState<S>, _: Authorized, req: Request) -> Answer {
    let frame = read_body(body_limit(&app.config), req).await?;
    let (req, payload): (CompleteRequest, _) = decode(&frame, true)?;
    app.config
        .limits
        .complete(&req, payload)
        .map_err(field_problem)?;
    if req.response.is_some() && req.retention_ms == 0 {
        return Err(bad_request(
            "retention_ms: must be greater than zero with a response".into(),
        ));
    }
    let body = frame.slice_ref(payload);
    let outcome = app
        .locks
        .complete(req, body)
        .await
        .map_err(|e| app.lock_error(e))?;
    Ok(framed_owner(&outcome))
}

async fn abort<S: Store>(State(app): AppState<S>, _: Authorized, req: Request) -> Answer {
    let frame = read_body(body_limit(&app.config), req).await?;
    let (req, _): (AbortRequest, _) = decode(&frame, false)?;
    app.config.limits.abort(&req).map_err(field_problem)?;
    let outcome = app.locks.abort(&req).await.map_err(|e| app.lock_error(e))?;
    Ok(framed_owner(&outcome))
}

async fn leave<S: Store>(State(app): AppState<S>, _: Authorized, req: Request) -> Answer {
    let frame = read_body(body_limit(&app.config), req).await?;
    let (req, _): (LeaveRequest, _) = decode(&frame, false)?;
    app.config.limits.leave(&req).map_err(field_problem)?;
    let outcome = app.locks.leave(&req).await.map_err(|e| app.lock_error(e))?;
    Ok(framed_owner(&outcome))
}

async fn renew<S: Store>(State(app): AppState<S>, _: Authorized, req: Request) -> Answer {
    let frame = read_body(body_limit(&app.config), req).await?;
    let (req, _): (RenewRequest, _) = decode(&frame, false)?;
    app.config.limits.renew(&req).map_err(field_problem)?;
    let outcome = app.locks.renew(&req).await.map_err(|e| app.lock_error(e))?;
    Ok(framed_owner(&outcome))
}

/// The HTTP hop alone, for benchmarks: `claim` answers `granted` and `complete` answers
/// `released`, fixed bodies after reading the request as the sidecar does (`read_body`),
/// with no decoding, store or metrics — what every sidecar request costs before any
/// protocol work.
#[cfg(feature = "testing")]
pub(crate) fn canned_router(config: &Config) -> Router {
    let limit = body_limit(config);
    let granted = ClaimOutcome::Granted {
        owner: "0".repeat(32),
        fence: 1,
        lease_ms: 30_000,
        waited_ms: 0,
    };
    let answer = move |head: Bytes| {
        post(move |req: Request| async move {
            match read_body(limit, req).await {
                Ok(_) => protocol_answer(head),
                Err(rejection) => rejection.into_response(),
            }
        })
    };
    Router::new()
        .route(
            paths::CLAIM,
            answer(Bytes::from(idemgate_wire::encode(&granted, &[]))),
        )
        .route(
            paths::COMPLETE,
            answer(Bytes::from(idemgate_wire::encode(
                &OwnerOutcome::Released,
                &[],
            ))),
        )
}

// === admin, health, metrics ===

fn json<T: serde::Serialize>(value: &T) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_vec(value).unwrap_or_default(),
    )
        .into_response()
}

async fn list_keys<S: Store>(State(app): AppState<S>, _: Authorized, req: Request) -> Answer {
    let limit = match req
        .uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .find_map(|pair| pair.strip_prefix("limit="))
    {
        None => LIST_DEFAULT,
        Some(v) => match v.parse::<usize>() {
            Ok(n) if (1..=LIST_MAX).contains(&n) => n,
            _ => return Err(bad_request(format!("limit: must be 1..={LIST_MAX}"))),
        },
    };
    let (keys, truncated) = timed_store_call(
        &app.metrics,
        StoreVerb::Admin,
        app.locks.store().list_held(limit),
    )
    .await
    .map_err(|e| app.store_error(&e))?;
    Ok(json(
        &serde_json::json!({ "keys": keys, "truncated": truncated }),
    ))
}

async fn inspect_key<S: Store>(
    State(app): AppState<S>,
    _: Authorized,
    key: Result<Path<String>, PathRejection>,
) -> Answer {
    let Path(key) = key.map_err(|e| bad_request(e.body_text()))?;
    app.config.limits.key(&key).map_err(field_problem)?;
    let info = timed_store_call(
        &app.metrics,
        StoreVerb::Admin,
        app.locks.store().inspect(&key),
    )
    .await
    .map_err(|e| app.store_error(&e))?;
    Ok(json(&info))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseRequest {
    key: String,
}

async fn force_release<S: Store>(State(app): AppState<S>, _: Authorized, req: Request) -> Answer {
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.to_string())
        .unwrap_or_default();
    let body = read_body(body_limit(&app.config), req).await?;
    let release: ReleaseRequest =
        serde_json::from_slice(&body).map_err(|e| bad_request(e.to_string()))?;
    app.config.limits.key(&release.key).map_err(field_problem)?;
    let fence = timed_store_call(
        &app.metrics,
        StoreVerb::Admin,
        app.locks.store().force_release(&release.key),
    )
    .await
    .map_err(|e| app.store_error(&e))?;
    app.metrics.force_releases.inc();
    tracing::warn!(
        audit = "force_release",
        key_digest = %telemetry::key_digest(&release.key),
        released_fence = ?fence,
        %peer,
        "operator force-released a key"
    );
    Ok(json(
        &serde_json::json!({ "released": fence.is_some(), "fence": fence }),
    ))
}

async fn ready<S: Store>(State(app): AppState<S>) -> Answer {
    if *app.shutting_down.borrow() {
        return Err(shutting_down());
    }
    timed_store_call(&app.metrics, StoreVerb::Ready, app.locks.store().ping())
        .await
        .map_err(|e| app.store_error(&e))?;
    Ok((StatusCode::OK, "ready\n").into_response())
}

async fn metrics<S: Store>(State(app): AppState<S>) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        Body::from(app.metrics.render()),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for (header, token) in [
            (&b"Bearer t0k"[..], Some(&b"t0k"[..])),
            (b"bearer t0k", Some(b"t0k")),
            (b"BEARER t0k", Some(b"t0k")),
            (b"bEaReR   t0k", Some(b"t0k")),
            (b"Bearer", None),
            (b"Bearer ", None),
            (b"Bearert0k", None),
            (b"Basic t0k", None),
            (b"Bear t0k", None),
        ] {
            assert_eq!(bearer_token(header), token, "{header:?}");
        }
    }

    #[test]
    fn route_labels_name_the_route_patterns() {
        let others = [ADMIN_KEYS, ADMIN_RELEASE, HEALTHZ, READYZ, METRICS];
        for route in crate::metrics::PROTOCOL_ROUTES.into_iter().chain(others) {
            assert_eq!(route_label(route), route);
        }
        assert_eq!(route_label("/admin/v1/keys/a/b"), ADMIN_KEY);
        for unknown in ["/admin/v1/keys/", "/admin/v1/keysx", "/v1/claim/", "/", ""] {
            assert_eq!(route_label(unknown), "unmatched", "{unknown}");
        }
    }
}
