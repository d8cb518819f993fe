//! The crate's single error type. Every message says what was expected, what
//! was found, and what to do about it.

use std::io;
use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, Error>;

/// Short lowercase hex of a digest prefix, for messages.
pub fn short_hex(bytes: &[u8]) -> String {
    bytes.iter().take(6).map(|b| format!("{b:02x}")).collect()
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("{op} {path}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: not a safetensors checkpoint ({detail}); pass a .safetensors file written by safetensors/torch/transformers")]
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

    #[error("chunk {seq} belongs to delta {found} but this refit is delta {expected}; a frame from another delta was spliced in: drop it and fetch the right stream")]
    ForeignChunk { seq: u32, expected: String, found: String },

    #[error("chunk {seq} was already applied; applying an XOR twice would undo it, so the replay is refused")]
    DuplicateChunk { seq: u32 },

    #[error("delta {base}->{target} needs base checkpoint digest {base}, but the target holds {found}; apply the deltas in order from the version it holds, or do a dense refit")]
    BaseMismatch { base: String, target: String, found: String },

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
    #[error("journal {}: {durable} is durable, but compacting the journal failed: {source}; nothing is lost, the journal only stays longer: call compact() again or reopen the journal", path.display())]
    JournalCompact { path: PathBuf, durable: String, source: Box<Error> },
}

/// What to do after an I/O error, by its kind.
fn io_advice(e: &io::Error) -> &'static str {
    // 28 = ENOSPC on Linux and macOS, in case the kind is not mapped.
    if e.kind() == io::ErrorKind::StorageFull || e.raw_os_error() == Some(28) {
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

    /// Whether this error (or the one it wraps) is a full disk (ENOSPC).
    pub fn is_disk_full(&self) -> bool {
        match self {
            Error::JournalIo { source, .. } => {
                source.kind() == io::ErrorKind::StorageFull || source.raw_os_error() == Some(28)
            }
            Error::JournalCompact { source, .. } => source.is_disk_full(),
            Error::Io { source, .. } => source.kind() == io::ErrorKind::StorageFull || source.raw_os_error() == Some(28),
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
