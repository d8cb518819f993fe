//! The Python exception hierarchy: everything dcr raises derives from
//! `DcrError`; I/O failures map onto the built-in `OSError` family.

use dcr_core::Error;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyFileExistsError, PyFileNotFoundError, PyOSError, PyPermissionError, PyValueError};
use pyo3::prelude::*;

create_exception!(dcr, DcrError, PyException, "Base class of every error dcr raises.");
create_exception!(dcr, CorruptDeltaError, DcrError, "A delta failed its checks: corrupt, truncated, foreign or from an unknown format.");
create_exception!(dcr, IncompleteDeltaError, CorruptDeltaError, "A delta or stream ended before its trailer.");
create_exception!(dcr, UnsupportedFormatError, CorruptDeltaError, "A delta written in a format version or encoding this dcr cannot read.");
create_exception!(dcr, BaseMismatchError, DcrError, "The target is not the version the delta was built against.");
create_exception!(dcr, LayoutMismatchError, DcrError, "Tensor names, dtypes or shapes differ from what was expected.");
create_exception!(dcr, VerificationError, DcrError, "After applying, the target's digests differ from the delta's.");
create_exception!(dcr, CheckpointError, DcrError, "A checkpoint file could not be read.");
create_exception!(dcr, JournalError, DcrError, "The receiver's commit journal refused a transition or is corrupt.");
create_exception!(dcr, TransportError, DcrError, "The relay transport failed: authentication, protocol, dead peers.");
create_exception!(dcr, ObjectStoreError, DcrError, "An object-storage request failed (network, credentials, permissions, missing bucket).");
create_exception!(dcr, VersionExistsError, ObjectStoreError, "The version is already committed: another publisher won the conditional put.");
create_exception!(dcr, VersionChainError, BaseMismatchError, "The committed versions do not form a chain from what the target holds.");

pub fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Io { source, .. } => match source.kind() {
            std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(msg),
            std::io::ErrorKind::PermissionDenied => PyPermissionError::new_err(msg),
            std::io::ErrorKind::AlreadyExists => PyFileExistsError::new_err(msg),
            _ => PyOSError::new_err((source.raw_os_error().unwrap_or(0), msg)),
        },
        Error::Checkpoint { .. } => CheckpointError::new_err(msg),
        Error::BadMagic { .. } | Error::Truncated { .. } | Error::TooLarge { .. } | Error::Checksum { .. } | Error::Corrupt { .. } | Error::ForeignFrame { .. } | Error::DuplicateChunk { .. } => {
            CorruptDeltaError::new_err(msg)
        }
        Error::Incomplete { .. } => IncompleteDeltaError::new_err(msg),
        Error::UnsupportedVersion { .. } | Error::UnknownCode { .. } => UnsupportedFormatError::new_err(msg),
        Error::BaseMismatch { .. } => BaseMismatchError::new_err(msg),
        Error::LayoutMismatch { .. } => LayoutMismatchError::new_err(msg),
        Error::TargetMismatch { .. } | Error::RollbackFailed { .. } | Error::RollbackIncomplete { .. } => VerificationError::new_err(msg),
        Error::UnsupportedDtype { .. } | Error::Invalid(_) => PyValueError::new_err(msg),
        Error::ObjectStore { .. } => ObjectStoreError::new_err(msg),
        Error::VersionExists { .. } => VersionExistsError::new_err(msg),
        Error::VersionChain { .. } => VersionChainError::new_err(msg),
        Error::JournalIo { source, .. } => PyOSError::new_err((source.raw_os_error().unwrap_or(0), msg)),
        Error::Timeout { .. } => pyo3::exceptions::PyTimeoutError::new_err(msg),
        Error::NetIo { .. } | Error::PeerClosed { .. } | Error::AllParentsFailed { .. } => {
            pyo3::exceptions::PyConnectionError::new_err(msg)
        }
        Error::AuthRefused { .. }
        | Error::FrameTooLarge { .. }
        | Error::MessageChecksum { .. }
        | Error::Protocol { .. }
        | Error::ResumeUnavailable { .. }
        | Error::Remote { .. }
        | Error::Callback { .. }
        | Error::Config(_)
        | Error::Tls(_)
        | Error::Closed(_) => TransportError::new_err(msg),
        _ => JournalError::new_err(msg),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("DcrError", py.get_type::<DcrError>())?;
    m.add("CorruptDeltaError", py.get_type::<CorruptDeltaError>())?;
    m.add("IncompleteDeltaError", py.get_type::<IncompleteDeltaError>())?;
    m.add("UnsupportedFormatError", py.get_type::<UnsupportedFormatError>())?;
    m.add("BaseMismatchError", py.get_type::<BaseMismatchError>())?;
    m.add("LayoutMismatchError", py.get_type::<LayoutMismatchError>())?;
    m.add("VerificationError", py.get_type::<VerificationError>())?;
    m.add("CheckpointError", py.get_type::<CheckpointError>())?;
    m.add("JournalError", py.get_type::<JournalError>())?;
    m.add("TransportError", py.get_type::<TransportError>())?;
    m.add("ObjectStoreError", py.get_type::<ObjectStoreError>())?;
    m.add("VersionExistsError", py.get_type::<VersionExistsError>())?;
    m.add("VersionChainError", py.get_type::<VersionChainError>())?;
    Ok(())
}
