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
