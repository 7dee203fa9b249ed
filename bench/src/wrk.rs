//! Group `e2e`: `wrk` (Debian's, installed by `cargo xtask bench`) through the gateway with
//! idemgate against the same gateway with the no-op filter: a GET mix no rule matches, and
//! a mutating mix of payments, each with its own `Idempotency-Key` so every one is granted
//! (claim at the sidecar, upstream, complete) rather than answered as a duplicate.

use anyhow::{Context, Result, bail};
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

/// wrk threads and connections, and seconds per run.
pub const THREADS: usize = 2;
pub const CONNECTIONS: usize = 16;
pub const SECONDS: u64 = 5;

/// Which requests wrk sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    /// `GET /items/1`: matches no rule.
    Get,
    /// `POST /payments` with a unique `Idempotency-Key` per request.
    Mutating,
}

impl Mix {
    pub fn describe(self) -> &'static str {
        match self {
            Mix::Get => "GET mix (no rule matches)",
            Mix::Mutating => "mutating mix (POST, unique keys: all granted)",
        }
    }
}

/// One wrk run's summary.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WrkRun {
    pub requests_per_sec: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub requests: u64,
    pub non_2xx: u64,
}

/// Which `Idempotency-Key` each request of a mutating script carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keys {
    /// `<nonce>-<wrk thread>-<n>`: unique within a run, and across runs by the nonce (the
    /// sidecar keeps completed keys for replay).
    Fresh,
    /// `<nonce>-<n mod count>`: every thread cycles over the same `count` keys, so once they
    /// have completed every request is a replay.
    Cycle(u64),
}

impl Keys {
    /// The key `Keys::Cycle` gives its `i`-th key, for callers that complete them first.
    pub fn cycled(nonce: &str, i: u64) -> String {
        format!("{nonce}-{i}")
    }
}

/// A POST to `path` with an `Idempotency-Key` chosen by `keys`.
fn mutating_script(nonce: &str, path: &str, keys: Keys) -> String {
    let key = match keys {
        Keys::Fresh => format!(r#""{nonce}-" .. thread_id .. "-" .. counter"#),
        Keys::Cycle(count) => format!(r#""{nonce}-" .. (counter % {count})"#),
    };
    format!(
        r#"-- written by idemgate-bench: the Idempotency-Key of each request
local next_thread = 0
function setup(thread)
  thread:set("thread_id", next_thread)
  next_thread = next_thread + 1
end
counter = 0
function request()
  counter = counter + 1
  local key = {key}
  return wrk.format("POST", "{path}",
    {{["idempotency-key"] = key, ["x-user-id"] = "wrk", ["content-type"] = "application/json"}},
    '{{"amount":1}}')
end
"#
    )
}

/// Runs wrk against `address`; `scratch` holds the Lua script.
pub fn run(address: SocketAddr, mix: Mix, nonce: &str, scratch: &Path) -> Result<WrkRun> {
    match mix {
        Mix::Get => wrk(command(), &format!("http://{address}/items/1")),
        Mix::Mutating => mutating(address, "/payments", Keys::Fresh, nonce, scratch),
    }
}

/// Runs wrk sending `POST path` with the keys `keys` gives; `scratch` holds the Lua script.
pub fn mutating(
    address: SocketAddr,
    path: &str,
    keys: Keys,
    nonce: &str,
    scratch: &Path,
) -> Result<WrkRun> {
    let script = scratch.join(format!("idemgate-bench-{nonce}.lua"));
    std::fs::write(&script, mutating_script(nonce, path, keys))?;
    let mut command = command();
    command.arg("-s").arg(script);
    wrk(command, &format!("http://{address}/"))
}

/// wrk with the load's threads, connections, duration and latency report.
fn command() -> Command {
    let mut command = Command::new("wrk");
    command
        .arg(format!("-t{THREADS}"))
        .arg(format!("-c{CONNECTIONS}"))
        .arg(format!("-d{SECONDS}s"))
        .arg("--latency");
    command
}

fn wrk(mut command: Command, url: &str) -> Result<WrkRun> {
    let output = command
        .arg(url)
        .output()
        .context("running wrk (apt-get install wrk)")?;
    let text = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "wrk failed ({}): {text}{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    parse(&text).with_context(|| format!("unexpected wrk output:\n{text}"))
}

/// A wrk latency like `512.00us`, `1.20ms` or `1.05s`, in µs.
fn micros(text: &str) -> Option<f64> {
    let split = text.find(|c: char| c.is_ascii_alphabetic())?;
    let (number, unit) = text.split_at(split);
    let value: f64 = number.parse().ok()?;
    let scale = match unit {
        "us" => 1.0,
        "ms" => 1e3,
        "s" => 1e6,
        "m" => 60e6,
        _ => return None,
    };
    Some(value * scale)
}

/// Reads requests/s, the 50 % and 99 % latencies (`--latency`), the request count and the
/// non-2xx/3xx count from wrk's report.
fn parse(report: &str) -> Option<WrkRun> {
    let field = |prefix: &str| {
        report
            .lines()
            .map(str::trim)
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.split_whitespace().next())
    };
    let requests = report
        .lines()
        .find(|l| l.contains("requests in"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())?;
    Some(WrkRun {
        requests_per_sec: field("Requests/sec:")?.parse().ok()?,
        p50_us: micros(field("50%")?)?,
        p99_us: micros(field("99%")?)?,
        requests,
        non_2xx: field("Non-2xx or 3xx responses:")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = "Running 5s test @ http://127.0.0.1:1/
  2 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   812.30us  401.22us  12.01ms   90.12%
    Req/Sec     9.81k   512.33    10.90k    70.00%
  Latency Distribution
     50%  750.00us
     75%    0.91ms
     90%    1.10ms
     99%    2.05ms
  97632 requests in 5.00s, 7.54MB read
  Non-2xx or 3xx responses: 3
Requests/sec:  19526.40
Transfer/sec:      1.51MB
";

    #[test]
    fn reads_a_wrk_report() {
        let run = parse(REPORT).unwrap();
        assert_eq!(run.requests_per_sec, 19526.40);
        assert_eq!(run.p50_us, 750.0);
        assert_eq!(run.p99_us, 2050.0);
        assert_eq!(run.requests, 97632);
        assert_eq!(run.non_2xx, 3);
        assert!(parse("garbage").is_none());
    }

    #[test]
    fn latency_units() {
        assert_eq!(micros("1.05s"), Some(1_050_000.0));
        assert_eq!(micros("12us"), Some(12.0));
        assert_eq!(micros("ms"), None);
    }

    #[test]
    fn keys_carry_the_nonce() {
        let fresh = mutating_script("abc", "/payments", Keys::Fresh);
        assert!(fresh.contains(r#""abc-" .. thread_id"#), "{fresh}");
        assert!(
            fresh.contains(r#"wrk.format("POST", "/payments""#),
            "{fresh}"
        );
        let cycled = mutating_script("abc", "/URL_X", Keys::Cycle(8));
        assert!(cycled.contains(r#""abc-" .. (counter % 8)"#), "{cycled}");
        assert_eq!(Keys::cycled("abc", 3), "abc-3");
    }
}
