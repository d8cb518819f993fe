//! dcr-core: bit-exact delta-compressed refit.
//!
//! Pure Rust, no Python: the canonical checkpoint model and digests
//! ([`checkpoint`]), the chunk codec ([`codec`]), the delta format
//! ([`format`]) and whole-checkpoint diff/apply ([`delta`]).
#![deny(unsafe_code)]

pub mod checkpoint;
pub mod codec;
pub mod delta;
pub mod dtype;
pub mod files;
pub mod error;
pub mod format;

pub use error::{Error, Result};
