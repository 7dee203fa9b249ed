//! Writes gathered per scheduler turn: a connection's answers that become ready together leave
//! in one system call instead of one each.
//!
//! hyper serves every HTTP/2 stream on a task of its own. When several answers become ready at
//! once (one batch of Redis replies wakes a dozen handlers), each handler's end wakes the
//! connection's task, and tokio runs a task woken that way next (its LIFO slot): the
//! connection encodes that one answer and flushes it, then the next handler runs, and so on.
//! A loopback write costs several microseconds here, most of it the receiving socket's work
//! done inside the sender's system call, so one write per answer was the largest single cost
//! of a busy sidecar connection.
//!
//! [`BatchedWrites`] keeps what the connection writes and, on the flush, first lets the rest
//! of the runtime's ready tasks run: it wakes its own task and answers `Pending` once. A task
//! that wakes itself goes to the back of the run queue, so by the time the connection runs
//! again every handler woken with it has handed over its answer, and the next flush writes
//! them all. With nothing else ready the task runs again at once: one more poll, no system
//! call and no timer. And when the connection has no other request in flight (HTTP/1.1 always,
//! HTTP/2 at concurrency one), no answer can join: writes go straight to the socket, so a lone
//! request pays nothing for it.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Beyond this much kept, a write goes to the socket before more is taken (so a large
/// answer streams instead of growing the buffer).
const KEEP_AT_MOST: usize = 64 * 1024;

/// An I/O stream whose writes are kept until a flush, and whose flush waits one scheduler
/// turn before it writes, while `others_in_flight` says other answers may join (see the
/// module's documentation).
pub(crate) struct BatchedWrites<T, F> {
    inner: T,
    others_in_flight: F,
    kept: Vec<u8>,
    /// How much of `kept` the socket has taken.
    written: usize,
    /// The flush has yielded once already: the next one writes.
    yielded: bool,
}

impl<T, F: Fn() -> bool> BatchedWrites<T, F> {
    pub(crate) fn new(inner: T, others_in_flight: F) -> Self {
        BatchedWrites {
            inner,
            others_in_flight,
            kept: Vec::new(),
            written: 0,
            yielded: false,
        }
    }

    /// Nothing is kept and no other answer is in flight: a write goes straight to the socket.
    fn writes_through(&self) -> bool {
        self.kept.is_empty() && !(self.others_in_flight)()
    }
}

impl<T: AsyncWrite + Unpin, F> BatchedWrites<T, F> {
    /// Writes everything kept to the socket.
    fn poll_write_kept(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some(rest) = self
            .kept
            .get(self.written..)
            .filter(|rest| !rest.is_empty())
        {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, rest))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.kept.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }

    /// Makes room for `incoming` more bytes: writes what is kept first when it would grow
    /// past [`KEEP_AT_MOST`].
    fn poll_room(&mut self, cx: &mut Context<'_>, incoming: usize) -> Poll<io::Result<()>> {
        if !self.kept.is_empty() && self.kept.len() + incoming > KEEP_AT_MOST {
            ready!(self.poll_write_kept(cx))?;
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin, F: Unpin> AsyncRead for BatchedWrites<T, F> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin, F: Fn() -> bool + Unpin> AsyncWrite for BatchedWrites<T, F> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        ready!(this.poll_room(cx, total))?;
        if total > KEEP_AT_MOST || this.writes_through() {
            // Larger than anything worth keeping, or nothing could join it: straight through
            // (nothing is kept now).
            return Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        }
        for buf in bufs {
            this.kept.extend_from_slice(buf);
        }
        Poll::Ready(Ok(total))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.kept.is_empty() {
            if !this.yielded {
                this.yielded = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            ready!(this.poll_write_kept(cx))?;
        }
        this.yielded = false;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        ready!(this.poll_write_kept(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};
    use hyper::body::Bytes;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    /// A socket that counts the writes it is given (each a system call).
    struct Counted {
        socket: TcpStream,
        writes: Arc<AtomicUsize>,
    }

    impl AsyncRead for Counted {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.socket).poll_read(cx, buf)
        }
    }

    /// One write, counted unless it did not happen. Counted before the system call: the peer
    /// may read the bytes (and the test read the count) before this thread runs on.
    fn counted(
        writes: &AtomicUsize,
        write: impl FnOnce() -> Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        writes.fetch_add(1, Ordering::SeqCst);
        let written = write();
        if written.is_pending() {
            writes.fetch_sub(1, Ordering::SeqCst);
        }
        written
    }

    impl AsyncWrite for Counted {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let this = &mut *self;
            counted(&this.writes, || {
                Pin::new(&mut this.socket).poll_write(cx, buf)
            })
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            let this = &mut *self;
            counted(&this.writes, || {
                Pin::new(&mut this.socket).poll_write_vectored(cx, bufs)
            })
        }

        fn is_write_vectored(&self) -> bool {
            self.socket.is_write_vectored()
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.socket).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.socket).poll_shutdown(cx)
        }
    }

    /// Sixteen HTTP/2 answers on one connection, made ready by one wake-up on the server's
    /// runtime (one worker, as the Deployment runs it), as a batch of Redis replies makes
    /// them: how many socket writes carry them.
    fn writes_for_sixteen_answers_ready_together(batched: bool) -> usize {
        const STREAMS: usize = 16;
        let server_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let client_rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let writes = Arc::new(AtomicUsize::new(0));
        let (open_tx, open_rx) = tokio::sync::watch::channel(false);
        let entered = Arc::new(AtomicUsize::new(0));
        let listener = server_rt
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        {
            let (writes, entered) = (Arc::clone(&writes), Arc::clone(&entered));
            server_rt.spawn(async move {
                let (socket, _) = listener.accept().await.unwrap();
                socket.set_nodelay(true).unwrap();
                // As the server counts them: a request counts itself out before its answer
                // is written.
                let in_flight = Arc::new(AtomicUsize::new(0));
                let service = {
                    let in_flight = Arc::clone(&in_flight);
                    hyper::service::service_fn(move |_req| {
                        let mut open = open_rx.clone();
                        entered.fetch_add(1, Ordering::SeqCst);
                        in_flight.fetch_add(1, Ordering::SeqCst);
                        let in_flight = Arc::clone(&in_flight);
                        async move {
                            let _ = open.wait_for(|open| *open).await;
                            in_flight.fetch_sub(1, Ordering::SeqCst);
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                                Bytes::from_static(b"granted"),
                            )))
                        }
                    })
                };
                let others_in_flight = move || in_flight.load(Ordering::SeqCst) > 0;
                let counted = Counted { socket, writes };
                let builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                let _ = if batched {
                    builder
                        .serve_connection(
                            TokioIo::new(BatchedWrites::new(counted, others_in_flight)),
                            service,
                        )
                        .await
                } else {
                    builder
                        .serve_connection(TokioIo::new(counted), service)
                        .await
                };
            });
        }
        client_rt.block_on(async {
            let socket = TcpStream::connect(addr).await.unwrap();
            socket.set_nodelay(true).unwrap();
            let (sender, connection) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(socket))
                    .await
                    .unwrap();
            tokio::spawn(connection);
            let mut answers = Vec::new();
            for _ in 0..STREAMS {
                let mut sender = sender.clone();
                answers.push(tokio::spawn(async move {
                    let request = hyper::Request::post("http://sidecar/v1/claim")
                        .body(Full::new(Bytes::from_static(b"{}")))
                        .unwrap();
                    let answer = sender.send_request(request).await.unwrap();
                    answer.into_body().collect().await.unwrap().to_bytes()
                }));
            }
            for _ in 0..500 {
                if entered.load(Ordering::SeqCst) == STREAMS {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(
                entered.load(Ordering::SeqCst),
                STREAMS,
                "every stream is waiting"
            );
            // Let the server write what it has (acknowledgements, window updates) first.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let before = writes.load(Ordering::SeqCst);
            // Opened from a task of the server's runtime, as a Redis reply wakes handlers.
            server_rt.spawn(async move { open_tx.send_replace(true) });
            for answer in answers {
                assert_eq!(&answer.await.unwrap()[..], b"granted");
            }
            let after = writes.load(Ordering::SeqCst);
            after - before
        })
    }

    #[test]
    fn answers_ready_together_leave_in_one_write() {
        let writes = writes_for_sixteen_answers_ready_together(true);
        assert!(writes <= 2, "16 answers took {writes} writes");
    }

    #[test]
    fn without_it_each_answer_is_a_write_of_its_own() {
        // What the batching is for: the unbatched connection writes nearly one per answer.
        let writes = writes_for_sixteen_answers_ready_together(false);
        assert!(
            writes >= 8,
            "16 answers took only {writes} writes unbatched"
        );
    }

    #[tokio::test]
    async fn writes_of_every_size_arrive_whole_and_in_order() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let reader = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            socket.read_to_end(&mut got).await.unwrap();
            got
        });
        let mut expected = Vec::new();
        let mut writer = BatchedWrites::new(TcpStream::connect(addr).await.unwrap(), || true);
        // Small pieces kept together, one past the keeping limit, and vectored writes on
        // both sides of it, flushed at various points.
        for (i, size) in [
            1,
            100,
            5,
            KEEP_AT_MOST - 50,
            200,
            KEEP_AT_MOST + 1,
            3,
            300_000,
        ]
        .into_iter()
        .enumerate()
        {
            let piece: Vec<u8> = (0..size).map(|b| (b * 7 + i) as u8).collect();
            if i % 2 == 0 {
                writer.write_all(&piece).await.unwrap();
            } else {
                let (a, b) = piece.split_at(size / 2);
                let mut slices = [IoSlice::new(a), IoSlice::new(b)];
                let mut slices = &mut slices[..];
                while !slices.is_empty() {
                    let n = writer.write_vectored(slices).await.unwrap();
                    IoSlice::advance_slices(&mut slices, n);
                }
            }
            expected.extend_from_slice(&piece);
            if i % 3 == 2 {
                writer.flush().await.unwrap();
            }
        }
        writer.shutdown().await.unwrap();
        let got = reader.await.unwrap();
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "the bytes arrived changed or out of order");
    }

    /// One answer written and flushed through a fresh connection: whether the flush finished
    /// on its first poll, and whether the bytes reached the socket before the flush.
    async fn lone_answer(others_in_flight: bool) -> (bool, bool) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let socket = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let mut writer = BatchedWrites::new(socket, move || others_in_flight);
        writer.write_all(b"answer").await.unwrap();
        let written_through = writer.kept.is_empty();
        let flushed =
            std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut writer).poll_flush(cx).is_ready()))
                .await;
        (flushed, written_through)
    }

    #[tokio::test]
    async fn a_lone_answer_goes_straight_through_and_one_among_others_waits_a_turn() {
        assert_eq!(
            lone_answer(false).await,
            (true, true),
            "nothing else in flight"
        );
        assert_eq!(lone_answer(true).await, (false, false), "others in flight");
    }
}
