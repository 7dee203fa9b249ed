//! Group `plugin`: what the filter costs per request inside the VM, against the no-op filter
//! driven through the same host with the same requests.
//!
//! Three request kinds, as the plugin issue names them: a request matching no rule, a
//! duplicate rejected by the local tier (shared data, no callout), and a claim through the
//! sidecar (claim callout answered `granted`, upstream 201, complete callout answered
//! `released`). The sidecar's own answers are canned here: the network and the sidecar are
//! measured by the `sidecar` group; this group isolates the filter and the host.
//!
//! Instructions come from `valgrind --tool=callgrind` restricted to [`measured_requests`]
//! (`--toggle-collect`), so module compilation, VM start and warm-up are excluded and the
//! count repeats within a few percent. Wall time per request is measured without valgrind.

use anyhow::{Context, Result, bail};
use idemgate_host::{
    CalloutOutcome, Clock, Cluster, Direction, HeaderMap, PluginSettings, SharedState, StreamEvent,
    StreamId, StreamInfo, Vm, WasmModule,
};
use idemgate_wire::{ClaimOutcome, OwnerOutcome};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// The sidecar cluster name of [`CONFIG`].
const SIDECAR: &str = "idemgate_sidecar";

/// The filter's configuration for every kind: `/bots/{id}/start` rejects duplicates of a
/// running call (lock mode), `/payments` is idempotent, `/limited` allows one request an
/// hour per caller (local rate tier); `GET /` matches none.
const CONFIG: &str = r#"{
  "sidecar": {"cluster": "idemgate_sidecar"},
  "rules": [
    {"name": "start-bot", "match": {"methods": ["POST"], "path_template": "/bots/{bot_id}/start"},
     "mode": "lock", "key": {"path_param": "bot_id"}, "on_conflict": "reject"},
    {"name": "payments", "match": {"methods": ["POST"], "path_prefix": "/payments"},
     "mode": "idempotency", "scope": {"headers": ["x-user-id"]}},
    {"name": "limited", "match": {"methods": ["POST"], "path_prefix": "/limited"},
     "scope": {"headers": ["x-user-id"]},
     "rate": {"tier": "local", "limits": [{"by": "scope", "requests": 1, "per": "1h"}]}}
  ]
}"#;

/// Which request is driven.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    NoRule,
    LocalDuplicate,
    SidecarClaim,
    /// The memory run's traffic, touching every path without holding a call open: a
    /// request matching no rule, a sidecar claim with a fresh key, and a duplicate of that
    /// completed call replayed by the local tier, in turn.
    Mixed,
    RateLimited,
    /// A storm in miniature: [`STORM`] identical requests, the first claiming through the
    /// sidecar and the rest parked behind it (queue mode), answered with its response.
    Storm,
}

/// Requests per storm of [`Kind::Storm`].
pub const STORM: usize = 64;

/// [`CONFIG`] with its payments rule queueing duplicates, as the shipped configuration does.
fn storm_config() -> String {
    const PAYMENTS: &str = r#""mode": "idempotency", "scope": {"headers": ["x-user-id"]}"#;
    CONFIG.replacen(
        PAYMENTS,
        &format!(
            r#"{PAYMENTS}, "on_conflict": "queue", "queue": {{"max_wait": "10s", "max_queue": 16}}"#
        ),
        1,
    )
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Kind::NoRule,
        Kind::LocalDuplicate,
        Kind::SidecarClaim,
        Kind::RateLimited,
        Kind::Storm,
    ];

    /// Requests one [`Driver::one`] runs: a whole storm for [`Kind::Storm`], else one.
    pub fn requests_per_call(self) -> u64 {
        match self {
            Kind::Storm => STORM as u64,
            _ => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::NoRule => "no-rule",
            Kind::LocalDuplicate => "local-duplicate",
            Kind::SidecarClaim => "sidecar-claim",
            Kind::Mixed => "mixed",
            Kind::RateLimited => "rate-limited",
            Kind::Storm => "storm",
        }
    }

    pub fn parse(name: &str) -> Result<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .with_context(|| format!("unknown request kind {name}"))
    }

    pub fn describe(self) -> &'static str {
        match self {
            Kind::NoRule => "request matching no rule",
            Kind::LocalDuplicate => "duplicate rejected by the local tier (409)",
            Kind::SidecarClaim => "claim through the sidecar (claim + upstream + complete)",
            Kind::Mixed => "no-rule, sidecar claim and local replay in turn",
            Kind::RateLimited => "request over its rate limit (local tier, 429)",
            Kind::Storm => {
                "a request of a local storm (64 identical: one claims, 63 park and get its response)"
            }
        }
    }
}

/// One VM with a virtual clock, ready to drive requests of one kind.
pub struct Driver {
    vm: Vm,
    clock: Clock,
    kind: Kind,
    seq: u64,
}

impl Driver {
    /// Boots `module` (the no-op filter ignores the configuration and only takes
    /// [`Kind::NoRule`] requests).
    pub fn boot(module: &Path, kind: Kind) -> Result<Driver> {
        Driver::start(&WasmModule::load(module)?, kind)
    }

    /// Starts a VM of an already compiled module: instantiation and Envoy's start sequence
    /// (`_initialize`, `on_vm_start`, `on_configure`).
    pub fn start(module: &WasmModule, kind: Kind) -> Result<Driver> {
        let clock = Clock::virtual_clock();
        let shared = Arc::new(SharedState::new(clock.clone(), None, 0));
        let settings = PluginSettings {
            name: "idemgate".into(),
            root_id: "idemgate".into(),
            vm_id: "idemgate".into(),
            configuration: match kind {
                Kind::Storm => storm_config(),
                _ => CONFIG.to_owned(),
            }
            .into_bytes(),
            ..PluginSettings::default()
        };
        let clusters = Arc::new(BTreeMap::from([(
            SIDECAR.to_owned(),
            Cluster::named(SIDECAR),
        )]));
        let vm = Vm::boot(module, Arc::new(settings), clusters, shared, 0)?;
        let mut driver = Driver {
            vm,
            clock,
            kind,
            seq: 0,
        };
        match kind {
            Kind::LocalDuplicate => driver.hold_bot()?,
            Kind::RateLimited => driver.spend_rate()?,
            _ => {}
        }
        Ok(driver)
    }

    /// The first call for bot `b1`: claimed in the local tier, its sidecar claim left
    /// unanswered, so every later call for `b1` meets a running call.
    fn hold_bot(&mut self) -> Result<()> {
        self.leave_open(
            "/bots/b1/start",
            None,
            "the holding call was answered locally",
        )
    }

    /// One `/limited` request: it spends the caller's hourly unit (its claim left unanswered),
    /// so every later one is over the limit.
    fn spend_rate(&mut self) -> Result<()> {
        self.leave_open(
            "/limited",
            Some("spent"),
            "the first limited-rule call was answered locally",
        )
    }

    /// Sends a POST to `path` whose sidecar claim is never answered, so it stays in flight;
    /// fails with `failure` if the filter answered it by itself.
    fn leave_open(&mut self, path: &str, key: Option<&str>, failure: &str) -> Result<()> {
        let id = self.vm.new_stream(StreamInfo::default());
        self.vm
            .headers(id, Direction::Request, request("POST", path, key), true);
        if self
            .vm
            .take_events(id)
            .iter()
            .any(|e| matches!(e, StreamEvent::LocalReply(_)))
        {
            bail!("{failure}");
        }
        Ok(())
    }

    /// Runs one request of this driver's kind to its end ([`Kind::requests_per_call`] of
    /// them for a storm).
    pub fn one(&mut self) -> Result<()> {
        self.seq += 1;
        match self.kind {
            Kind::NoRule => self.no_rule(),
            Kind::LocalDuplicate => self.local_duplicate(),
            Kind::SidecarClaim => self.sidecar_claim(),
            Kind::Mixed => match self.seq % 3 {
                0 => self.no_rule(),
                1 => self.sidecar_claim(),
                _ => self.local_replay(),
            },
            Kind::RateLimited => self.rate_limited(),
            Kind::Storm => self.storm(),
        }
    }

    /// [`STORM`] identical requests: the first claims through the sidecar and goes upstream,
    /// the others park on this VM's shared data; when the first completes, each parked one
    /// is answered with its response (the tick, or the wake-up its release sends).
    fn storm(&mut self) -> Result<()> {
        let key = format!("storm-{}", self.seq);
        let post = || request("POST", "/payments", Some(&key));
        let first = self.claimed(post())?;
        let mut parked = Vec::with_capacity(STORM - 1);
        for _ in 1..STORM {
            let id = self.vm.new_stream(StreamInfo::default());
            self.vm.headers(id, Direction::Request, post(), true);
            if !self.vm.take_events(id).is_empty() || !self.vm.take_new_callouts().is_empty() {
                bail!("a duplicate of a running call did not park");
            }
            parked.push(id);
        }
        self.complete(first)?;
        self.advance(Duration::from_millis(2));
        for id in parked {
            let replayed = self
                .vm
                .take_events(id)
                .iter()
                .any(|e| matches!(e, StreamEvent::LocalReply(r) if r.status == 201));
            if !replayed {
                bail!("a parked duplicate was not answered with the first response");
            }
            self.vm.remove_stream(id);
        }
        Ok(())
    }

    fn rate_limited(&mut self) -> Result<()> {
        let key = format!("key-{}", self.seq);
        self.local_reply(
            "/limited",
            Some(&key),
            429,
            "the request was not limited locally",
        )
    }

    /// Sends a POST to `path` and checks the filter answered it with `status` by itself,
    /// without a callout.
    fn local_reply(
        &mut self,
        path: &str,
        key: Option<&str>,
        status: u32,
        failure: &str,
    ) -> Result<()> {
        let id = self.vm.new_stream(StreamInfo::default());
        self.vm
            .headers(id, Direction::Request, request("POST", path, key), true);
        let events = self.vm.take_events(id);
        let answered = events
            .iter()
            .any(|e| matches!(e, StreamEvent::LocalReply(r) if r.status == status));
        if !answered || !self.vm.take_new_callouts().is_empty() {
            bail!("{failure}: {events:?}");
        }
        self.vm.remove_stream(id);
        Ok(())
    }

    /// The VM's linear memory (bytes).
    pub fn memory_bytes(&self) -> usize {
        self.vm.memory_bytes()
    }

    fn no_rule(&mut self) -> Result<()> {
        let id = self.vm.new_stream(StreamInfo::default());
        self.vm
            .headers(id, Direction::Request, request("GET", "/", None), true);
        self.respond(id)
    }

    fn local_duplicate(&mut self) -> Result<()> {
        self.local_reply(
            "/bots/b1/start",
            None,
            409,
            "a duplicate was not rejected locally",
        )
    }

    /// A duplicate of the previous request (a completed sidecar claim): replayed from the
    /// local tier, no callout.
    fn local_replay(&mut self) -> Result<()> {
        let key = format!("key-{}", self.seq.saturating_sub(1));
        self.local_reply(
            "/payments",
            Some(&key),
            201,
            "a duplicate of a completed call was not replayed locally",
        )
    }

    fn sidecar_claim(&mut self) -> Result<()> {
        let key = format!("key-{}", self.seq);
        let id = self.claimed(request("POST", "/payments", Some(&key)))?;
        self.complete(id)
    }

    /// A request whose sidecar claim is answered `granted`: it must go upstream.
    fn claimed(&mut self, headers: HeaderMap) -> Result<StreamId> {
        let id = self.vm.new_stream(StreamInfo::default());
        self.vm.headers(id, Direction::Request, headers, true);
        let granted = ClaimOutcome::Granted {
            owner: format!("owner-{}", self.seq),
            fence: self.seq,
            lease_ms: 30_000,
            waited_ms: 0,
        };
        self.answer_next_callout(&idemgate_wire::encode(&granted, b""))?;
        self.expect_upstream(id)?;
        Ok(id)
    }

    /// The upstream answers a claimed request 201, and its complete is answered `released`.
    fn complete(&mut self, id: StreamId) -> Result<()> {
        self.vm.headers(
            id,
            Direction::Response,
            HeaderMap::from([(":status", "201"), ("content-type", "application/json")]),
            false,
        );
        self.vm
            .data(id, Direction::Response, br#"{"payment":1}"#, true);
        let _ = self.vm.take_events(id);
        self.vm.remove_stream(id);
        self.answer_next_callout(&idemgate_wire::encode(&OwnerOutcome::Released, b""))
    }

    /// The filter dispatches sidecar callouts from its root context when its wake-up queue
    /// notifies it (or on a short tick): run what Envoy's event loop would, letting virtual
    /// time pass until a callout is out, then answer it.
    fn answer_next_callout(&mut self, body: &[u8]) -> Result<()> {
        for _ in 0..10 {
            self.vm.run_posted();
            if let Some(call) = self.vm.take_new_callouts().into_iter().next() {
                let outcome = CalloutOutcome::response(
                    200,
                    HeaderMap::from([("content-type", idemgate_wire::CONTENT_TYPE)]),
                    body.to_vec(),
                );
                if !self.vm.deliver_callout(call.token, outcome) {
                    bail!("callout {} was not pending", call.token);
                }
                return Ok(());
            }
            self.advance(Duration::from_millis(1));
        }
        bail!("no sidecar callout was dispatched")
    }

    fn advance(&mut self, by: Duration) {
        if let Clock::Virtual(ns) = &self.clock {
            ns.fetch_add(by.as_nanos() as u64, Ordering::SeqCst);
        }
        self.vm.fire_due();
    }

    /// Fails unless the filter let the request go upstream.
    fn expect_upstream(&mut self, id: StreamId) -> Result<()> {
        let events = self.vm.take_events(id);
        if !events
            .iter()
            .any(|e| matches!(e, StreamEvent::UpstreamHeaders { .. }))
        {
            bail!("the request did not go upstream: {events:?}");
        }
        Ok(())
    }

    fn respond(&mut self, id: StreamId) -> Result<()> {
        self.expect_upstream(id)?;
        self.vm.headers(
            id,
            Direction::Response,
            HeaderMap::from([(":status", "200"), ("content-length", "0")]),
            true,
        );
        let _ = self.vm.take_events(id);
        self.vm.remove_stream(id);
        Ok(())
    }
}

fn request(method: &str, path: &str, idempotency_key: Option<&str>) -> HeaderMap {
    let mut headers = HeaderMap::from([
        (":authority", "bench"),
        (":path", path),
        (":method", method),
        (":scheme", "http"),
        ("x-user-id", "u1"),
        ("x-request-id", "00000000-0000-4000-8000-000000000000"),
    ]);
    if let Some(key) = idempotency_key {
        headers.add(b"idempotency-key", key.as_bytes());
    }
    headers
}

/// The loop callgrind counts (`--toggle-collect=*measured_requests*`): keep it out of line.
#[inline(never)]
pub fn measured_requests(driver: &mut Driver, n: u64) -> Result<()> {
    for _ in 0..n {
        driver.one()?;
    }
    Ok(())
}

/// Warms up, then returns the wall time per request of about `n` requests.
pub fn wall_time(module: &Path, kind: Kind, n: u64) -> Result<Duration> {
    let mut driver = Driver::boot(module, kind)?;
    let calls = (n / kind.requests_per_call()).max(1);
    measured_requests(&mut driver, calls / 10 + 1)?;
    let started = Instant::now();
    measured_requests(&mut driver, calls)?;
    Ok(started.elapsed() / (calls * kind.requests_per_call()) as u32)
}
