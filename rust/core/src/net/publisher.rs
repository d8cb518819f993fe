//! The sending end: streams one version to a root relay while the encoder
//! is still producing chunks (a bounded channel gives backpressure), then
//! collects the receivers' acks.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{debug, info};

use super::tls::ClientTls;
use super::{connect, read_some, write_bytes, DEFAULT_CONNECT_TIMEOUT};
use crate::error::{Error, Result};
use crate::relay::auth::{random_nonce, PreSharedKey};
use crate::relay::client::{ClientConn, ClientSettings, Event};
use crate::relay::wire::{Ack, DEFAULT_MAX_FRAME};

/// Settings of a publisher.
#[derive(Debug, Clone)]
pub struct PublishConfig {
    /// Root relay (HOST:PORT).
    pub addr: String,
    /// Pre-shared key.
    pub key: Option<PreSharedKey>,
    /// TLS towards the relay.
    pub tls: Option<ClientTls>,
    /// Publisher id (logs).
    pub node_id: String,
    /// Largest frame (checks chunk sizes before sending).
    pub max_frame: usize,
    /// Chunks queued between the producer and the socket.
    pub queue_depth: usize,
    /// Connect and handshake deadline.
    pub connect_timeout: Duration,
    /// Standby roots, tried in order by [`publish_stream_retry`] when the
    /// connection to `addr` is lost.
    pub standby: Vec<String>,
}

impl PublishConfig {
    /// Defaults for a root relay address.
    pub fn new(addr: impl Into<String>) -> Self {
        PublishConfig {
            addr: addr.into(),
            key: None,
            tls: None,
            node_id: super::default_node_id("pub"),
            max_frame: DEFAULT_MAX_FRAME,
            queue_depth: 8,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            standby: vec![],
        }
    }
}

/// The receivers' verdicts on a version.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AckSummary {
    /// Receivers that verified and committed.
    pub committed: Vec<Ack>,
    /// Receivers that failed, with their reasons.
    pub failed: Vec<Ack>,
    /// Whether the number of acks asked for arrived before the deadline.
    pub complete: bool,
}

impl AckSummary {
    /// Acks received.
    pub fn len(&self) -> usize {
        self.committed.len() + self.failed.len()
    }
    /// No ack received.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Every expected receiver committed.
    pub fn all_committed(&self) -> bool {
        self.complete && self.failed.is_empty()
    }
}

enum Cmd {
    Chunk(Bytes),
    End(Bytes),
}

/// Streams one version to a root relay.
pub struct Publisher {
    version: u64,
    tx: Option<mpsc::Sender<Cmd>>,
    next_seq: u32,
    bytes: u64,
    acks: watch::Receiver<Vec<Ack>>,
    task: Option<JoinHandle<Result<()>>>,
    flushed: Arc<Mutex<Option<u32>>>,
    flushed_rx: watch::Receiver<bool>,
    max_frame: usize,
}

impl Publisher {
    /// Connect, authenticate and send the stream header.
    pub async fn connect(
        cfg: PublishConfig,
        version: u64,
        header: impl Into<Bytes>,
    ) -> Result<Self> {
        let header = header.into();
        let addr = cfg.addr.clone();
        let io = connect(&addr, cfg.tls.as_ref(), cfg.connect_timeout).await?;
        let (mut rd, mut wr) = tokio::io::split(io);
        let settings = ClientSettings {
            key: cfg.key.clone(),
            node_id: cfg.node_id.clone(),
            max_frame: cfg.max_frame,
            idle_timeout: None,
        };
        let mut conn = ClientConn::publisher(&settings, random_nonce(), std::time::Instant::now());
        // Handshake.
        let hs = async {
            loop {
                while let Some(b) = conn.poll_transmit() {
                    write_bytes(&mut wr, &b)
                        .await
                        .map_err(|e| Error::net_io(format!("writing to {addr}"), e))?;
                }
                if conn.is_authenticated() {
                    return Ok::<_, Error>(());
                }
                let n = read_some(&mut rd, conn.input_buf())
                    .await
                    .map_err(|e| Error::net_io(format!("reading from {addr}"), e))?;
                if n == 0 {
                    return Err(Error::PeerClosed {
                        peer: addr.clone(),
                        during: "the handshake".into(),
                    });
                }
                let r = conn.process(std::time::Instant::now());
                if r.is_err() {
                    if let Some(b) = conn.poll_transmit() {
                        let _ = write_bytes(&mut wr, &b).await;
                    }
                }
                r?;
            }
        };
        tokio::time::timeout(cfg.connect_timeout, hs)
            .await
            .map_err(|_| Error::Timeout {
                after_ms: cfg.connect_timeout.as_millis() as u64,
                during: format!("authenticating to {addr}"),
            })??;
        conn.send_header(version, header)?;
        info!(relay = %addr, version, "publishing");

        let (tx, mut rx) = mpsc::channel::<Cmd>(cfg.queue_depth.max(1));
        let (ack_tx, acks) = watch::channel(Vec::<Ack>::new());
        let (flushed_tx, flushed_rx) = watch::channel(false);
        let flushed = Arc::new(Mutex::new(None));
        let task = tokio::spawn(async move {
            let mut open = true;
            loop {
                while let Some(b) = conn.poll_transmit() {
                    write_bytes(&mut wr, &b)
                        .await
                        .map_err(|e| Error::net_io(format!("sending to relay {addr}"), e))?;
                }
                if !open {
                    let _ = flushed_tx.send(true);
                }
                tokio::select! {
                    cmd = rx.recv(), if open => match cmd {
                        Some(Cmd::Chunk(b)) => { conn.send_chunk(b)?; }
                        Some(Cmd::End(t)) => { let n = conn.send_end(t)?; debug!(count = n, "end queued"); open = false; }
                        None => { open = false; }
                    },
                    n = read_some(&mut rd, conn.input_buf()) => {
                        let n = n.map_err(|e| Error::net_io(format!("reading from relay {addr}"), e))?;
                        if n == 0 {
                            let _ = wr.shutdown().await;
                            return Err(Error::PeerClosed { peer: addr.clone(), during: "publishing".into() });
                        }
                        conn.process(std::time::Instant::now())?;
                        while let Some(ev) = conn.poll_event() {
                            if let Event::Ack(a) = ev {
                                ack_tx.send_modify(|v| if !v.iter().any(|x| x.node_id == a.node_id) { v.push(a) });
                            }
                        }
                    }
                }
            }
        });
        Ok(Publisher {
            version,
            tx: Some(tx),
            next_seq: 0,
            bytes: 0,
            acks,
            task: Some(task),
            flushed,
            flushed_rx,
            max_frame: cfg.max_frame,
        })
    }

    /// Version being published.
    pub fn version(&self) -> u64 {
        self.version
    }

    async fn fail(&mut self) -> Error {
        self.tx = None;
        match self.task.take() {
            Some(t) => match t.await {
                Ok(Err(e)) => e,
                Ok(Ok(())) => Error::Closed("publisher"),
                Err(e) => Error::net_io("publisher task", std::io::Error::other(e.to_string())),
            },
            None => Error::Closed("publisher"),
        }
    }

    /// Queue the next chunk (waits while the queue is full); returns its sequence number.
    pub async fn send(&mut self, blob: impl Into<Bytes>) -> Result<u32> {
        let blob = blob.into();
        if blob.len() + 64 > self.max_frame {
            return Err(Error::FrameTooLarge {
                len: blob.len() as u64,
                max: self.max_frame as u64,
            });
        }
        let n = blob.len() as u64;
        let tx = self.tx.as_ref().ok_or(Error::Closed("publisher"))?;
        if tx.send(Cmd::Chunk(blob)).await.is_err() {
            return Err(self.fail().await);
        }
        self.bytes += n;
        let s = self.next_seq;
        self.next_seq += 1;
        Ok(s)
    }

    /// End the version with `trailer`; returns once everything was handed to the socket.
    pub async fn finish(&mut self, trailer: impl Into<Bytes>) -> Result<u32> {
        let tx = self.tx.take().ok_or(Error::Closed("publisher"))?;
        if tx.send(Cmd::End(trailer.into())).await.is_err() {
            return Err(self.fail().await);
        }
        *self.flushed.lock().unwrap_or_else(|p| p.into_inner()) = Some(self.next_seq);
        loop {
            if *self.flushed_rx.borrow_and_update() {
                return Ok(self.next_seq);
            }
            if self.flushed_rx.changed().await.is_err() {
                return Err(self.fail().await);
            }
        }
    }

    /// Chunks and payload bytes queued so far.
    pub fn sent(&self) -> (u32, u64) {
        (self.next_seq, self.bytes)
    }

    /// Wait until `n` receivers acked (committed or failed) or `timeout` passed.
    pub async fn wait_acks(&mut self, n: usize, timeout: Duration) -> AckSummary {
        let done = tokio::time::timeout(timeout, async {
            loop {
                if self.acks.borrow_and_update().len() >= n {
                    return;
                }
                if self.acks.changed().await.is_err() {
                    // Connection gone: no more acks will come.
                    std::future::pending::<()>().await;
                }
            }
        })
        .await
        .is_ok();
        let acks = self.acks.borrow().clone();
        let (committed, failed): (Vec<Ack>, Vec<Ack>) = acks.into_iter().partition(|a| a.ok);
        AckSummary {
            complete: done,
            committed,
            failed,
        }
    }

    /// Close the connection.
    pub async fn close(mut self) {
        self.tx = None;
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// What a publish achieved.
#[derive(Debug, Clone)]
pub struct PublishReport {
    /// Version published.
    pub version: u64,
    /// Chunks sent.
    pub chunks: u32,
    /// Chunk payload bytes sent.
    pub bytes: u64,
    /// Receivers' verdicts.
    pub acks: AckSummary,
}

/// A [`Publisher`] for plain (non-async) threads; owns a runtime whose
/// worker sends while the caller produces the next chunk.
pub struct BlockingPublisher {
    rt: tokio::runtime::Runtime,
    inner: Option<Publisher>,
}

impl BlockingPublisher {
    /// Connect, authenticate and send the header. Must not be called from an async context.
    pub fn connect(cfg: PublishConfig, version: u64, header: impl Into<Bytes>) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("dcr-publish")
            .enable_all()
            .build()
            .map_err(|e| Error::net_io("starting the publisher runtime", e))?;
        let p = rt.block_on(Publisher::connect(cfg, version, header))?;
        Ok(BlockingPublisher { rt, inner: Some(p) })
    }

    fn p(&mut self) -> Result<(&tokio::runtime::Runtime, &mut Publisher)> {
        Ok((
            &self.rt,
            self.inner.as_mut().ok_or(Error::Closed("publisher"))?,
        ))
    }

    /// Send the next chunk (blocks while the queue is full).
    pub fn send(&mut self, blob: impl Into<Bytes>) -> Result<u32> {
        let (rt, p) = self.p()?;
        rt.block_on(p.send(blob))
    }

    /// End the version.
    pub fn finish(&mut self, trailer: impl Into<Bytes>) -> Result<u32> {
        let (rt, p) = self.p()?;
        rt.block_on(p.finish(trailer))
    }

    /// Wait for `n` acks or the timeout.
    pub fn wait_acks(&mut self, n: usize, timeout: Duration) -> Result<AckSummary> {
        let (rt, p) = self.p()?;
        Ok(rt.block_on(p.wait_acks(n, timeout)))
    }
}

impl Drop for BlockingPublisher {
    fn drop(&mut self) {
        if let Some(p) = self.inner.take() {
            self.rt.block_on(p.close());
        }
    }
}

/// Publish a whole version from a plain thread: header, every frame of
/// `frames` as it is produced, the trailer, then wait for `expect_acks`
/// receivers (0: don't wait) up to `ack_timeout`.
pub fn publish_stream<I>(
    cfg: PublishConfig,
    version: u64,
    header: impl Into<Bytes>,
    frames: I,
    trailer: impl Into<Bytes>,
    expect_acks: usize,
    ack_timeout: Duration,
) -> Result<PublishReport>
where
    I: IntoIterator,
    I::Item: Into<Bytes>,
{
    let mut p = BlockingPublisher::connect(cfg, version, header)?;
    for f in frames {
        p.send(f)?;
    }
    let chunks = p.finish(trailer)?;
    let bytes = p.inner.as_ref().map(|x| x.sent().1).unwrap_or(0);
    let acks = if expect_acks > 0 {
        p.wait_acks(expect_acks, ack_timeout)?
    } else {
        AckSummary {
            complete: true,
            ..Default::default()
        }
    };
    Ok(PublishReport {
        version,
        chunks,
        bytes,
        acks,
    })
}

/// Whether a publish failure is about the connection (worth a retry) rather
/// than about what was published.
fn connection_lost(e: &Error) -> bool {
    matches!(
        e,
        Error::NetIo { .. } | Error::PeerClosed { .. } | Error::Timeout { .. } | Error::Tls(_)
    ) || matches!(e, Error::Remote { code, .. } if *code == crate::relay::wire::code::SHUTTING_DOWN)
}

/// [`publish_stream`] that survives a lost root: on a connection failure it
/// sends the whole stream again, to `cfg.addr` then each of `cfg.standby`
/// in turn, up to `attempts` times. `make_frames` must yield the same frames
/// each time (a deterministic encoder, or frames read back from the delta
/// file). Relays accept an identical replay and skip what they hold, and
/// receivers resume by sequence number, so nothing is applied twice.
#[allow(clippy::too_many_arguments)]
pub fn publish_stream_retry<F, I>(
    cfg: PublishConfig,
    version: u64,
    header: impl Into<Bytes>,
    mut make_frames: F,
    trailer: impl Into<Bytes>,
    expect_acks: usize,
    ack_timeout: Duration,
    attempts: usize,
) -> Result<PublishReport>
where
    F: FnMut() -> I,
    I: IntoIterator,
    I::Item: Into<Bytes>,
{
    let (header, trailer) = (header.into(), trailer.into());
    let roots: Vec<String> = std::iter::once(cfg.addr.clone())
        .chain(cfg.standby.iter().cloned())
        .collect();
    let mut last = None;
    for attempt in 0..attempts.max(1) {
        let addr = roots[attempt % roots.len()].clone();
        let c = PublishConfig {
            addr: addr.clone(),
            ..cfg.clone()
        };
        match publish_stream(
            c,
            version,
            header.clone(),
            make_frames(),
            trailer.clone(),
            expect_acks,
            ack_timeout,
        ) {
            Ok(r) => return Ok(r),
            Err(e) if connection_lost(&e) => {
                tracing::warn!(root = %addr, error = %e, attempt, "publish lost its root; sending the stream again");
                last = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(Error::AllParentsFailed {
        tried: attempts.max(1),
        last: Box::new(last.expect("one attempt")),
    })
}
