//! The gateway groups' HTTP/1.1 client: one keep-alive connection per simulated caller,
//! opened before the measurement starts so connection set-up is not part of any figure.

use anyhow::Result;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;

/// One caller's keep-alive connection.
pub struct Connection {
    send: SendRequest<Full<Bytes>>,
    authority: String,
}

/// What a call got back.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    /// A stored response served again (`idempotent-replayed: true`).
    pub replayed: bool,
    pub body: Bytes,
}

impl Connection {
    pub async fn open(address: SocketAddr) -> Result<Connection> {
        let stream = tokio::net::TcpStream::connect(address).await?;
        stream.set_nodelay(true)?;
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        Ok(Connection {
            send,
            authority: address.to_string(),
        })
    }

    /// Sends one request and reads the whole answer.
    pub async fn call(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &'static str,
    ) -> Result<Answer> {
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.authority);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        if !body.is_empty() {
            request = request.header("content-type", "application/json");
        }
        let request = request.body(Full::new(Bytes::from_static(body.as_bytes())))?;
        self.send.ready().await?;
        let response = self.send.send_request(request).await?;
        let status = response.status().as_u16();
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
        let body = response.into_body().collect().await?.to_bytes();
        Ok(Answer {
            status,
            replayed,
            body,
        })
    }
}

/// `GET path` on a fresh connection: the body (for `/metrics`).
pub async fn get(address: SocketAddr, path: &str) -> Result<String> {
    let answer = Connection::open(address)
        .await?
        .call("GET", path, &[], "")
        .await?;
    Ok(String::from_utf8_lossy(&answer.body).into_owned())
}

/// A keep-alive HTTP/1.1 connection driven by its caller's own task, for the storm: a
/// thousand callers share the two cores with the gateway, and hyper's client spends a second
/// task per connection (the connection driver, woken for every request and answer) and
/// builds each request anew. Here the request is written as bytes prepared once and the
/// answer read in place: status, `idempotent-replayed`, and a body framed by
/// `content-length` or chunked.
pub struct RawConnection {
    stream: tokio::net::TcpStream,
    buffer: Vec<u8>,
}

/// Header lines an answer may carry before the client gives up on it.
const MAX_HEADERS: usize = 64;
/// Bytes an answer may take before the client gives up on it (bounds the read loop).
const MAX_ANSWER: usize = 1 << 20;

impl RawConnection {
    pub async fn open(address: SocketAddr) -> Result<RawConnection> {
        let stream = tokio::net::TcpStream::connect(address).await?;
        stream.set_nodelay(true)?;
        Ok(RawConnection {
            stream,
            buffer: Vec::with_capacity(4096),
        })
    }

    /// A request's bytes, for [`RawConnection::call`].
    pub fn request(
        address: SocketAddr,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Vec<u8> {
        use std::fmt::Write as _;
        let mut out = format!("{method} {path} HTTP/1.1\r\nhost: {address}\r\n");
        for (name, value) in headers {
            let _ = write!(out, "{name}: {value}\r\n");
        }
        if !body.is_empty() {
            out.push_str("content-type: application/json\r\n");
        }
        let _ = write!(out, "content-length: {}\r\n\r\n{body}", body.len());
        out.into_bytes()
    }

    /// Writes `request` and reads the whole answer.
    pub async fn call(&mut self, request: &[u8]) -> Result<Answer> {
        use tokio::io::AsyncWriteExt;
        self.stream.write_all(request).await?;
        self.buffer.clear();
        let (status, replayed, framing, head) = loop {
            self.fill().await?;
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut response = httparse::Response::new(&mut headers);
            if let httparse::Status::Complete(head) = response.parse(&self.buffer)? {
                let status = response.code.unwrap_or(0);
                let value = |name: &str| {
                    response
                        .headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case(name))
                        .map(|h| h.value)
                };
                let replayed =
                    value("idempotent-replayed").is_some_and(|v| v.eq_ignore_ascii_case(b"true"));
                let framing = if value("transfer-encoding")
                    .is_some_and(|v| v.eq_ignore_ascii_case(b"chunked"))
                {
                    Framing::Chunked
                } else if let Some(length) = value("content-length") {
                    Framing::Length(std::str::from_utf8(length)?.trim().parse()?)
                } else if status == 204 || status == 304 {
                    Framing::Length(0)
                } else {
                    anyhow::bail!("an answer ({status}) with neither a length nor chunks");
                };
                break (status, replayed, framing, head);
            }
        };
        let body = match framing {
            Framing::Length(length) => {
                while self.buffer.len() < head + length {
                    self.fill().await?;
                }
                Bytes::copy_from_slice(&self.buffer[head..head + length])
            }
            Framing::Chunked => self.chunked(head).await?,
        };
        Ok(Answer {
            status,
            replayed,
            body,
        })
    }

    /// A chunked body starting at `at`, through its last chunk and trailers.
    async fn chunked(&mut self, mut at: usize) -> Result<Bytes> {
        let mut body = Vec::new();
        loop {
            let line = loop {
                if let Some(end) = find_crlf(&self.buffer[at..]) {
                    break end;
                }
                self.fill().await?;
            };
            let size = std::str::from_utf8(&self.buffer[at..at + line])?;
            let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)?;
            at += line + 2;
            if size == 0 {
                // Trailers (if any), then the empty line.
                loop {
                    match find_crlf(&self.buffer[at..]) {
                        Some(0) => return Ok(Bytes::from(body)),
                        Some(end) => at += end + 2,
                        None => self.fill().await?,
                    }
                }
            }
            while self.buffer.len() < at + size + 2 {
                self.fill().await?;
            }
            body.extend_from_slice(&self.buffer[at..at + size]);
            at += size + 2;
        }
    }

    /// Reads what the socket has into the buffer; an error at the end of the stream or
    /// beyond [`MAX_ANSWER`].
    async fn fill(&mut self) -> Result<()> {
        use tokio::io::AsyncReadExt;
        if self.buffer.len() >= MAX_ANSWER {
            anyhow::bail!("an answer longer than {MAX_ANSWER} bytes");
        }
        if self.stream.read_buf(&mut self.buffer).await? == 0 {
            anyhow::bail!("the gateway closed the connection mid-answer");
        }
        Ok(())
    }
}

enum Framing {
    Length(usize),
    Chunked,
}

fn find_crlf(bytes: &[u8]) -> Option<usize> {
    bytes.windows(2).position(|w| w == b"\r\n")
}

#[cfg(test)]
mod tests {
    use super::RawConnection;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// One server connection that answers each request with the next canned answer, written
    /// in pieces so the client's reads meet split heads, lengths and chunks.
    async fn serve(answers: Vec<&'static [u8]>) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = vec![0; 4096];
            for answer in answers {
                let _ = socket.read(&mut request).await.unwrap();
                for piece in answer.chunks(7) {
                    socket.write_all(piece).await.unwrap();
                    socket.flush().await.unwrap();
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
            }
        });
        address
    }

    #[tokio::test]
    async fn answers_framed_by_length_or_chunks_are_read_whole() {
        let address = serve(vec![
            b"HTTP/1.1 201 Created\r\nidempotent-replayed: true\r\ncontent-length: 5\r\n\r\nhello",
            b"HTTP/1.1 409 Conflict\r\ntransfer-encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n2\r\nde\r\n0\r\ntrailer: t\r\n\r\n",
            b"HTTP/1.1 204 No Content\r\n\r\n",
        ])
        .await;
        let mut connection = RawConnection::open(address).await.unwrap();
        let request = RawConnection::request(address, "POST", "/p", &[("a", "b")], "{}");
        let first = connection.call(&request).await.unwrap();
        assert_eq!((first.status, first.replayed), (201, true));
        assert_eq!(&first.body[..], b"hello");
        let second = connection.call(&request).await.unwrap();
        assert_eq!((second.status, second.replayed), (409, false));
        assert_eq!(&second.body[..], b"abcde");
        let third = connection.call(&request).await.unwrap();
        assert_eq!(third.status, 204);
        assert!(third.body.is_empty());
    }

    #[test]
    fn a_request_is_written_with_its_length() {
        let address = "127.0.0.1:9".parse().unwrap();
        let request = RawConnection::request(address, "POST", "/p", &[("k", "v")], "{}");
        assert_eq!(
            String::from_utf8(request).unwrap(),
            "POST /p HTTP/1.1\r\nhost: 127.0.0.1:9\r\nk: v\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
        );
    }
}
