//! `dcr-relay`: one node of a dcr relay tree (clap + tracing + `run`).
//! The binary (`main.rs`) and the Python package's `dcr-relay` command both
//! call [`main_with_args`].

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use dcr_core::net::{self, ClientTls, RelayConfig, ServerTls};
use dcr_core::relay::{PreSharedKey, StoreConfig};
use tracing::info;

/// Relay of a dcr refit stream: receives chunks from a publisher (root) or a
/// parent relay and forwards each to its children as it arrives.
#[derive(Debug, Parser)]
#[command(name = "dcr-relay", version)]
struct Cli {
    /// Address to listen on (HOST:PORT; port 0 picks one, printed as `LISTENING addr`).
    #[arg(long)]
    listen: String,
    /// Parent relay (HOST:PORT), repeatable, in failover order. Without any, this relay is a root and accepts a publisher.
    #[arg(long = "parent")]
    parents: Vec<String>,
    /// File holding the pre-shared key (at least 16 bytes); every peer must prove it.
    #[arg(long)]
    key_file: Option<PathBuf>,
    /// TLS certificate chain (PEM) of this relay's listener.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM) of this relay's listener.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (mutual TLS).
    #[arg(long, requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Connect to parents over TLS, trusting this CA; --tls-cert/--tls-key are presented as client certificate.
    #[arg(long)]
    parent_tls_ca: Option<PathBuf>,
    /// Name to verify in the parents' certificates (default: the host of each --parent).
    #[arg(long)]
    parent_tls_name: Option<String>,
    /// Chunk bytes retained in memory (suffixes K, M, G); beyond, chunks spill to --spill-dir or are evicted.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    retention_bytes: u64,
    /// Versions retained.
    #[arg(long, default_value_t = 2)]
    keep_versions: usize,
    /// Directory for chunks beyond --retention-bytes.
    #[arg(long)]
    spill_dir: Option<PathBuf>,
    /// Per-child rate limit in bytes per second (suffixes K, M, G).
    #[arg(long, value_parser = parse_size)]
    rate_limit: Option<u64>,
    /// Serve Prometheus metrics over plain HTTP on HOST:PORT.
    #[arg(long)]
    metrics: Option<String>,
    /// Connection cap.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Largest frame accepted (suffixes K, M, G).
    #[arg(long, default_value = "32M", value_parser = parse_size)]
    max_frame: u64,
    /// Node id in logs and handshakes (default: relay-<pid>-<random>).
    #[arg(long)]
    node_id: Option<String>,
    /// Heartbeat to idle children, milliseconds.
    #[arg(long, default_value_t = 2000)]
    heartbeat_ms: u64,
    /// Without --spill-dir: how long upstream reading may pause for a child that lags by the
    /// whole retention window before its chunks are evicted anyway (it then resumes elsewhere).
    #[arg(long, default_value_t = 30_000)]
    stall_timeout_ms: u64,
    /// Drop a child that does not take a whole message within this many milliseconds
    /// (plus 1 µs per byte of the message).
    #[arg(long, default_value_t = 60_000)]
    write_timeout_ms: u64,
    /// Abandon a silent parent after this many milliseconds.
    #[arg(long, default_value_t = 10_000)]
    idle_timeout_ms: u64,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| {
            format!("expected a byte count such as 1048576, 512K, 64M or 2G, found {s:?}")
        })
}

fn config(cli: &Cli) -> dcr_core::error::Result<RelayConfig> {
    let key = cli
        .key_file
        .as_ref()
        .map(PreSharedKey::from_file)
        .transpose()?;
    let tls = match (&cli.tls_cert, &cli.tls_key) {
        (Some(c), Some(k)) => Some(ServerTls::from_pem_files(
            c,
            k,
            cli.tls_client_ca.as_deref(),
        )?),
        _ => None,
    };
    let parent_tls = match &cli.parent_tls_ca {
        Some(ca) => {
            let cert = cli.tls_cert.as_deref().zip(cli.tls_key.as_deref());
            let t = ClientTls::from_pem_files(ca, cert)?;
            Some(match &cli.parent_tls_name {
                Some(n) => t.with_server_name(n.clone()),
                None => t,
            })
        }
        None => None,
    };
    if key.is_none() {
        tracing::warn!("no --key-file: peers are not authenticated");
    }
    Ok(RelayConfig {
        node_id: cli
            .node_id
            .clone()
            .unwrap_or_else(|| net::default_node_id("relay")),
        key,
        tls,
        parents: cli.parents.clone(),
        parent_tls,
        store: StoreConfig {
            retention_bytes: cli.retention_bytes as usize,
            keep_versions: cli.keep_versions.max(1),
        },
        spill_dir: cli.spill_dir.clone(),
        rate_limit: cli.rate_limit,
        max_connections: cli.max_connections,
        max_frame: cli.max_frame as usize,
        heartbeat: Duration::from_millis(cli.heartbeat_ms.max(10)),
        idle_timeout: Duration::from_millis(cli.idle_timeout_ms.max(100)),
        stall_timeout: Duration::from_millis(cli.stall_timeout_ms),
        write_timeout: Duration::from_millis(cli.write_timeout_ms.max(100)),
        ..RelayConfig::default()
    })
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

/// Run `dcr-relay` with these command-line arguments (the first is the
/// program name) until SIGINT/SIGTERM; returns the process exit code. Used
/// by the standalone binary and by the Python package's `dcr-relay` command.
pub fn main_with_args(args: impl IntoIterator<Item = String>) -> i32 {
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("dcr-relay: cannot start the async runtime: {e}");
            return 1;
        }
    };
    match runtime.block_on(real_main(cli)) {
        Ok(()) => 0,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("dcr-relay: {e}");
            1
        }
    }
}

async fn real_main(cli: Cli) -> dcr_core::error::Result<()> {
    let cfg = config(&cli)?;
    let listener = tokio::net::TcpListener::bind(&cli.listen)
        .await
        .map_err(|e| dcr_core::error::Error::net_io(format!("binding --listen {}", cli.listen), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| dcr_core::error::Error::net_io("reading the bound address", e))?;
    let relay = net::Relay::new(cfg)?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    if let Some(m) = &cli.metrics {
        let ml = tokio::net::TcpListener::bind(m)
            .await
            .map_err(|e| dcr_core::error::Error::net_io(format!("binding --metrics {m}"), e))?;
        let maddr = ml
            .local_addr()
            .map_err(|e| dcr_core::error::Error::net_io("reading the metrics address", e))?;
        println!("METRICS {maddr}");
        info!(addr = %maddr, "serving metrics");
        let r = relay.clone();
        let mut rx = stop_rx.clone();
        tokio::spawn(net::serve_metrics(
            ml,
            relay.metrics(),
            move || r.refresh_metrics(),
            async move {
                let _ = rx.wait_for(|s| *s).await;
            },
        ));
    }
    println!("LISTENING {addr}");
    let _ = std::io::stdout().flush();
    let r = relay
        .run(listener, async {
            shutdown_signal().await;
        })
        .await;
    let _ = stop_tx.send(true);
    r
}
