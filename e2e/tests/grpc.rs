//! gRPC methods guarded end to end: a real tonic client → a live gateway running the built
//! filter (h2c in, HTTP/2 to the backend) → a real tonic service, with the sidecar on a real
//! Redis. The service counts what it executed per key — the ground truth — and the client
//! reads every decision as a gRPC status, as a gRPC client must.
//!
//! `pay.Payments` (hand-written service and `prost` message, no protoc): `Charge` and
//! `Refund` are idempotent per `idempotency-key` metadata (`Hold` too, releasing its key when
//! the client gives up); `Attach` locks the agent named in `x-agent-id` metadata and queues
//! duplicates.

use idemgate_e2e::live::{eventually, shipped_plugin, variant_of};
use idemgate_e2e::stack::Stack;
use idemgate_host::gateway::bootstrap::Bootstrap;
use idemgate_rig::gateway::LiveGateway;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::codec::ProstCodec;
use tonic::codegen::{BoxFuture, Context, Poll, Service, http as thttp};
use tonic::{Code, Status};

/// `pay.Text { string text = 1; }`, the service's one message.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Text {
    #[prost(string, tag = "1")]
    pub text: String,
}

/// What the service executed.
#[derive(Debug, Default)]
struct Executed {
    /// Runs per `idempotency-key` (Charge, Refund) or per agent (Attach).
    runs: HashMap<String, u32>,
    /// `x-seq` of each Attach, in the order they started.
    order: Vec<String>,
    /// Attach calls running now, and the most that ever ran at once.
    active: u32,
    max_active: u32,
}

type Shared = Arc<Mutex<Executed>>;

#[derive(Clone)]
struct Payments {
    executed: Shared,
}

impl tonic::server::NamedService for Payments {
    const NAME: &'static str = "pay.Payments";
}

/// One method: records the run, works `x-work-ms`, then answers by the request's text
/// (`fail`: INTERNAL, `missing`: NOT_FOUND, else OK).
struct Method {
    executed: Shared,
    attach: bool,
}

fn metadata(request: &tonic::Request<Text>, name: &str) -> String {
    request
        .metadata()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

impl tonic::server::UnaryService<Text> for Method {
    type Response = Text;
    type Future = BoxFuture<tonic::Response<Text>, Status>;

    fn call(&mut self, request: tonic::Request<Text>) -> Self::Future {
        let executed = Arc::clone(&self.executed);
        let attach = self.attach;
        Box::pin(async move {
            let key = metadata(
                &request,
                if attach {
                    "x-agent-id"
                } else {
                    "idempotency-key"
                },
            );
            let work_ms = metadata(&request, "x-work-ms").parse().unwrap_or(0);
            {
                let mut e = executed.lock().unwrap();
                *e.runs.entry(key.clone()).or_default() += 1;
                if attach {
                    e.order.push(metadata(&request, "x-seq"));
                    e.active += 1;
                    e.max_active = e.max_active.max(e.active);
                }
            }
            tokio::time::sleep(Duration::from_millis(work_ms)).await;
            if attach {
                executed.lock().unwrap().active -= 1;
            }
            match request.get_ref().text.as_str() {
                "fail" => Err(Status::internal("boom")),
                "missing" => Err(Status::not_found("no such account: 100% gone")),
                text => Ok(tonic::Response::new(Text {
                    text: format!("done {text} for {key}"),
                })),
            }
        })
    }
}

impl<B> Service<thttp::Request<B>> for Payments
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = thttp::Response<tonic::body::BoxBody>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: thttp::Request<B>) -> Self::Future {
        let executed = Arc::clone(&self.executed);
        let path = request.uri().path().to_owned();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Text, Text>::default());
            let method = |attach| Method { executed, attach };
            Ok(match path.as_str() {
                "/pay.Payments/Charge" | "/pay.Payments/Refund" | "/pay.Payments/Hold" => {
                    grpc.unary(method(false), request).await
                }
                "/pay.Payments/Attach" => grpc.unary(method(true), request).await,
                _ => Status::unimplemented(path).into_http(),
            })
        })
    }
}

/// The tonic service on a loopback port, on its own runtime thread (alive for the test).
fn payments() -> (SocketAddr, Shared) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    let executed = Shared::default();
    let service = Payments {
        executed: Arc::clone(&executed),
    };
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let incoming =
                tonic::transport::server::TcpIncoming::from_listener(listener, true, None).unwrap();
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await
                .unwrap();
        });
    });
    (address, executed)
}

const RULES: &str = r#"[
    {"name":"attach","mode":"lock","grpc":{"service":"pay.Payments","method":"Attach"},
     "key":{"header":"x-agent-id"},"on_conflict":"queue",
     "queue":{"max_wait":"20s","max_queue":32},"lease":"10s"},
    {"name":"hold","grpc":{"service":"pay.Payments","method":"Hold"},
     "on_client_abort":"release","lease":"10s"},
    {"name":"pay","grpc":{"service":"pay.Payments"},"lease":"10s"}
]"#;

/// The service, the sidecar on Redis, and a two-worker gateway guarding the service.
struct World {
    stack: Stack,
    gateway: LiveGateway,
    executed: Shared,
    runtime: tokio::runtime::Runtime,
}

impl World {
    fn start() -> World {
        let (service, executed) = payments();
        let stack = Stack::start();
        let mut plugin = shipped_plugin();
        plugin["rules"] = serde_json::from_str(RULES).unwrap();
        let bootstrap =
            Bootstrap::idemgate(service, stack.addr, &plugin.to_string()).backend_http2(1_000);
        World {
            stack,
            gateway: variant_of(bootstrap, 2),
            executed,
            runtime: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap(),
        }
    }

    /// A client connection to the gateway (h2c).
    fn channel(&self) -> tonic::transport::Channel {
        let url = self.gateway.url();
        self.runtime.block_on(async move {
            tonic::transport::Channel::from_shared(url)
                .unwrap()
                .connect()
                .await
                .expect("the gateway accepts h2c")
        })
    }

    fn runs(&self, key: &str) -> u32 {
        self.executed
            .lock()
            .unwrap()
            .runs
            .get(key)
            .copied()
            .unwrap_or(0)
    }
}

/// One unary call of `method` with `text` and `metadata`, bounded to 60 s.
async fn call(
    channel: tonic::transport::Channel,
    method: &'static str,
    text: &str,
    metadata: Vec<(&'static str, String)>,
) -> Result<String, Box<Status>> {
    let mut client = tonic::client::Grpc::new(channel);
    client
        .ready()
        .await
        .map_err(|e| Status::unknown(e.to_string()))?;
    let mut request = tonic::Request::new(Text { text: text.into() });
    for (name, value) in metadata {
        request.metadata_mut().insert(name, value.parse().unwrap());
    }
    request.set_timeout(Duration::from_secs(60));
    let path = thttp::uri::PathAndQuery::try_from(format!("/pay.Payments/{method}")).unwrap();
    client
        .unary::<Text, Text, _>(request, path, ProstCodec::default())
        .await
        .map(|r| r.into_inner().text)
        .map_err(Box::new)
}

fn charge(key: &str, work_ms: u64) -> Vec<(&'static str, String)> {
    vec![
        ("idempotency-key", key.to_owned()),
        ("x-work-ms", work_ms.to_string()),
    ]
}

fn metadata_of<'s>(status: &'s Status, name: &str) -> Option<&'s str> {
    status.metadata().get(name).and_then(|v| v.to_str().ok())
}

/// The wait hint of a refusal: gRPC retry pushback, milliseconds (gRFC A6).
fn pushback_ms(status: &Status) -> u64 {
    metadata_of(status, "grpc-retry-pushback-ms")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no grpc-retry-pushback-ms: {status:?}"))
}

#[test]
fn grpc_calls_run_once_per_key_and_every_decision_is_a_grpc_status() {
    let world = World::start();
    let channel = world.channel();
    let run = |method: &'static str, text: &str, metadata| {
        world
            .runtime
            .block_on(call(channel.clone(), method, text, metadata))
    };

    // The first call runs; its duplicate is told it already ran (no message can be replayed).
    assert_eq!(
        run("Charge", "a", charge("k1", 0)).unwrap(),
        "done a for k1"
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
    assert_eq!(
        world.runtime.block_on(slow).unwrap().unwrap(),
        "done slow for k4"
    );
    assert_eq!(world.runs("k4"), 1);
}

#[test]
fn queued_grpc_calls_run_one_at_a_time_in_fifo_order() {
    let world = World::start();
    let channel = world.channel();
    let attach = |seq: usize, work_ms: u64| {
        call(
            channel.clone(),
            "Attach",
            "tool",
            vec![
                ("x-agent-id", "agent-1".to_owned()),
                ("x-seq", seq.to_string()),
                ("x-work-ms", work_ms.to_string()),
            ],
        )
    };
    let first = world.runtime.spawn(attach(0, 800));
    eventually("the first Attach at the service", || {
        world.runs("agent-1") == 1
    });
    let mut queued = Vec::new();
    for seq in 1..=4 {
        queued.push(world.runtime.spawn(attach(seq, 50)));
        // Each joins the queue before the next is sent: the queue's order is the send order.
        eventually(&format!("{seq} waiting at the sidecar"), || {
            world.stack.waiters() == seq as u64
        });
    }
    for call in std::iter::once(first).chain(queued) {
        let answer = world.runtime.block_on(call).unwrap();
        assert_eq!(answer.unwrap(), "done tool for agent-1");
    }
    let executed = world.executed.lock().unwrap();
    assert_eq!(executed.order, ["0", "1", "2", "3", "4"]);
    assert_eq!(executed.max_active, 1, "never two Attach calls at once");
}

#[test]
fn a_storm_of_duplicate_grpc_calls_executes_once() {
    let world = World::start();
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
                assert_eq!(text, "done storm for storm");
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
                vec![
                    ("x-agent-id", "agent-storm".to_owned()),
                    ("x-seq", i.to_string()),
                    ("x-work-ms", "30".to_owned()),
                ],
            ))
        })
        .collect();
    for call in storm {
        assert!(world.runtime.block_on(call).unwrap().is_ok());
    }
    assert_eq!(world.runs("agent-storm"), 12);
    assert_eq!(world.executed.lock().unwrap().max_active, 1);
}

#[test]
fn a_grpc_call_its_client_gives_up_on_keeps_or_releases_its_key_as_the_rule_says() {
    let world = World::start();
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
        retry("Hold", "r1").is_ok_and(|text| text == "done x for r1")
    });
    assert_eq!(world.runs("r1"), 2);
    // The default (`hold`): the key stays held while the service may still run the call.
    assert!(give_up("Charge", "h1"), "the client gave up");
    eventually("the first Charge at the service", || world.runs("h1") == 1);
    let held = retry("Charge", "h1").unwrap_err();
    assert_eq!(held.code(), Code::Aborted, "{held:?}");
    assert_eq!(world.runs("h1"), 1);
}
