//! Helpers shared by the relay integration tests (loopback only, bounded).
#![allow(dead_code)]

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use dcr_core::net::{self, Delivered, Metrics, Relay, RelayConfig, SubscribeConfig, Subscription};
use dcr_core::relay::PreSharedKey;

pub const KEY: &[u8] = b"integration-test-key-0123456789";

pub fn key() -> Option<PreSharedKey> {
    Some(PreSharedKey::new(KEY).unwrap())
}

/// A relay running in-process on 127.0.0.1:0 with its own runtime.
pub struct TestRelay {
    pub addr: String,
    pub metrics: Arc<Metrics>,
    pub relay: Relay,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    rt: tokio::runtime::Runtime,
    task: Option<tokio::task::JoinHandle<dcr_core::error::Result<()>>>,
}

impl TestRelay {
    pub fn start(cfg: RelayConfig) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let relay = Relay::new(cfg).unwrap();
        let metrics = relay.metrics();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let r2 = relay.clone();
        let task = rt.spawn(async move {
            r2.run(listener, async {
                let _ = rx.await;
            })
            .await
        });
        TestRelay {
            addr,
            metrics,
            relay,
            stop: Some(tx),
            rt,
            task: Some(task),
        }
    }

    /// Graceful shutdown; returns once every connection task ended.
    pub fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            self.rt
                .block_on(async { tokio::time::timeout(Duration::from_secs(20), t).await })
                .expect("relay stops in time")
                .unwrap()
                .unwrap();
        }
    }
}

impl Drop for TestRelay {
    fn drop(&mut self) {
        self.stop();
    }
}

pub fn relay_cfg(name: &str, parents: &[&str]) -> RelayConfig {
    RelayConfig {
        node_id: name.into(),
        key: key(),
        parents: parents.iter().map(|s| s.to_string()).collect(),
        idle_timeout: Duration::from_secs(5),
        heartbeat: Duration::from_millis(500),
        ..Default::default()
    }
}

pub fn sub_cfg(name: &str, parents: &[&str]) -> SubscribeConfig {
    let mut c = SubscribeConfig::new(parents.iter().copied());
    c.key = key();
    c.node_id = name.into();
    c.timeout = Some(Duration::from_secs(60));
    c.idle_timeout = Duration::from_secs(5);
    c
}

/// Deterministic chunk `i` of a test stream.
pub fn chunk(i: u32, len: usize) -> Vec<u8> {
    let mut x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn chunk_len(i: u32) -> usize {
    1000 + (i as usize * 7919) % 20_000
}

/// What a subscriber saw, in order.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Seen {
    pub header: Vec<u8>,
    pub chunks: Vec<(u32, u32)>, // (seq, crc32c)
    pub end: Option<(u32, Vec<u8>)>,
}

pub fn expected(n: u32, header: &[u8], trailer: &[u8]) -> Seen {
    Seen {
        header: header.to_vec(),
        chunks: (0..n)
            .map(|i| (i, dcr_core::checksum::crc32c(&chunk(i, chunk_len(i)))))
            .collect(),
        end: Some((n, trailer.to_vec())),
    }
}

pub struct SubHandle {
    pub progress: mpsc::Receiver<u32>,
    pub done: mpsc::Receiver<(
        dcr_core::error::Result<Delivered>,
        Seen,
        Option<Subscription>,
    )>,
}

/// Run a blocking subscriber on its own thread. Each delivered chunk's seq is
/// reported on `progress`; `gate`, if set, is consulted before each chunk
/// (a slow receiver blocks there).
pub fn spawn_sub(cfg: SubscribeConfig, gate: Option<Arc<dyn Fn(u32) + Send + Sync>>) -> SubHandle {
    let (ptx, progress) = mpsc::channel();
    let (dtx, done) = mpsc::channel();
    thread::spawn(move || {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (s1, s2, s3) = (seen.clone(), seen.clone(), seen.clone());
        let r = net::subscribe(
            cfg,
            move |_, h| {
                s1.lock().unwrap().header = h.to_vec();
                Ok(())
            },
            move |_, seq, b| {
                if let Some(g) = &gate {
                    g(seq);
                }
                s2.lock().unwrap().chunks.push((seq, dcr_core::checksum::crc32c(b)));
                let _ = ptx.send(seq);
                Ok(())
            },
            move |_, n, t| {
                s3.lock().unwrap().end = Some((n, t.to_vec()));
                Ok(())
            },
        );
        let seen = seen.lock().unwrap().clone();
        let _ = match r {
            Ok(s) => dtx.send((Ok(s.delivered.clone()), seen, Some(s))),
            Err(e) => dtx.send((Err(e), seen, None)),
        };
    });
    SubHandle { progress, done }
}

impl SubHandle {
    /// Wait (bounded) until chunk `seq` was delivered.
    pub fn wait_chunk(&self, seq: u32) {
        loop {
            let s = self
                .progress
                .recv_timeout(Duration::from_secs(30))
                .expect("chunk progress in time");
            if s >= seq {
                return;
            }
        }
    }
    pub fn finish(
        self,
    ) -> (
        dcr_core::error::Result<Delivered>,
        Seen,
        Option<Subscription>,
    ) {
        self.done
            .recv_timeout(Duration::from_secs(90))
            .expect("subscriber finishes in time")
    }
}
