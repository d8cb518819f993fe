//! Multi-process tests: `dcr-relay` binaries on loopback, in-process
//! publishers and subscribers. Every wait is bounded; processes are killed
//! when a test ends.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::Duration;

use dcr_core::error::Error;
use dcr_core::net::{
    self, BlockingPublisher, Delivered, PublishConfig, SubscribeConfig, Subscription,
};
use dcr_core::relay::PreSharedKey;

const KEY: &[u8] = b"process-test-key-0123456789abcdef";

struct Relay {
    child: Child,
    addr: String,
    metrics: Option<String>,
    log: PathBuf,
}

impl Relay {
    fn start(dir: &Path, name: &str, key_file: &Path, parents: &[&str], extra: &[&str]) -> Relay {
        let log = dir.join(format!("{name}.log"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dcr-relay"));
        cmd.args([
            "--listen",
            "127.0.0.1:0",
            "--node-id",
            name,
            "--heartbeat-ms",
            "300",
            "--idle-timeout-ms",
            "3000",
        ])
        .arg("--key-file")
        .arg(key_file);
        for p in parents {
            cmd.args(["--parent", p]);
        }
        cmd.args(extra);
        cmd.stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .env("RUST_LOG", "info");
        let mut child = cmd.spawn().expect("spawn dcr-relay");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut metrics = None;
        loop {
            let Ok(line) = rx.recv_timeout(Duration::from_secs(30)) else {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{name} did not start: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            };
            if let Some(a) = line.strip_prefix("METRICS ") {
                metrics = Some(a.to_string());
            }
            if let Some(a) = line.strip_prefix("LISTENING ") {
                return Relay {
                    child,
                    addr: a.to_string(),
                    metrics,
                    log,
                };
            }
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.kill();
    }
}

fn setup() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, [KEY, b"\n"].concat()).unwrap();
    (dir, key)
}

fn key() -> Option<PreSharedKey> {
    Some(PreSharedKey::new(KEY).unwrap())
}

fn pub_cfg(addr: &str) -> PublishConfig {
    let mut c = PublishConfig::new(addr);
    c.key = key();
    c
}

fn sub_cfg(name: &str, parents: &[&str]) -> SubscribeConfig {
    let mut c = SubscribeConfig::new(parents.iter().copied());
    c.key = key();
    c.node_id = name.into();
    c.timeout = Some(Duration::from_secs(60));
    c.idle_timeout = Duration::from_secs(3);
    c
}

fn chunk(i: u32, len: usize) -> Vec<u8> {
    let mut x = (u64::from(i) + 7).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn len_of(i: u32) -> usize {
    2000 + (i as usize * 7919) % 30_000
}

type Seen = (Vec<u8>, Vec<(u32, u32)>, Option<(u32, Vec<u8>)>);

fn expected(n: u32, header: &[u8], trailer: &[u8]) -> Seen {
    (
        header.to_vec(),
        (0..n)
            .map(|i| (i, dcr_core::checksum::crc32c(&chunk(i, len_of(i)))))
            .collect(),
        Some((n, trailer.to_vec())),
    )
}

struct Sub {
    progress: mpsc::Receiver<u32>,
    done: mpsc::Receiver<(Result<Delivered, Error>, Seen, Option<Subscription>)>,
}

fn spawn_sub(cfg: SubscribeConfig, gate: Option<Arc<dyn Fn(u32) + Send + Sync>>) -> Sub {
    let (ptx, progress) = mpsc::channel();
    let (dtx, done) = mpsc::channel();
    thread::spawn(move || {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (a, b, c) = (seen.clone(), seen.clone(), seen.clone());
        let r = net::subscribe(
            cfg,
            move |_, h| {
                a.lock().unwrap().0 = h.to_vec();
                Ok(())
            },
            move |_, seq, blob| {
                if let Some(g) = &gate {
                    g(seq);
                }
                b.lock().unwrap().1.push((seq, dcr_core::checksum::crc32c(blob)));
                let _ = ptx.send(seq);
                Ok(())
            },
            move |_, n, t| {
                c.lock().unwrap().2 = Some((n, t.to_vec()));
                Ok(())
            },
        );
        let seen = seen.lock().unwrap().clone();
        let _ = match r {
            Ok(s) => dtx.send((Ok(s.delivered.clone()), seen, Some(s))),
            Err(e) => dtx.send((Err(e), seen, None)),
        };
    });
    Sub { progress, done }
}

impl Sub {
    fn wait_chunk(&self, seq: u32) {
        loop {
            if self
                .progress
                .recv_timeout(Duration::from_secs(30))
                .expect("progress in time")
                >= seq
            {
                return;
            }
        }
    }
    fn finish(self) -> (Result<Delivered, Error>, Seen, Option<Subscription>) {
        self.done
            .recv_timeout(Duration::from_secs(90))
            .expect("subscriber finishes in time")
    }
}

#[test]
fn publisher_two_level_tree_six_subscribers_with_acks() {
    let (dir, key_file) = setup();
    let root = Relay::start(
        dir.path(),
        "root",
        &key_file,
        &[],
        &["--metrics", "127.0.0.1:0"],
    );
    let a = Relay::start(dir.path(), "a", &key_file, &[&root.addr], &[]);
    let b = Relay::start(dir.path(), "b", &key_file, &[&root.addr], &[]);
    let subs: Vec<_> = (0..6)
        .map(|i| {
            let mid = if i < 3 { &a.addr } else { &b.addr };
            spawn_sub(sub_cfg(&format!("rollout-{i}"), &[mid, &root.addr]), None)
        })
        .collect();
    let n = 50u32;
    let header = b"0123456789abcdef delta v10".to_vec();
    let mut p = BlockingPublisher::connect(pub_cfg(&root.addr), 10, header.clone()).unwrap();
    for i in 0..n {
        p.send(chunk(i, len_of(i))).unwrap();
    }
    p.finish(&b"trailer"[..]).unwrap();
    let want = expected(n, &header, b"trailer");
    for (i, s) in subs.into_iter().enumerate() {
        let (r, seen, sub) = s.finish();
        r.unwrap_or_else(|e| panic!("sub {i}: {e}"));
        assert_eq!(seen, want, "sub {i}");
        sub.unwrap()
            .ack([9; 16], true, "", Duration::from_secs(10))
            .unwrap();
    }
    let acks = p.wait_acks(6, Duration::from_secs(30)).unwrap();
    assert!(acks.all_committed(), "{acks:?}");
    let mut ids: Vec<_> = acks.committed.iter().map(|a| a.node_id.clone()).collect();
    ids.sort();
    assert_eq!(
        ids,
        (0..6).map(|i| format!("rollout-{i}")).collect::<Vec<_>>()
    );
    // Metrics over plain HTTP.
    let mut s = std::net::TcpStream::connect(root.metrics.as_ref().unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
    assert!(body.contains("dcr_relay_children 2"), "{body}");
    assert!(body.contains("dcr_relay_acks_total 6"), "{body}");
    assert!(body.contains("dcr_relay_latest_version 10"), "{body}");
    let out: u64 = body
        .lines()
        .find_map(|l| l.strip_prefix("dcr_relay_bytes_out_total "))
        .unwrap()
        .parse()
        .unwrap();
    let total: u64 = (0..n).map(|i| len_of(i) as u64).sum();
    assert!(out >= 2 * total, "{out} < 2 x {total}");
}

#[test]
fn relay_killed_mid_stream_children_fail_over_and_complete() {
    let (dir, key_file) = setup();
    let root = Relay::start(dir.path(), "root", &key_file, &[], &[]);
    let mut a = Relay::start(dir.path(), "a", &key_file, &[&root.addr], &[]);
    let b = Relay::start(dir.path(), "b", &key_file, &[&root.addr], &[]);
    let subs: Vec<_> = (0..6)
        .map(|i| {
            let p: Vec<&str> = if i < 3 {
                vec![&a.addr, &b.addr, &root.addr]
            } else {
                vec![&b.addr, &root.addr]
            };
            spawn_sub(sub_cfg(&format!("s{i}"), &p), None)
        })
        .collect();
    let n = 40u32;
    let header = b"0123456789abcdef".to_vec();
    let mut p = BlockingPublisher::connect(pub_cfg(&root.addr), 1, header.clone()).unwrap();
    for i in 0..20 {
        p.send(chunk(i, len_of(i))).unwrap();
    }
    for s in &subs {
        s.wait_chunk(19);
    }
    a.kill(); // SIGKILL: no goodbye to its children
    for i in 20..n {
        p.send(chunk(i, len_of(i))).unwrap();
    }
    p.finish(Vec::new()).unwrap();
    let want = expected(n, &header, b"");
    for (i, s) in subs.into_iter().enumerate() {
        let (r, seen, _) = s.finish();
        let d = r.unwrap_or_else(|e| panic!("sub {i}: {e}"));
        assert_eq!(seen, want, "sub {i}");
        if i < 3 {
            assert!(d.failovers >= 1);
            assert_eq!(d.parent, b.addr, "sub {i} re-attached to the next parent");
        }
    }
    assert!(b.log().contains("child resumes"), "{}", b.log());
}

#[test]
fn slow_subscriber_does_not_stall_siblings() {
    let (dir, key_file) = setup();
    let root = Relay::start(dir.path(), "root", &key_file, &[], &[]);
    let spill = dir.path().join("spill");
    let mid = Relay::start(
        dir.path(),
        "mid",
        &key_file,
        &[&root.addr],
        &[
            "--retention-bytes",
            "64K",
            "--spill-dir",
            spill.to_str().unwrap(),
        ],
    );
    let release = Arc::new((Mutex::new(false), Condvar::new()));
    let r2 = release.clone();
    let gate: Arc<dyn Fn(u32) + Send + Sync> = Arc::new(move |seq| {
        if seq == 2 {
            let (m, c) = &*r2;
            let g = m.lock().unwrap();
            let (g, _) = c
                .wait_timeout_while(g, Duration::from_secs(60), |r| !*r)
                .unwrap();
            assert!(*g, "released in time");
        }
    });
    let mut sc = sub_cfg("slow", &[&mid.addr]);
    sc.idle_timeout = Duration::from_secs(120); // its own callback holds it, not the parent
    let slow = spawn_sub(sc, Some(gate));
    let fast: Vec<_> = (0..3)
        .map(|i| spawn_sub(sub_cfg(&format!("fast{i}"), &[&mid.addr]), None))
        .collect();
    let n = 80u32;
    let header = b"0123456789abcdef".to_vec();
    let (h2, raddr) = (header.clone(), root.addr.clone());
    let publisher = thread::spawn(move || {
        net::publish_stream(
            pub_cfg(&raddr),
            5,
            h2,
            (0..n).map(|i| chunk(i, len_of(i))),
            Vec::new(),
            0,
            Duration::ZERO,
        )
    });
    let want = expected(n, &header, b"");
    for f in fast {
        let (r, seen, _) = f.finish();
        r.unwrap();
        assert_eq!(seen, want);
    }
    assert_eq!(
        slow.progress.try_iter().max(),
        Some(1),
        "the slow one is still held at chunk 2"
    );
    *release.0.lock().unwrap() = true;
    release.1.notify_all();
    let (r, seen, _) = slow.finish();
    r.unwrap();
    assert_eq!(
        seen, want,
        "the slow one then gets everything (from the spilled retention window)"
    );
    publisher.join().unwrap().unwrap();
}

#[test]
fn wrong_key_refused_and_logged() {
    let (dir, key_file) = setup();
    let root = Relay::start(dir.path(), "root", &key_file, &[], &[]);
    let mut c = sub_cfg("intruder", &[&root.addr]);
    c.key = Some(PreSharedKey::new(b"a-different-key-0123456789").unwrap());
    c.max_rounds = 1;
    let (r, seen, _) = spawn_sub(c, None).finish();
    let Err(Error::AllParentsFailed { last, .. }) = r else {
        panic!("{r:?}")
    };
    assert!(matches!(*last, Error::AuthRefused { .. }), "{last}");
    assert_eq!(seen, Seen::default());
    let mut pc = pub_cfg(&root.addr);
    pc.key = None;
    let e = BlockingPublisher::connect(pc, 1, &b"0123456789abcdef"[..])
        .err()
        .expect("refused");
    assert!(
        matches!(e, Error::AuthRefused { side: "parent", .. }),
        "{e}"
    );
    // A refusal by the root is logged before it is sent.
    assert!(
        root.log().contains("presented no pre-shared key"),
        "{}",
        root.log()
    );
    // A relay child with the wrong key file refuses the root (the root proves
    // first) and tells it why, as the intruder did. Those refusals travel
    // root-wards with no reply, so poll the logs with a deadline.
    let bad_key = dir.path().join("bad-key");
    std::fs::write(&bad_key, b"another-key-for-the-child-relay").unwrap();
    let mut child = Relay::start(dir.path(), "child", &bad_key, &[&root.addr], &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !(child.log().contains("authentication refused")
        && root.log().matches("client refused this relay").count() >= 2)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "refusals not logged:\n{}\n{}",
            root.log(),
            child.log()
        );
        thread::sleep(Duration::from_millis(20));
    }
    child.kill();
}

/// A TCP proxy that flips one byte of the first connection's relay→client stream,
/// standing in for a relay that corrupts data.
fn corrupting_proxy(target: String, flip_at: usize) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    thread::spawn(move || {
        let Ok((mut down, _)) = l.accept() else {
            return;
        };
        let mut up = std::net::TcpStream::connect(&target).unwrap();
        up.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        down.set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let (mut d2, mut u2) = (down.try_clone().unwrap(), up.try_clone().unwrap());
        thread::spawn(move || {
            let mut b = [0u8; 8192];
            while let Ok(n) = d2.read(&mut b) {
                if n == 0 || u2.write_all(&b[..n]).is_err() {
                    break;
                }
            }
        });
        let mut b = [0u8; 8192];
        let mut off = 0;
        while let Ok(n) = up.read(&mut b) {
            if n == 0 {
                break;
            }
            if (off..off + n).contains(&flip_at) {
                b[flip_at - off] ^= 0x80;
            }
            off += n;
            if down.write_all(&b[..n]).is_err() {
                break;
            }
        }
        let _ = down.shutdown(std::net::Shutdown::Both);
    });
    addr
}

#[test]
fn corrupting_relay_detected_and_data_refetched_from_another_parent() {
    let (dir, key_file) = setup();
    let root = Relay::start(dir.path(), "root", &key_file, &[], &[]);
    let mid = Relay::start(dir.path(), "mid", &key_file, &[&root.addr], &[]);
    let n = 30u32;
    let sizes = 10_000usize;
    let rep = net::publish_stream(
        pub_cfg(&root.addr),
        3,
        &b"0123456789abcdef"[..],
        (0..n).map(|i| chunk(i, sizes)),
        Vec::new(),
        0,
        Duration::ZERO,
    )
    .unwrap();
    assert_eq!(rep.chunks, n);
    let bad = corrupting_proxy(mid.addr.clone(), 123_456);
    let mut c = sub_cfg("s", &[&bad, &root.addr]);
    c.from_version = 3;
    let (r, seen, _) = spawn_sub(c, None).finish();
    let d = r.unwrap();
    assert_eq!(d.failovers, 1);
    assert_eq!(d.parent, root.addr);
    assert_eq!(
        seen.1,
        (0..n)
            .map(|i| (i, dcr_core::checksum::crc32c(&chunk(i, sizes))))
            .collect::<Vec<_>>()
    );
}

#[test]
fn rate_limited_dense_stream_with_spill() {
    let (dir, key_file) = setup();
    let spill = dir.path().join("spill");
    let root = Relay::start(
        dir.path(),
        "root",
        &key_file,
        &[],
        &[
            "--retention-bytes",
            "8M",
            "--spill-dir",
            spill.to_str().unwrap(),
            "--rate-limit",
            "256M",
        ],
    );
    let n = 6u32;
    let big = |i: u32| chunk(i, 4 << 20);
    let s = spawn_sub(sub_cfg("dense", &[&root.addr]), None);
    let raddr = root.addr.clone();
    let publisher = thread::spawn(move || {
        net::publish_stream(
            pub_cfg(&raddr),
            1,
            &b"0123456789abcdef"[..],
            (0..n).map(big),
            Vec::new(),
            1,
            Duration::from_secs(60),
        )
    });
    let (r, seen, sub) = s.finish();
    r.unwrap();
    assert_eq!(
        seen.1,
        (0..n)
            .map(|i| (i, dcr_core::checksum::crc32c(&big(i))))
            .collect::<Vec<_>>()
    );
    sub.unwrap()
        .ack([0; 16], true, "", Duration::from_secs(10))
        .unwrap();
    let rep = publisher.join().unwrap().unwrap();
    assert!(rep.acks.all_committed());
}

#[test]
fn mutual_tls_tree_of_processes() {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let (dir, key_file) = setup();
    let d = dir.path();
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_p = CertificateParams::new(vec![]).unwrap();
    ca_p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_p.self_signed(&ca_key).unwrap();
    // One certificate for every node (a server and client certificate for 127.0.0.1).
    let node_key = KeyPair::generate().unwrap();
    let node = CertificateParams::new(vec!["127.0.0.1".into()])
        .unwrap()
        .signed_by(&node_key, &ca, &ca_key)
        .unwrap();
    for (n, s) in [
        ("ca.pem", ca.pem()),
        ("node.pem", node.pem()),
        ("node.key", node_key.serialize_pem()),
    ] {
        std::fs::write(d.join(n), s).unwrap();
    }
    let p = |n: &str| d.join(n).to_str().unwrap().to_string();
    let tls = [p("node.pem"), p("node.key"), p("ca.pem")];
    let server = [
        "--tls-cert",
        &tls[0],
        "--tls-key",
        &tls[1],
        "--tls-client-ca",
        &tls[2],
    ];
    let root = Relay::start(d, "root", &key_file, &[], &server);
    let mut mid_args = server.to_vec();
    mid_args.extend(["--parent-tls-ca", &tls[2]]);
    let mid = Relay::start(d, "mid", &key_file, &[&root.addr], &mid_args);
    let ctls = net::ClientTls::from_pem_files(
        &d.join("ca.pem"),
        Some((&d.join("node.pem"), &d.join("node.key"))),
    )
    .unwrap();
    let mut sc = sub_cfg("tls-sub", &[&mid.addr]);
    sc.tls = Some(ctls.clone());
    let s = spawn_sub(sc, None);
    let mut pc = pub_cfg(&root.addr);
    pc.tls = Some(ctls);
    let n = 10;
    net::publish_stream(
        pc,
        1,
        &b"0123456789abcdef"[..],
        (0..n).map(|i| chunk(i, len_of(i))),
        Vec::new(),
        0,
        Duration::ZERO,
    )
    .unwrap();
    let (r, seen, _) = s.finish();
    r.unwrap();
    assert_eq!(seen, expected(n, b"0123456789abcdef", b""));
    // Plain TCP to a TLS relay goes nowhere.
    let mut plain = sub_cfg("plain", &[&root.addr]);
    plain.max_rounds = 1;
    plain.connect_timeout = Duration::from_secs(5);
    plain.idle_timeout = Duration::from_secs(2);
    let (r, seen, _) = spawn_sub(plain, None).finish();
    assert!(r.is_err());
    assert_eq!(seen, Seen::default());
}

#[test]
fn sigterm_shuts_a_relay_down_gracefully_and_children_move_on() {
    let (dir, key_file) = setup();
    let root = Relay::start(dir.path(), "root", &key_file, &[], &[]);
    let mut mid = Relay::start(dir.path(), "mid", &key_file, &[&root.addr], &[]);
    let s = spawn_sub(sub_cfg("s", &[&mid.addr, &root.addr]), None);
    let header = b"0123456789abcdef".to_vec();
    let mut p = BlockingPublisher::connect(pub_cfg(&root.addr), 1, header.clone()).unwrap();
    for i in 0..10 {
        p.send(chunk(i, len_of(i))).unwrap();
    }
    s.wait_chunk(9);
    let st = Command::new("kill")
        .args(["-TERM", &mid.child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    // Wait for the exit on a helper thread, bounded by a channel timeout.
    let mut child = std::mem::replace(&mut mid.child, Command::new("true").spawn().unwrap());
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("relay exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
    assert!(mid.log().contains("relay shutting down"), "{}", mid.log());
    for i in 10..20 {
        p.send(chunk(i, len_of(i))).unwrap();
    }
    p.finish(Vec::new()).unwrap();
    let (r, seen, _) = s.finish();
    let d = r.unwrap();
    assert_eq!(seen, expected(20, &header, b""));
    assert_eq!(d.parent, root.addr);
}
