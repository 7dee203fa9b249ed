//! The HTTP context: a translator between Envoy's stream callbacks and the request's `Flow`
//! (kept in the VM state so the root can apply the sidecar's answers to it).

use idemgate_core::metrics::Counter;
use idemgate_core::{Action, Env, Flow};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action as Next, BufferType};

use crate::host::{self, RequestHeaders};
use crate::vm::{self, SharedVm, Vm};

pub(crate) struct Stream {
    id: u32,
    vm: SharedVm,
    /// A `Flow` was created for this stream. Without one every later callback has nothing to
    /// do: the flag spares requests that match no rule the VM borrow and the flow lookup.
    tracked: bool,
}

impl Stream {
    pub(crate) fn new(id: u32, vm: SharedVm) -> Stream {
        Stream {
            id,
            vm,
            tracked: false,
        }
    }

    /// Carries out a request-side action; returns what the callback returns to Envoy.
    fn apply(&self, vm: &mut Vm, action: Action) -> Next {
        match action {
            Action::Continue(headers) => {
                host::set_request_headers(&headers);
                Next::Continue
            }
            Action::Pause => Next::Pause,
            Action::Wait => {
                vm.poll_waits();
                Next::Pause
            }
            Action::Decide(callout) => {
                vm.queue_decision(self.id, callout);
                Next::Pause
            }
            Action::Respond(reply) => {
                host::send_reply(&reply);
                Next::Pause
            }
        }
    }

    /// Passes a response event to the flow and queues the release it may produce.
    fn response_event(&mut self, f: impl FnOnce(&idemgate_core::Config, &mut Flow, &mut Env<'_>)) {
        if !self.tracked {
            return;
        }
        let mut vm = self.vm.borrow_mut();
        let release = vm.with_flow(self.id, |config, flow, env| {
            if flow.watches_response() {
                f(config, flow, env);
            }
            flow.take_release()
        });
        if let Some(Some(release)) = release {
            vm.queue_release(self.id, release);
        }
    }

    fn request_body(&mut self, buffered: usize, end_of_stream: bool) -> Next {
        if !self.tracked {
            return Next::Continue;
        }
        let mut vm = self.vm.borrow_mut();
        let action = vm.with_flow(self.id, |config, flow, env| {
            flow.holds_request().then(|| {
                let mut read = |n| host::body(BufferType::HttpRequestBody, n);
                flow.on_request_body(
                    config,
                    &RequestHeaders::default(),
                    buffered,
                    end_of_stream,
                    &mut read,
                    env,
                )
            })
        });
        vm.publish_flow(self.id);
        match action.flatten() {
            Some(action) => self.apply(&mut vm, action),
            None => Next::Continue,
        }
    }
}

impl Context for Stream {
    fn on_done(&mut self) -> bool {
        if !self.tracked {
            return true;
        }
        let mut vm = self.vm.borrow_mut();
        let ended = vm.with_flow(self.id, |config, flow, env| {
            (flow.on_stream_end(config, env), flow.take_release())
        });
        let Some((awaiting_answer, release)) = ended else {
            return true;
        };
        let undispatched = vm.decisions.iter().position(|(id, _)| *id == self.id);
        if let Some(i) = undispatched {
            // Never sent: nobody at the sidecar holds anything for it (nor a place to leave).
            vm.decisions.remove(i);
        } else if let Some(release) = release {
            vm.queue_release(self.id, release);
        }
        if !awaiting_answer || undispatched.is_some() {
            vm.flows.remove(&self.id);
        }
        true
    }
}

/// Only idemgate sets these on what reaches the backend: a client's copy (a forged fencing
/// token, a fake degraded or would-block mark) is removed from every request the filter lets
/// on, matched or not, before anything else can forward it.
#[inline(never)]
fn strip_forged(config: &idemgate_core::Config) {
    host::remove_request_header(&config.fencing_header);
    host::remove_request_header(&config.degraded_header);
    if let Some(header) = &config.would_block_header {
        host::remove_request_header(header);
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Next {
        let mut vm = self.vm.borrow_mut();
        let headers = RequestHeaders::default();
        // Most requests match no rule: decided on a borrowed config, without touching its `Rc`.
        let route = vm.config.as_deref().and_then(|config| {
            let route = Flow::route(config, &headers);
            if route.is_none() {
                strip_forged(config);
            }
            route
        });
        let Some(route) = route else {
            vm.metrics.add(Counter::Pass, 1);
            return Next::Continue;
        };
        let Some(config) = vm.config.clone() else {
            return Next::Continue;
        };
        let owner = vm.next_owner();
        let rule = route.rule_index();
        let (flow, action) = {
            let Vm {
                breaker,
                metrics,
                waiter_secret,
                digests,
                ..
            } = &mut *vm;
            metrics.rule = rule;
            metrics.noted = idemgate_core::Noted::default();
            let mut env = vm::host_env(breaker, metrics, digests, owner, waiter_secret.as_ref());
            Flow::on_request_headers(&config, route, &headers, end_of_stream, &mut env)
        };
        // A request answered here (a local 409, 429 or replay) never reaches the backend, so
        // only one that may go on has a client's copies to lose; before `publish` and
        // `apply`, which may set idemgate's own.
        if !matches!(action, Action::Respond(_)) {
            strip_forged(&config);
        }
        // A request answered here has nothing left to track either.
        if let Some(flow) = flow.filter(|flow| !flow.is_done()) {
            vm.flows.insert(self.id, flow);
            self.tracked = true;
        }
        vm.publish(self.id, rule);
        self.apply(&mut vm, action)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Next {
        self.request_body(body_size, end_of_stream)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Next {
        // Trailers end the request: no body callback carried end_of_stream.
        self.request_body(0, true)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Next {
        self.response_event(|config, flow, env| {
            let headers = host::response_headers();
            flow.on_response_headers(config, &headers, end_of_stream, env);
            host::add_response_headers(&flow.take_response_headers());
        });
        Next::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Next {
        self.response_event(|config, flow, env| {
            let chunk = if flow.wants_response_body() && body_size > 0 {
                host::body(BufferType::HttpResponseBody, body_size).unwrap_or_default()
            } else {
                Vec::new()
            };
            flow.on_response_body(config, &chunk, end_of_stream, env);
        });
        Next::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Next {
        self.response_event(|config, flow, env| {
            let trailers = if flow.is_grpc() {
                host::response_trailers()
            } else {
                Vec::new()
            };
            flow.on_response_trailers(config, &trailers, env);
        });
        Next::Continue
    }
}
