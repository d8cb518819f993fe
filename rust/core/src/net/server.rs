//! The relay server (mini-redis style): `run(listener, config, shutdown)`,
//! a connection cap, accept back-off and graceful shutdown. Each child is
//! served by its own task reading the shared [`Hub`] through its cursor, so
//! chunks are forwarded as soon as they arrive (cut-through) and a slow child
//! only slows itself.

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, mpsc, watch, Notify, Semaphore};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::metrics::Metrics;
use super::spill::FileSpill;
use super::tls::{ClientTls, ServerTls};
use super::{connect, read_some, write_bytes, write_msg, BoxIo, DEFAULT_CONNECT_TIMEOUT};
use crate::error::{Error, Result};
use crate::relay::auth::{random_nonce, PreSharedKey};
use crate::relay::bucket::TokenBucket;
use crate::relay::client::{ClientConn, ClientSettings, Cursor, Event};
use crate::relay::hub::{ChildId, ChildPoll, Hub};
use crate::relay::server::{ServerConn, ServerEvent};
use crate::relay::store::{Spill, Store, StoreConfig};
use crate::relay::wire::{code, Message, Role, DEFAULT_MAX_FRAME};

/// Settings of a relay.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Node id of this relay (in logs and in its upstream handshake).
    pub node_id: String,
    /// Pre-shared key required from every peer (and proven to them).
    pub key: Option<PreSharedKey>,
    /// TLS on the listener.
    pub tls: Option<ServerTls>,
    /// Parents in failover order; empty for a root relay (which accepts a publisher).
    pub parents: Vec<String>,
    /// TLS towards the parents.
    pub parent_tls: Option<ClientTls>,
    /// Retention window in memory.
    pub store: StoreConfig,
    /// Where chunks beyond the memory budget go (else they are evicted).
    pub spill_dir: Option<PathBuf>,
    /// Per-child rate limit in bytes per second.
    pub rate_limit: Option<u64>,
    /// Connection cap.
    pub max_connections: usize,
    /// Largest frame accepted.
    pub max_frame: usize,
    /// Heartbeat sent to an idle child after this long.
    pub heartbeat: Duration,
    /// A silent parent is abandoned after this long.
    pub idle_timeout: Duration,
    /// Handshake deadline for incoming connections.
    pub handshake_timeout: Duration,
    /// Without a spill directory, how long upstream reading may pause
    /// (backpressure) for a child that lags by the whole retention window,
    /// before its chunks are evicted anyway and it is sent elsewhere.
    pub stall_timeout: Duration,
    /// A child that does not take one whole message within this long (plus
    /// 1 µs per byte) is dropped.
    pub write_timeout: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            node_id: super::default_node_id("relay"),
            key: None,
            tls: None,
            parents: vec![],
            parent_tls: None,
            store: StoreConfig::default(),
            spill_dir: None,
            rate_limit: None,
            max_connections: 1024,
            max_frame: DEFAULT_MAX_FRAME,
            heartbeat: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(60),
        }
    }
}

struct Shared {
    hub: Mutex<Hub>,
    changed: watch::Sender<u64>,
    /// Children made progress (wakes a stalled upstream reader).
    progress: Notify,
    cfg: RelayConfig,
    metrics: Arc<Metrics>,
}

impl Shared {
    fn hub(&self) -> MutexGuard<'_, Hub> {
        self.hub.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }
    /// Backpressure: while retention memory is over budget with chunks that
    /// connected children still need, stop reading upstream until they
    /// progress; after `stall_timeout`, evict anyway.
    async fn wait_for_room(&self, sd: &mut broadcast::Receiver<()>) {
        let deadline = Instant::now() + self.cfg.stall_timeout;
        let mut stalled = false;
        loop {
            let notified = self.progress.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.hub().relieve() {
                return;
            }
            if !stalled {
                stalled = true;
                self.metrics.upstream_stalls.fetch_add(1, Relaxed);
                debug!(node = %self.cfg.node_id, "retention full of chunks children still need; pausing upstream");
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => {
                    warn!(node = %self.cfg.node_id, stall = ?self.cfg.stall_timeout,
                        "a child lags by the whole retention window; evicting its chunks (it will resume elsewhere); set --spill-dir to keep them");
                    self.hub().force_relieve();
                    self.bump();
                    return;
                }
                _ = sd.recv() => return,
            }
        }
    }

    fn refresh_metrics(&self) {
        let h = self.hub();
        self.metrics.max_lag.store(h.max_lag(), Relaxed);
        self.metrics.resumes.store(h.resumes, Relaxed);
        self.metrics
            .spilled_chunks
            .store(h.store().spilled_chunks, Relaxed);
        self.metrics
            .evicted_chunks
            .store(h.store().evicted_chunks, Relaxed);
        self.metrics
            .latest_version
            .store(h.store().latest().map(|(v, _)| v).unwrap_or(0), Relaxed);
    }
}

/// A relay, built from a config; run it with [`Relay::run`].
#[derive(Clone)]
pub struct Relay {
    shared: Arc<Shared>,
}

impl Relay {
    /// Build the relay state (opens the spill directory).
    pub fn new(cfg: RelayConfig) -> Result<Self> {
        let spill: Option<Box<dyn Spill>> = match &cfg.spill_dir {
            Some(d) => Some(Box::new(FileSpill::new(d).map_err(|e| {
                Error::net_io(format!("creating spill directory {}", d.display()), e)
            })?)),
            None => None,
        };
        let hub = Hub::new(Store::new(cfg.store.clone(), spill));
        let (changed, _) = watch::channel(0);
        Ok(Relay {
            shared: Arc::new(Shared {
                hub: Mutex::new(hub),
                changed,
                progress: Notify::new(),
                cfg,
                metrics: Arc::new(Metrics::default()),
            }),
        })
    }

    /// The relay's counters.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.shared.metrics.clone()
    }

    /// Update the gauges of [`Relay::metrics`] from the hub.
    pub fn refresh_metrics(&self) {
        self.shared.refresh_metrics()
    }

    /// Serve `listener` until `shutdown` resolves, then close every
    /// connection and return once their tasks have ended.
    pub async fn run(self, listener: TcpListener, shutdown: impl Future) -> Result<()> {
        let shared = self.shared;
        let (notify_shutdown, _) = broadcast::channel::<()>(1);
        let (done_tx, mut done_rx) = mpsc::channel::<()>(1);
        let limit = Arc::new(Semaphore::new(shared.cfg.max_connections.max(1)));
        info!(node = %shared.cfg.node_id, addr = ?listener.local_addr().ok(), parents = ?shared.cfg.parents, "relay listening");

        if !shared.cfg.parents.is_empty() {
            let (s, sd, d) = (shared.clone(), notify_shutdown.subscribe(), done_tx.clone());
            tokio::spawn(async move {
                upstream_loop(s, sd).await;
                drop(d);
            });
        }

        let accept_loop = async {
            let mut backoff = Duration::from_millis(10);
            loop {
                let permit = limit
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("semaphore never closed");
                let (tcp, addr) = match listener.accept().await {
                    Ok(x) => {
                        backoff = Duration::from_millis(10);
                        x
                    }
                    Err(e) => {
                        warn!(error = %e, "accept failed; backing off {:?}", backoff);
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                        continue;
                    }
                };
                tcp.set_nodelay(true).ok();
                let (s, sd, d) = (shared.clone(), notify_shutdown.subscribe(), done_tx.clone());
                tokio::spawn(async move {
                    serve_connection(s, tcp, addr.to_string(), sd).await;
                    drop(permit);
                    drop(d);
                });
            }
        };
        tokio::select! {
            _ = accept_loop => {}
            _ = shutdown => info!(node = %shared.cfg.node_id, "relay shutting down"),
        }
        drop(notify_shutdown);
        drop(done_tx);
        let _ = done_rx.recv().await;
        Ok(())
    }
}

/// Run a relay on `listener` until `shutdown` resolves.
pub async fn run(listener: TcpListener, config: RelayConfig, shutdown: impl Future) -> Result<()> {
    Relay::new(config)?.run(listener, shutdown).await
}

/// The reason sent to a child: the receiving side wraps it in its own error.
fn wire_reason(e: &Error) -> String {
    match e {
        Error::ResumeUnavailable { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}

type Rd = ReadHalf<BoxIo>;
type Wr = WriteHalf<BoxIo>;

async fn serve_connection(
    shared: Arc<Shared>,
    tcp: TcpStream,
    peer: String,
    mut sd: broadcast::Receiver<()>,
) {
    let cfg = &shared.cfg;
    let hs = async {
        let io: BoxIo = match &cfg.tls {
            Some(t) => t.accept(tcp).await?,
            None => Box::new(tcp),
        };
        let (mut rd, mut wr) = tokio::io::split(io);
        let mut conn = ServerConn::new(cfg.key.clone(), cfg.max_frame, random_nonce());
        loop {
            let n = read_some(&mut rd, conn.input_buf())
                .await
                .map_err(|e| Error::net_io("reading the handshake", e))?;
            if n == 0 {
                return Err(Error::PeerClosed {
                    peer: peer.clone(),
                    during: "the handshake".into(),
                });
            }
            let r = conn.process();
            if let Err(e @ Error::AuthRefused { .. }) = &r {
                // Log before the refusal leaves, so the log is complete when the peer sees it.
                shared.metrics.refusals.fetch_add(1, Relaxed);
                warn!(node = %cfg.node_id, %peer, reason = %e, "connection refused");
            }
            if let Some(b) = conn.poll_transmit() {
                write_bytes(&mut wr, &b)
                    .await
                    .map_err(|e| Error::net_io("writing the handshake", e))?;
            }
            r?;
            if let Some(ServerEvent::Authenticated(p)) = conn.poll_event() {
                return Ok((rd, wr, conn, p));
            }
        }
    };
    let hs = tokio::time::timeout(cfg.handshake_timeout, hs);
    let (rd, mut wr, conn, p) = tokio::select! {
        r = hs => match r {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => {
                if !matches!(e, Error::AuthRefused { .. }) {
                    debug!(%peer, error = %e, "handshake failed");
                }
                return;
            }
            Err(_) => {
                shared.metrics.refusals.fetch_add(1, Relaxed);
                warn!(%peer, "handshake timed out; connection closed");
                return;
            }
        },
        _ = sd.recv() => return,
    };
    info!(node = %cfg.node_id, %peer, role = ?p.role, id = %p.node_id, "peer authenticated");
    let r = match p.role {
        Role::Publisher if !cfg.parents.is_empty() => {
            shared.metrics.refusals.fetch_add(1, Relaxed);
            let reason = "this relay has parents; publish to the root relay (the one started without --parent)";
            warn!(node = %cfg.node_id, %peer, "connection refused: publisher on a non-root relay: {reason}");
            let _ = write_msg(
                &mut wr,
                &Message::Error {
                    code: code::ROLE_REFUSED,
                    reason: reason.into(),
                },
            )
            .await;
            let _ = wr.shutdown().await;
            return;
        }
        Role::Publisher => serve_publisher(&shared, rd, wr, conn, &peer, &mut sd).await,
        Role::Relay | Role::Subscriber => {
            let id = shared.hub().add_child(p.node_id.clone());
            shared.metrics.children.fetch_add(1, Relaxed);
            let r = serve_child(&shared, id, rd, wr, conn, &peer, &mut sd).await;
            shared.hub().remove_child(id);
            shared.progress.notify_waiters();
            shared.metrics.children.fetch_sub(1, Relaxed);
            r
        }
    };
    match r {
        Ok(()) => debug!(%peer, "connection closed"),
        Err(e) => info!(node = %cfg.node_id, %peer, error = %e, "connection ended"),
    }
}

async fn serve_publisher(
    shared: &Shared,
    mut rd: Rd,
    mut wr: Wr,
    mut conn: ServerConn,
    peer: &str,
    sd: &mut broadcast::Receiver<()>,
) -> Result<()> {
    let mut version: Option<u64> = None;
    let mut ack_idx = 0usize;
    let mut rx = shared.changed.subscribe();
    loop {
        // Messages decoded so far (also any that came with the handshake).
        while let Some(ServerEvent::Message(m)) = conn.poll_event() {
            let len = m.payload_len() as u64;
            if let Message::Header { version: v, blob } = &m {
                version = Some(*v);
                ack_idx = 0;
                let id = crate::relay::wire::delta_id(blob).map(|d| crate::relay::wire::hex(&d));
                info!(node = %shared.cfg.node_id, %peer, version = v, delta_id = ?id, "publisher started a version");
            }
            let r = shared.hub().on_upstream(m);
            if let Err(e) = r {
                let _ = write_msg(
                    &mut wr,
                    &Message::Error {
                        code: code::PROTOCOL,
                        reason: e.to_string(),
                    },
                )
                .await;
                return Err(e);
            }
            shared.metrics.bytes_in.fetch_add(len, Relaxed);
            shared.bump();
        }
        // Forward the acks of our version to the publisher.
        rx.borrow_and_update();
        if let Some(v) = version {
            let (acks, next) = shared.hub().acks_since(ack_idx);
            ack_idx = next;
            for a in acks.into_iter().filter(|a| a.version == v) {
                write_msg(&mut wr, &Message::Ack(a))
                    .await
                    .map_err(|e| Error::net_io("sending acks to the publisher", e))?;
            }
            wr.flush()
                .await
                .map_err(|e| Error::net_io("sending acks to the publisher", e))?;
        }
        shared.wait_for_room(sd).await;
        tokio::select! {
            n = read_some(&mut rd, conn.input_buf()) => {
                let n = n.map_err(|e| Error::net_io("reading from the publisher", e))?;
                if n == 0 {
                    return Ok(());
                }
                conn.process()?;
            }
            _ = rx.changed() => {}
            _ = sd.recv() => return Ok(()),
        }
    }
}

async fn serve_child(
    shared: &Shared,
    id: ChildId,
    mut rd: Rd,
    mut wr: Wr,
    mut conn: ServerConn,
    peer: &str,
    sd: &mut broadcast::Receiver<()>,
) -> Result<()> {
    let mut rx = shared.changed.subscribe();
    let mut bucket = shared
        .cfg
        .rate_limit
        .map(|r| TokenBucket::new(r, r.clamp(64 * 1024, 1 << 20), std::time::Instant::now()));
    let mut last_tx = Instant::now();
    loop {
        // Messages decoded so far (also any that came with the handshake).
        while let Some(ServerEvent::Message(m)) = conn.poll_event() {
            match m {
                Message::Subscribe {
                    from_version,
                    follow,
                    resume,
                } => {
                    let r = shared.hub().subscribe(id, from_version, follow, resume);
                    if let Err(e) = r {
                        warn!(node = %shared.cfg.node_id, %peer, error = %e, "subscribe refused");
                        let _ = write_msg(
                            &mut wr,
                            &Message::Error {
                                code: code::RESUME_UNAVAILABLE,
                                reason: wire_reason(&e),
                            },
                        )
                        .await;
                        let _ = wr.shutdown().await;
                        return Err(e);
                    }
                    if let Some(r) = resume {
                        info!(node = %shared.cfg.node_id, %peer, version = r.version, seq = r.next_seq, "child resumes");
                    }
                }
                Message::Ack(a) => {
                    let reply = Message::AckReceived {
                        version: a.version,
                        node_id: a.node_id.clone(),
                    };
                    info!(node = %shared.cfg.node_id, version = a.version, from = %a.node_id, ok = a.ok, reason = %a.reason, "ack");
                    if shared.hub().on_ack(a) {
                        shared.metrics.acks.fetch_add(1, Relaxed);
                        shared.bump();
                    }
                    write_msg(&mut wr, &reply)
                        .await
                        .map_err(|e| Error::net_io("confirming an ack", e))?;
                    wr.flush()
                        .await
                        .map_err(|e| Error::net_io("confirming an ack", e))?;
                }
                Message::Heartbeat => {}
                other => {
                    let e = Error::protocol("Subscribe or Ack from a child", other.name());
                    let _ = write_msg(
                        &mut wr,
                        &Message::Error {
                            code: code::PROTOCOL,
                            reason: e.to_string(),
                        },
                    )
                    .await;
                    return Err(e);
                }
            }
        }
        rx.borrow_and_update();
        // Send everything available (the cursor advances as we go).
        let mut sent_any = false;
        loop {
            let p = shared.hub().poll_child(id);
            match p {
                ChildPoll::Send(m) => {
                    let len = m.payload_len() as u64;
                    if let Some(b) = bucket.as_mut() {
                        let wait = b.take(len + 16, std::time::Instant::now());
                        if !wait.is_zero() {
                            tokio::time::sleep(wait).await;
                        }
                    }
                    // A child that takes no whole message for this long is gone:
                    // free its cursor (and the retention it pins).
                    let limit = shared.cfg.write_timeout + Duration::from_micros(len);
                    match tokio::time::timeout(limit, write_msg(&mut wr, &m)).await {
                        Ok(r) => {
                            r.map_err(|e| Error::net_io(format!("sending {} to {peer}", m.name()), e))?
                        }
                        Err(_) => {
                            return Err(Error::Timeout {
                                after_ms: limit.as_millis() as u64,
                                during: format!(
                                    "sending {} to child {peer} (it accepts no data)",
                                    m.name()
                                ),
                            })
                        }
                    };
                    shared.metrics.bytes_out.fetch_add(len, Relaxed);
                    sent_any = true;
                }
                ChildPoll::Wait | ChildPoll::Done => break,
                ChildPoll::Fail(e) => {
                    warn!(node = %shared.cfg.node_id, %peer, error = %e, "cannot serve child");
                    let _ = write_msg(
                        &mut wr,
                        &Message::Error {
                            code: code::RESUME_UNAVAILABLE,
                            reason: wire_reason(&e),
                        },
                    )
                    .await;
                    let _ = wr.shutdown().await;
                    return Err(e);
                }
            }
        }
        if sent_any {
            wr.flush()
                .await
                .map_err(|e| Error::net_io(format!("flushing to {peer}"), e))?;
            last_tx = Instant::now();
            shared.progress.notify_waiters();
        }
        tokio::select! {
            n = read_some(&mut rd, conn.input_buf()) => {
                let n = n.map_err(|e| Error::net_io(format!("reading from child {peer}"), e))?;
                if n == 0 {
                    return Ok(());
                }
                conn.process()?;
            }
            _ = rx.changed() => {}
            _ = tokio::time::sleep_until(last_tx + shared.cfg.heartbeat) => {
                write_msg(&mut wr, &Message::Heartbeat).await.map_err(|e| Error::net_io(format!("heartbeat to {peer}"), e))?;
                wr.flush().await.map_err(|e| Error::net_io(format!("heartbeat to {peer}"), e))?;
                last_tx = Instant::now();
            }
            _ = sd.recv() => {
                let _ = write_msg(&mut wr, &Message::Error { code: code::SHUTTING_DOWN, reason: "relay shutting down".into() }).await;
                let _ = wr.shutdown().await;
                return Ok(());
            }
        }
    }
}

/// Keep a link to the first reachable parent; on loss, reattach to the next
/// one and resume from what the hub holds.
async fn upstream_loop(shared: Arc<Shared>, mut sd: broadcast::Receiver<()>) {
    let parents = shared.cfg.parents.clone();
    let mut i = 0usize;
    let mut failures = 0u32;
    let mut unavailable = 0usize;
    let mut sd2 = sd.resubscribe();
    loop {
        let addr = &parents[i % parents.len()];
        let r = tokio::select! {
            r = upstream_once(&shared, addr, &mut sd2) => r,
            _ = sd.recv() => return,
        };
        let e = match r {
            Ok(()) => Error::PeerClosed {
                peer: addr.clone(),
                during: "streaming".into(),
            },
            Err(e) => e,
        };
        shared.metrics.upstream_failovers.fetch_add(1, Relaxed);
        failures += 1;
        if matches!(e, Error::ResumeUnavailable { .. }) {
            unavailable += 1;
            if unavailable >= parents.len() {
                // No parent can complete our partial version any more.
                let v = shared.hub().abandon_partial();
                warn!(node = %shared.cfg.node_id, version = ?v, "no parent holds the rest of the version; abandoning it and following newer ones");
                shared.bump();
                unavailable = 0;
            }
        } else {
            unavailable = 0;
        }
        i += 1;
        let next = &parents[i % parents.len()];
        warn!(node = %shared.cfg.node_id, parent = %addr, error = %e, next = %next, "upstream link lost; failing over");
        // Back off once a whole round of parents failed.
        let pause = if (failures as usize).is_multiple_of(parents.len()) {
            Duration::from_millis(100 * u64::from((failures / parents.len() as u32).min(20)))
        } else {
            Duration::ZERO
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = sd.recv() => return,
        }
    }
}

async fn upstream_once(
    shared: &Shared,
    addr: &str,
    sd: &mut broadcast::Receiver<()>,
) -> Result<()> {
    let cfg = &shared.cfg;
    let io = connect(addr, cfg.parent_tls.as_ref(), DEFAULT_CONNECT_TIMEOUT).await?;
    let (mut rd, mut wr) = tokio::io::split(io);
    let cursor = {
        let (from, resume) = shared.hub().upstream_resume();
        let mut c = Cursor::follow(from);
        if let Some(r) = resume {
            c.version = Some(r.version);
            c.next_seq = r.next_seq;
            c.have_header = r.have_header;
        }
        c
    };
    debug!(node = %cfg.node_id, parent = addr, ?cursor, "attaching upstream");
    let settings = ClientSettings {
        key: cfg.key.clone(),
        node_id: cfg.node_id.clone(),
        max_frame: cfg.max_frame,
        idle_timeout: Some(cfg.idle_timeout),
    };
    let mut conn = ClientConn::receiver(
        &settings,
        Role::Relay,
        cursor,
        random_nonce(),
        std::time::Instant::now(),
    );
    let mut rx = shared.changed.subscribe();
    let mut ack_idx = 0usize;
    let mut announced = false;
    loop {
        if conn.is_authenticated() {
            if !announced {
                info!(node = %cfg.node_id, parent = addr, "attached to parent");
                announced = true;
            }
            rx.borrow_and_update();
            let (acks, next) = shared.hub().acks_since(ack_idx);
            ack_idx = next;
            for a in acks {
                conn.send_ack(a);
            }
        }
        while let Some(b) = conn.poll_transmit() {
            write_bytes(&mut wr, &b)
                .await
                .map_err(|e| Error::net_io(format!("writing to parent {addr}"), e))?;
        }
        shared.wait_for_room(sd).await;
        // Time spent paused is not the parent's silence.
        conn.reset_idle(std::time::Instant::now());
        let deadline = conn
            .poll_timeout()
            .map(Instant::from_std)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            n = read_some(&mut rd, conn.input_buf()) => {
                let n = n.map_err(|e| Error::net_io(format!("reading from parent {addr}"), e))?;
                if n == 0 {
                    return Err(Error::PeerClosed { peer: addr.to_string(), during: "streaming".into() });
                }
                let r = conn.process(std::time::Instant::now());
                while let Some(ev) = conn.poll_event() {
                    if let Event::Stream(m) = ev {
                        let len = m.payload_len() as u64;
                        shared.hub().on_upstream(m)?;
                        shared.metrics.bytes_in.fetch_add(len, Relaxed);
                        shared.bump();
                    }
                }
                if let Err(e) = r {
                    // Send a pending refusal (auth) before giving up.
                    if let Some(b) = conn.poll_transmit() {
                        let _ = write_bytes(&mut wr, &b).await;
                    }
                    return Err(e);
                }
            }
            _ = rx.changed(), if conn.is_authenticated() => {}
            _ = tokio::time::sleep_until(deadline) => conn.handle_timeout(std::time::Instant::now())?,
        }
    }
}
