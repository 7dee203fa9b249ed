//! Bad input and abuse through the live gateway: every malformed key gets a clear 4xx
//! problem (or the HTTP layer's 400), never a trap; equivalent keys are one key; what is not
//! guarded passes through untouched; scopes never share stored responses; neither Redis nor
//! the filter's log holds raw keys or caller identities.

use crate::rig::*;

const SCOPED: &str = r#"[{"name":"payments","match":{"path_prefix":"/payments"},"scope":{"headers":["x-user-id"]},"lease":"2s"}]"#;

fn pay_as(rig: &Rig, user: &str, key: &str) -> Call {
    rig.send(
        "POST",
        "/payments",
        &[
            ("idempotency-key", key),
            ("x-user-id", user),
            ("content-type", "application/json"),
            ("x-demo-work-ms", "10"),
        ],
        r#"{"amount":7}"#,
    )
}

#[test]
fn malformed_keys_get_problems_and_equivalent_forms_are_one_key() {
    let rig = Rig::start(Options {
        rules: SCOPED,
        ..Options::default()
    });
    let long = "k".repeat(256);
    for (key, status, problem) in [
        ("", 400, "urn:idemgate:problem:missing-key"),
        (long.as_str(), 400, "urn:idemgate:problem:invalid-key"),
        ("clé-ü", 400, "urn:idemgate:problem:invalid-key"),
        ("\"unterminated", 400, "urn:idemgate:problem:invalid-key"),
        ("a\"b", 400, "urn:idemgate:problem:invalid-key"),
        ("\"a\"; x=1", 400, "urn:idemgate:problem:invalid-key"),
    ] {
        let call = pay_as(&rig, "u1", key);
        assert_eq!(call.status(), status, "{key:?}: {call:?}");
        assert_eq!(call.problem_type(), problem, "{key:?}");
        assert_eq!(
            call.reply.header("content-type"),
            Some("application/problem+json")
        );
    }
    // The longest allowed key works.
    assert_eq!(pay_as(&rig, "u1", &"k".repeat(255)).status(), 201);

    // Quoted (RFC 8941 sf-string) and bare forms are the same key: the second is a replay.
    assert_eq!(pay_as(&rig, "u1", "\"form-1\"").status(), 201);
    let bare = pay_as(&rig, "u1", "form-1");
    assert_eq!(
        bare.reply.header("idempotent-replayed"),
        Some("true"),
        "{bare:?}"
    );

    // A bare CR inside a header value: the HTTP layer refuses it before the filter.
    let bare_cr = b"POST /payments HTTP/1.1\r\nhost: a\r\nidempotency-key: a\rb\r\ncontent-length: 2\r\n\r\n{}";
    let status = raw_status(rig.addr, bare_cr);
    assert!((400..500).contains(&status), "{status}");

    // Content-Length with Transfer-Encoding: chunked (request smuggling), on a call the
    // backend would otherwise run: the gateway refuses it as Envoy's HTTP/1 codec does
    // (`source/common/http/http1/codec_impl.cc`: 400 "Bad Request", details
    // `http1.content_length_and_chunked_not_allowed`, connection closed, `server: envoy` from
    // the connection manager), before the filter or the backend see anything.
    let before = rig.stats();
    let claims = rig.counter("idemgate.requests.granted");
    let (status, head, body) = raw_reply(
        rig.addr,
        b"POST /payments HTTP/1.1\r\nhost: a\r\nidempotency-key: cl-te\r\nx-user-id: u1\r\ncontent-type: application/json\r\ncontent-length: 12\r\ntransfer-encoding: chunked\r\n\r\nc\r\n{\"amount\":7}\r\n0\r\n\r\n",
    );
    assert_eq!((status, body.as_str()), (400, "Bad Request"), "{head}");
    let head = head.to_ascii_lowercase();
    assert!(
        head.contains("\r\nserver: envoy"),
        "the gateway answered: {head}"
    );
    assert!(head.contains("\r\nconnection: close"), "{head}");
    assert!(
        !head.contains("application/problem+json"),
        "not the filter: {head}"
    );
    assert_eq!(rig.stats(), before, "nothing ran on the backend");
    assert_eq!(rig.counter("idemgate.requests.granted"), claims, "no claim");
    // A CRLF in a value is a header boundary: the "injected" header is just another header,
    // and the key is what precedes it.
    let split = raw_status(
        rig.addr,
        b"POST /payments HTTP/1.1\r\nhost: a\r\nidempotency-key: split-1\r\nx-user-id: u1\r\ncontent-type: application/json\r\ncontent-length: 12\r\nconnection: close\r\n\r\n{\"amount\":7}",
    );
    assert_eq!(split, 201);

    // Two Idempotency-Key headers: ambiguous, refused with 400 invalid-key (never decided on
    // one of them), and nothing runs.
    let twice = |rig: &Rig| {
        raw_status(
            rig.addr,
            b"POST /payments HTTP/1.1\r\nhost: a\r\nidempotency-key: dup-a\r\nidempotency-key: dup-b\r\nx-user-id: u1\r\ncontent-type: application/json\r\ncontent-length: 12\r\nconnection: close\r\n\r\n{\"amount\":7}",
        )
    };
    let before = rig.stats();
    assert_eq!(twice(&rig), 400);
    assert_eq!(twice(&rig), 400);
    assert_eq!(rig.stats(), before, "a request with two keys never runs");

    // A chunked body (no Content-Length) is guarded like any other.
    let chunked = b"POST /payments HTTP/1.1\r\nhost: a\r\nidempotency-key: chunked-1\r\nx-user-id: u1\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n5\r\n{\"amo\r\n7\r\nunt\":7}\r\n0\r\n\r\n";
    assert_eq!(raw_status(rig.addr, chunked), 201);
    assert_eq!(raw_status(rig.addr, chunked), 201, "replayed");

    // HEAD and OPTIONS are not guarded methods: passed through untouched (the backend's own
    // answer), no claim.
    let granted = rig.counter("idemgate.requests.granted");
    for method in ["HEAD", "OPTIONS", "GET"] {
        let call = rig.send(method, "/payments", &[("idempotency-key", "k")], "");
        assert_ne!(
            call.reply.header("content-type"),
            Some("application/problem+json")
        );
        assert!(
            call.status() != 0 && call.status() != 503,
            "{method}: {call:?}"
        );
    }
    assert_eq!(rig.counter("idemgate.requests.granted"), granted);

    let stats = rig.stats();
    // 255-long, form-1, split-1, chunked-1: one charge each (the two-key request never ran).
    assert_eq!((stats.charges, stats.double_charges), (4, 0), "{stats:?}");
    assert!(rig.counter("idemgate.requests.invalid_key") >= 5);
    assert!(rig.counter("idemgate.requests.missing_key") >= 1);
    // No VM trapped: every worker still answers.
    assert_eq!(pay_as(&rig, "u1", "after-all").status(), 201);
    assert!(
        rig.gateway_logs()
            .iter()
            .all(|l| !l.contains("RuntimeError")),
        "no trap"
    );
}

#[test]
fn replay_never_crosses_scopes_and_nothing_stores_or_logs_raw_identities() {
    let rig = Rig::start(Options {
        rules: SCOPED,
        ..Options::default()
    });
    let alice = pay_as(&rig, "alice-7f3", "secret-key-91");
    let bob = pay_as(&rig, "bob-2c8", "secret-key-91");
    assert_eq!((alice.status(), bob.status()), (201, 201));
    assert_eq!(
        bob.reply.header("idempotent-replayed"),
        None,
        "bob ran his own call"
    );
    assert_ne!(
        alice.reply.body, bob.reply.body,
        "each got their own payment"
    );
    let again = pay_as(&rig, "alice-7f3", "secret-key-91");
    assert_eq!(again.reply.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        again.reply.body, alice.reply.body,
        "alice's replay is alice's"
    );
    // Absent and empty scope headers are different callers too.
    let anonymous = rig.send(
        "POST",
        "/payments",
        &[
            ("idempotency-key", "secret-key-91"),
            ("content-type", "application/json"),
        ],
        r#"{"amount":7}"#,
    );
    assert_eq!(anonymous.reply.header("idempotent-replayed"), None);
    assert_eq!(rig.stats().charges, 3);

    // Redis: key names and string/hash values carry hashes, never the raw key or caller.
    let names = rig.redis().cli(&["--scan"]).unwrap();
    let mut dump = names.clone();
    for name in names.lines().filter(|n| !n.is_empty()) {
        let kind = rig.redis().cli(&["type", name]).unwrap_or_default();
        let value = match kind.trim() {
            "string" => rig.redis().cli(&["--raw", "get", name]),
            "hash" => rig.redis().cli(&["--raw", "hgetall", name]),
            "list" => rig.redis().cli(&["--raw", "lrange", name, "0", "-1"]),
            "zset" => rig.redis().cli(&["--raw", "zrange", name, "0", "-1"]),
            _ => Ok(String::new()),
        };
        dump.push_str(&value.unwrap_or_default());
    }
    for secret in ["secret-key-91", "alice-7f3", "bob-2c8"] {
        assert!(!dump.contains(secret), "{secret} in Redis: {dump}");
        for line in rig.gateway_logs() {
            assert!(!line.contains(secret), "{secret} logged: {line}");
        }
    }
}

#[test]
fn sidecar_binds_loopback_by_default() {
    // Flags' defaults equal `Config::default()` (sidecar unit test); this is the address.
    let listen = idemgate_sidecar::Config::default().listen;
    assert!(listen.ip().is_loopback(), "{listen}");
}

/// Sends `request` as is and returns the status, the response head and the body.
fn raw_reply(addr: std::net::SocketAddr, request: &[u8]) -> (u16, String, String) {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).expect("connect");
    conn.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("timeout");
    conn.write_all(request).expect("send");
    let mut raw = Vec::new();
    let _ = conn.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_owned(), body.to_owned())
}
