//! Publishing: frames go up as content-addressed objects while the delta is
//! built (a bounded number of uploads in flight), then the manifest commits
//! the version with a conditional put.

use std::path::Path as FsPath;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use object_store::{ObjectStoreExt, PutMode, PutPayload, WriteMultipart};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use super::{hex_encode, now_ms, object_name, runtime, Manifest, ObjectEntry, Store, MANIFEST_FORMAT};
use crate::checkpoint::{digest_hex, digest_short, ReadOnlyCheckpoint};
use crate::delta::{self, DeltaStats, DiffOptions};
use crate::error::{Error, Result};
use crate::format::{self, DeltaHeader, Frame};

#[derive(Clone, Debug)]
pub struct PublishOptions {
    /// Version to publish as; `None`: the newest committed version + 1.
    pub version: Option<u64>,
    /// Uploads in flight at once (at least 1).
    pub concurrency: usize,
    /// Objects at least this large use a multipart upload.
    pub multipart_bytes: usize,
    /// Part size of multipart uploads.
    pub part_bytes: usize,
    /// Write the manifest (the commit point). `false` uploads the objects
    /// and the streaming index only: the version stays invisible.
    pub commit: bool,
}

impl Default for PublishOptions {
    fn default() -> Self {
        PublishOptions {
            version: None,
            concurrency: super::DEFAULT_CONCURRENCY,
            multipart_bytes: super::DEFAULT_MULTIPART_BYTES,
            part_bytes: super::DEFAULT_PART_BYTES,
            commit: true,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishSummary {
    pub version: u64,
    pub committed: bool,
    pub objects: usize,
    /// Bytes of the uploaded objects (frames).
    pub object_bytes: u64,
    pub multipart_objects: usize,
    pub manifest_bytes: u64,
    pub delta_bytes: u64,
    pub delta_id: String,
    pub base_digest: String,
    pub target_digest: String,
    pub changed: u64,
}

/// Uploads frames of one delta as they are pushed, then commits.
pub struct Publisher {
    store: Store,
    version: u64,
    /// Newest committed version below `version` (its target must be our base).
    prev: Option<Manifest>,
    opts: PublishOptions,
    buf: Vec<u8>,
    preamble_done: bool,
    header: Option<DeltaHeader>,
    delta_hex: String,
    entries: Vec<ObjectEntry>,
    trailer: Option<Vec<u8>>,
    changed: u64,
    delta_bytes: u64,
    multipart: usize,
    sem: Arc<Semaphore>,
    inflight: Vec<JoinHandle<Result<()>>>,
    uploaded: Arc<AtomicU64>,
}

impl Publisher {
    /// Choose the version (the newest committed + 1 unless given) and check
    /// that it is free.
    pub fn begin(store: &Store, opts: PublishOptions) -> Result<Publisher> {
        let committed = store.committed()?;
        let newest = committed.last().map(|m| m.version);
        let version = opts.version.unwrap_or(newest.map_or(1, |v| v + 1));
        if let Some(m) = committed.iter().find(|m| m.version == version) {
            return Err(Error::VersionExists {
                url: store.url.clone(),
                version,
                existing: format!("delta {}, target digest {}", &m.delta_id[..16], &m.target_digest[..12]),
                next: newest.unwrap_or(version) + 1,
            });
        }
        let prev = committed.into_iter().rev().find(|m| m.version < version);
        Ok(Publisher {
            store: store.clone(),
            version,
            prev,
            sem: Arc::new(Semaphore::new(opts.concurrency.max(1))),
            opts,
            buf: Vec::new(),
            preamble_done: false,
            header: None,
            delta_hex: String::new(),
            entries: Vec::new(),
            trailer: None,
            changed: 0,
            delta_bytes: 0,
            multipart: 0,
            inflight: Vec::new(),
            uploaded: Arc::new(AtomicU64::new(0)),
        })
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// Bytes of objects whose upload has completed.
    pub fn uploaded_bytes(&self) -> u64 {
        self.uploaded.load(Ordering::Relaxed)
    }

    /// Feed the next bytes of the delta stream (any split). Complete frames
    /// are validated and their uploads started; this blocks while
    /// `concurrency` uploads are in flight.
    pub fn push(&mut self, bytes: &[u8]) -> Result<()> {
        self.buf.extend_from_slice(bytes);
        self.delta_bytes += bytes.len() as u64;
        let mut pos = 0;
        if !self.preamble_done {
            match format::parse_preamble(&self.buf)? {
                Some(n) => {
                    pos = n;
                    self.preamble_done = true;
                }
                None => return Ok(()),
            }
        }
        while let Some((frame, used)) = format::parse_frame(&self.buf[pos..])? {
            let bytes = Bytes::copy_from_slice(&self.buf[pos..pos + used]);
            pos += used;
            self.frame(frame, bytes)?;
        }
        self.buf.drain(..pos);
        self.reap(false)
    }

    fn frame(&mut self, frame: Frame, bytes: Bytes) -> Result<()> {
        if self.trailer.is_some() {
            return Err(Error::corrupt("delta", "a frame after the trailer"));
        }
        match frame {
            Frame::Header(h) => {
                if self.header.is_some() {
                    return Err(Error::corrupt("delta", "a second header frame"));
                }
                if let Some(prev) = &self.prev {
                    if prev.target_digest != digest_hex(&h.base_digest) {
                        return Err(Error::VersionChain {
                            url: self.store.url.clone(),
                            detail: format!(
                                "this delta's base digest is {}, but v{} (the newest committed version below v{}) holds {}; receivers could not apply it: build the delta against v{}",
                                digest_short(&h.base_digest),
                                prev.version,
                                self.version,
                                &prev.target_digest[..12],
                                prev.version
                            ),
                        });
                    }
                }
                self.delta_hex = digest_hex(&h.delta_id);
                self.header = Some(h);
                self.upload(bytes)
            }
            Frame::Chunk(c) => {
                let h = self.header.as_ref().ok_or_else(|| Error::corrupt("delta", "a chunk frame before the header"))?;
                delta::check_chunk(h, &c)?;
                let expected = self.entries.len() as u32 - 1;
                if c.seq != expected {
                    return Err(Error::corrupt("delta", format!("chunk seq {} where {expected} was expected", c.seq)));
                }
                self.changed += u64::from(c.n_changed);
                self.upload(bytes)
            }
            Frame::Trailer(t) => {
                let h = self.header.as_ref().ok_or_else(|| Error::corrupt("delta", "a trailer before the header"))?;
                delta::check_trailer(h, &t, self.entries.len() as u32 - 1)?;
                self.trailer = Some(bytes.to_vec());
                Ok(())
            }
        }
    }

    /// Start the upload of one frame object and its streaming index entry.
    fn upload(&mut self, bytes: Bytes) -> Result<()> {
        let name = object_name(&bytes);
        let size = bytes.len() as u64;
        let idx = self.entries.len();
        self.entries.push(ObjectEntry { name: name.clone(), size });
        let multipart = bytes.len() >= self.opts.multipart_bytes;
        self.multipart += usize::from(multipart);
        let store = self.store.clone();
        let path = store.object_path(self.version, &name);
        let index = store.path(&["streaming", format!("v{}", self.version).as_str(), self.delta_hex.as_str(), format!("{idx:08}-{name}-{size}").as_str()]);
        let part = self.opts.part_bytes.max(1);
        let uploaded = self.uploaded.clone();
        let permit = runtime().block_on(self.sem.clone().acquire_owned()).expect("semaphore is never closed");
        self.inflight.push(runtime().spawn(async move {
            let _permit = permit;
            if multipart {
                let up = store.inner.put_multipart(&path).await.map_err(|e| store.os_err(format!("start multipart upload of {path}"), e))?;
                let mut w = WriteMultipart::new_with_chunk_size(up, part);
                w.put(bytes);
                w.finish().await.map_err(|e| store.os_err(format!("multipart upload of {path}"), e))?;
            } else {
                store.inner.put(&path, PutPayload::from(bytes)).await.map_err(|e| store.os_err(format!("put {path}"), e))?;
            }
            // The index entry is written once the object is complete, so a
            // receiver that lists it can fetch the object at once.
            store.inner.put(&index, PutPayload::new()).await.map_err(|e| store.os_err(format!("put {index}"), e))?;
            uploaded.fetch_add(size, Ordering::Relaxed);
            Ok(())
        }));
        Ok(())
    }

    /// Collect finished uploads (all of them when `all`), failing on the first error.
    fn reap(&mut self, all: bool) -> Result<()> {
        let mut i = 0;
        while i < self.inflight.len() {
            if all || self.inflight[i].is_finished() {
                let h = self.inflight.swap_remove(i);
                runtime()
                    .block_on(h)
                    .map_err(|e| Error::ObjectStore { url: self.store.url.clone(), op: "upload".into(), detail: e.to_string() })??;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Wait for every upload, then (with `commit`) write the manifest with
    /// a conditional put: the version becomes visible atomically, or the
    /// call fails with `VersionExists` when another publisher committed it.
    pub fn finish(mut self) -> Result<PublishSummary> {
        self.wait_uploads()?;
        if !self.buf.is_empty() || self.trailer.is_none() {
            return Err(Error::Incomplete {
                detail: format!("the delta stream ended after {} frames without a trailer ({} stray bytes)", self.entries.len(), self.buf.len()),
            });
        }
        let h = self.header.as_ref().expect("a trailer implies a header");
        let manifest = Manifest {
            format: MANIFEST_FORMAT.into(),
            version: self.version,
            delta_id: self.delta_hex.clone(),
            base_digest: digest_hex(&h.base_digest),
            target_digest: digest_hex(&h.target_digest),
            base_version: h.base_version,
            target_version: h.target_version,
            chunk_bytes: h.chunk_bytes,
            objects: self.entries.clone(),
            trailer: hex_encode(self.trailer.as_ref().expect("trailer")),
            delta_bytes: self.delta_bytes,
            changed: self.changed,
            published_unix_ms: now_ms(),
        };
        let value = serde_json::to_value(&manifest).expect("manifest serializes");
        let manifest_bytes = serde_json::to_vec_pretty(&value).expect("JSON").len() as u64;
        if self.opts.commit {
            let store = self.store.clone();
            let path = store.manifest_path(self.version);
            let r = runtime().block_on(store.put_json(&path, &value, PutMode::Create));
            if let Err(Error::ObjectStore { .. }) = &r {
                // Tell a lost race apart from any other failure.
                let existing = runtime().block_on(store.get_manifest(self.version)).ok().flatten();
                if let Some(m) = existing {
                    let newest = store.committed().ok().and_then(|c| c.last().map(|m| m.version)).unwrap_or(self.version);
                    return Err(Error::VersionExists {
                        url: store.url.clone(),
                        version: self.version,
                        existing: format!("delta {}, target digest {}", &m.delta_id[..16], &m.target_digest[..12]),
                        next: newest + 1,
                    });
                }
            }
            r?;
        }
        Ok(PublishSummary {
            version: self.version,
            committed: self.opts.commit,
            objects: self.entries.len(),
            object_bytes: self.entries.iter().map(|e| e.size).sum(),
            multipart_objects: self.multipart,
            manifest_bytes,
            delta_bytes: self.delta_bytes,
            delta_id: manifest.delta_id,
            base_digest: manifest.base_digest,
            target_digest: manifest.target_digest,
            changed: self.changed,
        })
    }

    /// Wait for every upload started so far (the commit is separate:
    /// `finish`).
    pub fn wait_uploads(&mut self) -> Result<()> {
        let result = self.reap(true);
        if result.is_err() {
            self.abort();
        }
        result
    }

    fn abort(&mut self) {
        for h in self.inflight.drain(..) {
            h.abort();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.abort();
    }
}

/// Publish a delta file. `progress(uploaded, total)` in bytes of objects.
pub fn publish_delta(store: &Store, delta: &FsPath, opts: PublishOptions, progress: &mut dyn FnMut(u64, u64)) -> Result<PublishSummary> {
    let bytes = std::fs::read(delta).map_err(|e| Error::io("read", delta, e))?;
    let mut p = Publisher::begin(store, opts)?;
    let total = bytes.len() as u64;
    // Feed in slices so uploads start (and progress moves) before the whole
    // file is parsed.
    for piece in bytes.chunks(1 << 20) {
        p.push(piece)?;
        progress(p.uploaded_bytes().min(total), total);
    }
    // Every object is up: 100 %, then the commit.
    p.wait_uploads()?;
    progress(total, total);
    p.finish()
}

/// Build the delta from `old` to `new` (safetensors files) and publish it as
/// it is built: each frame's upload starts as soon as it is encoded. The
/// header's versions are set to `version - 1 -> version`.
pub fn publish_diff(
    store: &Store,
    old: &FsPath,
    new: &FsPath,
    diff: &DiffOptions,
    opts: PublishOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(PublishSummary, DeltaStats)> {
    let old_ck = ReadOnlyCheckpoint::open(old)?;
    let new_ck = ReadOnlyCheckpoint::open(new)?;
    old_ck.layout().ensure_same(new_ck.layout(), &format!("{} against {}", new.display(), old.display()))?;
    let mut p = Publisher::begin(store, opts)?;
    let diff = DiffOptions { base_version: p.version().saturating_sub(1), target_version: p.version(), ..*diff };
    let stats = delta::diff(old_ck.layout(), &old_ck.buffers(), &new_ck.buffers(), &diff, &mut |b| p.push(b), progress)?;
    let s = p.finish()?;
    Ok((s, stats))
}
