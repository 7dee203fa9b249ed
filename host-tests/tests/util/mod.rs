//! Shared fixture builders for the integration suite.

use idemgate_host::testing::{TestHost, TestVm};

/// "A booted probe plugin": the probe fixture on one VM, with a `sidecar` cluster.
pub fn probe() -> (TestHost, TestVm) {
    probe_with(|b| b)
}

pub fn probe_with(
    configure: impl FnOnce(
        idemgate_host::testing::PluginBuilder,
    ) -> idemgate_host::testing::PluginBuilder,
) -> (TestHost, TestVm) {
    let host = TestHost::new().cluster("sidecar");
    let vm = configure(
        host.fixture("probe")
            .name("probe")
            .vm_id("probe_vm")
            .root_id("probe_root"),
    )
    .boot()
    .unwrap_or_else(|e| panic!("{e}"));
    (host, vm)
}

/// Log lines with `needle`, for order assertions.
pub fn lines(host: &TestHost, needle: &str) -> Vec<String> {
    host.logs_containing(needle)
}

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A loopback HTTP/1.1 upstream that answers `200` with a dump of what it received
/// (`METHOD PATH`, one `name: value` line per header, a blank line, the body), or with a
/// fixed body when `fixed` is set. Counts requests.
pub fn upstream(fixed: Option<&'static str>) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&hits);
    std::thread::spawn(move || {
        for socket in listener.incoming().flatten() {
            let counter = Arc::clone(&counter);
            std::thread::spawn(move || serve_one(socket, fixed, &counter));
        }
    });
    (address, hits)
}

fn serve_one(mut socket: TcpStream, fixed: Option<&str>, hits: &AtomicUsize) {
    socket.set_read_timeout(Some(Duration::from_secs(30))).ok();
    loop {
        let Some((head, body)) = read_message(&mut socket) else {
            return;
        };
        hits.fetch_add(1, Ordering::SeqCst);
        let reply = match fixed {
            Some(text) => text.to_owned(),
            None => format!("{head}\r\n\r\n{}", String::from_utf8_lossy(&body)),
        };
        let response = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nx-upstream: yes\r\n\r\n{reply}",
            reply.len()
        );
        if socket.write_all(response.as_bytes()).is_err() {
            return;
        }
    }
}

/// Reads one HTTP/1.1 message with a content-length body (or none).
fn read_message(socket: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match socket.read(&mut byte) {
            Ok(1) => buf.push(byte[0]),
            _ => return None,
        }
    }
    let head = String::from_utf8_lossy(&buf[..buf.len() - 4]).into_owned();
    let length = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    socket.read_exact(&mut body).ok()?;
    Some((head, body))
}

/// A parsed HTTP/1.1 response.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    }
}

/// Sends one request (`Connection: close`) and reads the whole response.
pub fn http(
    address: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut socket = TcpStream::connect(address).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nhost: gateway.test\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    socket.write_all(request.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = socket.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {raw:?}"));
    Reply {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    }
}

/// Polls `check` every 20 ms for up to 20 s.
pub fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if check() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out waiting for {what}");
}
