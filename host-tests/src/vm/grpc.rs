//! gRPC calls and streams owned by the root context, as Envoy's wasm `Context` keeps them
//! (envoy `source/extensions/common/wasm/context.cc`: `grpcCall`, `grpcStream`, `grpcSend`,
//! `grpcClose`, `grpcCancel`, `onGrpcReceiveInitialMetadata`, `onGrpcReceive`,
//! `onGrpcReceiveTrailingMetadata`, `onGrpcClose`; proxy-wasm-cpp-host `src/exports.cc`).
//!
//! The VM is sans-IO here too: hostcalls record [`GrpcAction`]s for a transport to carry out
//! (the gateway's HTTP/2 client), and the transport feeds back [`GrpcEvent`]s, which become
//! the `proxy_on_grpc_*` callbacks on the root, between exports.

use super::Vm;
use super::state::VmState;
use crate::grpc::GrpcTarget;
use crate::headers::HeaderMap;
use std::time::Duration;

/// Whether a token names a unary call or a stream (Envoy's token low bits: 1 and 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcKind {
    Call,
    Stream,
}

impl GrpcKind {
    /// The kind a token encodes, if any.
    pub(crate) fn of(token: u32) -> Option<Self> {
        match token & 3 {
            1 => Some(Self::Call),
            2 => Some(Self::Stream),
            _ => None,
        }
    }
}

/// A gRPC call or stream to start upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcRequest {
    /// Calls 5, 9, 13, ...; streams 6, 10, 14, ... (per VM).
    pub token: u32,
    pub kind: GrpcKind,
    pub cluster: String,
    /// Includes `:method`, `:path`, `:authority`, `te`, `content-type` (and `grpc-timeout`
    /// for calls), then the metadata.
    pub headers: HeaderMap,
    /// The unary call's request message.
    pub message: Option<Vec<u8>>,
}

/// What the plugin asked of its gRPC exchanges, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrpcAction {
    Start(GrpcRequest),
    /// A stream message (`proxy_grpc_send`), ending the request side if `end_stream`.
    Send {
        token: u32,
        message: Vec<u8>,
        end_stream: bool,
    },
    /// `proxy_grpc_close` on a stream: the request side ends (empty DATA with end_stream).
    HalfClose {
        token: u32,
    },
    /// Cancelled, timed out, or its root died: reset the HTTP/2 stream, report nothing.
    Cancel {
        token: u32,
    },
}

/// What came back from upstream for an exchange, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrpcEvent {
    InitialMetadata(HeaderMap),
    Message(Vec<u8>),
    TrailingMetadata(HeaderMap),
    /// The end: `grpc-status` (2 Unknown when missing) and the decoded `grpc-message`.
    Close {
        status: u32,
        message: String,
    },
}

impl GrpcEvent {
    /// The close Envoy reports when a call's timeout expires: its router answers the async
    /// client with a local 504, which a gRPC request gets as `grpc-status` 14.
    pub fn timeout() -> Self {
        Self::Close {
            status: 14,
            message: "upstream request timeout".into(),
        }
    }
}

/// One exchange the root has open.
pub(super) struct GrpcExchange {
    kind: GrpcKind,
    root: u32,
    generation: u32,
    deadline_ns: Option<u64>,
    /// A unary call's response message, delivered when the call closes with status 0.
    response: Option<Vec<u8>>,
}

/// What the running `proxy_on_grpc_*` callback may read (Envoy keeps them on the root
/// context only for the duration of the callback).
#[derive(Debug, Default)]
pub(crate) struct GrpcDelivery {
    /// Buffer type 5 (`GrpcReceiveBuffer`).
    pub(crate) message: Option<Vec<u8>>,
    /// Map type 4 (`GrpcReceiveInitialMetadata`).
    pub(crate) initial_metadata: Option<HeaderMap>,
    /// Map type 5 (`GrpcReceiveTrailingMetadata`).
    pub(crate) trailing_metadata: Option<HeaderMap>,
}

/// Per-VM gRPC bookkeeping.
#[derive(Default)]
pub(crate) struct GrpcState {
    exchanges: std::collections::BTreeMap<u32, GrpcExchange>,
    actions: Vec<GrpcAction>,
    next_call: u32,
    next_stream: u32,
    pub(crate) delivery: GrpcDelivery,
}

impl GrpcState {
    /// A new VM instance (reload): the old root's exchanges are cancelled.
    pub(super) fn restart(&mut self) {
        let tokens: Vec<u32> = self.exchanges.keys().copied().collect();
        self.exchanges.clear();
        self.actions
            .extend(tokens.into_iter().map(|token| GrpcAction::Cancel { token }));
        self.next_call = 0;
        self.next_stream = 0;
    }

    pub(super) fn next_deadline_ns(&self) -> Option<u64> {
        self.exchanges.values().filter_map(|e| e.deadline_ns).min()
    }

    pub(super) fn due(&self, now: u64) -> Option<(u64, u32)> {
        self.exchanges
            .iter()
            .filter_map(|(t, e)| e.deadline_ns.map(|d| (d, *t)))
            .filter(|(d, _)| *d <= now)
            .min()
    }
}

impl VmState {
    /// Starts a call (`message` is its request) or a stream on behalf of the root.
    pub(crate) fn start_grpc(
        &mut self,
        kind: GrpcKind,
        target: GrpcTarget,
        path: (&str, &str),
        metadata: &HeaderMap,
        message: Option<Vec<u8>>,
        timeout: Option<Duration>,
    ) -> u32 {
        let now = self.now_ns();
        let root = self.root.as_ref().map_or(0, |r| r.id);
        let generation = self.generation;
        let grpc = &mut self.grpc;
        let token = match kind {
            GrpcKind::Call => {
                grpc.next_call += 1;
                grpc.next_call * 4 + 1
            }
            GrpcKind::Stream => {
                grpc.next_stream += 1;
                grpc.next_stream * 4 + 2
            }
        };
        // Envoy always sets a call's timeout (0 sends `grpc-timeout: 0m`, and its router
        // treats 0 as no timeout); streams have none.
        let headers = crate::grpc::request_headers(&target, path.0, path.1, timeout, metadata);
        let deadline_ns = timeout
            .filter(|t| !t.is_zero())
            .map(|t| now.saturating_add(t.as_nanos() as u64));
        grpc.exchanges.insert(
            token,
            GrpcExchange {
                kind,
                root,
                generation,
                deadline_ns,
                response: None,
            },
        );
        grpc.actions.push(GrpcAction::Start(GrpcRequest {
            token,
            kind,
            cluster: target.cluster,
            headers,
            message,
        }));
        token
    }

    /// `proxy_grpc_send`: streams only (a call token is BadArgument).
    pub(crate) fn grpc_send(
        &mut self,
        token: u32,
        message: Vec<u8>,
        end_stream: bool,
    ) -> crate::abi::Status {
        use crate::abi::Status;
        if GrpcKind::of(token) == Some(GrpcKind::Call) {
            return Status::BadArgument;
        }
        if !self.grpc.exchanges.contains_key(&token) {
            return Status::NotFound;
        }
        self.grpc.actions.push(GrpcAction::Send {
            token,
            message,
            end_stream,
        });
        Status::Ok
    }

    /// `proxy_grpc_cancel`, and `proxy_grpc_close` on a call: forgotten at once, no callback.
    /// `proxy_grpc_close` on a stream half-closes it; its remote close is still reported.
    pub(crate) fn grpc_end(&mut self, token: u32, cancel: bool) -> crate::abi::Status {
        use crate::abi::Status;
        let Some(exchange) = self.grpc.exchanges.get(&token) else {
            return Status::NotFound;
        };
        if exchange.kind == GrpcKind::Stream && !cancel {
            self.grpc.actions.push(GrpcAction::HalfClose { token });
        } else {
            self.grpc.exchanges.remove(&token);
            self.grpc.actions.push(GrpcAction::Cancel { token });
        }
        Status::Ok
    }
}

impl Vm {
    /// gRPC actions recorded since the last call, for the transport to carry out in order.
    pub fn take_grpc_actions(&mut self) -> Vec<GrpcAction> {
        std::mem::take(&mut self.store.data_mut().grpc.actions)
    }

    /// gRPC exchanges still open, by token.
    pub fn open_grpc_tokens(&self) -> Vec<u32> {
        self.store.data().grpc.exchanges.keys().copied().collect()
    }

    /// Delivers what came back for an exchange to the root (Envoy's `onGrpc*`); false if the
    /// token is not open (cancelled, timed out, closed, or its root died). A unary call gets
    /// no metadata callbacks, `proxy_on_grpc_receive` on success and `proxy_on_grpc_close` on
    /// failure only; a stream gets each event as it comes, ending with the close.
    pub fn deliver_grpc(&mut self, token: u32, event: GrpcEvent) -> bool {
        let state = self.store.data_mut();
        let Some(exchange) = state.grpc.exchanges.get_mut(&token) else {
            return false;
        };
        if exchange.generation != state.generation || state.failed {
            state.grpc.exchanges.remove(&token);
            return true;
        }
        let (kind, root) = (exchange.kind, exchange.root);
        let ctx = root as i32;
        match (kind, event) {
            (GrpcKind::Call, GrpcEvent::InitialMetadata(_) | GrpcEvent::TrailingMetadata(_)) => {}
            (GrpcKind::Call, GrpcEvent::Message(message)) => exchange.response = Some(message),
            (GrpcKind::Call, GrpcEvent::Close { status, message }) => {
                let response = exchange.response.take();
                state.grpc.exchanges.remove(&token);
                match response {
                    Some(response) if status == 0 => {
                        let size = response.len() as i32;
                        state.grpc.delivery.message = Some(response);
                        self.call(
                            root,
                            "proxy_on_grpc_receive",
                            |e| e.grpc_receive.clone(),
                            (ctx, token as i32, size),
                        );
                    }
                    // A call that ends OK without a message is Internal
                    // (`AsyncRequestImpl::onRemoteClose`).
                    None if status == 0 => self.grpc_close(root, token, 13, String::new()),
                    _ => self.grpc_close(root, token, status, message),
                }
            }
            (GrpcKind::Stream, GrpcEvent::InitialMetadata(headers)) => {
                let n = headers.len() as i32;
                state.grpc.delivery.initial_metadata = Some(headers);
                self.call(
                    root,
                    "proxy_on_grpc_receive_initial_metadata",
                    |e| e.grpc_receive_initial_metadata.clone(),
                    (ctx, token as i32, n),
                );
            }
            (GrpcKind::Stream, GrpcEvent::Message(message)) => {
                let size = message.len() as i32;
                state.grpc.delivery.message = Some(message);
                self.call(
                    root,
                    "proxy_on_grpc_receive",
                    |e| e.grpc_receive.clone(),
                    (ctx, token as i32, size),
                );
            }
            (GrpcKind::Stream, GrpcEvent::TrailingMetadata(trailers)) => {
                let n = trailers.len() as i32;
                state.grpc.delivery.trailing_metadata = Some(trailers);
                self.call(
                    root,
                    "proxy_on_grpc_receive_trailing_metadata",
                    |e| e.grpc_receive_trailing_metadata.clone(),
                    (ctx, token as i32, n),
                );
            }
            (GrpcKind::Stream, GrpcEvent::Close { status, message }) => {
                state.grpc.exchanges.remove(&token);
                self.grpc_close(root, token, status, message);
            }
        }
        self.store.data_mut().grpc.delivery = GrpcDelivery::default();
        self.drain();
        true
    }

    /// `proxy_on_grpc_close`, with the status readable through `proxy_get_status` during the
    /// callback (Envoy's `onGrpcCloseWrapper`; the code stays, the message is cleared after).
    fn grpc_close(&mut self, root: u32, token: u32, status: u32, message: String) {
        if let Some(r) = self.store.data_mut().root.as_mut() {
            r.status = (status, message.into_bytes());
        }
        self.call(
            root,
            "proxy_on_grpc_close",
            |e| e.grpc_close.clone(),
            (root as i32, token as i32, status as i32),
        );
        if let Some(r) = self.store.data_mut().root.as_mut() {
            r.status.1.clear();
        }
    }

    /// Times out the earliest due gRPC call, if any is due at `now`: the transport is told to
    /// cancel it and the plugin gets Envoy's timeout close.
    pub(super) fn grpc_due(&self, now: u64) -> Option<(u64, u32)> {
        self.store.data().grpc.due(now)
    }

    pub(super) fn expire_grpc(&mut self, token: u32) {
        self.store
            .data_mut()
            .grpc
            .actions
            .push(GrpcAction::Cancel { token });
        self.deliver_grpc(token, GrpcEvent::timeout());
    }
}
