//! One request through the filter's decision state machine with fuzzed headers (the
//! `Idempotency-Key` sf-string, path, method, scope and fingerprint headers, lock-mode path
//! and query keys, keys from a fuzzed JSON body in one or two chunks), then a fuzzed sidecar answer to its claim, a renewal answer, a response
//! and the stream's end. Every step must return an action, never panic; a request the
//! filter let through must carry a fence only when the sidecar granted one.

#![no_main]

use idemgate_core::testing::{MemStore, Recorder, Req};
use idemgate_core::{Action, Answer, Breaker, Config, DigestMemo, Env, Flow};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

/// Rules covering every key source, charset and conflict policy.
const CONFIG: &str = r#"{"sidecar":{"cluster":"s"},"allow_on_headers_stop_iteration":true,"rules":[
 {"name":"pay","match":{"path_prefix":"/payments"},"scope":{"headers":["x-user-id"]},"fingerprint":{"headers":["x-tenant"],"max_body_bytes":64}},
 {"name":"tok","match":{"path_prefix":"/tokens"},"key":{"charset":"token","max_length":16}},
 {"name":"alnum","match":{"path_prefix":"/alnum"},"key":{"charset":"alphanumeric","required":false},"on_conflict":"queue"},
 {"name":"agents","mode":"lock","match":{"path_template":"/agents/{agent_id}/mcp"},"key":{"path_param":"agent_id"},"on_conflict":"queue"},
 {"name":"query","mode":"lock","match":{"path_prefix":"/q"},"key":{"query_param":"id"}},
 {"name":"hook","match":{"path_prefix":"/webhooks"},"key":{"body_pointer":"/data/id","required":false},"fingerprint":{"body":false,"max_body_bytes":256}},
 {"name":"lockbody","mode":"lock","match":{"path_prefix":"/lockbody"},"key":{"body_pointer":"/a~1b/0","charset":"token"},"fingerprint":{"max_body_bytes":128}}]}"#;

fn config() -> &'static Config {
    static CONFIG_ONCE: OnceLock<Config> = OnceLock::new();
    CONFIG_ONCE.get_or_init(|| match idemgate_core::config::parse(CONFIG.as_bytes()) {
        Ok(c) => c,
        Err(e) => panic!("the fuzz configuration is valid: {e}"),
    })
}

#[derive(Debug, Arbitrary)]
struct Input {
    method: u8,
    path: Vec<u8>,
    key: Option<Vec<u8>>,
    user: Option<Vec<u8>>,
    tenant: Option<Vec<u8>>,
    body: Vec<u8>,
    /// Where the body's first chunk ends.
    split: u8,
    end_of_stream: bool,
    claim_status: u16,
    claim_answer: Vec<u8>,
    renew_answer: Vec<u8>,
    response_status: Vec<u8>,
    response_body: Vec<u8>,
}

fuzz_target!(|input: Input| {
    let config = config();
    let methods = [
        "POST", "PUT", "PATCH", "DELETE", "GET", "HEAD", "OPTIONS", "post",
    ];
    let method = methods[usize::from(input.method) % methods.len()];
    let mut req = Req::default()
        .with(":method", method)
        .with_bytes(":path", &input.path)
        .with(":authority", "api.test");
    for (name, value) in [
        ("idempotency-key", input.key),
        ("x-user-id", input.user),
        ("x-tenant", input.tenant),
    ] {
        if let Some(v) = value {
            req = req.with_bytes(name, &v);
        }
    }
    let shared = MemStore::default();
    let mut breaker = Breaker::default();
    let mut telemetry = Recorder::default();
    let secret = [7; 32];
    let mut env = Env {
        now_ms: 1_000,
        shared: &shared,
        breaker: &mut breaker,
        telemetry: &mut telemetry,
        owner: 7,
        waiter_secret: Some(&secret),
        digests: &mut DigestMemo::new(),
    };
    let Some(route) = Flow::route(config, &req) else {
        return;
    };
    let (flow, mut action) =
        Flow::on_request_headers(config, route, &req, input.end_of_stream, &mut env);
    let Some(mut flow) = flow else {
        return;
    };
    if action == Action::Pause {
        let body = input.body.clone();
        let mut read = |n: usize| body.get(..n).map(<[u8]>::to_vec);
        // The body in two chunks when it has a split: Envoy reports what it buffered so far.
        let split = usize::from(input.split).min(body.len());
        if split > 0 && split < body.len() {
            action = flow.on_request_body(config, &req, split, false, &mut read, &mut env);
        }
        if action == Action::Pause {
            action = flow.on_request_body(config, &req, body.len(), true, &mut read, &mut env);
        }
    }
    if let Action::Decide(_) = action {
        let answer = Answer::Http {
            status: input.claim_status,
            body: &input.claim_answer,
        };
        action = flow.on_decision(config, answer, &mut env);
        if let Action::Continue(added) = &action {
            let fenced = added.iter().any(|(n, _)| n == "x-fencing-token");
            assert_eq!(fenced, flow.fence().is_some(), "a fence only from a grant");
        }
    }
    env.now_ms = u64::MAX / 2;
    if let Some(_renew) = flow.renewal_due(config, &mut env) {
        let answer = Answer::Http {
            status: 200,
            body: &input.renew_answer,
        };
        flow.on_renew_answer(config, answer, &mut env);
    }
    if flow.watches_response() {
        let headers = vec![
            (":status".to_string(), input.response_status),
            ("content-type".to_string(), b"application/json".to_vec()),
        ];
        flow.on_response_headers(config, &headers, false, &mut env);
        flow.on_response_body(config, &input.response_body, true, &mut env);
    }
    flow.on_stream_end(config, &mut env);
    let _ = flow.take_release();
});
