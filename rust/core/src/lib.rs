#![deny(unsafe_code)]

pub mod error;
pub mod net;
pub mod relay;
