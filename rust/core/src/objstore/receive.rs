//! Receiving: find the version after the one the target holds (by digest),
//! fetch its objects in parallel (from the streaming index before the
//! manifest exists), verify, apply in place through the receiver journal,
//! acknowledge. Plus GC.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path as FsPath, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::{ObjectStoreExt, PutMode};

use super::{check_receiver_id, hex_decode, now_ms, object_name, runtime, Manifest, Store};
use crate::checkpoint::{digest_hex, ReadOnlyCheckpoint};
use crate::error::{Error, Result};
use crate::format::{self, Frame};
use crate::receiver::{self, RefitOptions, RefitOutcome};

#[derive(Clone, Debug)]
pub struct ReceiveOptions {
    /// Register under `receivers/` and acknowledge each version applied
    /// (`acks/v{N}/{id}`); `None`: anonymous (never holds back GC).
    pub receiver_id: Option<String>,
    /// When the target already holds the newest committed version, wait up
    /// to this long for the next one (prefetching its objects while it
    /// streams), apply it and return. Zero: return at once.
    pub wait: Duration,
    /// Poll interval while waiting.
    pub poll: Duration,
    /// Downloads in flight at once.
    pub concurrency: usize,
    /// The receiver journal (`None`: `<target>.dcrj` beside it). Every
    /// version is applied through it (`receiver::refit_received`), so a
    /// receiver killed mid-apply resumes on its next call.
    pub journal: Option<PathBuf>,
}

impl Default for ReceiveOptions {
    fn default() -> Self {
        ReceiveOptions {
            receiver_id: None,
            wait: Duration::ZERO,
            poll: Duration::from_millis(200),
            concurrency: super::DEFAULT_CONCURRENCY,
            journal: None,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReceiveSummary {
    /// Versions applied, in order.
    pub applied: Vec<u64>,
    /// The version the target holds now (`None`: nothing committed yet, or
    /// the target is the base of the first version).
    pub version: Option<u64>,
    pub digest: String,
    /// Bytes of objects downloaded.
    pub fetched_bytes: u64,
    /// Objects downloaded from the streaming index before their version's
    /// manifest existed.
    pub prefetched: usize,
    /// Objects downloaded again after a failed check.
    pub refetched: usize,
}

/// What `receive` reports while it works.
#[derive(Clone, Debug)]
pub enum ReceiveEvent {
    /// Fetching version `version`: `done` of `total` object bytes.
    Fetch { version: u64, done: u64, total: u64 },
    /// Version applied and verified.
    Applied { version: u64, chunks: u32, changed: u64 },
    /// A version that an earlier, interrupted call had started was finished
    /// from its spooled delta, before anything was fetched.
    Resumed { version: u64, chunks: u32, changed: u64 },
    /// At the newest committed version, waiting for the next.
    Waiting { next: u64 },
    /// Objects of the uncommitted version `version` fetched so far from its
    /// streaming index (before its manifest exists).
    Prefetched { version: u64, objects: u64 },
}

fn chain_err(store: &Store, detail: String) -> Error {
    Error::VersionChain { url: store.url.clone(), detail }
}

/// Check one downloaded object: its size, its frame checksum, and that its
/// bytes hash to its name.
fn verify_object(path: &str, name: &str, size: Option<u64>, bytes: &[u8]) -> Result<()> {
    if let Some(size) = size {
        if bytes.len() as u64 != size {
            return Err(Error::corrupt(format!("object {path}"), format!("{} bytes, the manifest says {size}", bytes.len())));
        }
    }
    match format::parse_frame_in(bytes) {
        Ok(Some((Frame::Header(_) | Frame::Chunk(_), used))) if used == bytes.len() => {}
        Ok(Some((Frame::Trailer(_), _))) => return Err(Error::corrupt(format!("object {path}"), "a trailer frame where a header or chunk was expected")),
        Ok(_) => return Err(Error::corrupt(format!("object {path}"), "not exactly one whole frame")),
        Err(Error::Checksum { context, expected, found }) => {
            return Err(Error::Checksum { context: format!("{context} of object {path}"), expected, found })
        }
        Err(e) => return Err(e),
    }
    let h = object_name(bytes);
    if h != name {
        return Err(Error::corrupt(format!("object {path}"), format!("its bytes hash to {h}, not to its name")));
    }
    Ok(())
}

/// Download one object and verify it; on a failed check download it once
/// more (a transient corruption), then give up with the check's error.
/// Returns the bytes and whether it was refetched.
async fn fetch_verified(store: &Store, version: u64, name: &str, size: Option<u64>) -> Result<(Bytes, bool)> {
    let path = store.object_path(version, name);
    let mut last = None;
    for attempt in 0..2 {
        let r = store.inner.get(&path).await.map_err(|e| match e {
            object_store::Error::NotFound { .. } => Error::ObjectStore {
                url: store.url.clone(),
                op: format!("get {path}"),
                detail: format!("the object of v{version} is missing (deleted by GC, or an incomplete upload)"),
            },
            e => store.os_err(format!("get {path}"), e),
        })?;
        if let Some(size) = size {
            if r.meta.size != size {
                last = Some(Error::corrupt(format!("object {path}"), format!("{} bytes, the manifest says {size}", r.meta.size)));
                continue;
            }
        }
        if r.meta.size > (format::MAX_FRAME_BODY + 9) as u64 {
            return Err(Error::TooLarge { context: format!("object {path}"), len: r.meta.size, max: (format::MAX_FRAME_BODY + 9) as u64 });
        }
        let bytes = r.bytes().await.map_err(|e| store.os_err(format!("read {path}"), e))?;
        match verify_object(path.as_ref(), name, size, &bytes) {
            Ok(()) => return Ok((bytes, attempt > 0)),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("two attempts failed"))
}

/// Fetch every object of `m` not in `have` (in parallel), verify, and
/// assemble the delta bytes: preamble, frames in order, trailer.
async fn fetch_delta(
    store: &Store,
    m: &Manifest,
    have: &mut HashMap<String, Bytes>,
    concurrency: usize,
    summary: &mut ReceiveSummary,
    events: &mut dyn FnMut(ReceiveEvent),
) -> Result<Vec<u8>> {
    let total: u64 = m.objects.iter().map(|o| o.size).sum();
    let mut done: u64 = m.objects.iter().filter(|o| have.contains_key(&o.name)).map(|o| o.size).sum();
    // Prefetched bytes were checked against their name; re-check the size.
    for o in &m.objects {
        if have.get(&o.name).is_some_and(|b| b.len() as u64 != o.size) {
            have.remove(&o.name);
        }
    }
    events(ReceiveEvent::Fetch { version: m.version, done, total });
    let missing: Vec<(String, u64)> = {
        let mut seen = HashSet::new();
        m.objects.iter().filter(|o| !have.contains_key(&o.name) && seen.insert(o.name.clone())).map(|o| (o.name.clone(), o.size)).collect()
    };
    let mut stream = futures::stream::iter(missing.into_iter().map(|(name, size)| async move {
        let r = fetch_verified(store, m.version, &name, Some(size)).await;
        (name, r)
    }))
    .buffer_unordered(concurrency.max(1));
    while let Some((name, r)) = stream.next().await {
        let (bytes, refetched) = r?;
        done += bytes.len() as u64;
        summary.fetched_bytes += bytes.len() as u64;
        summary.refetched += usize::from(refetched);
        have.insert(name, bytes);
        events(ReceiveEvent::Fetch { version: m.version, done, total });
    }
    let trailer = hex_decode(&m.trailer, &format!("trailer in the manifest of v{}", m.version))?;
    let mut out = Vec::with_capacity(format::PREAMBLE_LEN + total as usize + trailer.len());
    out.extend_from_slice(&format::preamble());
    for o in &m.objects {
        out.extend_from_slice(&have[&o.name]);
    }
    out.extend_from_slice(&trailer);
    Ok(out)
}

/// Prefetch what the streaming index of `version` lists (objects whose
/// upload has completed), skipping deltas whose header needs another base.
struct Prefetch {
    version: u64,
    have: HashMap<String, Bytes>,
    /// delta_id -> whether its header's base matches (None: header not seen).
    deltas: HashMap<String, bool>,
    fetched: usize,
}

impl Prefetch {
    fn new(version: u64) -> Prefetch {
        Prefetch { version, have: HashMap::new(), deltas: HashMap::new(), fetched: 0 }
    }

    async fn round(&mut self, store: &Store, base_hex: &str, concurrency: usize) -> Result<()> {
        let prefix = store.path(&["streaming", format!("v{}", self.version).as_str()]);
        let listed: Vec<object_store::ObjectMeta> =
            store.inner.list(Some(&prefix)).try_collect().await.map_err(|e| store.os_err(format!("list {prefix}"), e))?;
        // delta_id -> idx -> (name, size)
        let mut entries: BTreeMap<String, BTreeMap<u32, (String, u64)>> = BTreeMap::new();
        for meta in listed {
            let parts: Vec<String> = meta.location.parts().map(|p| p.as_ref().to_string()).collect();
            let n = parts.len();
            if n < 2 {
                continue;
            }
            let fields: Vec<&str> = parts[n - 1].split('-').collect();
            if let [idx, name, size] = &fields[..] {
                if let (Ok(idx), Ok(size)) = (idx.parse::<u32>(), size.parse::<u64>()) {
                    if name.len() == 32 && size <= (format::MAX_FRAME_BODY + 9) as u64 {
                        entries.entry(parts[n - 2].clone()).or_default().insert(idx, (name.to_string(), size));
                    }
                }
            }
        }
        let mut want = Vec::new();
        for (id, objs) in &entries {
            match self.deltas.get(id).copied() {
                Some(false) => continue,
                Some(true) => want.extend(objs.values().filter(|(n, _)| !self.have.contains_key(n)).cloned()),
                None => {
                    // Header first: it says whether this delta applies here.
                    if let Some((name, size)) = objs.get(&0) {
                        let (bytes, _) = fetch_verified(store, self.version, name, Some(*size)).await?;
                        let ok = match format::parse_frame_in(&bytes)? {
                            Some((Frame::Header(h), _)) => digest_hex(&h.base_digest) == base_hex,
                            _ => false,
                        };
                        self.deltas.insert(id.clone(), ok);
                        if ok {
                            self.have.insert(name.clone(), bytes);
                            self.fetched += 1;
                            want.extend(objs.values().filter(|(n, _)| !self.have.contains_key(n)).cloned());
                        }
                    }
                }
            }
        }
        let version = self.version;
        let mut stream = futures::stream::iter(want.into_iter().map(|(name, size)| async move {
            let r = fetch_verified(store, version, &name, Some(size)).await;
            (name, r)
        }))
        .buffer_unordered(concurrency.max(1));
        let mut got = Vec::new();
        while let Some((name, r)) = stream.next().await {
            // A failed prefetch is not fatal: the object is fetched again
            // (and checked) once the manifest names it.
            if let Ok((bytes, _)) = r {
                got.push((name, bytes));
            }
        }
        drop(stream);
        for (name, bytes) in got {
            if self.have.insert(name, bytes).is_none() {
                self.fetched += 1;
            }
        }
        Ok(())
    }
}

fn target_digest(target: &FsPath) -> Result<String> {
    Ok(digest_hex(&ReadOnlyCheckpoint::open(target)?.checkpoint_digest()))
}

/// (chunks, changed elements) of a journaled refit.
fn refit_counts(outcome: &RefitOutcome) -> (u32, u64) {
    match outcome {
        RefitOutcome::Committed(r) => (r.chunks, r.changed),
        RefitOutcome::AlreadyAtTarget { .. } => (0, 0),
    }
}

pub(super) async fn ack(store: &Store, id: &str, version: u64, digest: &str) -> Result<()> {
    let path = store.path(&["acks", format!("v{version}").as_str(), id]);
    let v = serde_json::json!({ "receiver": id, "version": version, "digest": digest, "unix_ms": now_ms() });
    store.put_json(&path, &v, PutMode::Overwrite).await
}

/// Where the target stands: the index in `ms` of the next version to apply
/// (`ms.len()` when at the newest) and the version it holds.
fn position(store: &Store, ms: &[Manifest], digest: &str) -> Result<(usize, Option<u64>)> {
    if ms.is_empty() {
        return Ok((0, None));
    }
    if ms[ms.len() - 1].target_digest == digest {
        return Ok((ms.len(), Some(ms[ms.len() - 1].version)));
    }
    // The highest version built on what the target holds: the shortest path.
    if let Some(i) = ms.iter().rposition(|m| m.base_digest == digest) {
        return Ok((i, if i > 0 { Some(ms[i - 1].version) } else { None }));
    }
    if let Some(i) = ms.iter().rposition(|m| m.target_digest == digest) {
        return Ok((i + 1, Some(ms[i].version)));
    }
    Err(chain_err(
        store,
        format!(
            "the target holds digest {}, which is neither the base nor the target of any committed version (v{}..v{}); it was never published here, or the versions it needs were garbage-collected: do a dense refit to v{} and receive from there",
            &digest[..12.min(digest.len())],
            ms[0].version,
            ms[ms.len() - 1].version,
            ms[ms.len() - 1].version
        ),
    ))
}

/// Bring `target` (a safetensors file, changed in place) to the newest
/// committed version at `store`: every committed version after the one it
/// holds, in order, and return once at the newest. With `opts.wait`, a
/// target that is already at the newest waits up to that long for the next
/// version, prefetching its objects while it streams.
pub fn receive(store: &Store, target: &FsPath, opts: &ReceiveOptions, events: &mut dyn FnMut(ReceiveEvent)) -> Result<ReceiveSummary> {
    if let Some(id) = &opts.receiver_id {
        check_receiver_id(id)?;
    }
    let rt = runtime();
    let refit_opts = RefitOptions::default();
    if let Some(done) = receiver::resume_received(target, opts.journal.as_deref(), &refit_opts)? {
        let (chunks, changed) = refit_counts(&done);
        let version = match &done {
            RefitOutcome::Committed(r) => r.version,
            RefitOutcome::AlreadyAtTarget { version, .. } => *version,
        };
        events(ReceiveEvent::Resumed { version, chunks, changed });
    }
    let mut digest = target_digest(target)?;
    let mut summary = ReceiveSummary::default();
    if let Some(id) = &opts.receiver_id {
        let v = serde_json::json!({ "receiver": id, "registered_unix_ms": now_ms() });
        rt.block_on(store.put_json(&store.path(&["receivers", id.as_str()]), &v, PutMode::Overwrite))?;
    }
    let deadline = Instant::now() + opts.wait;
    let mut prefetch: Option<Prefetch> = None;
    let mut acked: Option<u64> = None;
    loop {
        let ms = rt.block_on(store.manifests())?;
        let (start, held) = match summary.version {
            // After the first round we know our version; only newer ones count.
            Some(v) if !summary.applied.is_empty() => (ms.iter().position(|m| m.version > v).unwrap_or(ms.len()), Some(v)),
            _ => position(store, &ms, &digest)?,
        };
        summary.version = held;
        let applied_before = summary.applied.len();
        for m in &ms[start..] {
            if m.base_digest != digest {
                return Err(chain_err(
                    store,
                    format!(
                        "v{} needs base digest {}, but the target holds {} (v{}); the chain is broken: do a dense refit to v{}",
                        m.version,
                        &m.base_digest[..12],
                        &digest[..12],
                        summary.version.map_or("?".into(), |v| v.to_string()),
                        ms[ms.len() - 1].version
                    ),
                ));
            }
            let mut have = match prefetch.take() {
                Some(p) if p.version == m.version => {
                    summary.prefetched += p.fetched;
                    p.have
                }
                _ => HashMap::new(),
            };
            let bytes = rt.block_on(fetch_delta(store, m, &mut have, opts.concurrency, &mut summary, events))?;
            drop(have);
            let outcome = receiver::refit_received(&bytes, target, opts.journal.as_deref(), &refit_opts)?;
            let (chunks, changed) = refit_counts(&outcome);
            digest = m.target_digest.clone();
            summary.applied.push(m.version);
            summary.version = Some(m.version);
            events(ReceiveEvent::Applied { version: m.version, chunks, changed });
            if let Some(id) = &opts.receiver_id {
                rt.block_on(ack(store, id, m.version, &digest))?;
                acked = Some(m.version);
            }
        }
        if summary.applied.len() > applied_before {
            continue; // list again: a newer version may have landed meanwhile
        }
        // At the newest. Having applied something, or out of time: done.
        if !summary.applied.is_empty() || Instant::now() >= deadline {
            break;
        }
        // Wait for the next version; prefetch it while it streams.
        let next = ms.last().map_or(1, |m| m.version + 1);
        events(ReceiveEvent::Waiting { next });
        let p = prefetch.get_or_insert_with(|| Prefetch::new(next));
        if p.version != next {
            *p = Prefetch::new(next);
        }
        loop {
            if rt.block_on(store.get_manifest(next))?.is_some() {
                break;
            }
            let before = p.fetched;
            rt.block_on(p.round(store, &digest, opts.concurrency))?;
            if p.fetched > before {
                events(ReceiveEvent::Prefetched { version: next, objects: p.fetched as u64 });
            }
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(opts.poll.min(deadline.saturating_duration_since(Instant::now())));
        }
        if Instant::now() >= deadline && rt.block_on(store.get_manifest(next))?.is_none() {
            break;
        }
    }
    if let (Some(id), Some(v)) = (&opts.receiver_id, summary.version) {
        if acked != Some(v) {
            rt.block_on(ack(store, id, v, &digest))?;
        }
    }
    summary.digest = digest;
    Ok(summary)
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcSummary {
    /// Versions whose manifest and objects were deleted.
    pub deleted: Vec<u64>,
    /// Objects deleted (frames, index entries, manifests, old acks).
    pub objects_deleted: usize,
    /// Each registered receiver and the newest version it acknowledged.
    pub receivers: Vec<(String, Option<u64>)>,
    /// Versions up to this one were acknowledged by every registered receiver.
    pub acknowledged_by_all: Option<u64>,
    pub newest: Option<u64>,
}

/// Delete the versions every registered receiver has acknowledged (their
/// deltas are needed by no one), always keeping the newest committed
/// version. With no registered receiver nothing is deleted. Uncommitted
/// leftovers (interrupted uploads) below the newest version go too.
pub fn gc(store: &Store, dry_run: bool) -> Result<GcSummary> {
    runtime().block_on(async {
        let list_names = |parts: &[&str]| {
            let prefix = store.path(parts);
            async move {
                let metas: Vec<object_store::ObjectMeta> =
                    store.inner.list(Some(&prefix)).try_collect().await.map_err(|e| store.os_err(format!("list {prefix}"), e))?;
                Ok::<_, Error>(metas.into_iter().map(|m| m.location.parts().map(|p| p.as_ref().to_string()).collect::<Vec<_>>()).collect::<Vec<_>>())
            }
        };
        let receivers: Vec<String> = list_names(&["receivers"]).await?.into_iter().filter_map(|p| p.last().cloned()).collect();
        let mut newest_ack: HashMap<String, u64> = HashMap::new();
        for parts in list_names(&["acks"]).await? {
            let n = parts.len();
            if n < 2 {
                continue;
            }
            if let Some(v) = parts[n - 2].strip_prefix('v').and_then(|v| v.parse::<u64>().ok()) {
                let e = newest_ack.entry(parts[n - 1].clone()).or_insert(v);
                *e = (*e).max(v);
            }
        }
        let ms = store.manifests().await?;
        let newest = ms.last().map(|m| m.version);
        let mut s = GcSummary {
            receivers: receivers.iter().map(|r| (r.clone(), newest_ack.get(r).copied())).collect(),
            newest,
            ..Default::default()
        };
        if receivers.is_empty() || newest.is_none() {
            return Ok(s);
        }
        let Some(all) = receivers.iter().map(|r| newest_ack.get(r).copied()).collect::<Option<Vec<u64>>>().and_then(|v| v.into_iter().min())
        else {
            return Ok(s);
        };
        s.acknowledged_by_all = Some(all);
        let newest = newest.expect("checked");
        let committed: HashSet<u64> = ms.iter().map(|m| m.version).collect();
        for v in store.version_dirs().await? {
            if v >= newest || (v > all && committed.contains(&v)) {
                continue;
            }
            if committed.contains(&v) {
                s.deleted.push(v);
            }
            if dry_run {
                continue;
            }
            let vname = format!("v{v}");
            // The manifest first: the version turns invisible before any of
            // its objects disappear.
            match store.inner.delete(&store.manifest_path(v)).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(store.os_err(format!("delete {}", store.manifest_path(v)), e)),
            }
            s.objects_deleted += store.delete_prefix(&[vname.as_str()]).await? + store.delete_prefix(&["streaming", vname.as_str()]).await?;
            if v < all {
                s.objects_deleted += store.delete_prefix(&["acks", vname.as_str()]).await?;
            }
        }
        Ok(s)
    })
}
