//! gRPC methods guarded end to end: a real tonic client → a live gateway running the built
//! filter (h2c in, HTTP/2 to the backend) → the demo backend's tonic service
//! (`idemgate_rig::backend::grpc`, `pay.Payments`), with the sidecar on a real Redis. The
//! backend counts what it started per resource — the ground truth — and the client reads
//! every decision as a gRPC status, as a gRPC client must.
//!
//! `Charge` and `Refund` (which the backend does not implement: only a call the gateway lets
//! through would reach it) are idempotent per `idempotency-key` metadata (`Hold` too,
//! releasing its key when the client gives up); `Attach` locks the agent named in
//! `x-agent-id` metadata and queues duplicates; `Installments` is a server-streaming `Charge`.

use idemgate_demo::scenarios;
use idemgate_e2e::live::{Demo, eventually, shipped, shipped_plugin, variant_of};
use idemgate_e2e::stack::Stack;
use idemgate_host::gateway::bootstrap::Bootstrap;
use idemgate_rig::DemoBackend;
use idemgate_rig::backend::grpc::{self, metadata_of};
use idemgate_rig::backend::{SEQ_HEADER, Stats, Timings, WORK_HEADER};
use idemgate_rig::gateway::LiveGateway;
use std::time::{Duration, Instant};
use tonic::{Code, Status};

const RULES: &str = r#"[
    {"name":"attach","mode":"lock","grpc":{"service":"pay.Payments","method":"Attach"},
     "key":{"header":"x-agent-id"},"on_conflict":"queue",
     "queue":{"max_wait":"20s","max_queue":32},"lease":"10s"},
    {"name":"hold","grpc":{"service":"pay.Payments","method":"Hold"},
     "on_client_abort":"release","lease":"10s"},
    {"name":"pay","grpc":{"service":"pay.Payments"},"lease":"10s"}
]"#;

/// The demo backend, the sidecar on Redis, and a two-worker gateway guarding the backend's
/// gRPC service with `rules`.
struct World {
    stack: Stack,
    gateway: LiveGateway,
    backend: DemoBackend,
    runtime: tokio::runtime::Runtime,
}

impl World {
    fn start(rules: &str) -> World {
        let backend = DemoBackend::start(Timings::default()).expect("the demo backend starts");
        let stack = Stack::start();
        let mut plugin = shipped_plugin();
        plugin["rules"] = serde_json::from_str(rules).unwrap();
        let bootstrap = Bootstrap::idemgate(backend.addr(), stack.addr, &plugin.to_string())
            .backend_http2(1_000);
        World {
            stack,
            gateway: variant_of(bootstrap, 2),
            backend,
            runtime: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap(),
        }
    }

    /// A client connection to the gateway (h2c).
    fn channel(&self) -> tonic::transport::Channel {
        self.runtime
            .block_on(grpc::connect(self.gateway.url(), Duration::from_secs(5)))
            .expect("the gateway accepts h2c")
    }

    /// Starts `Attach` call `seq` for `agent` (`work_ms` of work at the backend) on `channel`.
    fn spawn_attach(
        &self,
        channel: &tonic::transport::Channel,
        agent: &str,
        seq: usize,
        work_ms: u64,
    ) -> tokio::task::JoinHandle<Result<String, Box<Status>>> {
        self.runtime.spawn(call(
            channel.clone(),
            "Attach",
            format!("tool-{seq}"),
            attach(agent, seq, work_ms),
        ))
    }

    fn stats(&self) -> Stats {
        self.backend.backend().stats()
    }

    /// Calls of `Charge`/`Hold` with idempotency key `key` that started at the backend.
    fn runs(&self, key: &str) -> u64 {
        self.started(&format!("payment::{key}"))
    }

    /// `Attach` calls for `agent` that started at the backend.
    fn attaches(&self, agent: &str) -> u64 {
        self.started(&format!("agent:{agent}"))
    }

    fn started(&self, resource: &str) -> u64 {
        self.stats().started.get(resource).copied().unwrap_or(0)
    }

    /// Waits (bounded) until the sidecar holds no key and no claim waits: every call's end
    /// reached it (completions and aborts are sent after the response).
    fn eventually_nothing_held(&self) {
        eventually("no key held, no claim waiting at the sidecar", || {
            self.stack.held_keys() == 0 && self.stack.waiters() == 0
        });
    }
}

/// One unary call of `method` with `text` and `metadata`, bounded to 60 s.
async fn call(
    channel: tonic::transport::Channel,
    method: &'static str,
    text: impl Into<String>,
    metadata: Vec<(&'static str, String)>,
) -> Result<String, Box<Status>> {
    let text = text.into();
    let metadata: Vec<(String, String)> = metadata
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value))
        .collect();
    grpc::call(channel, method, &text, &metadata, Duration::from_secs(60)).await
}

fn charge(key: &str, work_ms: u64) -> Vec<(&'static str, String)> {
    vec![
        ("idempotency-key", key.to_owned()),
        (WORK_HEADER, work_ms.to_string()),
    ]
}

fn attach(agent: &str, seq: usize, work_ms: u64) -> Vec<(&'static str, String)> {
    vec![
        ("x-agent-id", agent.to_owned()),
        (SEQ_HEADER, seq.to_string()),
        (WORK_HEADER, work_ms.to_string()),
    ]
}

/// The wait hint of a refusal: gRPC retry pushback, milliseconds (gRFC A6).
fn pushback_ms(status: &Status) -> u64 {
    grpc::pushback_ms(status).unwrap_or_else(|| panic!("no grpc-retry-pushback-ms: {status:?}"))
}

#[test]
fn grpc_calls_run_once_per_key_and_every_decision_is_a_grpc_status() {
    let world = World::start(RULES);
    let channel = world.channel();
    let run = |method: &'static str, text: &str, metadata| {
        world
            .runtime
            .block_on(call(channel.clone(), method, text, metadata))
    };

    // The first call runs; its duplicate is told it already ran (no message can be replayed).
    assert_eq!(
        run("Charge", "a", charge("k1", 0)).unwrap(),
        "charged a for k1: payment 1"
    );
    let again = run("Charge", "a", charge("k1", 0)).unwrap_err();
    assert_eq!(again.code(), Code::AlreadyExists, "{again:?}");
    assert_eq!(
        again.message(),
        "a call with this idempotency key already completed (OK)"
    );
    assert_eq!(metadata_of(&again, "idempotent-replayed"), Some("true"));
    assert_eq!(world.runs("k1"), 1);

    // A stored failure (NOT_FOUND) comes back exactly, message included.
    let first = run("Charge", "missing", charge("k2", 0)).unwrap_err();
    let replayed = run("Charge", "missing", charge("k2", 0)).unwrap_err();
    assert_eq!(first.code(), Code::NotFound);
    assert_eq!(
        (replayed.code(), replayed.message()),
        (Code::NotFound, "no such account: 100% gone")
    );
    assert_eq!(metadata_of(&replayed, "idempotent-replayed"), Some("true"));
    assert_eq!(world.runs("k2"), 1);

    // HTTP 200 with grpc-status INTERNAL is a failed call: not stored, the retry runs — once
    // the abort reached the sidecar (dispatched after the response: until then the retry is
    // refused ABORTED, never replayed).
    let failed = run("Charge", "fail", charge("k3", 0)).unwrap_err();
    assert_eq!((failed.code(), failed.message()), (Code::Internal, "boom"));
    eventually("the retry of a failed call to run", || {
        let retried = run("Charge", "fail", charge("k3", 0)).unwrap_err();
        assert!(
            matches!(retried.code(), Code::Internal | Code::Aborted),
            "{retried:?}"
        );
        retried.code() == Code::Internal
    });
    assert_eq!(world.runs("k3"), 2);

    // No key: INVALID_ARGUMENT, and the service never sees it.
    let no_key = run("Charge", "a", vec![]).unwrap_err();
    assert_eq!(no_key.code(), Code::InvalidArgument, "{no_key:?}");
    assert!(no_key.message().contains("requires an idempotency key"));
    assert_eq!(world.runs(""), 0);

    // The key reused for another method: FAILED_PRECONDITION.
    let reused = run("Refund", "a", charge("k1", 0)).unwrap_err();
    assert_eq!(reused.code(), Code::FailedPrecondition, "{reused:?}");
    assert_eq!(world.runs("k1"), 1);

    // A duplicate while the first still runs: ABORTED, with the wait as retry pushback.
    let slow = world
        .runtime
        .spawn(call(channel.clone(), "Charge", "slow", charge("k4", 1_500)));
    eventually("the slow call at the service", || world.runs("k4") == 1);
    let busy = run("Charge", "slow", charge("k4", 0)).unwrap_err();
    assert_eq!(busy.code(), Code::Aborted, "{busy:?}");
    assert!(pushback_ms(&busy) > 0);
    assert!(
        world
            .runtime
            .block_on(slow)
            .unwrap()
            .unwrap()
            .starts_with("charged slow for k4")
    );
    assert_eq!(world.runs("k4"), 1);
}

#[test]
fn queued_grpc_calls_run_one_at_a_time_in_fifo_order() {
    let world = World::start(RULES);
    let channel = world.channel();
    let send = |seq, work_ms| world.spawn_attach(&channel, "agent-1", seq, work_ms);
    let first = send(0, 800);
    eventually("the first Attach at the service", || {
        world.attaches("agent-1") == 1
    });
    let mut queued = Vec::new();
    for seq in 1..=4 {
        queued.push(send(seq, 50));
        // Each joins the queue in Redis before the next is sent: the queue's order is the
        // send order.
        eventually(&format!("{seq} queued at the sidecar"), || {
            world.stack.claims_queued() == seq as u64
        });
    }
    let mut answers = Vec::new();
    for call in std::iter::once(first).chain(queued) {
        answers.push(world.runtime.block_on(call).unwrap().unwrap());
    }
    assert_eq!(
        answers.last().map(String::as_str),
        Some("agent-1 has tool-0,tool-1,tool-2,tool-3,tool-4")
    );
    let stats = world.stats();
    assert_eq!(stats.order["agent:agent-1"], ["0", "1", "2", "3", "4"]);
    assert_eq!(stats.max_overlap, 1, "never two Attach calls at once");
    assert_eq!(stats.lost_updates, 0);
    world.eventually_nothing_held();
}

#[test]
fn a_storm_of_duplicate_grpc_calls_executes_once() {
    let world = World::start(RULES);
    // Four client connections, ten calls each, all with one key, all at once.
    let channels: Vec<_> = (0..4).map(|_| world.channel()).collect();
    let storm: Vec<_> = (0..40)
        .map(|i| {
            let channel = channels[i % channels.len()].clone();
            world
                .runtime
                .spawn(call(channel, "Charge", "storm", charge("storm", 300)))
        })
        .collect();
    let (mut ok, mut aborted, mut already) = (0, 0, 0);
    for call in storm {
        match world.runtime.block_on(call).unwrap() {
            Ok(text) => {
                assert_eq!(text, "charged storm for storm: payment 1");
                ok += 1;
            }
            Err(s) if s.code() == Code::Aborted => {
                assert!(pushback_ms(&s) > 0);
                aborted += 1;
            }
            Err(s) if s.code() == Code::AlreadyExists => already += 1,
            Err(s) => panic!("unexpected status {s:?}"),
        }
    }
    assert_eq!(ok, 1, "one call ran (aborted {aborted}, already {already})");
    assert_eq!(ok + aborted + already, 40);
    assert_eq!(world.runs("storm"), 1);

    // A storm on the queued lock: every call runs, one at a time.
    let storm: Vec<_> = (0..12)
        .map(|i| {
            let channel = channels[i % channels.len()].clone();
            world.runtime.spawn(call(
                channel,
                "Attach",
                "tool",
                attach("agent-storm", i, 30),
            ))
        })
        .collect();
    for call in storm {
        assert!(world.runtime.block_on(call).unwrap().is_ok());
    }
    assert_eq!(world.attaches("agent-storm"), 12);
    let stats = world.stats();
    assert_eq!(stats.max_overlap, 1);
    assert_eq!(stats.lost_updates, 0);
    assert_eq!(stats.double_charges, 0);
    world.eventually_nothing_held();
}

#[test]
fn a_grpc_call_its_client_gives_up_on_keeps_or_releases_its_key_as_the_rule_says() {
    let world = World::start(RULES);
    let channel = world.channel();
    // The client cancels each call (RST_STREAM) 300 ms in, while the service still works.
    let give_up = |method: &'static str, key: &str| {
        let call = call(channel.clone(), method, "x", charge(key, 1_500));
        world.runtime.block_on(async move {
            tokio::time::timeout(Duration::from_millis(300), call)
                .await
                .is_err()
        })
    };
    let retry = |method: &'static str, key: &str| {
        world
            .runtime
            .block_on(call(channel.clone(), method, "x", charge(key, 0)))
    };
    // `on_client_abort: release`: the reset aborts the claim, and the retry runs at once.
    assert!(give_up("Hold", "r1"), "the client gave up");
    eventually("the first Hold at the service", || world.runs("r1") == 1);
    eventually("the key released", || {
        retry("Hold", "r1").is_ok_and(|text| text.starts_with("charged x for r1"))
    });
    assert_eq!(world.runs("r1"), 2);
    // The default (`hold`): the key stays held while the service may still run the call.
    assert!(give_up("Charge", "h1"), "the client gave up");
    eventually("the first Charge at the service", || world.runs("h1") == 1);
    let held = retry("Charge", "h1").unwrap_err();
    assert_eq!(held.code(), Code::Aborted, "{held:?}");
    assert_eq!(world.runs("h1"), 1);
}

/// `Attach` queued, at most `max_queue` waiting, each at most `max_wait`.
fn queued_attach(max_queue: u32, max_wait: &str) -> String {
    format!(
        r#"[{{"name":"attach","mode":"lock","grpc":{{"service":"pay.Payments","method":"Attach"}},
             "key":{{"header":"x-agent-id"}},"on_conflict":"queue",
             "queue":{{"max_wait":"{max_wait}","max_queue":{max_queue}}},"lease":"10s"}}]"#
    )
}

/// A call beyond a full queue is RESOURCE_EXHAUSTED with pushback and never runs; the one
/// that found a place runs after the holder, and nothing stays held.
#[test]
fn a_grpc_call_beyond_a_full_queue_is_resource_exhausted_and_never_runs() {
    let world = World::start(&queued_attach(1, "20s"));
    let channel = world.channel();
    let send = |seq, work_ms| world.spawn_attach(&channel, "agent-q", seq, work_ms);
    let holder = send(0, 800);
    eventually("the holder at the backend", || {
        world.attaches("agent-q") == 1
    });
    let waiting = send(1, 0);
    eventually("one waiting at the sidecar", || world.stack.waiters() == 1);
    let started = Instant::now();
    let full = world
        .runtime
        .block_on(send(2, 0))
        .unwrap()
        .expect_err("the queue is full");
    assert_eq!(full.code(), Code::ResourceExhausted, "{full:?}");
    assert!(
        full.message().contains("already waiting"),
        "the message says why: {full:?}"
    );
    assert!(pushback_ms(&full) > 0);
    assert!(
        started.elapsed() < Duration::from_millis(700),
        "refused at once, not after waiting"
    );
    for call in [holder, waiting] {
        assert!(world.runtime.block_on(call).unwrap().is_ok());
    }
    let stats = world.stats();
    assert_eq!(world.attaches("agent-q"), 2, "the refused call never ran");
    assert_eq!(stats.order["agent:agent-q"], ["0", "1"]);
    assert_eq!(stats.max_overlap, 1);
    world.eventually_nothing_held();
}

/// A queued call whose wait runs out is UNAVAILABLE with pushback and never runs; its place
/// is given up, the key is released when the holder ends, and the next call runs at once.
#[test]
fn a_queued_grpc_call_whose_wait_expires_is_unavailable_and_never_runs() {
    let world = World::start(&queued_attach(8, "400ms"));
    let channel = world.channel();
    let send = |seq, work_ms| world.spawn_attach(&channel, "agent-w", seq, work_ms);
    let holder = send(0, 1_500);
    eventually("the holder at the backend", || {
        world.attaches("agent-w") == 1
    });
    // The sidecar lists the held key: what "nothing held" below is read from.
    assert_eq!(world.stack.held_keys(), 1);
    let started = Instant::now();
    let expired = world
        .runtime
        .block_on(send(1, 0))
        .unwrap()
        .expect_err("the wait expires");
    let waited = started.elapsed();
    assert_eq!(expired.code(), Code::Unavailable, "{expired:?}");
    assert!(
        expired.message().starts_with("Waited too long"),
        "{expired:?}"
    );
    assert!(pushback_ms(&expired) > 0);
    assert!(
        waited >= Duration::from_millis(400) && waited < Duration::from_millis(1_400),
        "answered when its wait ran out, before the holder ended: {waited:?}"
    );
    assert_eq!(world.attaches("agent-w"), 1, "the expired call never ran");
    assert!(world.runtime.block_on(holder).unwrap().is_ok());
    world.eventually_nothing_held();
    // The key is free: the next call runs at once.
    let next = world.runtime.block_on(send(2, 0)).unwrap();
    assert_eq!(next.unwrap(), "agent-w has tool-0,tool-2");
    assert_eq!(world.stats().order["agent:agent-w"], ["0", "2"]);
    world.eventually_nothing_held();
}

/// Over a rate limit a gRPC call is RESOURCE_EXHAUSTED with pushback and the limit as
/// metadata: it claims nothing and never runs, while the calls within the limit run once each.
#[test]
fn a_rate_limited_grpc_call_is_resource_exhausted_with_pushback_and_never_runs() {
    let world = World::start(
        r#"[{"name":"pay","grpc":{"service":"pay.Payments","method":"Charge"},"lease":"10s",
             "scope":{"headers":["x-user-id"]},
             "rate":{"tier":"local","limits":[{"by":"scope","requests":1,"per":"1m","burst":2}]}}]"#,
    );
    let channel = world.channel();
    let run = |key: &str| {
        let mut metadata = charge(key, 0);
        metadata.push(("x-user-id", "u1".to_owned()));
        world
            .runtime
            .block_on(call(channel.clone(), "Charge", "a", metadata))
    };
    assert!(run("r1").is_ok());
    assert!(run("r2").is_ok());
    let limited = run("r3").unwrap_err();
    assert_eq!(limited.code(), Code::ResourceExhausted, "{limited:?}");
    assert!(
        limited.message().contains("over the rate limit"),
        "the message says why: {limited:?}"
    );
    // One request a minute: the next is allowed within a minute, after at least 10 s.
    let pushback = pushback_ms(&limited);
    assert!((10_000..=60_000).contains(&pushback), "{pushback} ms");
    assert!(
        metadata_of(&limited, "ratelimit").is_some(),
        "the limit's state as metadata: {limited:?}"
    );
    let runs = |key: &str| {
        world
            .stats()
            .started
            .get(&format!("payment:u1:{key}"))
            .copied()
            .unwrap_or(0)
    };
    assert_eq!((runs("r1"), runs("r2"), runs("r3")), (1, 1, 0));
    // Another caller has a budget of its own.
    let mut other = charge("r4", 0);
    other.push(("x-user-id", "u2".to_owned()));
    assert!(
        world
            .runtime
            .block_on(call(channel.clone(), "Charge", "a", other))
            .is_ok()
    );
    world.eventually_nothing_held();
}

/// The demo's gRPC scenario through the shipped `envoy/envoy.yaml` (its `backend_grpc`
/// HTTP/2 route and its "grpc-charges" rule): straight to the backend every hedged attempt
/// charges; through the gateway the charge runs once, the attempts that overlap it are
/// ABORTED with pushback and the retry after it is told it already ran.
#[test]
fn the_shipped_gateway_charges_a_hedged_grpc_call_once() {
    let demo = Demo::start();
    let stack = Stack::start();
    let gateway = shipped(demo.addr, stack.addr, 2);
    let direct = demo.play_direct(&scenarios::grpc_hedged_charge("hedged-direct"));
    assert_eq!(
        (direct.backend.charges, direct.backend.double_charges),
        (4, 3),
        "{:?}",
        direct.outcomes
    );
    demo.reset();
    let run = demo.play(&gateway, &scenarios::grpc_hedged_charge("hedged"));
    let codes: Vec<_> = run.outcomes.iter().map(|o| o.grpc).collect();
    assert_eq!(
        codes,
        [
            Some(Code::Ok),
            Some(Code::Aborted),
            Some(Code::Aborted),
            Some(Code::AlreadyExists)
        ],
        "{:?}",
        run.outcomes
    );
    assert!(run.outcomes[1..3].iter().all(|o| o.retry_after.is_some()));
    assert!(run.outcomes[3].replayed);
    assert_eq!((run.backend.charges, run.backend.double_charges), (1, 0));
    assert_eq!((run.succeeded(), run.refused(), run.replays()), (1, 2, 1));
    eventually("no key held at the sidecar", || stack.held_keys() == 0);
}

/// The shipped file's two clusters share the backend's address, one HTTP/1.1 and one
/// HTTP/2: each keeps connections of its own protocol. HTTP calls before and after a gRPC
/// call, on one worker, must not send the gRPC call over an HTTP/1.1 connection (nor the
/// HTTP calls over the HTTP/2 one).
#[test]
fn http_and_grpc_calls_to_one_backend_port_keep_their_protocols() {
    let demo = Demo::start();
    let stack = Stack::start();
    let gateway = shipped(demo.addr, stack.addr, 1);
    let http = |key: &str| {
        let reply = idemgate_e2e::client::http(
            gateway.addr(),
            "POST",
            "/payments",
            &[
                ("idempotency-key", key),
                ("x-user-id", "u1"),
                ("content-type", "application/json"),
            ],
            r#"{"amount":1}"#,
        );
        assert_eq!(reply.status, 201, "{reply:?}");
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    http("h1");
    let channel = runtime
        .block_on(grpc::connect(gateway.url(), Duration::from_secs(5)))
        .unwrap();
    for i in 0..3 {
        let key = format!("g{i}");
        let answer = runtime.block_on(call(channel.clone(), "Charge", "a", charge(&key, 0)));
        assert!(answer.is_ok(), "{answer:?}");
        http(&format!("h{}", i + 2));
    }
    assert_eq!(demo.stats().charges, 7);
}

/// A server stream's outcome is the status in its trailers, after its messages: the key
/// stays claimed for the whole stream (a duplicate after the first message is ABORTED), a
/// stream that ends INTERNAL is not stored (its retry streams again), one that ends OK is
/// (its retry is told it already ran).
#[test]
fn a_server_stream_is_guarded_until_its_trailers_and_stored_by_their_status() {
    let world = World::start(RULES);
    let channel = world.channel();
    let stream = |key: &str, text: &'static str| {
        let metadata: Vec<(String, String)> = charge(key, 800)
            .into_iter()
            .map(|(name, value)| (name.to_owned(), value))
            .collect();
        let channel = channel.clone();
        async move {
            let mut receipts = Vec::new();
            let mut stream = grpc::open_stream(
                channel,
                "Installments",
                text,
                &metadata,
                Duration::from_secs(60),
            )
            .await?;
            loop {
                match stream.message().await {
                    Ok(Some(message)) => receipts.push(message.text),
                    Ok(None) => return Ok(receipts),
                    Err(status) => return Err(Box::new(status)),
                }
            }
        }
    };
    let read_all = |key: &str, text: &'static str| world.runtime.block_on(stream(key, text));

    // A stream that fails after its receipts: the duplicate sent mid-stream is refused, the
    // retry after the failure streams again.
    let first = world.runtime.spawn(stream("s1", "fail"));
    eventually("the first stream at the backend", || world.runs("s1") == 1);
    std::thread::sleep(Duration::from_millis(300));
    let busy = read_all("s1", "fail").unwrap_err();
    assert_eq!(busy.code(), Code::Aborted, "{busy:?}");
    let failed = world.runtime.block_on(first).unwrap().unwrap_err();
    assert_eq!((failed.code(), failed.message()), (Code::Internal, "boom"));
    assert_eq!(world.runs("s1"), 1);
    eventually("the failed stream's retry to run", || {
        let retried = read_all("s1", "fail").unwrap_err();
        assert!(
            matches!(retried.code(), Code::Internal | Code::Aborted),
            "{retried:?}"
        );
        retried.code() == Code::Internal
    });
    assert_eq!(world.runs("s1"), 2);

    // A stream that ends OK: every receipt arrives, and its retry is a replay.
    let receipts = read_all("s2", "ok").unwrap();
    assert_eq!(receipts.len(), grpc::INSTALLMENTS + 1, "{receipts:?}");
    assert_eq!(receipts.last().map(String::as_str), Some("payment 1"));
    let again = read_all("s2", "ok").unwrap_err();
    assert_eq!(again.code(), Code::AlreadyExists, "{again:?}");
    assert!(grpc::replayed(&again));
    assert_eq!(world.runs("s2"), 1);
    assert_eq!(world.stats().double_charges, 0);
    world.eventually_nothing_held();
}
