//! HTTP callouts owned by the root context (tokens 4, 8, 12, ...), timers (`on_tick`), and
//! shared-queue notifications posted to this VM: all delivered between exports, never
//! re-entrantly.

use super::Vm;
use super::lifecycle::Called;
use super::state::VmState;
use crate::headers::HeaderMap;
use crate::shared::Mailbox;
use std::sync::Arc;
use std::time::Duration;

/// An HTTP callout the plugin dispatched, waiting for an outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalloutRequest {
    /// Token 4, 8, 12, ... (per VM).
    pub token: u32,
    pub cluster: String,
    /// Includes `:method`, `:path`, `:authority`.
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    pub trailers: HeaderMap,
    /// `None` = no timeout (`timeout_ms == 0`).
    pub timeout: Option<Duration>,
}

/// How a callout ended, as Envoy reports it to the plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CalloutOutcome {
    /// A complete response (also Envoy-generated ones: 504 timeout, 503 connect failure).
    Response {
        /// Includes `:status`.
        headers: HeaderMap,
        body: Vec<u8>,
        trailers: HeaderMap,
    },
    /// Reset after a partial response: `(0, 0, 0)` and `get_status` = (11, "reset").
    Reset,
}

impl CalloutOutcome {
    /// A plain response with `:status` and a body.
    pub fn response(status: u16, headers: HeaderMap, body: impl Into<Vec<u8>>) -> Self {
        let mut all = HeaderMap::from([(":status", status.to_string())]);
        for (k, v) in headers.entries() {
            all.add(k, v);
        }
        Self::Response {
            headers: all,
            body: body.into(),
            trailers: HeaderMap::new(),
        }
    }

    /// Envoy's router answer when the callout's timeout expires.
    pub fn timeout() -> Self {
        Self::generated(504, "upstream request timeout")
    }

    /// Envoy's router answer when no connection could be made to the cluster.
    pub fn connect_failure() -> Self {
        Self::generated(
            503,
            "upstream connect error or disconnect/reset before headers. reset reason: connection failure",
        )
    }

    /// Envoy's router answer when the connection closes before response headers.
    pub fn generated_reset_before_headers() -> Self {
        Self::generated(
            503,
            "upstream connect error or disconnect/reset before headers. reset reason: connection termination",
        )
    }

    fn generated(status: u16, body: &str) -> Self {
        Self::response(
            status,
            HeaderMap::from([
                ("content-length", body.len().to_string()),
                ("content-type", "text/plain".to_owned()),
            ]),
            body,
        )
    }
}

pub(super) struct Callout {
    pub(super) request: CalloutRequest,
    pub(super) root: u32,
    pub(super) generation: u32,
    pub(super) deadline_ns: Option<u64>,
    pub(super) handed_out: bool,
}

impl VmState {
    /// Validates and records a callout on behalf of the root (HOST `root_context()`).
    pub(crate) fn register_callout(&mut self, mut request: CalloutRequest) -> u32 {
        self.next_callout_serial += 1;
        let token = self.next_callout_serial * 4;
        request.token = token;
        let deadline_ns = request
            .timeout
            .map(|t| self.now_ns().saturating_add(t.as_nanos() as u64));
        let root = self.root.as_ref().map_or(0, |r| r.id);
        self.callouts.insert(
            token,
            Callout {
                request,
                root,
                generation: self.generation,
                deadline_ns,
                handed_out: false,
            },
        );
        token
    }
}

impl Vm {
    /// Callouts not yet delivered, in token order.
    pub fn pending_callouts(&self) -> Vec<CalloutRequest> {
        self.store
            .data()
            .callouts
            .values()
            .map(|c| c.request.clone())
            .collect()
    }

    /// Callouts dispatched since the last call (for a live driver to send over the network).
    pub fn take_new_callouts(&mut self) -> Vec<CalloutRequest> {
        self.store
            .data_mut()
            .callouts
            .values_mut()
            .filter(|c| !c.handed_out)
            .map(|c| {
                c.handed_out = true;
                c.request.clone()
            })
            .collect()
    }

    /// Delivers a callout's outcome to the root context; false if the token is not pending
    /// (already answered, timed out, or cancelled with its root).
    pub fn deliver_callout(&mut self, token: u32, outcome: CalloutOutcome) -> bool {
        let state = self.store.data_mut();
        let Some(callout) = state.callouts.remove(&token) else {
            return false;
        };
        state.shared.end_request(&callout.request.cluster);
        if callout.generation != state.generation || state.failed {
            return true;
        }
        let (nh, nb, nt) = match &outcome {
            CalloutOutcome::Response {
                headers,
                body,
                trailers,
            } => (headers.len(), body.len(), trailers.len()),
            CalloutOutcome::Reset => {
                if let Some(root) = state.root.as_mut() {
                    root.status = (11, b"reset".to_vec());
                }
                (0, 0, 0)
            }
        };
        state.callout_response = Some(outcome);
        let root = callout.root;
        self.call(
            root,
            "proxy_on_http_call_response",
            |e| e.http_call_response.clone(),
            (root as i32, token as i32, nh as i32, nb as i32, nt as i32),
        );
        self.store.data_mut().callout_response = None;
        self.drain();
        true
    }

    /// The earliest timer or callout deadline (monotonic ns).
    pub fn next_deadline_ns(&self) -> Option<u64> {
        let state = self.store.data();
        let tick = state.root.as_ref().and_then(|r| r.next_tick_ns);
        let callout = state.callouts.values().filter_map(|c| c.deadline_ns).min();
        let grpc = state.grpc.next_deadline_ns();
        [tick, callout, grpc].into_iter().flatten().min()
    }

    /// Whether this VM's root has a tick to run that has not ended at or after `since_ns`
    /// ([`SharedState::ticked_since`](crate::SharedState::ticked_since)).
    pub(crate) fn awaits_tick_since(&self, since_ns: u64) -> bool {
        let state = self.store.data();
        !state.failed
            && state.root.as_ref().is_some_and(|r| r.tick_period.is_some())
            && !state
                .shared
                .ticked_since(&state.plugin.name, state.worker, since_ns)
    }

    /// Fires every due callout timeout (504), gRPC call timeout (close 14) and tick, in
    /// deadline order.
    pub fn fire_due(&mut self) {
        for _ in 0..10_000 {
            let now = self.store.data().now_ns();
            let state = self.store.data();
            let timed_out = state
                .callouts
                .iter()
                .filter_map(|(t, c)| c.deadline_ns.map(|d| (d, *t)))
                .filter(|(d, _)| *d <= now)
                .min();
            let tick = state
                .root
                .as_ref()
                .and_then(|r| r.next_tick_ns)
                .filter(|d| *d <= now);
            let grpc = self.grpc_due(now);
            // On equal deadlines: HTTP callouts, then gRPC calls, then the tick.
            let due = [
                timed_out.map(|(d, token)| (d, 0, token)),
                grpc.map(|(d, token)| (d, 1, token)),
                tick.map(|d| (d, 2, 0)),
            ];
            match due.into_iter().flatten().min() {
                Some((_, 0, token)) => {
                    self.deliver_callout(token, CalloutOutcome::timeout());
                }
                Some((_, 1, token)) => self.expire_grpc(token),
                Some(_) => self.tick(),
                None => return,
            }
        }
    }

    fn tick(&mut self) {
        let Some(root) = self.root_context_id() else {
            return;
        };
        if let Some(r) = self.store.data_mut().root.as_mut() {
            r.next_tick_ns = None;
        }
        let called = self.call(root, "proxy_on_tick", |e| e.tick.clone(), root as i32);
        if matches!(called, Called::Returned(_)) {
            let state = self.store.data();
            state.shared.note_tick(&state.plugin.name, state.worker);
        }
        let now = self.store.data().now_ns();
        if let Some(r) = self.store.data_mut().root.as_mut()
            && r.next_tick_ns.is_none()
            && !matches!(called, Called::Missing | Called::Failed)
        {
            // Re-armed after the callback returns (periods drift by its run time).
            r.next_tick_ns = r
                .tick_period
                .map(|p| now.saturating_add(p.as_nanos() as u64));
        }
        self.drain();
    }

    /// Delivers posted `on_queue_ready` notifications; returns how many ran.
    pub fn run_posted(&mut self) -> usize {
        let posted = self.store.data().mailbox.take();
        let mut ran = 0;
        for ready in posted {
            if self.root_context_id() == Some(ready.root_context_id) && !self.is_failed() {
                let root = ready.root_context_id as i32;
                self.call(
                    ready.root_context_id,
                    "proxy_on_queue_ready",
                    |e| e.queue_ready.clone(),
                    (root, ready.token as i32),
                );
                ran += 1;
                self.drain();
            }
        }
        ran
    }

    /// Whether events are posted to this VM and not yet run.
    pub fn has_posted(&self) -> bool {
        !self.store.data().mailbox.is_empty()
    }

    pub(crate) fn mailbox(&self) -> Arc<Mailbox> {
        Arc::clone(&self.store.data().mailbox)
    }
}
