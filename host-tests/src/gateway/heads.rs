//! The raw HTTP/1 request heads of a connection, as they arrived. hyper's parser drops a
//! Content-Length that comes with Transfer-Encoding (it frames by the chunked encoding),
//! where Envoy's HTTP/1 codec refuses the request unless `allow_chunked_length`
//! (`source/common/http/http1/codec_impl.cc`): the connection manager reads the head here
//! to see what hyper hid.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Envoy's default `max_request_headers_kb` (60 KiB); a longer block is not a head.
const MAX_HEAD: usize = 60 * 1024;
/// Heads read ahead of the request being handled (pipelining) that are remembered.
const MAX_QUEUED: usize = 16;

/// Request heads read from one connection, oldest first.
#[derive(Default)]
pub(crate) struct Heads {
    block: Vec<u8>,
    queued: VecDeque<Vec<u8>>,
}

impl Heads {
    fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if self.block.len() < MAX_HEAD {
                self.block.push(b);
            }
            if b == b'\n' && self.block.ends_with(b"\r\n\r\n") {
                let block = std::mem::take(&mut self.block);
                if is_http1_head(&block) && self.queued.len() < MAX_QUEUED {
                    self.queued.push_back(block);
                }
            }
        }
    }

    /// The head of the next HTTP/1 request hyper hands over (requests come in order).
    pub(crate) fn next(&mut self) -> Option<Vec<u8>> {
        self.queued.pop_front()
    }
}

/// A block starting with a request line (`METHOD SP target SP HTTP/1.x`); chunked body
/// data and the HTTP/2 preface do not.
fn is_http1_head(block: &[u8]) -> bool {
    let line = block.split(|b| *b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|b| *b == b' ');
    let method = parts.next().unwrap_or_default();
    let version = parts.nth(1).unwrap_or_default();
    !method.is_empty()
        && method.iter().all(u8::is_ascii_uppercase)
        && (version == b"HTTP/1.1" || version == b"HTTP/1.0")
}

/// Whether a raw head carries a header called `name` (lower-case).
pub(crate) fn has_header(head: &[u8], name: &str) -> bool {
    head.split(|b| *b == b'\n').skip(1).any(|line| {
        line.iter()
            .position(|b| *b == b':')
            .and_then(|at| line.get(..at))
            .is_some_and(|n| n.eq_ignore_ascii_case(name.as_bytes()))
    })
}

/// A stream that records request heads as hyper reads them.
pub(crate) struct Recording<IO> {
    io: IO,
    heads: Rc<RefCell<Heads>>,
}

impl<IO> Recording<IO> {
    pub(crate) fn new(io: IO, heads: Rc<RefCell<Heads>>) -> Self {
        Self { io, heads }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Recording<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let result = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Some(new) = buf.filled().get(before..) {
            this.heads.borrow_mut().feed(new);
        }
        result
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Recording<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_are_found_in_order_and_bodies_skipped() {
        let mut heads = Heads::default();
        heads.feed(
            b"POST /a HTTP/1.1\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel",
        );
        heads.feed(b"lo\r\n0\r\n\r\nGET /b HTTP/1.1\r\nhost: x\r\n\r\n");
        let first = heads.next().unwrap_or_default();
        assert!(has_header(&first, "content-length") && has_header(&first, "transfer-encoding"));
        let second = heads.next().unwrap_or_default();
        assert!(second.starts_with(b"GET /b") && !has_header(&second, "content-length"));
        assert!(heads.next().is_none());
        heads.feed(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        assert!(heads.next().is_none());
    }
}
