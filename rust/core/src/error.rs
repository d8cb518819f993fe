//! Errors of dcr-core. Every message says what was expected, what was found
//! and what to do about it.
//!
//! This branch only holds the journal's variants; they are named `Journal*`
//! so they can be folded into the crate's single error enum unchanged.

use std::io;
use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
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
    /// Whether this error (or the one it wraps) is a full disk (ENOSPC).
    pub fn is_disk_full(&self) -> bool {
        match self {
            Error::JournalIo { source, .. } => {
                source.kind() == io::ErrorKind::StorageFull || source.raw_os_error() == Some(28)
            }
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
