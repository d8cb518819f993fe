//! The crate's single error type. Every message says what was expected, what
//! was found, and what to do about it.

use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, Error>;

/// Short lowercase hex of a digest prefix, for messages.
pub fn short_hex(bytes: &[u8]) -> String {
    bytes.iter().take(6).map(|b| format!("{b:02x}")).collect()
}

#[derive(Debug, thiserror::Error)]
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

    #[error("incomplete delta: {detail}; the stream ended early: fetch the rest (or the whole delta) again")]
    Incomplete { detail: String },

    #[error("invalid argument: {0}")]
    Invalid(String),
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
}
