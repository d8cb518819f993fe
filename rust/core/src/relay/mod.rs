//! Relay-tree transport protocol: wire messages, authentication and the
//! I/O-free state machines of each role. The tokio drivers live in
//! [`crate::net`]; see `docs/relay.md`.
//!
//! * [`wire`]: framing (length, kind, body, CRC32C) and messages.
//! * [`auth`]: HMAC-SHA256 challenge–response over a pre-shared key.
//! * [`client`]: [`ClientConn`] for publishers and receivers, and the
//!   failover-proof receive [`Cursor`].
//! * [`server`]: [`ServerConn`], a relay's view of one connection.
//! * [`hub`]: [`Hub`], a relay's shared state (retained streams, child cursors, acks).
//! * [`store`]: retention window with spill.
//! * [`bucket`]: token bucket for rate limits.

pub mod auth;
pub mod bucket;
pub mod client;
pub mod hub;
pub mod server;
pub mod store;
pub mod wire;

#[cfg(test)]
mod harness;

pub use auth::PreSharedKey;
pub use client::{ClientConn, ClientSettings, Cursor, Event};
pub use hub::{ChildId, ChildPoll, Hub};
pub use server::{ServerConn, ServerEvent};
pub use store::{Store, StoreConfig};
pub use wire::{Ack, Message, Resume, Role};
