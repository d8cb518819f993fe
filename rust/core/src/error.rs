//! Errors of the relay transport (`relay` and `net` modules).
//!
//! Each message says what was expected, what was found and what to do.
//! These variants are meant to be folded into the crate's single error enum.

use std::io;

/// Result alias of the transport.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the relay transport.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The peer refused our credentials, or we refused the peer's.
    #[error("authentication refused by {side}: {reason}")]
    AuthRefused {
        /// "parent" (the peer refused us) or "local" (we refused the peer).
        side: &'static str,
        /// Why; never contains key material.
        reason: String,
    },
    /// The peer closed the connection before the stream was complete.
    #[error("peer {peer} closed the connection {during}; the receiver resumes from another parent if one is configured")]
    PeerClosed {
        /// Address of the peer.
        peer: String,
        /// What we were doing.
        during: String,
    },
    /// A length prefix announced a frame above the configured maximum.
    #[error("frame of {len} bytes announced, at most {max} allowed: the peer is not a dcr relay of a compatible version, or raise --max-frame on both ends")]
    FrameTooLarge {
        /// Announced length.
        len: u64,
        /// Configured maximum.
        max: u64,
    },
    /// A message failed its CRC32C check (bytes corrupted in flight or by a relay).
    #[error("message checksum mismatch: expected crc32c {expected:08x}, computed {found:08x}; the data is refetched from another parent")]
    Checksum {
        /// CRC carried by the message.
        expected: u32,
        /// CRC computed over the received bytes.
        found: u32,
    },
    /// A message was well framed but its contents were not what the protocol allows here.
    #[error("protocol violation: expected {expected}, found {found}")]
    Protocol {
        /// What the protocol expected.
        expected: String,
        /// What was received.
        found: String,
    },
    /// The parent no longer holds (or never held) what a resume asked for.
    #[error("cannot resume version {version} at chunk {seq}: {reason}; try another parent or restart the refit")]
    ResumeUnavailable {
        /// Version asked for.
        version: u64,
        /// Sequence number asked for.
        seq: u32,
        /// Why.
        reason: String,
    },
    /// The peer sent an error message.
    #[error("peer reported error {code}: {reason}")]
    Remote {
        /// Wire error code.
        code: u16,
        /// Text sent by the peer.
        reason: String,
    },
    /// Every parent in the list failed.
    #[error("all {tried} parent connection attempts failed; last error: {last}")]
    AllParentsFailed {
        /// Attempts made.
        tried: usize,
        /// Last error seen.
        last: Box<Error>,
    },
    /// A deadline passed.
    #[error("timed out after {after_ms} ms while {during}")]
    Timeout {
        /// Elapsed milliseconds.
        after_ms: u64,
        /// What was awaited.
        during: String,
    },
    /// A callback of the application refused a blob.
    #[error("receiver callback failed on {what}: {reason}")]
    Callback {
        /// "header", "chunk 17", "end".
        what: String,
        /// The callback's message.
        reason: String,
    },
    /// Invalid configuration (addresses, keys, certificates).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// TLS setup or handshake failure.
    #[error("TLS error: {0}")]
    Tls(String),
    /// An I/O error, with what we were doing.
    #[error("I/O error while {during}: {source}")]
    Io {
        /// What we were doing.
        during: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The local object was closed / shut down.
    #[error("{0} is closed")]
    Closed(&'static str),
}

impl Error {
    /// Wrap an `io::Error` with context.
    pub fn io(during: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            during: during.into(),
            source,
        }
    }

    /// Shorthand for a protocol violation.
    pub fn protocol(expected: impl Into<String>, found: impl Into<String>) -> Self {
        Error::Protocol {
            expected: expected.into(),
            found: found.into(),
        }
    }

    /// Whether a subscriber should try another parent after this error
    /// (as opposed to giving up: a refusal by the application callback).
    pub fn is_retryable(&self) -> bool {
        !matches!(
            self,
            Error::Callback { .. } | Error::Config(_) | Error::Closed(_)
        )
    }
}
