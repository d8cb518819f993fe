//! tokio drivers of the relay protocol: [`Publisher`], the relay server
//! ([`run`], [`Relay`]) and [`Subscriber`], plus blocking entry points
//! ([`publish_stream`], [`subscribe`]) that own a runtime and can be called
//! from plain threads (and from Python bindings).

use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::{Error, Result};
use crate::relay::wire::{Message, Parts};

mod metrics;
mod publisher;
mod receive_file;
mod server;
mod spill;
mod subscriber;
mod tls;

pub use metrics::{serve_metrics, Metrics};
pub use publisher::{
    publish_stream, publish_stream_retry, AckSummary, BlockingPublisher, PublishConfig,
    PublishReport, Publisher,
};
pub use receive_file::{receive_into_file, ApplyMode, FileReceipt};
pub use server::{run, Relay, RelayConfig};
pub use spill::FileSpill;
pub use subscriber::{subscribe, Delivered, Receiver, SubscribeConfig, Subscriber, Subscription};
pub use tls::{ClientTls, ServerTls};

/// A byte stream: TCP or TLS over TCP.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Io for T {}

/// A boxed [`Io`].
pub type BoxIo = Box<dyn Io>;

/// Default time to establish TCP (and TLS).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Connect to `addr` (HOST:PORT), optionally over TLS.
pub(crate) async fn connect(
    addr: &str,
    tls: Option<&ClientTls>,
    timeout: Duration,
) -> Result<BoxIo> {
    let fut = async {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|e| Error::net_io(format!("connecting to {addr}"), e))?;
        tcp.set_nodelay(true).ok();
        match tls {
            None => Ok(Box::new(tcp) as BoxIo),
            Some(t) => t.connect(addr, tcp).await,
        }
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout {
            after_ms: timeout.as_millis() as u64,
            during: format!("connecting to {addr}"),
        }),
    }
}

/// Write one message, its blob without a copy.
pub(crate) async fn write_msg<W: AsyncWrite + Unpin + ?Sized>(
    w: &mut W,
    m: &Message,
) -> std::io::Result<usize> {
    let p: Parts = m.encode_parts();
    w.write_all(&p.head).await?;
    if !p.blob.is_empty() {
        w.write_all(&p.blob).await?;
    }
    if p.has_tail {
        w.write_all(&p.tail).await?;
    }
    Ok(p.len())
}

/// Write bytes and flush.
pub(crate) async fn write_bytes<W: AsyncWrite + Unpin + ?Sized>(
    w: &mut W,
    b: &Bytes,
) -> std::io::Result<()> {
    w.write_all(b).await?;
    w.flush().await
}

/// Read more bytes into `buf`; `Ok(0)` is end of stream.
pub(crate) async fn read_some<R: AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    buf: &mut bytes::BytesMut,
) -> std::io::Result<usize> {
    if buf.capacity() - buf.len() < 64 * 1024 {
        buf.reserve(64 * 1024);
    }
    r.read_buf(buf).await
}

/// A fresh node id: `prefix-<hostname-ish>-<pid>-<random>`.
pub fn default_node_id(prefix: &str) -> String {
    let n = crate::relay::auth::random_nonce();
    format!(
        "{prefix}-{}-{:02x}{:02x}{:02x}",
        std::process::id(),
        n[0],
        n[1],
        n[2]
    )
}
