//! The receiving end: connects to parents in failover order, delivers each
//! blob exactly once and in order, resumes by sequence number after a
//! failover, and sends the receiver's ack.

use std::time::Duration;

use bytes::Bytes;
use tokio::io::{ReadHalf, WriteHalf};
use tokio::time::Instant;
use tracing::{info, warn};

use super::tls::ClientTls;
use super::{connect, read_some, write_bytes, BoxIo, DEFAULT_CONNECT_TIMEOUT};
use crate::error::{Error, Result};
use crate::relay::auth::{random_nonce, PreSharedKey};
use crate::relay::client::{ClientConn, ClientSettings, Cursor, Event};
use crate::relay::wire::{Ack, Message, Role, DEFAULT_MAX_FRAME, DIGEST_LEN};

/// Settings of a subscriber.
#[derive(Debug, Clone)]
pub struct SubscribeConfig {
    /// Parents (HOST:PORT) in failover order.
    pub parents: Vec<String>,
    /// Pre-shared key.
    pub key: Option<PreSharedKey>,
    /// TLS towards the parents.
    pub tls: Option<ClientTls>,
    /// This receiver's id (appears in acks).
    pub node_id: String,
    /// Receive the first version `>= from_version`.
    pub from_version: u64,
    /// Largest frame accepted.
    pub max_frame: usize,
    /// A parent silent this long is abandoned (relays send heartbeats every 2 s).
    pub idle_timeout: Duration,
    /// Per-attempt connect deadline.
    pub connect_timeout: Duration,
    /// Passes over the parent list before giving up.
    pub max_rounds: usize,
    /// Deadline for a whole receive.
    pub timeout: Option<Duration>,
}

impl SubscribeConfig {
    /// Defaults for these parents.
    pub fn new(parents: impl IntoIterator<Item = impl Into<String>>) -> Self {
        SubscribeConfig {
            parents: parents.into_iter().map(Into::into).collect(),
            key: None,
            tls: None,
            node_id: super::default_node_id("sub"),
            from_version: 0,
            max_frame: DEFAULT_MAX_FRAME,
            idle_timeout: Duration::from_secs(10),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_rounds: 3,
            timeout: None,
        }
    }
}

/// What the application does with the stream. Each method is called at most
/// once per blob, in order; an `Err` aborts the receive (no failover).
pub trait Receiver {
    /// The stream header (its first 16 bytes are the delta id).
    fn on_header(&mut self, version: u64, header: &[u8]) -> std::result::Result<(), String>;
    /// Chunk `seq` (0, 1, 2, ...).
    fn on_chunk(&mut self, version: u64, seq: u32, blob: &[u8]) -> std::result::Result<(), String>;
    /// The end: chunk count and trailer.
    fn on_end(
        &mut self,
        version: u64,
        count: u32,
        trailer: &[u8],
    ) -> std::result::Result<(), String>;
}

/// A finished receive.
#[derive(Debug, Clone)]
pub struct Delivered {
    /// Version received.
    pub version: u64,
    /// Delta id: the first 16 bytes of the header (`None` if it is shorter).
    pub delta_id: Option<[u8; 16]>,
    /// Number of chunks.
    pub count: u32,
    /// Trailer blob.
    pub trailer: Bytes,
    /// Parent that delivered the end.
    pub parent: String,
    /// Connections lost and resumed elsewhere during the receive.
    pub failovers: u32,
}

struct Link {
    rd: ReadHalf<BoxIo>,
    wr: WriteHalf<BoxIo>,
    conn: ClientConn,
    addr: String,
}

/// A receiver attached to a relay tree.
pub struct Subscriber {
    cfg: SubscribeConfig,
    cursor: Cursor,
    link: Option<Link>,
    next_parent: usize,
    last: Option<Delivered>,
    delta_id: Option<[u8; 16]>,
}

impl Subscriber {
    /// A subscriber; nothing happens until [`Subscriber::receive`].
    pub fn new(cfg: SubscribeConfig) -> Result<Self> {
        if cfg.parents.is_empty() {
            return Err(Error::Config(
                "a subscriber needs at least one parent address (HOST:PORT)".into(),
            ));
        }
        let cursor = Cursor::once(cfg.from_version);
        Ok(Subscriber {
            cfg,
            cursor,
            link: None,
            next_parent: 0,
            last: None,
            delta_id: None,
        })
    }

    /// A subscriber that resumes from a cursor saved by an earlier process
    /// (e.g. from the receiver's journal after a crash: the chunks it knows
    /// it applied), so nothing is applied twice across restarts either.
    pub fn with_cursor(cfg: SubscribeConfig, cursor: Cursor) -> Result<Self> {
        let mut s = Self::new(cfg)?;
        s.cursor = cursor;
        Ok(s)
    }

    /// Where the receiver stands (save it to resume after a restart).
    pub fn cursor(&self) -> &Cursor {
        &self.cursor
    }

    fn settings(&self) -> ClientSettings {
        ClientSettings {
            key: self.cfg.key.clone(),
            node_id: self.cfg.node_id.clone(),
            max_frame: self.cfg.max_frame,
            idle_timeout: Some(self.cfg.idle_timeout),
        }
    }

    async fn open(&self, addr: &str, conn: ClientConn) -> Result<Link> {
        let io = connect(addr, self.cfg.tls.as_ref(), self.cfg.connect_timeout).await?;
        let (rd, wr) = tokio::io::split(io);
        Ok(Link {
            rd,
            wr,
            conn,
            addr: addr.to_string(),
        })
    }

    /// Receive one version (the first `>= from_version`; on later calls, the
    /// first above the one received last), failing over between parents as
    /// needed.
    pub async fn receive<R: Receiver + ?Sized>(&mut self, app: &mut R) -> Result<Delivered> {
        let deadline = self.cfg.timeout.map(|t| Instant::now() + t);
        let fut = self.receive_inner(app);
        match deadline {
            None => fut.await,
            Some(d) => match tokio::time::timeout_at(d, fut).await {
                Ok(r) => r,
                Err(_) => Err(Error::Timeout {
                    after_ms: self.cfg.timeout.unwrap_or_default().as_millis() as u64,
                    during: "receiving a version".into(),
                }),
            },
        }
    }

    async fn receive_inner<R: Receiver + ?Sized>(&mut self, app: &mut R) -> Result<Delivered> {
        if self.cursor.is_complete() {
            // A further receive: the next version, on a new subscription.
            let next = self.cursor.version.map_or(self.cfg.from_version, |v| v + 1);
            self.cursor = Cursor::once(next);
            self.link = None;
        }
        let n = self.cfg.parents.len();
        let attempts = n * self.cfg.max_rounds.max(1);
        let mut failovers = 0u32;
        let mut last_err = None;
        for attempt in 0..attempts {
            let addr = self.cfg.parents[self.next_parent % n].clone();
            if attempt > 0 && attempt % n == 0 {
                // A whole round failed: pause a little before the next.
                tokio::time::sleep(Duration::from_millis(100 * (attempt / n) as u64)).await;
            }
            match self.attempt(&addr, app).await {
                Ok(d) => {
                    let d = Delivered { failovers, ..d };
                    self.last = Some(d.clone());
                    return Ok(d);
                }
                Err(e) if !e.is_retryable() => return Err(e),
                Err(e) => {
                    warn!(node = %self.cfg.node_id, parent = %addr, error = %e, cursor = ?self.cursor, "parent failed; trying the next one");
                    self.link = None;
                    self.next_parent += 1;
                    failovers += 1;
                    last_err = Some(e);
                }
            }
        }
        Err(Error::AllParentsFailed {
            tried: attempts,
            last: Box::new(last_err.expect("at least one attempt")),
        })
    }

    async fn attempt<R: Receiver + ?Sized>(
        &mut self,
        addr: &str,
        app: &mut R,
    ) -> Result<Delivered> {
        let conn = ClientConn::receiver(
            &self.settings(),
            Role::Subscriber,
            self.cursor.clone(),
            random_nonce(),
            std::time::Instant::now(),
        );
        let link = self.open(addr, conn).await?;
        if self.cursor.version.is_some() {
            info!(node = %self.cfg.node_id, parent = addr, cursor = ?self.cursor, "resuming");
        }
        let link = self.link.insert(link);
        loop {
            while let Some(b) = link.conn.poll_transmit() {
                write_bytes(&mut link.wr, &b)
                    .await
                    .map_err(|e| Error::net_io(format!("writing to {addr}"), e))?;
            }
            let deadline = link
                .conn
                .poll_timeout()
                .map(Instant::from_std)
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                r = read_some(&mut link.rd, link.conn.input_buf()) => {
                    let n = r.map_err(|e| Error::net_io(format!("reading from {addr}"), e))?;
                    if n == 0 {
                        return Err(Error::PeerClosed { peer: addr.to_string(), during: format!("streaming (cursor {:?})", self.cursor) });
                    }
                    let res = link.conn.process(std::time::Instant::now());
                    // Deliver what was decoded before any error.
                    while let Some(ev) = link.conn.poll_event() {
                        let Event::Stream(m) = ev else { continue };
                        // The cursor advances only once the application took the blob.
                        let mut next = self.cursor.clone();
                        if !next.accept(&m)? {
                            continue;
                        }
                        match &m {
                            Message::Header { version, blob } => {
                                app.on_header(*version, blob).map_err(|r| Error::Callback { what: "header".into(), reason: r })?;
                                self.delta_id = crate::relay::wire::delta_id(blob);
                            }
                            Message::Chunk { version, seq, blob } => app.on_chunk(*version, *seq, blob).map_err(|r| Error::Callback { what: format!("chunk {seq}"), reason: r })?,
                            Message::End { version, count, trailer } => {
                                app.on_end(*version, *count, trailer).map_err(|r| Error::Callback { what: "end".into(), reason: r })?;
                                self.cursor = next;
                                return Ok(Delivered {
                                    version: *version,
                                    delta_id: self.delta_id,
                                    count: *count,
                                    trailer: trailer.clone(),
                                    parent: addr.to_string(),
                                    failovers: 0,
                                });
                            }
                            _ => {}
                        }
                        self.cursor = next;
                    }
                    link.conn.reset_idle(std::time::Instant::now());
                    if let Err(e) = res {
                        if let Some(b) = link.conn.poll_transmit() {
                            let _ = write_bytes(&mut link.wr, &b).await;
                        }
                        return Err(e);
                    }
                }
                _ = tokio::time::sleep_until(deadline) => link.conn.handle_timeout(std::time::Instant::now())?,
            }
        }
    }

    /// Report the verdict on the received version upward. Uses the open
    /// connection, or reconnects through the parent list; returns once a
    /// parent confirmed it.
    pub async fn ack(
        &mut self,
        digest: [u8; DIGEST_LEN],
        ok: bool,
        reason: &str,
        timeout: Duration,
    ) -> Result<()> {
        let version = self.last.as_ref().map(|d| d.version).ok_or_else(|| {
            Error::protocol("a received version before ack()", "nothing received yet")
        })?;
        let ack = Ack {
            version,
            node_id: self.cfg.node_id.clone(),
            digest,
            ok,
            reason: reason.to_string(),
        };
        let deadline = Instant::now() + timeout;
        if let Some(mut link) = self.link.take() {
            link.conn.send_ack(ack.clone());
            match tokio::time::timeout_at(deadline, wait_ack_received(&mut link, version)).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => {
                    warn!(parent = %link.addr, error = %e, "ack on the open connection failed; reconnecting")
                }
                Err(_) => {}
            }
        }
        let mut last = None;
        for i in 0..self.cfg.parents.len() {
            let addr = self.cfg.parents[(self.next_parent + i) % self.cfg.parents.len()].clone();
            let conn = ClientConn::acker(
                &self.settings(),
                ack.clone(),
                random_nonce(),
                std::time::Instant::now(),
            );
            let r = tokio::time::timeout_at(deadline, async {
                let mut link = self.open(&addr, conn).await?;
                wait_ack_received(&mut link, version).await
            })
            .await;
            match r {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => last = Some(e),
                Err(_) => {
                    return Err(Error::Timeout {
                        after_ms: timeout.as_millis() as u64,
                        during: format!("acknowledging version {version}"),
                    })
                }
            }
        }
        Err(Error::AllParentsFailed {
            tried: self.cfg.parents.len(),
            last: Box::new(last.unwrap_or(Error::Closed("subscriber"))),
        })
    }
}

async fn wait_ack_received(link: &mut Link, version: u64) -> Result<()> {
    loop {
        while let Some(b) = link.conn.poll_transmit() {
            write_bytes(&mut link.wr, &b)
                .await
                .map_err(|e| Error::net_io(format!("writing to {}", link.addr), e))?;
        }
        let n = read_some(&mut link.rd, link.conn.input_buf())
            .await
            .map_err(|e| Error::net_io("reading an ack confirmation", e))?;
        if n == 0 {
            return Err(Error::PeerClosed {
                peer: link.addr.clone(),
                during: "waiting for the ack confirmation".into(),
            });
        }
        let r = link.conn.process(std::time::Instant::now());
        while let Some(ev) = link.conn.poll_event() {
            if let Event::AckReceived { version: v, .. } = ev {
                if v == version {
                    return Ok(());
                }
            }
        }
        r?;
    }
}

struct Closures<H, C, E> {
    h: H,
    c: C,
    e: E,
}

impl<H, C, E> Receiver for Closures<H, C, E>
where
    H: FnMut(u64, &[u8]) -> std::result::Result<(), String>,
    C: FnMut(u64, u32, &[u8]) -> std::result::Result<(), String>,
    E: FnMut(u64, u32, &[u8]) -> std::result::Result<(), String>,
{
    fn on_header(&mut self, v: u64, h: &[u8]) -> std::result::Result<(), String> {
        (self.h)(v, h)
    }
    fn on_chunk(&mut self, v: u64, s: u32, b: &[u8]) -> std::result::Result<(), String> {
        (self.c)(v, s, b)
    }
    fn on_end(&mut self, v: u64, n: u32, t: &[u8]) -> std::result::Result<(), String> {
        (self.e)(v, n, t)
    }
}

/// A finished blocking receive, holding the connection for [`Subscription::ack`].
pub struct Subscription {
    rt: tokio::runtime::Runtime,
    sub: Subscriber,
    /// What was received.
    pub delivered: Delivered,
}

impl Subscription {
    /// Report the verdict upward (blocking).
    pub fn ack(
        &mut self,
        digest: [u8; DIGEST_LEN],
        ok: bool,
        reason: &str,
        timeout: Duration,
    ) -> Result<()> {
        let Subscription { rt, sub, .. } = self;
        rt.block_on(sub.ack(digest, ok, reason, timeout))
    }
}

/// Blocking receive of one version from a thread that is not async: owns a
/// current-thread runtime; the callbacks run on the calling thread.
pub fn subscribe(
    cfg: SubscribeConfig,
    on_header: impl FnMut(u64, &[u8]) -> std::result::Result<(), String>,
    on_chunk: impl FnMut(u64, u32, &[u8]) -> std::result::Result<(), String>,
    on_end: impl FnMut(u64, u32, &[u8]) -> std::result::Result<(), String>,
) -> Result<Subscription> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::net_io("starting the subscriber runtime", e))?;
    let mut sub = Subscriber::new(cfg)?;
    let mut app = Closures {
        h: on_header,
        c: on_chunk,
        e: on_end,
    };
    let delivered = rt.block_on(sub.receive(&mut app))?;
    Ok(Subscription { rt, sub, delivered })
}
