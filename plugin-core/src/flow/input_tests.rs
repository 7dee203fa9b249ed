//! Hostile spellings of one request: every spelling of a guarded path is guarded under one
//! key, and a request that reads two ways (encoded separator, repeated identity or key) is
//! refused with a 400 problem rather than guessed at.

use super::*;
use crate::breaker::Breaker;
use crate::testing::{MemStore, Recorder, Req};
use alloc::format;

const RULES: &str = r#"[
 {"name":"agents","mode":"lock","match":{"path_template":"/agents/{agent_id}/tools"},"key":{"path_param":"agent_id"},"on_conflict":"queue"},
 {"name":"bots","mode":"lock","match":{"path_template":"/bots/{bot}/start"},"key":{"path_param":"bot"}},
 {"name":"docs","mode":"lock","match":{"path_prefix":"/docs/"},"key":{"query_param":"doc"}},
 {"name":"pay","match":{"path_prefix":"/payments"},"scope":{"headers":["x-user-id"]}}]"#;

fn config() -> Config {
    crate::config::parse(format!(r#"{{"sidecar":{{"cluster":"s"}},"rules":{RULES}}}"#).as_bytes())
        .unwrap()
}

/// The request's action and, when it claims, the claimed key.
fn start(config: &Config, req: &Req) -> (Action, Option<String>, Recorder) {
    let shared = MemStore::default();
    let mut breaker = Breaker::default();
    let mut rec = Recorder::default();
    let mut env = Env {
        now_ms: 1_000,
        shared: &shared,
        breaker: &mut breaker,
        telemetry: &mut rec,
        owner: 1,
        waiter_secret: None,
        digests: &mut crate::DigestMemo::new(),
    };
    let Some(route) = Flow::route(config, req) else {
        return (Action::pass(), None, rec);
    };
    let (_, action) = Flow::on_request_headers(config, route, req, true, &mut env);
    let key = match &action {
        Action::Decide(call) => {
            let (claim, _): (ClaimRequest, &[u8]) = idemgate_wire::decode(&call.body).unwrap();
            Some(claim.key)
        }
        _ => None,
    };
    (action, key, rec)
}

fn key_of(config: &Config, req: &Req) -> String {
    let (action, key, _) = start(config, req);
    key.unwrap_or_else(|| panic!("{req:?} is claimed, got {action:?}"))
}

fn refused(config: &Config, req: &Req) -> (String, Recorder) {
    let (action, _, rec) = start(config, req);
    let Action::Respond(reply) = action else {
        panic!("{req:?} is refused, got {action:?}")
    };
    assert_eq!(reply.status, 400, "{req:?}");
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    (body["type"].as_str().unwrap().into(), rec)
}

#[test]
fn every_spelling_of_a_guarded_path_is_guarded_under_one_key() {
    let c = config();
    let agent = |path: &str| key_of(&c, &Req::new("POST", path));
    let a2 = agent("/agents/a2/tools");
    for path in [
        "/agents/%61%32/tools",
        "/agents/%61%32/tools?x=1",
        "//agents/a2/tools",
        "/agents//a2/tools",
        "/agents/a2/./tools",
        "/agents/a2/tools/",
        "/agents/x/../a2/tools",
        "/agents/a2/%2e/tools",
        "/%61gents/a2/tools",
    ] {
        assert_eq!(agent(path), a2, "{path}");
    }
    assert_ne!(agent("/agents/a3/tools"), a2);
    let b2 = key_of(&c, &Req::new("POST", "/bots/b2/start"));
    assert_eq!(key_of(&c, &Req::new("POST", "/bots/%62%32/start")), b2);
    // A reserved character is one resource however the client escapes it, as the backend's
    // router decodes the segment.
    assert_eq!(agent("/agents/a%3Bb/tools"), agent("/agents/a;b/tools"));
    // Query keys are decoded as form values.
    let doc = |q: &str| key_of(&c, &Req::new("PUT", &format!("/docs/edit?{q}")));
    assert_eq!(doc("doc=a+b"), doc("doc=a%20b"));
    assert_eq!(doc("d%6Fc=x"), doc("doc=x"));
    // Prefixes: `/docs/` covers `/docs` and `/./docs/` too.
    assert_eq!(key_of(&c, &Req::new("PUT", "/./docs?doc=x")), doc("doc=x"));
    // Still outside every rule: the canonical path is another resource.
    assert_eq!(
        start(&c, &Req::new("POST", "/agents/a2/tools/x")).0,
        Action::pass()
    );
    assert_eq!(
        start(&c, &Req::new("POST", "/agents/a2/../tools")).0,
        Action::pass()
    );
}

#[test]
fn an_encoded_separator_on_a_guarded_path_is_refused() {
    let c = config();
    for path in [
        "/agents/a%2Fb/tools",
        "/agents/a%2fb/tools",
        "/agents/a%5Cb/tools",
        "/agents/a\\b/tools",
        // Read as separators, these reach a guarded path on a backend that decodes first.
        "/agents%2Fa2%2Ftools",
        "/bots/b2%2fstart",
        "/x/..%2Fbots/b2/start",
    ] {
        let (problem, rec) = refused(&c, &Req::new("POST", path));
        assert_eq!(problem, "urn:idemgate:problem:ambiguous-request", "{path}");
        assert_eq!(rec.count_of(Counter::Ambiguous), 1);
    }
    // Unguarded either way: passed untouched.
    assert_eq!(
        start(&c, &Req::new("POST", "/other/a%2Fb")).0,
        Action::pass()
    );
}

#[test]
fn a_repeated_scope_header_is_refused() {
    let c = config();
    let alice = Req::new("POST", "/payments")
        .with("idempotency-key", "k1")
        .with("x-user-id", "alice");
    assert!(start(&c, &alice).1.is_some());
    let (problem, rec) = refused(&c, &alice.clone().with("x-user-id", "mallory"));
    assert_eq!(problem, "urn:idemgate:problem:ambiguous-request");
    assert_eq!(rec.count_of(Counter::Ambiguous), 1);
}

#[test]
fn a_repeated_or_joined_key_is_invalid() {
    let c = config();
    let pay = |key: &str| {
        Req::new("POST", "/payments")
            .with("x-user-id", "alice")
            .with("idempotency-key", key)
    };
    for req in [
        pay("k1").with("idempotency-key", "k2"),
        pay("k1").with("idempotency-key", "k1"),
        pay("k1, k2"),
        pay("k1,k2"),
    ] {
        let (problem, rec) = refused(&c, &req);
        assert_eq!(problem, "urn:idemgate:problem:invalid-key", "{req:?}");
        assert_eq!(rec.count_of(Counter::InvalidKey), 1);
    }
    // Inside an sf-string a comma is an ordinary character.
    assert!(start(&c, &pay("\"k1,k2\"")).1.is_some());
    let (problem, _) = refused(&c, &Req::new("PUT", "/docs/e?doc=a&doc=b"));
    assert_eq!(problem, "urn:idemgate:problem:invalid-key");
}
