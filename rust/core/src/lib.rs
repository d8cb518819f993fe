//! dcr-core: bit-exact delta-compressed refit.
//!
//! Pure Rust, no Python: the canonical checkpoint model and digests
//! ([`checkpoint`]), the chunk codec ([`codec`]), the delta format
//! ([`format`]), whole-checkpoint diff/apply ([`delta`], [`files`]) and the
//! receiver's crash-safe commit journal ([`journal`]) and the resumable
//! in-place refit built on it ([`receiver`]); the publishing side's joint
//! commit bookkeeping ([`commit`]); the relay-tree transport: I/O-free
//! protocol state machines ([`relay`]) and their tokio drivers ([`net`]).
#![deny(unsafe_code)]

pub mod checkpoint;
pub mod checksum;
pub mod codec;
pub mod commit;
pub mod delta;
pub mod digest;
pub mod dtype;
pub mod error;
pub mod exec;
pub mod files;
pub mod format;
pub mod journal;
pub mod net;
pub mod receiver;
pub mod relay;
pub mod sharded;
#[cfg(feature = "objstore")]
pub mod objstore;

pub use error::{Error, Result};
