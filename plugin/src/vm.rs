//! The state one VM's root context shares with its streams (same thread, so `Rc<RefCell>`):
//! the compiled configuration, the breaker, metrics, every live request's `Flow`, and the
//! callouts waiting for the root to dispatch them.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

use idemgate_core::{Breaker, Callout, Config, DigestMemo, Env, Flow, Noted, TraceContext};

use crate::host::{self, Metrics, SharedData};

pub(crate) type SharedVm = Rc<RefCell<Vm>>;

/// The tick's period while a flow waits on shared data for a request on another worker
/// (this worker's own requests wake the root when they end): shared queues notify only the
/// VM that registered them, so a worker cannot be told, and polling one key per tick costs
/// a shared-data read.
pub(crate) const WAIT_POLL_MS: u64 = 1;

/// What a dispatched callout was for; its answer is routed by token.
pub(crate) enum Call {
    /// A decision callout of a stream: its claim, or its rate checks.
    Decision(u32),
    Renew(u32),
    Release(PendingRelease),
}

/// A complete/abort/leave callout, retried a bounded number of times.
pub(crate) struct PendingRelease {
    pub(crate) callout: Callout,
    pub(crate) attempts: u32,
    /// The stream it releases for (a leave is retried while that stream's claim is unanswered).
    pub(crate) stream: u32,
    /// Its request's trace context (the flow may be gone when it is sent).
    pub(crate) trace: TraceContext,
}

#[derive(Default)]
pub(crate) struct Vm {
    pub(crate) config: Option<Rc<Config>>,
    pub(crate) breaker: Breaker,
    pub(crate) metrics: Metrics,
    /// Live requests (and abandoned ones whose claim answer is still due), by stream id.
    /// Ordered maps: no hashing cost, and few entries per worker.
    pub(crate) flows: BTreeMap<u32, Flow>,
    /// Decision callouts (claims and rate checks) the root dispatches when next woken, by
    /// stream id.
    pub(crate) decisions: Vec<(u32, Callout)>,
    pub(crate) releases: Vec<PendingRelease>,
    /// Releases whose callout failed: sent again on the next regular tick, a natural backoff.
    pub(crate) retries: Vec<PendingRelease>,
    pub(crate) calls: BTreeMap<u32, Call>,
    /// A wake-up is on its way to dispatch queued callouts (cleared when the root runs).
    pub(crate) kicked: bool,
    /// The 1 ms fallback tick is armed (the tick goes back to its period when it fires).
    pub(crate) fast_tick: bool,
    /// Some flow waits on this gateway's shared data ([`Flow::waits_locally`]): the tick
    /// polls it every [`WAIT_POLL_MS`].
    pub(crate) waiting: bool,
    /// The tick period last set (ms; 0 = none yet).
    pub(crate) tick_armed_ms: u64,
    /// When the tick's regular work (renewals, release retries) is next due.
    pub(crate) next_regular_ms: u64,
    /// This VM's own shared queue: an enqueue makes Envoy run the root's `on_queue_ready` on
    /// the next turn of this worker's event loop. `None`: wake-ups fall back to a 1 ms tick.
    pub(crate) wake_queue: Option<u32>,
    /// High half of local-tier owner ids, unique per VM; the low half counts requests.
    pub(crate) nonce: u64,
    pub(crate) sequence: u32,
    /// Random per VM: queued claims' waiter names are derived from it (`Env::waiter_secret`).
    pub(crate) waiter_secret: Option<[u8; 32]>,
    /// This worker's last stored-key and rate-key digests (`Env::digests`).
    pub(crate) digests: DigestMemo,
}

/// The decisions' environment over this VM: the host's clock read now, Envoy's shared data,
/// and the VM's breaker and metrics (borrowed field by field, beside its flows).
pub(crate) fn host_env<'a>(
    breaker: &'a mut Breaker,
    metrics: &'a mut Metrics,
    digests: &'a mut DigestMemo,
    owner: u64,
    waiter_secret: Option<&'a [u8; 32]>,
) -> Env<'a> {
    Env {
        now_ms: host::now_ms(),
        shared: &SharedData,
        breaker,
        telemetry: metrics,
        owner,
        waiter_secret,
        digests,
    }
}

impl Vm {
    /// Runs `f` with the flow of `context_id` and an environment over the host.
    pub(crate) fn with_flow<R>(
        &mut self,
        context_id: u32,
        f: impl FnOnce(&Config, &mut Flow, &mut Env<'_>) -> R,
    ) -> Option<R> {
        // Field by field: the common case (a stream without a flow) costs one map lookup.
        let Vm {
            config,
            flows,
            breaker,
            metrics,
            nonce,
            sequence,
            waiter_secret,
            digests,
            ..
        } = self;
        let config = config.as_deref()?;
        let flow = flows.get_mut(&context_id)?;
        metrics.rule = flow.rule_index();
        metrics.noted = Noted::default();
        *sequence = sequence.wrapping_add(1);
        let owner = *nonce | u64::from(*sequence);
        let mut env = host_env(breaker, metrics, digests, owner, waiter_secret.as_ref());
        Some(f(config, flow, &mut env))
    }

    /// The tick's lease work over every live flow: renewal callouts to dispatch (local-tier
    /// entries of requests forwarded without a grant are extended on the way).
    pub(crate) fn tick_work(&mut self) -> Vec<(u32, Callout)> {
        let Vm {
            config,
            flows,
            breaker,
            metrics,
            digests,
            nonce,
            ..
        } = self;
        let Some(config) = config.as_deref() else {
            return Vec::new();
        };
        let mut env = host_env(breaker, metrics, digests, *nonce, None);
        flows
            .iter_mut()
            .filter_map(|(id, flow)| Some((*id, flow.renewal_due(config, &mut env)?)))
            .collect()
    }

    /// Streams whose flow waits on this gateway's shared data ([`Flow::waits_locally`]);
    /// none left clears [`Vm::waiting`].
    pub(crate) fn waiting_streams(&mut self) -> Vec<u32> {
        let streams: Vec<u32> = self
            .flows
            .iter()
            .filter(|(_, flow)| flow.waits_locally())
            .map(|(id, _)| *id)
            .collect();
        self.waiting = !streams.is_empty();
        streams
    }

    /// A flow now waits on shared data: the tick polls it.
    pub(crate) fn poll_waits(&mut self) {
        self.waiting = true;
        self.rearm();
    }

    /// Sets the tick's period to what is needed now, when it differs from the one set
    /// (setting it re-arms Envoy's timer: setting it on every event would postpone it).
    pub(crate) fn rearm(&mut self) {
        let Some(regular) = self.config.as_ref().map(|c| c.tick_ms) else {
            return;
        };
        let period = if self.fast_tick {
            1
        } else if self.waiting {
            WAIT_POLL_MS.min(regular)
        } else {
            regular
        };
        if period != self.tick_armed_ms {
            self.tick_armed_ms = period;
            host::set_tick_ms(period);
        }
    }

    /// Writes what the last step on stream `stream` (rule `rule`) decided into its filter
    /// state (the stream is the current or effective context), and logs it: a shadow rule's
    /// would-be block at info, once per request (and marks the request, `would_block_header`),
    /// a block at debug
    /// — the rule, the decision, the stored key's digest prefix and the context id, never a
    /// raw key.
    pub(crate) fn publish(&mut self, stream: u32, rule: usize) {
        let noted = std::mem::take(&mut self.metrics.noted);
        let Some(decision) = noted.decision else {
            return;
        };
        let flow = self.flows.get(&stream);
        let Some((config, rule)) = self
            .config
            .as_deref()
            .and_then(|c| Some((c, c.rules.get(rule)?)))
        else {
            return;
        };
        host::set_filter_state(noted, &rule.name, flow.and_then(Flow::fence));
        let key = flow.map_or("-", Flow::key_digest);
        // One log site for both (the module's size budget): a would-be block at info, once
        // per request (the flow counts it once), with the decision that would have answered
        // it; a local answer at debug.
        let (level, shown) = match noted.would_block {
            Some(reason) => {
                if let Some(header) = &config.would_block_header {
                    host::set_request_headers(&[(header.clone(), reason.name().to_owned())]);
                }
                (log::Level::Info, reason)
            }
            None if decision.blocks() => (log::Level::Debug, decision),
            None => return,
        };
        log::log!(
            level,
            "idemgate: rule {} {} #{stream}, key {key}{}",
            rule.name,
            shown.name(),
            if noted.would_block.is_some() {
                " (shadow: forwarded)"
            } else {
                ""
            }
        );
    }

    /// [`Vm::publish`] for a stream with a flow.
    pub(crate) fn publish_flow(&mut self, stream: u32) {
        if let Some(rule) = self.flows.get(&stream).map(Flow::rule_index) {
            self.publish(stream, rule);
        }
    }

    pub(crate) fn next_owner(&mut self) -> u64 {
        self.sequence = self.sequence.wrapping_add(1);
        self.nonce | u64::from(self.sequence)
    }

    /// Queues a release for the root and makes sure a tick comes soon to dispatch it.
    pub(crate) fn queue_release(&mut self, stream: u32, callout: Callout) {
        let trace = self
            .flows
            .get(&stream)
            .map(|flow| flow.trace().clone())
            .unwrap_or_default();
        self.releases.push(PendingRelease {
            callout,
            attempts: 0,
            stream,
            trace,
        });
        self.kick();
    }

    pub(crate) fn queue_decision(&mut self, context_id: u32, callout: Callout) {
        self.decisions.push((context_id, callout));
        self.kick();
    }

    /// Wakes the root once per batch: through the wake queue (the callouts go out within the
    /// same event-loop turn's aftermath, not up to a tick later), else a 1 ms tick, armed once
    /// because re-arming on every request would keep postponing it under load.
    fn kick(&mut self) {
        if self.kicked {
            return;
        }
        self.kicked = true;
        if let Some(queue) = self.wake_queue
            && host::wake(queue)
        {
            return;
        }
        self.fast_tick = true;
        self.rearm();
    }
}
