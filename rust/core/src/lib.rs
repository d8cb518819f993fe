#![deny(unsafe_code)]

pub mod error;
pub mod journal;

pub use error::{Error, Result};
