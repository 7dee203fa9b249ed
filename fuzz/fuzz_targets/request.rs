//! One request through the filter's decision state machine with fuzzed headers (the
//! `Idempotency-Key` sf-string, path, method, scope and fingerprint headers, lock-mode path
//! and query keys), then a fuzzed sidecar answer to its claim, a renewal answer, a response
//! and the stream's end. Every step must return an action, never panic; a request the
//! filter let through must carry a fence only when the sidecar granted one.

#![no_main]

use idemgate_core::{
    Action, Answer, Breaker, Config, Counter, Env, Flow, Histogram, HostError, RequestView,
    SharedStore, Telemetry,
};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::OnceLock;

/// Rules covering every key source, charset and conflict policy.
const CONFIG: &str = r#"{"sidecar":{"cluster":"s"},"allow_on_headers_stop_iteration":true,"rules":[
 {"name":"pay","match":{"path_prefix":"/payments"},"scope":{"headers":["x-user-id"]},"fingerprint":{"headers":["x-tenant"],"max_body_bytes":64}},
 {"name":"tok","match":{"path_prefix":"/tokens"},"key":{"charset":"token","max_length":16}},
 {"name":"alnum","match":{"path_prefix":"/alnum"},"key":{"charset":"alphanumeric","required":false},"on_conflict":"queue"},
 {"name":"agents","mode":"lock","match":{"path_template":"/agents/{agent_id}/mcp"},"key":{"path_param":"agent_id"},"on_conflict":"queue"},
 {"name":"query","mode":"lock","match":{"path_prefix":"/q"},"key":{"query_param":"id"}}]}"#;

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
    end_of_stream: bool,
    claim_status: u16,
    claim_answer: Vec<u8>,
    renew_answer: Vec<u8>,
    response_status: Vec<u8>,
    response_body: Vec<u8>,
}

struct Req(HashMap<String, Vec<u8>>);

impl RequestView for Req {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.0.get(name).cloned()
    }
    fn property(&self, _: &[String]) -> Option<Vec<u8>> {
        None
    }
    fn repeated(&self, _: &[String]) -> bool {
        false
    }
}

/// Envoy's shared data semantics, enough for one request.
#[derive(Default)]
struct Shared(RefCell<HashMap<String, (Vec<u8>, u32)>>, RefCell<u32>);

impl SharedStore for Shared {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        Ok(self.0.borrow().get(key).cloned())
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<bool, HostError> {
        let mut map = self.0.borrow_mut();
        if let (Some(cas), Some((_, current))) = (cas, map.get(key))
            && *current != cas
        {
            return Ok(false);
        }
        let mut next = self.1.borrow_mut();
        *next += 1;
        map.insert(key.to_string(), (value.to_vec(), *next));
        Ok(true)
    }
}

struct Discard;

impl Telemetry for Discard {
    fn count(&mut self, _: Counter) {}
    fn record(&mut self, _: Histogram, _: u64) {}
    fn count_rate(&mut self, _: usize, _: bool) {}
}

fuzz_target!(|input: Input| {
    let config = config();
    let methods = [
        "POST", "PUT", "PATCH", "DELETE", "GET", "HEAD", "OPTIONS", "post",
    ];
    let method = methods[usize::from(input.method) % methods.len()];
    let mut headers = HashMap::new();
    headers.insert(":method".to_string(), method.as_bytes().to_vec());
    headers.insert(":path".to_string(), input.path);
    headers.insert(":authority".to_string(), b"api.test".to_vec());
    for (name, value) in [
        ("idempotency-key", input.key),
        ("x-user-id", input.user),
        ("x-tenant", input.tenant),
    ] {
        if let Some(v) = value {
            headers.insert(name.to_string(), v);
        }
    }
    let req = Req(headers);
    let shared = Shared::default();
    let mut breaker = Breaker::default();
    let mut telemetry = Discard;
    let mut env = Env {
        now_ms: 1_000,
        shared: &shared,
        breaker: &mut breaker,
        telemetry: &mut telemetry,
        owner: 7,
        // Queued claims name their waiter (derived from this secret) as the filter's do.
        waiter_secret: Some(&[7; 32]),
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
        action = flow.on_request_body(config, input.body.len(), true, &mut read, &mut env);
    }
    if let Action::Claim(_) = action {
        let answer = Answer::Http {
            status: input.claim_status,
            body: &input.claim_answer,
        };
        action = flow.on_claim_answer(config, answer, &mut env);
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
