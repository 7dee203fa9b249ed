//! `idemgate-sidecar --check`: validates the flags and proves the store works for this
//! sidecar, then exits 0 (ready) or 1 — for init containers and deploy pipelines.
//!
//! The check runs the real server on an ephemeral loopback port with the given flags and
//! drives it as a gateway would, so it exercises exactly what serving will: the Redis
//! connection (topology, `rediss://` with the configured CA and client certificate), the
//! ACL rights on the key prefix (a claim and an abort write and delete a probe key under
//! it, the inbox subscription subscribes under it, the admin listing SCANs it) and the Lua
//! scripts (claim, abort and the admin inspection each run one). Redis errors (`NOPERM`,
//! TLS failures) are in the log lines printed beside the verdicts.

use crate::{Cli, Config, Sidecar, StoreConfig};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use idemgate_wire::{AbortRequest, ClaimOutcome, ClaimRequest, Mode, OwnerOutcome, paths};
use std::ffi::OsString;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The command line without `--check`, when it was given: the check takes every other
/// flag (and environment variable) the server would.
pub fn requested(args: impl IntoIterator<Item = OsString>) -> Option<Vec<OsString>> {
    let args: Vec<OsString> = args.into_iter().collect();
    let rest: Vec<OsString> = args.iter().filter(|a| *a != "--check").cloned().collect();
    (rest.len() < args.len()).then_some(rest)
}

/// The key the check claims and releases (lock mode, under the configured prefix).
pub const PROBE_KEY: &str = "idemgate-check";

/// One line of the report.
fn say(verdict: &str, what: &str) {
    println!("{verdict:<5} {what}");
}

/// Runs every check and reports each; true when all passed.
pub async fn run(cli: Cli) -> bool {
    let config = match Config::from_cli(cli) {
        Ok(config) => config,
        Err(err) => {
            say("FAIL", &format!("flags: {err}"));
            return false;
        }
    };
    say("ok", "flags");
    for warning in warnings(&config) {
        say("WARN", &warning);
    }
    let probe = Config {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        ..config.clone()
    };
    let sidecar = match Sidecar::spawn(probe).await {
        Ok(sidecar) => sidecar,
        Err(err) => {
            say("FAIL", &format!("store: {err}"));
            return false;
        }
    };
    let client = Client {
        addr: sidecar.addr(),
        token: config.auth_token.clone(),
    };
    let passed = store_checks(&client, &config).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), sidecar.shutdown()).await;
    passed
}

/// What works but is probably not what the operator meant.
pub fn warnings(config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    if config.store == StoreConfig::Memory && !config.listen.ip().is_loopback() {
        out.push(format!(
            "memory store listening on {}: every replica keeps its own locks, so gateways \
             reaching different replicas let duplicates through; set REDIS_URL",
            config.listen
        ));
    }
    if config.auth_token.is_none() && !config.listen.ip().is_loopback() {
        out.push(format!(
            "no auth token while listening on {}: anyone who reaches the port can claim, \
             release and list keys; set IDEMGATE_AUTH_TOKEN",
            config.listen
        ));
    }
    out
}

async fn store_checks(client: &Client, config: &Config) -> bool {
    let store = match &config.store {
        StoreConfig::Memory => "memory store".to_owned(),
        StoreConfig::Redis(redis) => format!(
            "Redis ({:?}{}, prefix {:?})",
            redis.topology,
            if redis.urls.iter().any(|u| u.starts_with("rediss://")) {
                ", TLS"
            } else {
                ""
            },
            redis.prefix
        ),
    };
    // Ready: the store answers (bounded: a few store timeouts).
    let deadline = Instant::now() + config.store_timeout * 3;
    loop {
        match client.call("GET", "/readyz", None).await {
            Ok((200, _)) => break,
            answer if Instant::now() >= deadline => {
                say("FAIL", &format!("{store} reachable: {}", describe(&answer)));
                return false;
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    say("ok", &format!("{store} reachable"));

    // One fixed probe key: a released key keeps its record (its last fence) for the fence
    // TTL, so a key per run would leave one record behind per init container start.
    let key = PROBE_KEY.to_owned();
    let claim = ClaimRequest {
        key: key.clone(),
        mode: Mode::Lock,
        lease_ms: 5_000,
        fingerprint: None,
        wait: None,
        waiter: None,
    };
    let answer = client
        .call(
            "POST",
            paths::CLAIM,
            Some(idemgate_wire::encode(&claim, &[])),
        )
        .await;
    let owner = match &answer {
        Ok((200, body)) => match idemgate_wire::decode::<ClaimOutcome>(body) {
            Ok((ClaimOutcome::Granted { owner, .. }, _)) => Some(owner.clone()),
            // Another check (a sibling replica's init container) holds it: the claim script
            // ran on the prefix all the same.
            Ok((ClaimOutcome::Busy { .. }, _)) => None,
            other => {
                say(
                    "FAIL",
                    &format!("claim a probe key: unexpected answer {other:?}"),
                );
                return false;
            }
        },
        _ => {
            say(
                "FAIL",
                &format!(
                    "claim a probe key (write rights on the prefix, claim script): {}",
                    describe(&answer)
                ),
            );
            return false;
        }
    };
    say(
        "ok",
        "claim a probe key (write rights on the prefix, claim script)",
    );

    let inspect = client
        .call("GET", &format!("/admin/v1/keys/{key}"), None)
        .await;
    let inspected = matches!(&inspect, Ok((200, _)));
    verdict(
        inspected,
        "inspect it (read rights, inspect script)",
        &inspect,
    );

    let aborted = match owner {
        Some(owner) => {
            let abort = AbortRequest { key, owner };
            let answer = client
                .call(
                    "POST",
                    paths::ABORT,
                    Some(idemgate_wire::encode(&abort, &[])),
                )
                .await;
            let released = match &answer {
                Ok((200, body)) => matches!(
                    idemgate_wire::decode::<OwnerOutcome>(body),
                    Ok((OwnerOutcome::Released, _))
                ),
                _ => false,
            };
            verdict(
                released,
                "release it (delete rights, abort script)",
                &answer,
            );
            released
        }
        None => {
            say(
                "ok",
                "release it: skipped, another check holds the probe key",
            );
            true
        }
    };

    let list = client.call("GET", "/admin/v1/keys?limit=1", None).await;
    let listed = matches!(&list, Ok((200, _)));
    verdict(listed, "list keys (SCAN on the prefix)", &list);
    inspected && aborted && listed
}

fn verdict(passed: bool, what: &str, answer: &Result<(u16, Bytes), String>) {
    if passed {
        say("ok", what);
    } else {
        say("FAIL", &format!("{what}: {}", describe(answer)));
    }
}

fn describe(answer: &Result<(u16, Bytes), String>) -> String {
    match answer {
        Ok((status, body)) => {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            if text.is_empty() || !text.is_ascii() {
                format!("HTTP {status}")
            } else {
                format!(
                    "HTTP {status} {}",
                    text.chars().take(300).collect::<String>()
                )
            }
        }
        Err(err) => err.clone(),
    }
}

/// HTTP/1.1 to the probe server, one connection per call.
struct Client {
    addr: SocketAddr,
    token: Option<String>,
}

impl Client {
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(u16, Bytes), String> {
        let attempt = async {
            let stream = tokio::net::TcpStream::connect(self.addr)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream))
                    .await
                    .map_err(|e| format!("handshake: {e}"))?;
            tokio::spawn(connection);
            let mut request = hyper::Request::builder()
                .method(method)
                .uri(path)
                .header(hyper::header::HOST, self.addr.to_string())
                .header(hyper::header::CONTENT_TYPE, idemgate_wire::CONTENT_TYPE);
            if let Some(token) = &self.token {
                request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
            }
            let request = request
                .body(Full::new(Bytes::from(body.unwrap_or_default())))
                .map_err(|e| format!("request: {e}"))?;
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| format!("request: {e}"))?;
            let status = response.status().as_u16();
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("body: {e}"))?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(Duration::from_secs(10), attempt)
            .await
            .map_err(|_| "no answer within 10 s".to_owned())?
    }
}

// Two attributes, not `all(test, feature)`: clippy's allow-*-in-tests settings recognise
// only a plain `cfg(test)` as test code.
#[cfg(test)]
#[cfg(feature = "testing")]
mod tests {
    use super::*;
    use crate::testing::RedisServer;
    use clap::Parser;

    fn cli(args: &[&str]) -> Cli {
        Cli::parse_from(std::iter::once("idemgate-sidecar").chain(args.iter().copied()))
    }

    #[test]
    fn the_flag_is_taken_out_of_the_command_line() {
        let args = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            requested(args(&["s", "--check", "--listen", "0.0.0.0:1"])),
            Some(args(&["s", "--listen", "0.0.0.0:1"]))
        );
        assert_eq!(requested(args(&["s", "--listen", "0.0.0.0:1"])), None);
    }

    #[test]
    fn a_memory_store_on_a_shared_address_is_warned_about() {
        let config = |args: &[&str]| Config::from_cli(cli(args)).unwrap();
        let warned = warnings(&config(&["--listen", "0.0.0.0:9470", "--auth-token", "t"]));
        assert_eq!(warned.len(), 1, "{warned:?}");
        assert!(warned[0].starts_with("memory store listening on 0.0.0.0:9470"));
        assert!(warnings(&config(&["--auth-token", "t"])).is_empty());
        let redis = config(&[
            "--listen",
            "0.0.0.0:9470",
            "--auth-token",
            "t",
            "--redis-url",
            "redis://r:6379",
        ]);
        assert!(warnings(&redis).is_empty());
        assert_eq!(warnings(&config(&["--listen", "[::]:9470"])).len(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_rights_on_the_prefix_decide_the_verdict() {
        let redis = RedisServer::start().expect("redis-server (apt install redis-server)");
        let port = redis.port();
        for (user, rules) in [
            ("owner", "~idemgate:* &idemgate:* +@all"),
            ("outsider", "~other:* &other:* +@all"),
            ("noscripts", "~idemgate:* &idemgate:* +@all -@scripting"),
        ] {
            let mut acl = vec!["ACL", "SETUSER", user, "on", ">pw"];
            acl.extend(rules.split(' '));
            redis.cli(&acl).unwrap();
        }
        let url = |user: &str| format!("redis://{user}:pw@127.0.0.1:{port}");
        let check = |args: Vec<String>| async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run(cli(&args)).await
        };
        let flags = |user: &str| {
            vec![
                "--redis-url".to_owned(),
                url(user),
                "--store-timeout-ms".to_owned(),
                "500".to_owned(),
                "--auth-token".to_owned(),
                "t0ken".to_owned(),
            ]
        };
        assert!(check(flags("owner")).await, "full rights on the prefix");
        assert!(!check(flags("outsider")).await, "no rights on the prefix");
        assert!(!check(flags("noscripts")).await, "no scripting");
        let mut prefixed = flags("outsider");
        prefixed.extend(["--redis-prefix".to_owned(), "other".to_owned()]);
        assert!(check(prefixed).await, "the outsider owns its own prefix");
        assert!(
            !check(vec![
                "--redis-url".into(),
                "redis://127.0.0.1:1".into(),
                "--store-timeout-ms".into(),
                "200".into()
            ])
            .await,
            "unreachable"
        );
        assert!(
            !check(vec!["--redis-url".into(), "http://x".into()]).await,
            "bad flags"
        );
        // Runs leave one lock record behind, not one per run (besides the readiness probe's
        // key, which expires by itself).
        assert!(check(flags("owner")).await);
        let records = redis.cli(&["--scan", "--pattern", "idemgate:*"]).unwrap();
        let locks: Vec<&str> = records.lines().filter(|k| k.ends_with(":record")).collect();
        assert_eq!(locks, ["idemgate:{idemgate-check}:record"], "{records}");
    }
}
