use super::*;
use alloc::string::ToString;
use alloc::vec;

fn claim() -> ClaimRequest {
    ClaimRequest {
        key: "a".repeat(64),
        mode: Mode::Idempotency,
        lease_ms: 30_000,
        fingerprint: Some("f".repeat(64)),
        wait: Some(WaitPolicy {
            budget_ms: 1000,
            per_waiter_ms: 100,
            max_budget_ms: 1500,
            max_queue: 10,
        }),
        waiter: Some("w".repeat(32)),
    }
}

#[test]
fn frame_without_payload_is_plain_json() {
    let bytes = encode(&claim(), b"");
    assert!(!bytes.contains(&b'\n'));
    let (back, payload): (ClaimRequest, _) = decode(&bytes).unwrap();
    assert_eq!(back, claim());
    assert!(payload.is_empty());
}

#[test]
fn payload_with_newlines_and_binary_roundtrips() {
    let body = b"line1\nline2\n\x00\xff";
    let outcome = ClaimOutcome::Completed {
        response: StoredResponse {
            status: 201,
            headers: vec![("content-type".to_string(), "a\nb".to_string())],
        },
        waited_ms: 3,
    };
    let bytes = encode(&outcome, body);
    let (back, payload): (ClaimOutcome, _) = decode(&bytes).unwrap();
    assert_eq!(back, outcome);
    assert_eq!(payload, body);
}

/// The head is checked for UTF-8 as a whole: text beyond ASCII and escapes still decode,
/// bytes that are not UTF-8 are refused wherever they stand, and the payload after the head
/// is never checked.
#[test]
fn heads_must_be_utf8_and_payloads_need_not_be() {
    let (abort, payload): (AbortRequest, _) =
        decode("{\"key\":\"cl\u{e9}\",\"owner\":\"\\u00e9\\n\"}\n\u{ff}".as_bytes()).unwrap();
    assert_eq!(abort.key, "cl\u{e9}");
    assert_eq!(abort.owner, "\u{e9}\n");
    assert_eq!(payload, "\u{ff}".as_bytes());
    for head in [
        &b"{\"key\":\"a\xff\",\"owner\":\"b\"}"[..],
        b"{\"key\":\"a\",\"owner\":\"b\xc3\"}",
        b"{\"key\":\"a\",\"own\xe9r\":\"b\"}",
        b"{\"key\":\"a\",\"owner\":\"b\"}\xff",
    ] {
        let decoded: Result<(AbortRequest, _), _> = decode(head);
        assert!(decoded.is_err(), "{head:?} decoded");
    }
    let (_, payload): (AbortRequest, _) =
        decode(b"{\"key\":\"a\",\"owner\":\"b\"}\n\xff\xfe").unwrap();
    assert_eq!(payload, b"\xff\xfe");
}

#[test]
fn outcomes_are_tagged_snake_case() {
    let bytes = encode(
        &ClaimOutcome::QueueFull {
            retry_after_ms: 5,
            queue_len: 2,
        },
        b"",
    );
    assert_eq!(
        core::str::from_utf8(&bytes).unwrap(),
        r#"{"outcome":"queue_full","retry_after_ms":5,"queue_len":2}"#
    );
    let (o, _): (OwnerOutcome, _) = decode(br#"{"outcome":"stale"}"#).unwrap();
    assert_eq!(o, OwnerOutcome::Stale);
}

#[test]
fn garbage_is_an_error() {
    assert!(decode::<ClaimOutcome>(b"").is_err());
    assert!(decode::<ClaimOutcome>(b"\xff\xfe").is_err());
    assert!(decode::<ClaimOutcome>(br#"{"outcome":"granted"}"#).is_err());
    assert!(decode::<ClaimOutcome>(br#"{"outcome":"won"}"#).is_err());
    assert!(decode::<OwnerOutcome>(br#"{"outcome":"released"} trailing"#).is_err());
}

#[test]
fn answers_tolerate_new_fields_requests_do_not() {
    let (o, _): (ClaimOutcome, _) = decode(br#"{"outcome":"mismatch","hint":1}"#).unwrap();
    assert_eq!(o, ClaimOutcome::Mismatch);
    let mut request = serde_json::to_value(claim()).unwrap();
    request["lease"] = 5.into();
    assert!(serde_json::from_value::<ClaimRequest>(request).is_err());
}

#[test]
fn wait_budget_grows_with_queue_and_is_capped() {
    let w = claim().wait.unwrap();
    assert_eq!(w.budget_for(0), 1000);
    assert_eq!(w.budget_for(3), 1300);
    assert_eq!(w.budget_for(100), 1500);
    assert_eq!(w.longest_budget(), 1500);
    let flat = WaitPolicy {
        budget_ms: 800,
        per_waiter_ms: 0,
        max_budget_ms: 0,
        max_queue: 4,
    };
    assert_eq!(flat.budget_for(4), 800);
}

#[test]
fn limits_name_the_offending_field() {
    let limits = Limits::default();
    assert!(limits.claim(&claim()).is_ok());
    let mut bad = claim();
    bad.key = "has space".to_string();
    assert_eq!(limits.claim(&bad).unwrap_err().field, "key");
    bad.key = "k".repeat(129);
    let err = limits.claim(&bad).unwrap_err();
    assert!(err.too_large);
    let mut bad = claim();
    bad.lease_ms = 0;
    assert_eq!(limits.claim(&bad).unwrap_err().field, "lease_ms");

    let complete = CompleteRequest {
        key: "k".to_string(),
        owner: "o".to_string(),
        retention_ms: 1,
        response: Some(StoredResponse {
            status: 200,
            headers: vec![("x-ok".to_string(), "v\r\nset-cookie: x".to_string())],
        }),
    };
    assert_eq!(
        limits.complete(&complete, b"").unwrap_err().field,
        "response.headers"
    );
    let release_only = CompleteRequest {
        response: None,
        ..complete
    };
    assert!(limits.complete(&release_only, b"").is_ok());
    assert_eq!(
        limits.complete(&release_only, b"body").unwrap_err().field,
        "response"
    );
    let big = vec![0u8; limits.max_body + 1];
    let with_body = CompleteRequest {
        response: Some(StoredResponse {
            status: 200,
            headers: vec![],
        }),
        ..release_only
    };
    assert!(limits.complete(&with_body, &big).unwrap_err().too_large);
}

#[test]
fn flat_answer_decoding_keeps_defaults_and_names_missing_fields() {
    let (o, _): (ClaimOutcome, _) =
        decode(br#"{"retry_after_ms":7,"queue_len":1,"outcome":"busy"}"#).unwrap();
    assert_eq!(
        o,
        ClaimOutcome::Busy {
            retry_after_ms: 7,
            queue_len: 1,
            waited: false
        }
    );
    let e = decode::<ClaimOutcome>(br#"{"outcome":"granted","fence":1,"lease_ms":5}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing field `owner`"), "{e}");
    let (o, _): (OwnerOutcome, _) = decode(br#"{"outcome":"renewed","lease_ms":9}"#).unwrap();
    assert_eq!(o, OwnerOutcome::Renewed { lease_ms: 9 });
    assert!(decode::<OwnerOutcome>(br#"{"outcome":"renewed"}"#).is_err());
}

#[test]
fn waiter_names_are_checked_like_owner_tokens() {
    let limits = Limits::default();
    let mut req = claim();
    assert!(limits.claim(&req).is_ok());
    req.waiter = Some("has space".into());
    assert_eq!(limits.claim(&req).unwrap_err().field, "waiter");
    req.waiter = Some("w".repeat(65));
    assert!(limits.claim(&req).unwrap_err().too_large);

    let leave = LeaveRequest {
        key: "k".repeat(64),
        waiter: "w".repeat(32),
    };
    let bytes = encode(&leave, b"");
    let (back, payload): (LeaveRequest, &[u8]) = decode(&bytes).unwrap();
    assert_eq!((back, payload), (leave.clone(), &b""[..]));
    assert!(limits.leave(&leave).is_ok());
    let empty = LeaveRequest {
        waiter: String::new(),
        ..leave
    };
    assert_eq!(limits.leave(&empty).unwrap_err().field, "waiter");
}

/// The filter's answer decoding accepts and yields exactly what the typed decoding does, on
/// every answer shape and on the malformed ones (wrong types, nulls, floats, extra elements,
/// unknown fields, fields named twice, escapes, trailing bytes).
#[test]
fn answer_decoding_agrees_with_the_typed_decoding() {
    fn agree<T: serde::de::DeserializeOwned + PartialEq + core::fmt::Debug>(frame: &[u8]) {
        let typed = decode::<T>(frame).ok();
        let lean = decode_answer::<T>(frame).ok();
        assert_eq!(lean, typed, "{}", String::from_utf8_lossy(frame));
    }
    let claims: &[&[u8]] = &[
        br#"{"outcome":"granted","owner":"o","fence":3,"lease_ms":5}"#,
        br#"{"outcome":"granted","owner":"o","fence":3,"lease_ms":5,"waited_ms":2}"#,
        br#"{"outcome":"granted","owner":"o","fence":3,"lease_ms":5,"waited_ms":null}"#,
        br#"{"outcome":"granted","owner":"o","fence":3,"lease_ms":null}"#,
        br#"{"outcome":"granted","owner":"o","fence":3.0,"lease_ms":5}"#,
        br#"{"outcome":"granted","owner":"o","fence":-3,"lease_ms":5}"#,
        br#"{"outcome":"granted","owner":"o","fence":1e2,"lease_ms":5}"#,
        br#"{"outcome":"granted","owner":7,"fence":3,"lease_ms":5}"#,
        br#"{"outcome":"granted","fence":3,"lease_ms":5}"#,
        br#"{"outcome":"completed","response":{"status":200}}"#,
        b"{\"outcome\":\"completed\",\"response\":{\"status\":201,\"headers\":[[\"a\",\"b\"]]}}\nbody",
        br#"{"outcome":"completed","response":{"status":201,"headers":[["a","b","c"]]}}"#,
        br#"{"outcome":"completed","response":{"status":201,"headers":[["a"]]}}"#,
        br#"{"outcome":"completed","response":{"status":70000}}"#,
        br#"{"outcome":"completed","response":{"status":200,"extra":1}}"#,
        br#"{"outcome":"completed","response":null}"#,
        br#"{"outcome":"mismatch","hint":1.5,"more":{"a":[1,-2,null,true]}}"#,
        br#"{"outcome":"busy","retry_after_ms":7,"queue_len":1}"#,
        br#"{"outcome":"busy","retry_after_ms":7,"queue_len":4294967296}"#,
        br#"{"outcome":"busy","retry_after_ms":7,"queue_len":1,"waited":true}"#,
        br#"{"outcome":"busy","retry_after_ms":7,"queue_len":1,"waited":1}"#,
        br#"{"outcome":"queue_full","retry_after_ms":7,"queue_len":1}"#,
        br#"{"outcome":"won"}"#,
        br#"{"outcome":"busy","outcome":"mismatch"}"#,
        br#"{"outcome":"mismatch","hint":1,"hint":2}"#,
        br#"{"outcome":"granted","owner":"o\u0041","fence":3,"lease_ms":5}"#,
        br#"{"outc\u006fme":"mismatch"}"#,
        br#"{"outcome":1}"#,
        br#"{"outcome":null}"#,
        br#"{"outcome":"mismatch"} trailing"#,
        br#"["mismatch"]"#,
        br#"null"#,
        b"",
        b"\xff\xfe",
    ];
    for frame in claims {
        agree::<ClaimOutcome>(frame);
    }
    let owners: &[&[u8]] = &[
        br#"{"outcome":"released"}"#,
        br#"{"outcome":"stale","lease_ms":"x"}"#,
        br#"{"outcome":"renewed","lease_ms":9}"#,
        br#"{"outcome":"renewed"}"#,
        br#"{"outcome":"renewed","lease_ms":9.5}"#,
    ];
    for frame in owners {
        agree::<OwnerOutcome>(frame);
    }
    let rates: &[&[u8]] = &[
        br#"{"results":[{"allowed":true,"remaining":3}]}"#,
        br#"{"results":[{"allowed":false,"remaining":0,"retry_after_ms":5,"reset_ms":9}]}"#,
        br#"{"results":[{"allowed":false,"remaining":-1}]}"#,
        br#"{"results":[{"allowed":"no","remaining":0}]}"#,
        br#"{"results":[]}"#,
        br#"{"results":{}}"#,
        br#"{}"#,
    ];
    for frame in rates {
        agree::<RateOutcome>(frame);
    }
}
