//! The root context: validates the configuration once, owns the tick, and dispatches every
//! sidecar callout. Claims, renewals and releases all go out from here so that their answers
//! arrive at the root — the SDK silently drops an answer addressed to a stream that ended,
//! which would leave a granted key held until its lease ran out. The root applies a claim's
//! answer to its stream through `set_effective_context`.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use idemgate_core::metrics::Counter;
use idemgate_core::{
    Action, Answer, Callout, Config, Env, Flow, Lookups, ReleaseResult, TraceContext,
    on_leave_answer, on_release_answer,
};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType};

use crate::host::{self, Metrics, SharedData};
use crate::stream::Stream;
use crate::vm::{Call, PendingRelease, SharedVm, Vm};

/// Shared-data key handing out VM numbers: owner ids must differ across workers.
const VM_SEQUENCE_KEY: &str = "idemgate.v1.vm-sequence";

pub(crate) struct Root {
    vm: SharedVm,
}

impl Root {
    pub(crate) fn new() -> Root {
        Root {
            vm: Rc::new(RefCell::new(Vm::default())),
        }
    }
}

impl Context for Root {
    /// The plugin is going away: the counters' last increments are handed to the host.
    fn on_done(&mut self) -> bool {
        self.vm.borrow_mut().metrics.flush();
        true
    }

    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let mut vm = self.vm.borrow_mut();
        let Some(call) = vm.calls.remove(&token_id) else {
            return;
        };
        let (status, body) = host::callout_answer(num_headers, body_size);
        if status != 200 {
            log::warn!(
                "idemgate: sidecar answered {}",
                if status == 0 {
                    "nothing (reset)".into()
                } else {
                    status.to_string()
                }
            );
        }
        let answer = host::as_answer(status, &body);
        match call {
            Call::Decision(stream) => settle_decision(&mut vm, stream, answer),
            Call::Renew(stream) => {
                vm.with_flow(stream, |config, flow, env| {
                    flow.on_renew_answer(config, answer, env)
                });
            }
            Call::Release(release) => {
                let again = if release.callout.path == idemgate_wire::paths::LEAVE {
                    match on_leave_answer(answer, &mut vm.metrics) {
                        ReleaseResult::Done => false,
                        // No place yet: the claim may not have reached its queue when the
                        // client left. Again on the next tick while its answer is still due.
                        ReleaseResult::Stale => vm.flows.contains_key(&release.stream),
                        ReleaseResult::Retry => true,
                    }
                } else {
                    on_release_answer(answer, &mut vm.metrics) == ReleaseResult::Retry
                };
                if again {
                    retry(&mut vm, release);
                }
            }
        }
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        log::info!(
            "idemgate {} ({}) starting",
            env!("CARGO_PKG_VERSION"),
            env!("IDEMGATE_GIT_COMMIT")
        );
        true
    }

    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let bytes = hostcalls::get_buffer(
            BufferType::PluginConfiguration,
            0,
            plugin_configuration_size,
        )
        .ok()
        .flatten()
        .unwrap_or_default();
        // `sidecar.token_env`: WASI's environment is Envoy's
        // `vm_config.environment_variables` (Istio `vmConfig.env`, Envoy Gateway `env`).
        let config = idemgate_core::config::parse(&bytes).and_then(|mut config| {
            config
                .sidecar
                .resolve_token(crate::environment::var)
                .map(|()| config)
        });
        let config = match config {
            Ok(config) => config,
            Err(e) => {
                log::error!("idemgate: invalid configuration: {e}");
                return false;
            }
        };
        log::info!(
            "idemgate: {} rule(s), sidecar cluster {}, failure mode {:?}{}",
            config.rules.len(),
            config.sidecar.cluster,
            config.failure_mode,
            if config.shadow { ", shadow mode" } else { "" }
        );
        let mut vm = self.vm.borrow_mut();
        let number = vm_number();
        vm.nonce = u64::from(number) << 32;
        if vm.waiter_secret.is_none() {
            let mut secret = [0u8; 32];
            if getrandom::fill(&mut secret).is_ok() {
                vm.waiter_secret = Some(secret);
            } else {
                log::error!("idemgate: no host randomness: queued claims cannot be left");
            }
        }
        vm.wake_queue = host::register_wake_queue(number);
        // A new configuration's metrics replace the old ones: what the old ones counted first.
        vm.metrics.flush();
        vm.metrics = Metrics::define(&config);
        vm.config = Some(Rc::new(config));
        vm.rearm();
        true
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        host::drain_wake_queue(queue_id);
        let mut vm = self.vm.borrow_mut();
        let Some(config) = vm.config.clone() else {
            return;
        };
        dispatch_queued(&mut vm, &config);
        // A request of this worker may have ended: its parked duplicates need not wait for
        // the poll.
        settle_waits(&mut vm);
    }

    fn on_tick(&mut self) {
        let mut vm = self.vm.borrow_mut();
        let Some(config) = vm.config.clone() else {
            return;
        };
        vm.fast_tick = false;
        dispatch_queued(&mut vm, &config);
        settle_waits(&mut vm);
        // The rest keeps the configured period, whatever the tick's (a failed release's
        // retry on the next regular tick is its backoff).
        let now = host::now_ms();
        if now >= vm.next_regular_ms {
            vm.next_regular_ms = now.saturating_add(config.tick_ms);
            let retries = std::mem::take(&mut vm.retries);
            dispatch_releases(&mut vm, &config, retries);
            for (stream, callout) in vm.tick_work() {
                match dispatch(&config, &callout, vm.flows.get(&stream).map(Flow::trace)) {
                    Some(token) => {
                        vm.calls.insert(token, Call::Renew(stream));
                    }
                    None => {
                        vm.with_flow(stream, |config, flow, env| {
                            flow.on_renew_answer(config, Answer::Failed, env)
                        });
                    }
                }
            }
        }
        // On every tick, not only the regular ones: the counters lag by at most one period.
        vm.metrics.flush();
        vm.rearm();
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream::new(context_id, self.vm.clone())))
    }
}

/// A unique number for this VM among all VMs sharing the `vm_id` (CAS on one shared key).
fn vm_number() -> u32 {
    use idemgate_core::SharedStore;
    for _ in 0..16 {
        let Ok(current) = SharedData.get(VM_SEQUENCE_KEY) else {
            break;
        };
        let (next, cas) = match current {
            Some((bytes, cas)) => {
                let n = bytes.try_into().map(u32::from_le_bytes).unwrap_or(0);
                (n.wrapping_add(1), Some(cas))
            }
            None => (1, None),
        };
        if let Ok(true) = SharedData.set(VM_SEQUENCE_KEY, &next.to_le_bytes(), cas) {
            return next;
        }
    }
    // Contention beyond reason: fall back to the clock, unique enough for owner ids.
    (host::now_ms() & 0xffff_ffff) as u32
}

/// Sends the decision callouts and releases the streams queued since the last wake-up.
fn dispatch_queued(vm: &mut Vm, config: &Config) {
    vm.kicked = false;
    for (stream, callout) in std::mem::take(&mut vm.decisions) {
        match dispatch(config, &callout, vm.flows.get(&stream).map(Flow::trace)) {
            Some(token) => {
                vm.calls.insert(token, Call::Decision(stream));
            }
            None => settle_decision(vm, stream, Answer::Failed),
        }
    }
    let releases = std::mem::take(&mut vm.releases);
    dispatch_releases(vm, config, releases);
}

fn dispatch_releases(vm: &mut Vm, config: &Config, releases: Vec<PendingRelease>) {
    for release in releases {
        // A leave is best effort and never sent into an open breaker: the place it gives up
        // ends with its wait budget anyway.
        if release.callout.path == idemgate_wire::paths::LEAVE && vm.breaker.is_open(host::now_ms())
        {
            continue;
        }
        match dispatch(config, &release.callout, Some(&release.trace)) {
            Some(token) => {
                vm.calls.insert(token, Call::Release(release));
            }
            None => retry(vm, release),
        }
    }
}

/// Sends a callout, carrying its request's trace context (`None`: the flow is gone).
fn dispatch(config: &Config, callout: &Callout, trace: Option<&TraceContext>) -> Option<u32> {
    let auth = config.sidecar.token.as_ref().map(|t| format!("Bearer {t}"));
    let mut headers = vec![
        (":method", "POST"),
        (":path", callout.path),
        (":authority", config.sidecar.authority.as_str()),
        ("content-type", idemgate_wire::CONTENT_TYPE),
    ];
    if let Some(auth) = &auth {
        headers.push(("authorization", auth.as_str()));
    }
    headers.extend(trace.into_iter().flat_map(TraceContext::headers));
    // Envoy reads the timeout as a signed 32-bit value.
    let timeout = Duration::from_millis(callout.timeout_ms.min(i32::MAX as u64));
    match hostcalls::dispatch_http_call(
        &config.sidecar.cluster,
        headers,
        Some(&callout.body),
        vec![],
        timeout,
    ) {
        Ok(token) => Some(token),
        Err(status) => {
            log::warn!(
                "idemgate: callout to cluster {} refused: {status:?}",
                config.sidecar.cluster
            );
            None
        }
    }
}

/// Retries every local wait ([`Flow::waits_locally`]), reading each waited-on key once.
fn settle_waits(vm: &mut Vm) {
    if !vm.waiting {
        return;
    }
    let mut seen = Lookups::default();
    let now_ms = host::now_ms();
    for stream in vm.waiting_streams() {
        if vm
            .flows
            .get(&stream)
            .is_some_and(|f| seen.unchanged(f, now_ms))
        {
            continue;
        }
        settle(vm, stream, &mut |config, flow, env| {
            flow.on_local_wait_tick(config, env, &mut seen)
        });
    }
    // Cleared (and the poll stopped, on the tick's re-arm) once none waits.
    vm.waiting_streams();
}

/// Applies a decision's answer (to a claim or a rate check) to its flow and, if the stream is
/// still paused, to the stream.
fn settle_decision(vm: &mut Vm, stream: u32, answer: Answer<'_>) {
    settle(vm, stream, &mut |config, flow, env| {
        Some(flow.on_decision(config, answer, env))
    });
}

/// What a decision made at the root means for its stream.
enum ForStream {
    /// Nothing yet (a local wait goes on).
    Nothing,
    /// The stream is gone (its client left while the claim was out): the flow is dropped.
    Gone,
    Apply(Action),
}

/// Applies a decision made at the root (a claim's answer, the end of a local wait) to its
/// flow and, if the stream is still paused, to the stream.
fn settle(
    vm: &mut Vm,
    stream: u32,
    // `dyn`: one copy of this in the module whatever the caller (the size budget).
    decide: &mut dyn FnMut(&Config, &mut Flow, &mut Env<'_>) -> Option<Action>,
) {
    let settled = vm.with_flow(stream, |config, flow, env| {
        let abandoned = flow.is_abandoned();
        let for_stream = match decide(config, flow, env) {
            _ if abandoned => ForStream::Gone,
            None => ForStream::Nothing,
            Some(_) if hostcalls::set_effective_context(stream).is_err() => {
                // Envoy no longer knows the stream: treat it as gone.
                flow.on_stream_end(config, env);
                ForStream::Gone
            }
            Some(action) => ForStream::Apply(action),
        };
        (for_stream, flow.take_release())
    });
    let Some((for_stream, release)) = settled else {
        return;
    };
    if matches!(for_stream, ForStream::Apply(_)) {
        // The stream is the effective context now.
        vm.publish_flow(stream);
    }
    if let Some(release) = release {
        vm.queue_release(stream, release);
    }
    match for_stream {
        ForStream::Nothing => {}
        ForStream::Gone => {
            vm.flows.remove(&stream);
        }
        ForStream::Apply(Action::Continue(headers)) => {
            host::set_request_headers(&headers);
            if hostcalls::resume_http_request().is_err() {
                log::error!("idemgate: could not resume #{stream}");
            }
        }
        ForStream::Apply(Action::Respond(reply)) => host::send_reply(&reply),
        // The rate check passed: the key's claim goes out next.
        ForStream::Apply(Action::Decide(callout)) => vm.queue_decision(stream, callout),
        ForStream::Apply(Action::Pause) => {}
        ForStream::Apply(Action::Wait) => vm.poll_waits(),
    }
}

fn retry(vm: &mut Vm, mut release: PendingRelease) {
    release.attempts += 1;
    let attempts = vm.config.as_ref().map_or(1, |c| c.release_attempts);
    if release.attempts < attempts {
        vm.metrics.add(Counter::ReleaseRetries, 1);
        vm.retries.push(release);
    } else {
        vm.metrics.add(Counter::ReleaseFailures, 1);
        log::error!(
            "idemgate: giving up a {} after {attempts} attempts: its lease or wait budget ends it",
            release.callout.path
        );
    }
}
