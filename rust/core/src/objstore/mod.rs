//! Object-storage transport (feature `objstore`; layout in docs/objstore.md).
//!
//! A publisher uploads a delta's header frame and chunk frames as
//! content-addressed objects (name = xxh3-128 of the frame bytes) while the
//! delta is built, a bounded number at a time, and then commits the version
//! with a small manifest written by a conditional put (`PutMode::Create`,
//! If-None-Match: *). A version without a manifest is invisible; a second
//! publisher racing for the same version is refused. Receivers find the
//! version after the one they hold by digest, fetch objects in parallel
//! (even before the manifest exists, from the `streaming/` index), verify
//! every frame's checksum and content hash, apply, and acknowledge.
//!
//! ```text
//! {prefix}/v{N}/manifest.json                         commit point (Create)
//! {prefix}/v{N}/objects/{xxh3-128 hex}                header and chunk frames
//! {prefix}/streaming/v{N}/{delta_id}/{idx:08}-{hash}-{size}   write-ahead index (empty)
//! {prefix}/receivers/{receiver_id}                    registration (JSON)
//! {prefix}/acks/v{N}/{receiver_id}                    acknowledgement (JSON)
//! ```
//!
//! The API is blocking; the I/O runs on a small tokio runtime owned by this
//! module, so callers (the CLI, the Python bindings) need no async code.

mod publish;
mod receive;
#[cfg(test)]
mod tests;

use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub use publish::{publish_delta, publish_diff, PublishOptions, PublishSummary, Publisher};
pub use receive::{gc, receive, GcSummary, ReceiveEvent, ReceiveOptions, ReceiveSummary};

/// Format tag of a manifest; a reader refuses any other.
pub const MANIFEST_FORMAT: &str = "dcr-objstore-manifest/1";
/// Largest manifest read (the trailer's digests dominate: 32 hex chars per tensor).
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;
/// Default number of concurrent uploads or downloads.
pub const DEFAULT_CONCURRENCY: usize = 8;
/// Objects at least this large go up as multipart uploads.
pub const DEFAULT_MULTIPART_BYTES: usize = 8 << 20;
/// Part size of a multipart upload (S3's minimum is 5 MiB, the last part excepted).
pub const DEFAULT_PART_BYTES: usize = 5 << 20;

/// The runtime that runs every request. Two workers: the work is I/O bound,
/// and the caller's thread drives `block_on`.
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("dcr-objstore")
            .enable_all()
            .build()
            .expect("cannot start the object-store I/O runtime")
    })
}

/// TLS for the cloud stores uses rustls with the ring provider; install it
/// as the process default once (a no-op if the application installed one).
fn install_crypto_provider() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// xxh3-128 of an object's bytes as 32 lowercase hex digits: its name.
pub fn object_name(bytes: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(bytes))
}

/// A bucket (or local folder) and a prefix inside it.
#[derive(Clone, Debug)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    root: Path,
    url: String,
}

/// One content-addressed object of a version: a header or chunk frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectEntry {
    pub name: String,
    pub size: u64,
}

/// The commit point of a version (JSON at `v{N}/manifest.json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u64,
    pub delta_id: String,
    pub base_digest: String,
    pub target_digest: String,
    /// Policy versions written in the delta's header (informational).
    pub base_version: u64,
    pub target_version: u64,
    pub chunk_bytes: u32,
    /// Header frame first, then the chunk frames in `seq` order.
    pub objects: Vec<ObjectEntry>,
    /// The trailer frame, hex.
    pub trailer: String,
    /// Size of the delta as a file (preamble + frames + trailer).
    pub delta_bytes: u64,
    pub changed: u64,
    pub published_unix_ms: u64,
}

impl Manifest {
    fn parse(bytes: &[u8], url: &str, version: u64) -> Result<Manifest> {
        let m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| Error::corrupt(format!("manifest of v{version} at {url}"), format!("not a dcr manifest ({e})")))?;
        if m.format != MANIFEST_FORMAT {
            return Err(Error::corrupt(
                format!("manifest of v{version} at {url}"),
                format!("format {:?}, this dcr reads {MANIFEST_FORMAT:?}: upgrade dcr", m.format),
            ));
        }
        if m.version != version || m.objects.is_empty() {
            return Err(Error::corrupt(
                format!("manifest of v{version} at {url}"),
                format!("it names version {} with {} objects", m.version, m.objects.len()),
            ));
        }
        Ok(m)
    }
}

fn hex_decode(s: &str, context: &str) -> Result<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return Err(Error::corrupt(context.to_string(), "odd-length hex"));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|_| Error::corrupt(context.to_string(), "not hex")))
        .collect()
}

pub(crate) fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A receiver id: 1..128 of `[A-Za-z0-9._-]`, not starting with a dot.
pub fn check_receiver_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!("receiver id {id:?}: use 1 to 128 of A-Z a-z 0-9 . _ - (not starting with a dot)")))
    }
}

impl Store {
    /// Open `s3://bucket/prefix`, `gs://bucket/prefix`, `az://container/prefix`
    /// (also `abfs://`, `azure://`) or `file:///path`. Credentials, region and
    /// endpoint come from the usual environment variables (`AWS_*` including
    /// `AWS_ENDPOINT_URL` and `AWS_ALLOW_HTTP`, `GOOGLE_*`, `AZURE_*`).
    pub fn open(url: &str) -> Result<Store> {
        let parsed = url::Url::parse(url).map_err(|e| Error::Invalid(format!("{url:?} is not a URL ({e}); use s3://bucket/prefix, gs://..., az://... or file:///path")))?;
        let err = |e: object_store::Error| Error::ObjectStore { url: url.to_string(), op: "open".into(), detail: e.to_string() };
        let (inner, root): (Arc<dyn ObjectStore>, String) = match parsed.scheme() {
            "file" => {
                let dir = parsed
                    .to_file_path()
                    .map_err(|_| Error::Invalid(format!("{url:?}: a file URL needs an absolute path, e.g. file:///data/refit")))?;
                std::fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
                let fs = object_store::local::LocalFileSystem::new_with_prefix(&dir)
                    .map_err(err)?
                    .with_automatic_cleanup(true)
                    .with_fsync(true);
                (Arc::new(fs), String::new())
            }
            "s3" | "s3a" => {
                install_crypto_provider();
                let b = object_store::aws::AmazonS3Builder::from_env().with_url(url).build().map_err(err)?;
                (Arc::new(b), parsed.path().to_string())
            }
            "gs" => {
                install_crypto_provider();
                let b = object_store::gcp::GoogleCloudStorageBuilder::from_env().with_url(url).build().map_err(err)?;
                (Arc::new(b), parsed.path().to_string())
            }
            "az" | "abfs" | "abfss" | "azure" | "adl" => {
                install_crypto_provider();
                let b = object_store::azure::MicrosoftAzureBuilder::from_env().with_url(url).build().map_err(err)?;
                (Arc::new(b), parsed.path().to_string())
            }
            other => {
                return Err(Error::Invalid(format!(
                    "{url:?}: scheme {other:?} is not an object store; use s3://, gs://, az:// or file://"
                )))
            }
        };
        let root = Path::parse(root.trim_matches('/')).map_err(|e| Error::Invalid(format!("{url:?}: bad prefix ({e})")))?;
        Ok(Store { inner, root, url: url.trim_end_matches('/').to_string() })
    }

    /// Wrap any `ObjectStore` (tests use `InMemory`); `label` names it in messages.
    pub fn from_object_store(inner: Arc<dyn ObjectStore>, prefix: &str, label: &str) -> Result<Store> {
        let root = Path::parse(prefix.trim_matches('/')).map_err(|e| Error::Invalid(format!("bad prefix {prefix:?} ({e})")))?;
        Ok(Store { inner, root, url: label.to_string() })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn inner(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    /// `{prefix}/a/b/...`
    pub fn path(&self, parts: &[&str]) -> Path {
        let mut p = self.root.clone();
        for part in parts {
            p = p.join(*part);
        }
        p
    }

    pub(crate) fn manifest_path(&self, version: u64) -> Path {
        self.path(&[format!("v{version}").as_str(), "manifest.json"])
    }

    pub(crate) fn object_path(&self, version: u64, name: &str) -> Path {
        self.path(&[format!("v{version}").as_str(), "objects", name])
    }

    pub(crate) fn os_err(&self, op: impl Into<String>, e: object_store::Error) -> Error {
        Error::ObjectStore { url: self.url.clone(), op: op.into(), detail: e.to_string() }
    }

    /// The version numbers that have a `v{N}/` folder (committed or not).
    pub(crate) async fn version_dirs(&self) -> Result<Vec<u64>> {
        let prefix = if self.root.as_ref().is_empty() { None } else { Some(&self.root) };
        let listed = self.inner.list_with_delimiter(prefix).await.map_err(|e| self.os_err("list versions", e))?;
        let mut v: Vec<u64> = listed
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().and_then(|f| f.strip_prefix('v')).and_then(|n| n.parse().ok()))
            .collect();
        v.sort_unstable();
        Ok(v)
    }

    /// The manifest of `version`, or `None` when it is not committed.
    pub(crate) async fn get_manifest(&self, version: u64) -> Result<Option<Manifest>> {
        let path = self.manifest_path(version);
        match self.inner.get(&path).await {
            Ok(r) => {
                if r.meta.size > MAX_MANIFEST_BYTES {
                    return Err(Error::TooLarge { context: format!("manifest {path}"), len: r.meta.size, max: MAX_MANIFEST_BYTES });
                }
                let bytes = r.bytes().await.map_err(|e| self.os_err(format!("read {path}"), e))?;
                Ok(Some(Manifest::parse(&bytes, &self.url, version)?))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.os_err(format!("get {path}"), e)),
        }
    }

    /// Every committed version's manifest, by version.
    pub(crate) async fn manifests(&self) -> Result<Vec<Manifest>> {
        use futures::StreamExt;
        let dirs = self.version_dirs().await?;
        let got: Vec<Option<Manifest>> = futures::stream::iter(dirs.into_iter().map(|v| self.get_manifest(v)))
            .buffered(DEFAULT_CONCURRENCY)
            .try_collect()
            .await?;
        Ok(got.into_iter().flatten().collect())
    }

    /// Blocking: every committed version's manifest, by version.
    pub fn committed(&self) -> Result<Vec<Manifest>> {
        runtime().block_on(self.manifests())
    }

    /// Blocking: the manifest of `version`, if committed.
    pub fn manifest(&self, version: u64) -> Result<Option<Manifest>> {
        runtime().block_on(self.get_manifest(version))
    }

    pub(crate) async fn put_json(&self, path: &Path, value: &serde_json::Value, mode: PutMode) -> Result<()> {
        let body = serde_json::to_vec_pretty(value).expect("JSON");
        let opts = PutOptions { mode, ..Default::default() };
        self.inner.put_opts(path, PutPayload::from(body), opts).await.map(|_| ()).map_err(|e| self.os_err(format!("put {path}"), e))
    }

    /// Delete everything under `{prefix}/parts...`; returns the count.
    pub(crate) async fn delete_prefix(&self, parts: &[&str]) -> Result<usize> {
        use futures::StreamExt;
        let prefix = self.path(parts);
        let locations = self.inner.list(Some(&prefix)).map_ok(|m| m.location).boxed();
        let deleted: Vec<Path> = self
            .inner
            .delete_stream(locations)
            .try_collect()
            .await
            .map_err(|e| self.os_err(format!("delete {prefix}"), e))?;
        Ok(deleted.len())
    }
}
