//! Relay throughput on loopback: publisher → root → mid relay → N subscribers,
//! in-process. Prints a table and writes `bench-out/relay_throughput.json` at the workspace root.
//! Run: `cargo bench -j1 -p dcr-core --bench relay_throughput [-- TOTAL_MIB]`.

use std::time::{Duration, Instant};

use dcr_core::net::{
    publish_stream, subscribe, PublishConfig, Relay, RelayConfig, SubscribeConfig,
};
use dcr_core::relay::{PreSharedKey, StoreConfig};

fn start(rt: &tokio::runtime::Runtime, cfg: RelayConfig) -> String {
    let l = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let r = Relay::new(cfg).unwrap();
    rt.spawn(r.run(l, std::future::pending::<()>()));
    addr
}

fn main() {
    let total_mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(256);
    let key = PreSharedKey::new(b"bench-key-0123456789abcdef").unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut rows = vec![];
    for (chunk_kib, subs) in [(64usize, 1usize), (1024, 1), (4096, 1), (1024, 4)] {
        let store = StoreConfig {
            retention_bytes: 64 << 20,
            keep_versions: 1,
        };
        let root = start(
            &rt,
            RelayConfig {
                key: Some(key.clone()),
                store: store.clone(),
                ..Default::default()
            },
        );
        let mid = start(
            &rt,
            RelayConfig {
                key: Some(key.clone()),
                parents: vec![root.clone()],
                store,
                ..Default::default()
            },
        );
        let n = (total_mib * 1024 / chunk_kib) as u32;
        let blob = vec![0x5au8; chunk_kib * 1024];
        let handles: Vec<_> = (0..subs)
            .map(|i| {
                let mut c = SubscribeConfig::new([mid.clone(), root.clone()]);
                c.key = Some(key.clone());
                c.node_id = format!("bench-{i}");
                c.timeout = Some(Duration::from_secs(600));
                std::thread::spawn(move || {
                    let mut bytes = 0usize;
                    subscribe(
                        c,
                        |_, _| Ok(()),
                        |_, _, b| {
                            bytes += b.len();
                            Ok(())
                        },
                        |_, _, _| Ok(()),
                    )
                    .unwrap();
                    Instant::now()
                })
            })
            .collect();
        let mut pc = PublishConfig::new(root.clone());
        pc.key = Some(key.clone());
        let t0 = Instant::now();
        let b2 = blob.clone();
        publish_stream(
            pc,
            1,
            vec![0u8; 16],
            (0..n).map(move |_| b2.clone()),
            Vec::new(),
            0,
            Duration::ZERO,
        )
        .unwrap();
        let end = handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .max()
            .unwrap();
        let secs = (end - t0).as_secs_f64();
        let mib_s = total_mib as f64 / secs;
        rows.push((chunk_kib, subs, n, secs, mib_s));
    }
    println!(
        "{:>10} {:>5} {:>7} {:>9} {:>12}",
        "chunk_KiB", "subs", "chunks", "seconds", "MiB/s/sub"
    );
    for (c, s, n, t, r) in &rows {
        println!("{c:>10} {s:>5} {n:>7} {t:>9.3} {r:>12.1}");
    }
    let json: Vec<String> = rows
        .iter()
        .map(|(c, s, n, t, r)| format!("{{\"chunk_kib\":{c},\"subscribers\":{s},\"chunks\":{n},\"seconds\":{t:.4},\"mib_per_s_per_subscriber\":{r:.1}}}"))
        .collect();
    // The workspace's bench-out/ (ignored by git), whatever the working directory.
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench-out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(
        out.join("relay_throughput.json"),
        format!(
            "{{\"total_mib\":{total_mib},\"rows\":[{}]}}\n",
            json.join(",")
        ),
    )
    .unwrap();
}
