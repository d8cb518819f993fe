//! The crate's single error type. Every message says what was expected, what
//! was found, and what to do about it.

use std::io;
use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Short lowercase hex of a digest prefix, for messages.
pub fn short_hex(bytes: &[u8]) -> String {
    bytes.iter().take(6).map(|b| format!("{b:02x}")).collect()
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("{op} {path}: {source}{}", file_io_advice(source))]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: not a safetensors checkpoint ({detail}); pass a .safetensors file written by safetensors/torch/transformers, a directory of its shards, or its .safetensors.index.json")]
    Checkpoint { path: PathBuf, detail: String },

    #[error("dtype {dtype} is not supported: {detail}")]
    UnsupportedDtype { dtype: String, detail: String },

    #[error("not a dcr delta: expected magic {expected:?}, found {found:?}; pass a file written by `dcr diff`")]
    BadMagic { expected: String, found: String },

    #[error("delta format version {found} is not supported (this dcr reads version {supported}); upgrade dcr on this host or re-encode the delta with the sender's dcr")]
    UnsupportedVersion { found: u16, supported: u16 },

    #[error("unknown {what} code {code} in {context}; the delta was written by a newer or different encoder: upgrade dcr or re-encode")]
    UnknownCode { what: &'static str, code: u8, context: String },

    #[error("truncated delta: {context} needs {needed} bytes but only {available} remain; the file or stream was cut short: fetch it again")]
    Truncated { context: String, needed: u64, available: u64 },

    #[error("{context}: length {len} exceeds the limit of {max}; the delta is corrupt or hostile: fetch it again from a trusted sender")]
    TooLarge { context: String, len: u64, max: u64 },

    #[error("checksum mismatch in {context}: stored crc32c {expected:#010x}, computed {found:#010x}; the bytes were corrupted in transit or on disk: fetch them again")]
    Checksum { context: String, expected: u32, found: u32 },

    #[error("corrupt delta: {context}: {detail}; fetch it again from the sender")]
    Corrupt { context: String, detail: String },

    /// A chunk or trailer frame whose delta tag is not the header's.
    #[error("{frame} belongs to delta {found} but this refit is delta {expected}; a frame from another delta was spliced in: drop it and fetch the right stream")]
    ForeignFrame { frame: String, expected: String, found: String },

    #[error("chunk {seq} was already applied; applying an XOR twice would undo it, so the replay is refused")]
    DuplicateChunk { seq: u32 },

    #[error("delta v{base_version}->v{target_version} needs base digest {base_digest}, but the target holds digest {found}; apply the deltas in order from the version it holds, or do a dense refit")]
    BaseMismatch { base_version: u64, target_version: u64, base_digest: String, found: String },

    #[error("layout mismatch: {detail}; the delta was built for a different model layout: check that you passed the right checkpoint, or do a dense refit")]
    LayoutMismatch { detail: String },

    #[error("after applying, {count} tensor(s) do not match the delta's target digests (first: {first}); the target was restored to its base: re-fetch the delta or do a dense refit")]
    TargetMismatch { count: usize, first: String, tensors: Vec<String> },

    #[error("after a failed apply, {count} tensor(s) could not be restored (first: {first}); the target holds neither version: do a dense refit")]
    RollbackFailed { count: usize, first: String },

    #[error("rolling back a refit that failed verification did not restore its base: {detail}; the target holds neither version: do a dense refit")]
    RollbackIncomplete { detail: String },

    /// The publishing side's commit ledger refused an operation.
    #[error("commit ledger: {op} refused: {detail}")]
    LedgerRefused { op: &'static str, detail: String },

    #[error("commit ledger {}: cannot read it ({detail}); restore it from a backup or start a new ledger from a dense version", path.display())]
    LedgerCorrupt { path: PathBuf, detail: String },

    #[error("incomplete delta: {detail}; the stream ended early: fetch the rest (or the whole delta) again")]
    Incomplete { detail: String },

    #[error("invalid argument: {0}")]
    Invalid(String),

    /// A file operation on the journal failed.
    #[error("journal {}: {op} failed: {source}; {}", path.display(), io_advice(source))]
    JournalIo {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },

    /// The journal's bytes are not what this code wrote: a bad header, or a
    /// complete (committed) record whose checksum, marker or contents are
    /// wrong. Never raised for a torn tail, which is truncated instead.
    #[error("journal {} is corrupt at byte offset {offset}: {detail}; the journal cannot be trusted: move it aside and do a dense refit", path.display())]
    JournalCorrupt { path: PathBuf, offset: u64, detail: String },

    /// The journal was written in a format version this build cannot read.
    #[error("journal {} has format version {found}, but this dcr reads version {supported}; open it with a dcr that reads version {found}, or move it aside and do a dense refit", path.display())]
    JournalVersion { path: PathBuf, found: u16, supported: u16 },

    /// A record to append is larger than the format allows.
    #[error("journal {}: a record of {len} bytes exceeds the limit of {max} bytes; nothing was written: shorten the record (e.g. the abort reason)", path.display())]
    JournalRecordTooLarge { path: PathBuf, len: usize, max: usize },

    /// The requested transition is not allowed in the receiver's state
    /// (nothing was written).
    #[error("journal {}: {op} refused: {detail}", path.display())]
    JournalTransition { path: PathBuf, op: &'static str, detail: String },

    /// An earlier failure left this handle's view of the file uncertain.
    #[error("journal {}: this handle is unusable after an earlier failure ({cause}); reopen the journal, which recovers the last committed state", path.display())]
    JournalPoisoned { path: PathBuf, cause: String },

    /// A terminal transition (commit, dense commit, abort) is durable, but
    /// rewriting the journal down to the current state failed.
    // ---------------------------------------------------------- transport
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
    MessageChecksum {
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
    NetIo {
        /// What we were doing.
        during: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The local object was closed / shut down.
    #[error("{0} is closed")]
    Closed(&'static str),

    #[error("journal {}: {durable} is durable, but compacting the journal failed: {source}; nothing is lost, the journal only stays longer: call compact() again or reopen the journal", path.display())]
    JournalCompact { path: PathBuf, durable: String, source: Box<Error> },

    // ---- object-storage transport (feature `objstore`; docs/objstore.md)
    /// A request to the object store failed: network, credentials,
    /// permissions, a missing bucket or object.
    #[error("object store {url}: {op} failed: {detail}; check the URL, the credentials and endpoint in the environment (AWS_*, GOOGLE_*, AZURE_*), and that the bucket exists, then retry")]
    ObjectStore { url: String, op: String, detail: String },

    /// The conditional put of a version's manifest was refused: that version
    /// is already committed (another publisher won the race for it).
    #[error("{url}: version {version} is already committed ({existing}); another publisher won the race for it and nothing of yours became visible: build your delta against v{version} and publish it as v{next}")]
    VersionExists { url: String, version: u64, existing: String, next: u64 },

    /// The committed versions at a URL do not form a chain from what the
    /// receiver (or publisher) holds.
    #[error("{url}: {detail}")]
    VersionChain { url: String, detail: String },
}

/// Whether an I/O error is a full device (ENOSPC).
fn storage_full(e: &io::Error) -> bool {
    // 28 = ENOSPC on Linux and macOS, in case the kind is not mapped.
    e.kind() == io::ErrorKind::StorageFull || e.raw_os_error() == Some(28)
}

/// What to do after a file operation failed, for the kinds with a clear
/// remedy (appended to the message; empty otherwise).
fn file_io_advice(e: &io::Error) -> &'static str {
    if storage_full(e) {
        "; the device is full: free space or write somewhere else, then retry"
    } else if e.kind() == io::ErrorKind::PermissionDenied {
        "; check the permissions of the file and its directory"
    } else {
        ""
    }
}

/// What to do after an I/O error, by its kind.
fn io_advice(e: &io::Error) -> &'static str {
    if storage_full(e) {
        "the disk is full: free space and retry; every record acknowledged before this call is intact"
    } else if e.kind() == io::ErrorKind::NotFound {
        "the file or its directory is missing: check the path"
    } else if e.kind() == io::ErrorKind::PermissionDenied {
        "check the permissions of the journal file and its directory"
    } else {
        "every record acknowledged before this call is intact: reopen the journal to continue"
    }
}

impl Error {
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), op, source }
    }
    pub fn corrupt(context: impl Into<String>, detail: impl Into<String>) -> Self {
        Error::Corrupt { context: context.into(), detail: detail.into() }
    }
    pub fn truncated(context: impl Into<String>, needed: u64, available: u64) -> Self {
        Error::Truncated { context: context.into(), needed, available }
    }

    /// Wrap an `io::Error` of the network transport with what it was doing.
    pub fn net_io(during: impl Into<String>, source: io::Error) -> Self {
        Error::NetIo { during: during.into(), source }
    }

    /// Shorthand for a protocol violation.
    pub fn protocol(expected: impl Into<String>, found: impl Into<String>) -> Self {
        Error::Protocol { expected: expected.into(), found: found.into() }
    }

    /// Whether a subscriber should try another parent after this error
    /// (as opposed to giving up: a refusal by the application callback).
    pub fn is_retryable(&self) -> bool {
        !matches!(self, Error::Callback { .. } | Error::Config(_) | Error::Closed(_))
    }

    /// Whether this error (or the one it wraps) is a full disk (ENOSPC).
    pub fn is_disk_full(&self) -> bool {
        match self {
            Error::JournalIo { source, .. } | Error::Io { source, .. } => storage_full(source),
            Error::JournalCompact { source, .. } => source.is_disk_full(),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_say_what_to_do() {
        let e = Error::JournalIo {
            path: "/x/r.dcrj".into(),
            op: "write",
            source: io::Error::new(io::ErrorKind::StorageFull, "no space left on device"),
        };
        assert!(e.is_disk_full());
        let m = e.to_string();
        assert!(m.contains("/x/r.dcrj") && m.contains("disk is full") && m.contains("intact"), "{m}");

        let e = Error::JournalCorrupt { path: "/x/r.dcrj".into(), offset: 4096, detail: "bad".into() };
        let m = e.to_string();
        assert!(m.contains("offset 4096") && m.contains("dense refit"), "{m}");
        assert!(!e.is_disk_full());

        let e = Error::JournalVersion { path: "/x/r.dcrj".into(), found: 9, supported: 1 };
        assert!(e.to_string().contains("version 9"));
    }
}
