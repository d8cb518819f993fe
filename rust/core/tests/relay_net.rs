//! In-process relay trees over loopback TCP: publisher → relays → subscribers.

mod relay_common;

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use dcr_core::error::Error;
use dcr_core::net::{
    publish_stream, BlockingPublisher, ClientTls, PublishConfig, RelayConfig, ServerTls,
};
use dcr_core::relay::PreSharedKey;
use relay_common::*;

fn pub_cfg(addr: &str) -> PublishConfig {
    let mut c = PublishConfig::new(addr);
    c.key = key();
    c
}

#[test]
fn two_level_tree_delivers_every_blob_once_in_order_and_collects_acks() {
    let root = TestRelay::start(relay_cfg("root", &[]));
    let a = TestRelay::start(relay_cfg("a", &[&root.addr]));
    let b = TestRelay::start(relay_cfg("b", &[&root.addr]));
    let subs: Vec<_> = (0..6)
        .map(|i| {
            let mid = if i % 2 == 0 { &a.addr } else { &b.addr };
            spawn_sub(sub_cfg(&format!("sub-{i}"), &[mid, &root.addr]), None)
        })
        .collect();
    let n = 40u32;
    let header = b"0123456789abcdef: delta 1->2".to_vec();
    let mut p = BlockingPublisher::connect(pub_cfg(&root.addr), 2, header.clone()).unwrap();
    for i in 0..n {
        assert_eq!(p.send(chunk(i, chunk_len(i))).unwrap(), i);
    }
    assert_eq!(p.finish(&b"trailer"[..]).unwrap(), n);
    let want = expected(n, &header, b"trailer");
    for (i, s) in subs.into_iter().enumerate() {
        let (r, seen, sub) = s.finish();
        let d = r.unwrap();
        assert_eq!(seen, want, "sub {i}");
        assert_eq!((d.version, d.count), (2, n));
        assert_eq!(&d.delta_id.unwrap(), b"0123456789abcdef");
        let ok = i != 5;
        sub.unwrap()
            .ack(
                [i as u8; 16],
                ok,
                if ok { "" } else { "digest mismatch on layer 3" },
                Duration::from_secs(10),
            )
            .unwrap();
    }
    let acks = p.wait_acks(6, Duration::from_secs(30)).unwrap();
    assert!(acks.complete, "{acks:?}");
    assert_eq!(acks.committed.len(), 5);
    assert_eq!(acks.failed.len(), 1);
    assert_eq!(acks.failed[0].node_id, "sub-5");
    assert_eq!(acks.failed[0].reason, "digest mismatch on layer 3");
    assert!(!acks.all_committed());
    assert_eq!(
        root.metrics.acks.load(std::sync::atomic::Ordering::Relaxed),
        6
    );
}

#[test]
fn relay_shutdown_mid_stream_children_fail_over_and_complete() {
    let root = TestRelay::start(relay_cfg("root", &[]));
    let mut a = TestRelay::start(relay_cfg("a", &[&root.addr]));
    let b = TestRelay::start(relay_cfg("b", &[&root.addr]));
    let subs: Vec<_> = (0..4)
        .map(|i| {
            let (first, second) = if i < 2 {
                (&a.addr, &b.addr)
            } else {
                (&b.addr, &root.addr)
            };
            spawn_sub(
                sub_cfg(&format!("sub-{i}"), &[first, second, &root.addr]),
                None,
            )
        })
        .collect();
    let n = 30u32;
    let mut p =
        BlockingPublisher::connect(pub_cfg(&root.addr), 7, &b"0123456789abcdefH"[..]).unwrap();
    for i in 0..15 {
        p.send(chunk(i, chunk_len(i))).unwrap();
    }
    for s in &subs {
        s.wait_chunk(14);
    }
    a.stop(); // children of `a` are cut off mid-stream
    for i in 15..n {
        p.send(chunk(i, chunk_len(i))).unwrap();
    }
    p.finish(Vec::new()).unwrap();
    let want = expected(n, b"0123456789abcdefH", b"");
    for (i, s) in subs.into_iter().enumerate() {
        let (r, seen, _) = s.finish();
        let d = r.unwrap();
        assert_eq!(seen, want, "sub {i}");
        if i < 2 {
            assert!(d.failovers >= 1, "sub {i} failed over");
            assert_ne!(d.parent, a.addr);
        }
    }
    b.relay.refresh_metrics();
    assert!(b.metrics.resumes.load(std::sync::atomic::Ordering::Relaxed) >= 2);
}

#[test]
fn slow_subscriber_does_not_stall_siblings() {
    let root = TestRelay::start(relay_cfg("root", &[]));
    let n = 60u32;
    // The slow receiver blocks on chunk 1 until the fast ones are done.
    let release = Arc::new((Mutex::new(false), Condvar::new()));
    let r2 = release.clone();
    let gate: Arc<dyn Fn(u32) + Send + Sync> = Arc::new(move |seq| {
        if seq == 1 {
            let (m, c) = &*r2;
            let g = m.lock().unwrap();
            let (g, t) = c
                .wait_timeout_while(g, Duration::from_secs(60), |r| !*r)
                .unwrap();
            assert!(*g && !t.timed_out(), "released in time");
        }
    });
    let slow = spawn_sub(sub_cfg("slow", &[&root.addr]), Some(gate));
    let fast: Vec<_> = (0..3)
        .map(|i| spawn_sub(sub_cfg(&format!("fast-{i}"), &[&root.addr]), None))
        .collect();
    let header = b"0123456789abcdef".to_vec();
    let h2 = header.clone();
    let raddr = root.addr.clone();
    let publisher = std::thread::spawn(move || {
        publish_stream(
            pub_cfg(&raddr),
            1,
            h2,
            (0..n).map(|i| chunk(i, chunk_len(i))),
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
    // The fast ones completed while the slow one still sits on chunk 1.
    assert_eq!(slow.progress.try_iter().collect::<Vec<_>>(), vec![0]);
    *release.0.lock().unwrap() = true;
    release.1.notify_all();
    let (r, seen, _) = slow.finish();
    r.unwrap();
    assert_eq!(seen, want);
    publisher.join().unwrap().unwrap();
}

#[test]
fn wrong_or_missing_key_is_refused() {
    let root = TestRelay::start(relay_cfg("root", &[]));
    // A receiver with another key.
    let mut c = sub_cfg("intruder", &[&root.addr]);
    c.key = Some(PreSharedKey::new(b"not-the-right-key-000000").unwrap());
    c.max_rounds = 1;
    let (r, seen, _) = spawn_sub(c, None).finish();
    match r {
        Err(Error::AllParentsFailed { last, .. }) => {
            assert!(matches!(*last, Error::AuthRefused { .. }), "{last}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(seen, Seen::default());
    // A receiver without a key.
    let mut c = sub_cfg("anonymous", &[&root.addr]);
    c.key = None;
    c.max_rounds = 1;
    let (r, _, _) = spawn_sub(c, None).finish();
    match r {
        Err(Error::AllParentsFailed { last, .. }) => match *last {
            Error::AuthRefused { side, reason } => {
                assert_eq!(side, "parent");
                assert!(reason.contains("no pre-shared key"), "{reason}");
            }
            other => panic!("{other}"),
        },
        other => panic!("{other:?}"),
    }
    // A publisher with a wrong key.
    let mut pc = pub_cfg(&root.addr);
    pc.key = Some(PreSharedKey::new(b"not-the-right-key-000000").unwrap());
    let e = BlockingPublisher::connect(pc, 1, &b"0123456789abcdef"[..])
        .err()
        .expect("refused");
    assert!(matches!(e, Error::AuthRefused { .. }), "{e}");
    assert!(
        root.metrics
            .refusals
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 2
    );
}

#[test]
fn publisher_refused_by_non_root_relay() {
    let root = TestRelay::start(relay_cfg("root", &[]));
    let a = TestRelay::start(relay_cfg("a", &[&root.addr]));
    // The refusal comes right after authentication: at connect, or at the latest on finish.
    let r = BlockingPublisher::connect(pub_cfg(&a.addr), 1, &b"0123456789abcdef"[..]).and_then(
        |mut p| {
            (0..1000).try_for_each(|i| p.send(chunk(i, 100)).map(|_| ()))?;
            p.finish(Vec::new()).map(|_| ())
        },
    );
    let e = r.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote { code: 6, .. } | Error::PeerClosed { .. } | Error::NetIo { .. }
        ),
        "{e}"
    );
}

#[test]
fn dense_frames_of_4_mib_with_spill_and_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = relay_cfg("root", &[]);
    cfg.store.retention_bytes = 8 << 20;
    cfg.spill_dir = Some(dir.path().to_path_buf());
    let root = TestRelay::start(cfg);
    let mid = TestRelay::start(RelayConfig {
        store: dcr_core::relay::StoreConfig {
            retention_bytes: 8 << 20,
            keep_versions: 2,
        },
        ..relay_cfg("mid", &[&root.addr])
    });
    let n = 10u32;
    let big = |i: u32| chunk(i, 4 << 20);
    let subs: Vec<_> = (0..2)
        .map(|i| spawn_sub(sub_cfg(&format!("s{i}"), &[&mid.addr, &root.addr]), None))
        .collect();
    let raddr = root.addr.clone();
    let publisher = std::thread::spawn(move || {
        let mut c = pub_cfg(&raddr);
        c.queue_depth = 2;
        publish_stream(
            c,
            3,
            &b"0123456789abcdef"[..],
            (0..n).map(big),
            Vec::new(),
            2,
            Duration::from_secs(60),
        )
    });
    for s in subs {
        let (r, seen, sub) = s.finish();
        r.unwrap();
        assert_eq!(seen.chunks.len(), n as usize);
        for (i, (seq, crc)) in seen.chunks.iter().enumerate() {
            assert_eq!((*seq, *crc), (i as u32, dcr_core::checksum::crc32c(&big(i as u32))));
        }
        sub.unwrap()
            .ack([1; 16], true, "", Duration::from_secs(10))
            .unwrap();
    }
    let rep = publisher.join().unwrap().unwrap();
    assert_eq!((rep.chunks, rep.bytes), (n, u64::from(n) * (4 << 20)));
    assert!(rep.acks.all_committed(), "{:?}", rep.acks);
    // 40 MiB went through an 8 MiB window: the root spilled, memory stayed bounded.
    root.relay.refresh_metrics();
    mid.relay.refresh_metrics();
    for r in [&root, &mid] {
        let spilled = r
            .metrics
            .spilled_chunks
            .load(std::sync::atomic::Ordering::Relaxed);
        let evicted = r
            .metrics
            .evicted_chunks
            .load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            spilled + evicted >= u64::from(n) - 2,
            "spilled {spilled} evicted {evicted}"
        );
    }
}

#[test]
fn late_subscriber_resumes_from_retention() {
    let root = TestRelay::start(relay_cfg("root", &[]));
    let n = 20u32;
    let rep = publish_stream(
        pub_cfg(&root.addr),
        4,
        &b"0123456789abcdef"[..],
        (0..n).map(|i| chunk(i, chunk_len(i))),
        &b"t"[..],
        0,
        Duration::ZERO,
    )
    .unwrap();
    assert_eq!(rep.chunks, n);
    let mut c = sub_cfg("late", &[&root.addr]);
    c.from_version = 4;
    let (r, seen, _) = spawn_sub(c, None).finish();
    r.unwrap();
    assert_eq!(seen, expected(n, b"0123456789abcdef", b"t"));
}

/// A TCP proxy that flips one byte of the relay→subscriber stream.
fn corrupting_proxy(target: String, flip_at: usize) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        let Ok((mut down, _)) = l.accept() else {
            return;
        };
        let mut up = std::net::TcpStream::connect(&target).unwrap();
        down.set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        up.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let (mut d2, mut u2) = (down.try_clone().unwrap(), up.try_clone().unwrap());
        std::thread::spawn(move || {
            let mut b = [0u8; 8192];
            while let Ok(n) = d2.read(&mut b) {
                if n == 0 || u2.write_all(&b[..n]).is_err() {
                    break;
                }
            }
        });
        let mut b = [0u8; 8192];
        let mut off = 0usize;
        while let Ok(n) = up.read(&mut b) {
            if n == 0 {
                break;
            }
            if flip_at >= off && flip_at < off + n {
                b[flip_at - off] ^= 0x01;
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
fn corrupted_bytes_are_detected_and_refetched_from_another_parent() {
    let root = TestRelay::start(relay_cfg("root", &[]));
    let n = 20u32;
    publish_stream(
        pub_cfg(&root.addr),
        1,
        &b"0123456789abcdef"[..],
        (0..n).map(|i| chunk(i, 10_000)),
        Vec::new(),
        0,
        Duration::ZERO,
    )
    .unwrap();
    // Byte 50_000 of the relay's output lies inside a chunk body (chunks are 10 kB).
    let bad = corrupting_proxy(root.addr.clone(), 50_000);
    let (r, seen, _) = spawn_sub(sub_cfg("s", &[&bad, &root.addr]), None).finish();
    let d = r.unwrap();
    assert_eq!(d.failovers, 1);
    assert_eq!(d.parent, root.addr);
    assert_eq!(seen.chunks.len(), n as usize);
    for (i, (seq, crc)) in seen.chunks.iter().enumerate() {
        assert_eq!(
            (*seq, *crc),
            (i as u32, dcr_core::checksum::crc32c(&chunk(i as u32, 10_000)))
        );
    }
}

fn tls_files(dir: &std::path::Path) -> (std::path::PathBuf, [std::path::PathBuf; 4]) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_p = CertificateParams::new(vec![]).unwrap();
    ca_p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_p.self_signed(&ca_key).unwrap();
    let srv_key = KeyPair::generate().unwrap();
    let srv = CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()])
        .unwrap()
        .signed_by(&srv_key, &ca, &ca_key)
        .unwrap();
    let cli_key = KeyPair::generate().unwrap();
    let cli = CertificateParams::new(vec!["client".into()])
        .unwrap()
        .signed_by(&cli_key, &ca, &ca_key)
        .unwrap();
    let w = |n: &str, s: String| {
        let p = dir.join(n);
        std::fs::write(&p, s).unwrap();
        p
    };
    (
        w("ca.pem", ca.pem()),
        [
            w("srv.pem", srv.pem()),
            w("srv.key", srv_key.serialize_pem()),
            w("cli.pem", cli.pem()),
            w("cli.key", cli_key.serialize_pem()),
        ],
    )
}

#[test]
fn mutual_tls_with_key() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, [srv, srv_key, cli, cli_key]) = tls_files(dir.path());
    let mut cfg = relay_cfg("root", &[]);
    cfg.tls = Some(ServerTls::from_pem_files(&srv, &srv_key, Some(&ca)).unwrap());
    let root = TestRelay::start(cfg);
    let ctls = ClientTls::from_pem_files(&ca, Some((&cli, &cli_key))).unwrap();
    let mut sc = sub_cfg("tls-sub", &[&root.addr]);
    sc.tls = Some(ctls.clone());
    let s = spawn_sub(sc, None);
    // A client without a certificate is refused by mutual TLS.
    let mut nc = sub_cfg("no-cert", &[&root.addr]);
    nc.tls = Some(ClientTls::from_pem_files(&ca, None).unwrap());
    nc.max_rounds = 1;
    let nocert = spawn_sub(nc, None);
    let mut pc = pub_cfg(&root.addr);
    pc.tls = Some(ctls);
    publish_stream(
        pc,
        1,
        &b"0123456789abcdef"[..],
        (0..5).map(|i| chunk(i, chunk_len(i))),
        Vec::new(),
        0,
        Duration::ZERO,
    )
    .unwrap();
    let (r, seen, _) = s.finish();
    r.unwrap();
    assert_eq!(seen, expected(5, b"0123456789abcdef", b""));
    let (r, seen, _) = nocert.finish();
    assert!(r.is_err());
    assert_eq!(seen, Seen::default());
}

#[test]
fn successive_versions_through_a_follower_relay() {
    let root = TestRelay::start(relay_cfg("root", &[]));
    let mid = TestRelay::start(relay_cfg("mid", &[&root.addr]));
    for v in 1..=3u64 {
        let mut c = sub_cfg("s", &[&mid.addr]);
        c.from_version = v;
        let s = spawn_sub(c, None);
        let n = 3 + v as u32;
        publish_stream(
            pub_cfg(&root.addr),
            v,
            vec![v as u8; 16],
            (0..n).map(|i| chunk(i, chunk_len(i))),
            Vec::new(),
            0,
            Duration::ZERO,
        )
        .unwrap();
        let (r, seen, _) = s.finish();
        assert_eq!(r.unwrap().version, v);
        assert_eq!(seen, expected(n, &[v as u8; 16], b""));
    }
}

#[test]
fn one_subscriber_receives_successive_versions_and_acks_each() {
    struct Count(Vec<(u64, u32)>);
    impl dcr_core::net::Receiver for Count {
        fn on_header(&mut self, _: u64, _: &[u8]) -> Result<(), String> {
            Ok(())
        }
        fn on_chunk(&mut self, v: u64, s: u32, _: &[u8]) -> Result<(), String> {
            self.0.push((v, s));
            Ok(())
        }
        fn on_end(&mut self, _: u64, _: u32, _: &[u8]) -> Result<(), String> {
            Ok(())
        }
    }
    let root = TestRelay::start(relay_cfg("root", &[]));
    let addr = root.addr.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let mut sub = dcr_core::net::Subscriber::new(sub_cfg("rollout", &[&addr])).unwrap();
        for v in [1u64, 2] {
            let mut p = dcr_core::net::Publisher::connect(
                pub_cfg(&addr),
                v,
                bytes::Bytes::from(vec![v as u8; 16]),
            )
            .await
            .unwrap();
            for i in 0..3 {
                p.send(chunk(i, 100)).await.unwrap();
            }
            p.finish(Vec::new()).await.unwrap();
            let mut c = Count(vec![]);
            let d = sub.receive(&mut c).await.unwrap();
            assert_eq!(d.version, v);
            assert_eq!(c.0, vec![(v, 0), (v, 1), (v, 2)]);
            sub.ack([v as u8; 16], true, "", Duration::from_secs(10))
                .await
                .unwrap();
            let acks = p.wait_acks(1, Duration::from_secs(10)).await;
            assert!(acks.all_committed(), "{acks:?}");
            assert_eq!(acks.committed[0].digest, [v as u8; 16]);
        }
    });
}

#[test]
fn restarted_receiver_resumes_from_saved_cursor() {
    struct Fail(u32, Vec<u32>);
    impl dcr_core::net::Receiver for Fail {
        fn on_header(&mut self, _: u64, _: &[u8]) -> Result<(), String> {
            Ok(())
        }
        fn on_chunk(&mut self, _: u64, s: u32, _: &[u8]) -> Result<(), String> {
            if s == self.0 {
                return Err("process crashed".into());
            }
            self.1.push(s);
            Ok(())
        }
        fn on_end(&mut self, _: u64, _: u32, _: &[u8]) -> Result<(), String> {
            Ok(())
        }
    }
    let root = TestRelay::start(relay_cfg("root", &[]));
    publish_stream(
        pub_cfg(&root.addr),
        6,
        &b"0123456789abcdef"[..],
        (0..10).map(|i| chunk(i, 500)),
        Vec::new(),
        0,
        Duration::ZERO,
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut first = dcr_core::net::Subscriber::new(sub_cfg("r", &[&root.addr])).unwrap();
        let mut app = Fail(4, vec![]);
        let e = first.receive(&mut app).await.unwrap_err();
        assert!(matches!(e, Error::Callback { .. }), "{e}");
        assert_eq!(app.1, vec![0, 1, 2, 3]);
        // A new process resumes from the saved cursor (or its journal) at 4.
        let cur = first.cursor().clone();
        assert_eq!(
            (cur.version, cur.next_seq),
            (Some(6), 4),
            "the cursor counts only what the application took"
        );
        let mut second =
            dcr_core::net::Subscriber::with_cursor(sub_cfg("r", &[&root.addr]), cur).unwrap();
        let mut app = Fail(u32::MAX, vec![]);
        second.receive(&mut app).await.unwrap();
        assert_eq!(app.1, (4..10).collect::<Vec<_>>());
    });
}

#[test]
fn child_that_stops_reading_is_dropped_and_releases_backpressure() {
    use dcr_core::relay::{ClientConn, ClientSettings, Cursor, Role};
    use std::io::{Read, Write};
    let mut cfg = relay_cfg("root", &[]);
    cfg.store.retention_bytes = 2 << 20; // no spill: a stuck child would pin the window
    cfg.stall_timeout = Duration::from_secs(120); // longer than the test may take
    cfg.write_timeout = Duration::from_millis(300);
    let root = TestRelay::start(cfg);
    // A child that authenticates and subscribes with the sans-IO machine over a
    // plain socket, then never reads again.
    let mut sock = std::net::TcpStream::connect(&root.addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let settings = ClientSettings {
        key: key(),
        node_id: "stuck".into(),
        max_frame: 1 << 20,
        idle_timeout: None,
    };
    let mut conn = ClientConn::receiver(
        &settings,
        Role::Subscriber,
        Cursor::once(0),
        [7; 32],
        std::time::Instant::now(),
    );
    let mut buf = [0u8; 4096];
    while !conn.is_authenticated() {
        while let Some(b) = conn.poll_transmit() {
            sock.write_all(&b).unwrap();
        }
        let n = sock.read(&mut buf).unwrap();
        assert!(n > 0);
        conn.handle_input(&buf[..n], std::time::Instant::now())
            .unwrap();
    }
    while let Some(b) = conn.poll_transmit() {
        sock.write_all(&b).unwrap(); // the Subscribe
    }
    let good = spawn_sub(sub_cfg("good", &[&root.addr]), None);
    // The good child connected before anything is published: the window
    // (2 MiB) moves on once the stuck child is dropped, and a good child
    // that came later (its handshake is slow under emulation) would find
    // chunk 0 gone (`ResumeUnavailable`, seen under qemu in CI).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while root.metrics.children.load(std::sync::atomic::Ordering::Relaxed) < 2 {
        assert!(std::time::Instant::now() < deadline, "the good child connects in time");
        std::thread::sleep(Duration::from_millis(5));
    }
    let n = 40u32; // 40 MiB: far more than the socket buffers and the window
    let big = |i: u32| chunk(i, 1 << 20);
    let raddr = root.addr.clone();
    let publisher = std::thread::spawn(move || {
        publish_stream(
            pub_cfg(&raddr),
            1,
            &b"0123456789abcdef"[..],
            (0..n).map(big),
            Vec::new(),
            0,
            Duration::ZERO,
        )
    });
    let (r, seen, _) = good.finish();
    r.unwrap();
    assert_eq!(seen.chunks.len(), n as usize);
    publisher.join().unwrap().unwrap();
    root.relay.refresh_metrics();
    assert!(
        root.metrics
            .upstream_stalls
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1,
        "the stuck child did hold the window"
    );
    drop(sock);
}

#[test]
fn publisher_survives_a_lost_root_by_replaying_to_a_standby() {
    let mut r0 = TestRelay::start(relay_cfg("root0", &[]));
    let r1 = TestRelay::start(relay_cfg("root1", &[]));
    let mid = TestRelay::start(relay_cfg("mid", &[&r0.addr, &r1.addr]));
    let subs: Vec<_> = (0..3)
        .map(|i| spawn_sub(sub_cfg(&format!("s{i}"), &[&mid.addr]), None))
        .collect();
    let n = 30u32;
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let gate = Arc::new(Mutex::new(Some(go_rx)));
    let mut cfg = pub_cfg(&r0.addr);
    cfg.standby = vec![r1.addr.clone()];
    let publisher = std::thread::spawn(move || {
        dcr_core::net::publish_stream_retry(
            cfg,
            4,
            &b"0123456789abcdef"[..],
            move || {
                // The first attempt is held between chunks 9 and 10 until its root is gone.
                let g = gate.lock().unwrap().take();
                (0..n).map(move |i| {
                    if let (10, Some(g)) = (i, &g) {
                        g.recv_timeout(Duration::from_secs(60)).expect("released");
                    }
                    chunk(i, chunk_len(i))
                })
            },
            Vec::new(),
            3,
            Duration::from_secs(30),
            3,
        )
    });
    for s in &subs {
        s.wait_chunk(9);
    }
    r0.stop();
    go_tx.send(()).unwrap();
    let want = expected(n, b"0123456789abcdef", b"");
    for (i, s) in subs.into_iter().enumerate() {
        let (r, seen, sub) = s.finish();
        r.unwrap();
        assert_eq!(
            seen, want,
            "sub {i}: every chunk once, in order, across the root change"
        );
        sub.unwrap()
            .ack([i as u8; 16], true, "", Duration::from_secs(10))
            .unwrap();
    }
    let rep = publisher.join().unwrap().unwrap();
    assert_eq!(rep.chunks, n);
    assert!(rep.acks.all_committed(), "{:?}", rep.acks);
    use std::sync::atomic::Ordering::Relaxed;
    let total: u64 = (0..n).map(|i| chunk_len(i) as u64).sum();
    assert!(
        r1.metrics.bytes_in.load(Relaxed) >= total,
        "the standby root got the whole replay"
    );
    assert!(
        mid.metrics.upstream_failovers.load(Relaxed) >= 1,
        "mid moved to the standby root"
    );
}
