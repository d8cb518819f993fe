//! Relay counters and a Prometheus text endpoint over plain HTTP.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Counters of one relay.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Payload bytes received from the publisher or the parent.
    pub bytes_in: AtomicU64,
    /// Payload bytes sent to children.
    pub bytes_out: AtomicU64,
    /// Children connected now.
    pub children: AtomicU64,
    /// Largest lag of a child, in chunks (updated on scrape by the relay).
    pub max_lag: AtomicU64,
    /// Resume requests served.
    pub resumes: AtomicU64,
    /// Connections refused (authentication, role, cap).
    pub refusals: AtomicU64,
    /// Upstream connection losses (failovers to the next parent).
    pub upstream_failovers: AtomicU64,
    /// Times upstream reading paused for lagging children (backpressure).
    pub upstream_stalls: AtomicU64,
    /// Acks received from below.
    pub acks: AtomicU64,
    /// Chunks spilled to disk.
    pub spilled_chunks: AtomicU64,
    /// Chunks evicted from retention.
    pub evicted_chunks: AtomicU64,
    /// Newest version held.
    pub latest_version: AtomicU64,
}

impl Metrics {
    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let mut m = |name: &str, kind: &str, help: &str, v: u64| {
            s.push_str(&format!("# HELP dcr_relay_{name} {help}\n# TYPE dcr_relay_{name} {kind}\ndcr_relay_{name} {v}\n"));
        };
        m(
            "bytes_in_total",
            "counter",
            "Payload bytes received from upstream.",
            self.bytes_in.load(Relaxed),
        );
        m(
            "bytes_out_total",
            "counter",
            "Payload bytes sent to children.",
            self.bytes_out.load(Relaxed),
        );
        m(
            "children",
            "gauge",
            "Children connected.",
            self.children.load(Relaxed),
        );
        m(
            "max_child_lag_chunks",
            "gauge",
            "Largest lag of a child behind the newest chunk.",
            self.max_lag.load(Relaxed),
        );
        m(
            "resumes_total",
            "counter",
            "Resume requests served.",
            self.resumes.load(Relaxed),
        );
        m(
            "refusals_total",
            "counter",
            "Connections refused.",
            self.refusals.load(Relaxed),
        );
        m(
            "upstream_failovers_total",
            "counter",
            "Upstream links lost.",
            self.upstream_failovers.load(Relaxed),
        );
        m(
            "upstream_stalls_total",
            "counter",
            "Pauses of upstream reading for lagging children.",
            self.upstream_stalls.load(Relaxed),
        );
        m(
            "acks_total",
            "counter",
            "Receiver acks recorded.",
            self.acks.load(Relaxed),
        );
        m(
            "spilled_chunks_total",
            "counter",
            "Chunks spilled to disk.",
            self.spilled_chunks.load(Relaxed),
        );
        m(
            "evicted_chunks_total",
            "counter",
            "Chunks evicted from retention.",
            self.evicted_chunks.load(Relaxed),
        );
        m(
            "latest_version",
            "gauge",
            "Newest version held.",
            self.latest_version.load(Relaxed),
        );
        s
    }
}

/// Serve `GET /metrics` (any path) until `shutdown` resolves. `refresh` runs
/// before each scrape (the relay updates its gauges there).
pub async fn serve_metrics(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    refresh: impl Fn() + Send + Sync + 'static,
    shutdown: impl Future<Output = ()>,
) {
    let refresh = Arc::new(refresh);
    tokio::pin!(shutdown);
    loop {
        let (mut sock, _) = tokio::select! {
            r = listener.accept() => match r { Ok(x) => x, Err(e) => { tracing::warn!(error = %e, "metrics accept failed"); continue } },
            _ = &mut shutdown => return,
        };
        let metrics = metrics.clone();
        let refresh = refresh.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut n = 0;
            // Read the request head (bounded), with a deadline.
            let read = async {
                while n < buf.len() {
                    let k = sock.read(&mut buf[n..]).await?;
                    if k == 0 {
                        break;
                    }
                    n += k;
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                Ok::<_, std::io::Error>(())
            };
            if tokio::time::timeout(std::time::Duration::from_secs(5), read)
                .await
                .is_err()
            {
                return;
            }
            refresh();
            let body = metrics.render();
            let resp = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}
