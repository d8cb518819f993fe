//! The canonical checkpoint model: an ordered list of named tensors (name,
//! dtype, shape) and the digests that identify a version bit for bit.

use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use xxhash_rust::xxh3::Xxh3;

use crate::dtype::DType;
use crate::error::{short_hex, Error, Result};

pub use crate::digest::Digest;

pub fn digest_hex(d: &Digest) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn digest_short(d: &Digest) -> String {
    short_hex(d)
}

/// Digest of one tensor's stored bytes (see [`crate::digest`]).
pub fn tensor_digest(bytes: &[u8], dtype: DType) -> Digest {
    crate::digest::tensor_digest(bytes, dtype.word_bytes())
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

impl TensorSpec {
    pub fn numel(&self) -> Result<u64> {
        self.shape.iter().try_fold(1u64, |acc, &d| {
            acc.checked_mul(d)
                .ok_or_else(|| Error::Invalid(format!("tensor {} has shape {:?} whose size overflows u64", self.name, self.shape)))
        })
    }

    pub fn storage_bytes(&self) -> Result<u64> {
        self.dtype.storage_bytes(self.numel()?)
    }

    /// Number of codec words (elements, or bytes for packed sub-byte types).
    pub fn words(&self) -> Result<u64> {
        Ok(self.storage_bytes()? / self.dtype.word_bytes() as u64)
    }
}

/// Tensors in canonical order (sorted by name), names unique.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    tensors: Vec<TensorSpec>,
}

impl Layout {
    pub fn new(mut tensors: Vec<TensorSpec>) -> Result<Self> {
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(w) = tensors.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(Error::Invalid(format!("tensor name {:?} appears twice; names must be unique", w[0].name)));
        }
        for t in &tensors {
            t.storage_bytes()?;
        }
        Ok(Layout { tensors })
    }

    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.tensors.binary_search_by(|t| t.name.as_str().cmp(name)).ok()
    }

    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.storage_bytes().unwrap_or(0)).sum()
    }

    /// Digest of the whole checkpoint: over the ordered (name, dtype, shape,
    /// tensor digest) list.
    pub fn checkpoint_digest(&self, tensor_digests: &[Digest]) -> Digest {
        assert_eq!(tensor_digests.len(), self.tensors.len());
        let mut h = Xxh3::new();
        h.update(b"dcr-checkpoint-v2");
        h.update(&(self.tensors.len() as u64).to_le_bytes());
        for (t, d) in self.tensors.iter().zip(tensor_digests) {
            h.update(&(t.name.len() as u64).to_le_bytes());
            h.update(t.name.as_bytes());
            h.update(&[t.dtype.code(), t.shape.len() as u8]);
            for dim in &t.shape {
                h.update(&dim.to_le_bytes());
            }
            h.update(d);
        }
        h.digest128().to_le_bytes()
    }

    /// Digest of every tensor (buffers in canonical order); tensors in
    /// parallel and large tensors in parallel blocks.
    pub fn tensor_digests(&self, buffers: &[&[u8]]) -> Vec<Digest> {
        assert_eq!(buffers.len(), self.tensors.len());
        crate::exec::map_range(self.tensors.len(), |i| tensor_digest(buffers[i], self.tensors[i].dtype))
    }

    /// Check that `other` has the same names, dtypes and shapes.
    pub fn ensure_same(&self, other: &Layout, what: &str) -> Result<()> {
        if self.tensors.len() != other.tensors.len() {
            return Err(Error::LayoutMismatch {
                detail: format!("{what}: expected {} tensors, found {}", self.tensors.len(), other.tensors.len()),
            });
        }
        for (a, b) in self.tensors.iter().zip(&other.tensors) {
            if a != b {
                return Err(Error::LayoutMismatch {
                    detail: format!(
                        "{what}: expected tensor {} {} {:?}, found {} {} {:?}",
                        a.name, a.dtype, a.shape, b.name, b.dtype, b.shape
                    ),
                });
            }
        }
        Ok(())
    }

    /// Check that each buffer has exactly the tensor's storage size.
    pub fn check_buffers(&self, lens: impl Iterator<Item = usize>) -> Result<()> {
        let mut n = 0;
        for (t, len) in self.tensors.iter().zip(lens) {
            n += 1;
            let want = t.storage_bytes()?;
            if want != len as u64 {
                return Err(Error::LayoutMismatch {
                    detail: format!("tensor {} ({} {:?}) needs {want} bytes of storage, the buffer has {len}", t.name, t.dtype, t.shape),
                });
            }
        }
        if n != self.tensors.len() {
            return Err(Error::LayoutMismatch { detail: format!("expected {} tensor buffers, got {n}", self.tensors.len()) });
        }
        Ok(())
    }
}


/// The safetensors files a checkpoint path names, and the tensor-to-file map
/// of its index when it has one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointFiles {
    pub files: Vec<PathBuf>,
    /// `weight_map` of the index (tensor name to file name), if one was used.
    pub weight_map: Option<std::collections::BTreeMap<String, String>>,
}

/// Upper bound on a `*.safetensors.index.json` (a 1T-parameter model's index
/// is a few MiB).
const MAX_INDEX_BYTES: u64 = 256 << 20;

/// Resolve a checkpoint path: one `.safetensors` file; a
/// `*.safetensors.index.json` (its `weight_map` names the shard files beside
/// it); or a directory holding one such index, or else its `*.safetensors`
/// files (hidden files skipped). Sharded checkpoints (`model-00001-of-00004.
/// safetensors`, ...) are one checkpoint: the union of their tensors.
pub fn checkpoint_files(path: &Path) -> Result<CheckpointFiles> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io("open", path, e))?;
    if meta.is_dir() {
        let mut shards = Vec::new();
        let mut indexes = Vec::new();
        for entry in std::fs::read_dir(path).map_err(|e| Error::io("list", path, e))? {
            let entry = entry.map_err(|e| Error::io("list", path, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            if name.ends_with(".safetensors.index.json") {
                indexes.push(entry.path());
            } else if name.ends_with(".safetensors") {
                shards.push(entry.path());
            }
        }
        indexes.sort();
        shards.sort();
        return match indexes.len() {
            0 if shards.is_empty() => Err(Error::Checkpoint {
                path: path.into(),
                detail: "the directory holds no .safetensors files".into(),
            }),
            0 => Ok(CheckpointFiles { files: shards, weight_map: None }),
            1 => index_files(&indexes[0]),
            _ => Err(Error::Checkpoint {
                path: path.into(),
                detail: format!(
                    "the directory holds {} safetensors indexes ({}); pass the one to use",
                    indexes.len(),
                    indexes.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
                ),
            }),
        };
    }
    if path.to_string_lossy().ends_with(".index.json") {
        return index_files(path);
    }
    Ok(CheckpointFiles { files: vec![path.to_path_buf()], weight_map: None })
}

/// The shard files of a `*.safetensors.index.json`.
fn index_files(index: &Path) -> Result<CheckpointFiles> {
    use std::io::Read;
    let bad = |detail: String| Error::Checkpoint { path: index.into(), detail };
    let too_large = |len: u64| bad(format!("the index is {len} bytes, over the limit of {MAX_INDEX_BYTES} (a real index is a few MB at most); pass the checkpoint's *.safetensors.index.json"));
    let file = File::open(index).map_err(|e| Error::io("open", index, e))?;
    // Refused by its size before any of it is read; the read is bounded
    // as well (a file that grows, or one with no size, such as a pipe).
    let len = file.metadata().map_err(|e| Error::io("stat", index, e))?.len();
    if len > MAX_INDEX_BYTES {
        return Err(too_large(len));
    }
    let mut text = String::new();
    file.take(MAX_INDEX_BYTES + 1).read_to_string(&mut text).map_err(|e| Error::io("read", index, e))?;
    if text.len() as u64 > MAX_INDEX_BYTES {
        return Err(too_large(text.len() as u64));
    }
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("the index is not JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("the index has no \"weight_map\" object".into()))?;
    let mut weight_map = std::collections::BTreeMap::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| bad(format!("weight_map entry {name:?} is not a file name")))?;
        let plain = Path::new(file);
        if plain.components().count() != 1 || plain.file_name().is_none() {
            return Err(bad(format!("weight_map names {file:?} for {name:?}; shards must be plain file names beside the index")));
        }
        weight_map.insert(name.clone(), file.to_string());
    }
    let dir = index.parent().unwrap_or(Path::new(""));
    let mut files: Vec<PathBuf> = weight_map.values().map(|f| dir.join(f)).collect();
    files.sort();
    files.dedup();
    if files.is_empty() {
        return Err(bad("the index's weight_map is empty".into()));
    }
    Ok(CheckpointFiles { files, weight_map: Some(weight_map) })
}

/// One memory-mapped safetensors file of a checkpoint.
struct Shard<M> {
    path: PathBuf,
    map: M,
}

/// A checkpoint on disk (one safetensors file, or the shards of a sharded
/// one) viewed in canonical order through memory maps.
pub struct MappedCheckpoint<M> {
    path: PathBuf,
    shards: Vec<Shard<M>>,
    layout: Layout,
    /// Where each tensor's bytes lie (canonical order): shard index and
    /// byte range within that shard.
    places: Vec<(usize, Range<usize>)>,
}

pub type ReadOnlyCheckpoint = MappedCheckpoint<memmap2::Mmap>;
pub type WritableCheckpoint = MappedCheckpoint<memmap2::MmapMut>;

/// The tensors of one safetensors file and their byte ranges in it.
fn parse_shard(path: &Path, bytes: &[u8]) -> Result<Vec<(TensorSpec, Range<usize>)>> {
    let (header_len, meta) = SafeTensors::read_metadata(bytes).map_err(|e| {
        let detail = match e {
            safetensors::SafeTensorError::MetadataIncompleteBuffer => {
                let header = bytes.get(..8).map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
                let data = (bytes.len() as u64).saturating_sub(8).saturating_sub(header);
                format!("{e}: its data region holds {data} bytes, not what its header declares; a truncated file, or one still being written?")
            }
            e => e.to_string(),
        };
        Error::Checkpoint { path: path.into(), detail }
    })?;
    let data_start = 8usize
        .checked_add(header_len)
        .ok_or_else(|| Error::Checkpoint { path: path.into(), detail: "header length overflows".into() })?;
    let mut tensors = Vec::new();
    for (name, info) in meta.tensors() {
        let spec = TensorSpec {
            name: name.clone(),
            dtype: DType(info.dtype),
            shape: info.shape.iter().map(|&d| d as u64).collect(),
        };
        let (a, b) = info.data_offsets;
        let range = data_start + a..data_start + b;
        if range.end > bytes.len() || spec.storage_bytes()? != (b - a) as u64 {
            return Err(Error::Checkpoint {
                path: path.into(),
                detail: format!("tensor {name} has data offsets {a}..{b} that do not fit its shape or the file"),
            });
        }
        tensors.push((spec, range));
    }
    let mut sorted: Vec<_> = tensors.iter().map(|(_, r)| r.clone()).filter(|r| !r.is_empty()).collect();
    sorted.sort_by_key(|r| r.start);
    if sorted.windows(2).any(|w| w[0].end > w[1].start) {
        return Err(Error::Checkpoint { path: path.into(), detail: "two tensors share bytes".into() });
    }
    Ok(tensors)
}

impl<M: std::ops::Deref<Target = [u8]>> MappedCheckpoint<M> {
    /// Map every file of the checkpoint at `path` with `map` and join their
    /// tensors into one layout (names unique across files; with an index,
    /// each tensor in the file the index names).
    fn open_with(path: &Path, map: impl Fn(&Path) -> Result<M>) -> Result<Self> {
        let found = checkpoint_files(path)?;
        let mut shards = Vec::with_capacity(found.files.len());
        let mut all: Vec<(TensorSpec, usize, Range<usize>)> = Vec::new();
        for (k, file) in found.files.iter().enumerate() {
            let shard = Shard { path: file.clone(), map: map(file)? };
            all.extend(parse_shard(file, &shard.map)?.into_iter().map(|(spec, range)| (spec, k, range)));
            shards.push(shard);
        }
        all.sort_by(|a, b| a.0.name.cmp(&b.0.name));
        if let Some(w) = all.windows(2).find(|w| w[0].0.name == w[1].0.name) {
            return Err(Error::Checkpoint {
                path: path.into(),
                detail: format!(
                    "tensor {:?} is stored twice, in {} and {}; a checkpoint's files must hold disjoint tensors",
                    w[0].0.name,
                    shards[w[0].1].path.display(),
                    shards[w[1].1].path.display()
                ),
            });
        }
        if let Some(weight_map) = &found.weight_map {
            check_weight_map(path, weight_map, &all, &shards)?;
        }
        let places = all.iter().map(|(_, k, r)| (*k, r.clone())).collect();
        let layout = Layout::new(all.into_iter().map(|(spec, _, _)| spec).collect())?;
        Ok(MappedCheckpoint { path: path.into(), shards, layout, places })
    }

    /// The path the checkpoint was opened from (a file, a directory or an index).
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The safetensors files it spans.
    pub fn files(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    pub fn tensor(&self, i: usize) -> &[u8] {
        let (k, r) = &self.places[i];
        &self.shards[*k].map[r.clone()]
    }
    pub fn buffers(&self) -> Vec<&[u8]> {
        (0..self.places.len()).map(|i| self.tensor(i)).collect()
    }
    pub fn digests(&self) -> Vec<Digest> {
        self.layout.tensor_digests(&self.buffers())
    }
    pub fn checkpoint_digest(&self) -> Digest {
        self.layout.checkpoint_digest(&self.digests())
    }
}

/// An index that disagrees with its shards is stale: refuse it rather than
/// guess which side is right.
fn check_weight_map<M>(
    path: &Path,
    weight_map: &std::collections::BTreeMap<String, String>,
    all: &[(TensorSpec, usize, Range<usize>)],
    shards: &[Shard<M>],
) -> Result<()> {
    let stale = |detail: String| Error::Checkpoint {
        path: path.into(),
        detail: format!("{detail}; the index is stale: rewrite it, or delete it (a directory without an index is read as all its .safetensors files)"),
    };
    for (spec, k, _) in all {
        let file = shards[*k].path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        match weight_map.get(&spec.name) {
            Some(listed) if *listed == file => {}
            Some(listed) => return Err(stale(format!("tensor {:?} is in {file} but the index says {listed}", spec.name))),
            None => return Err(stale(format!("tensor {:?} in {file} is missing from the index", spec.name))),
        }
    }
    if weight_map.len() != all.len() {
        let held: std::collections::BTreeSet<&str> = all.iter().map(|(s, _, _)| s.name.as_str()).collect();
        let missing = weight_map.keys().find(|n| !held.contains(n.as_str())).cloned().unwrap_or_default();
        return Err(stale(format!("the index lists tensor {missing:?}, which no shard holds")));
    }
    Ok(())
}

impl ReadOnlyCheckpoint {
    /// Open a checkpoint for reading: a safetensors file, a directory of
    /// shards, or an index (see [`checkpoint_files`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path.as_ref(), |file| {
            let f = File::open(file).map_err(|e| Error::io("open", file, e))?;
            // Safety: the map is read-only; a concurrent writer to the same
            // file could change bytes under us, which the digests then detect.
            #[allow(unsafe_code)]
            unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io("mmap", file, e))
        })
    }
}

impl WritableCheckpoint {
    /// Open a checkpoint to write it in place (every file of a sharded one).
    pub fn open_rw(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path.as_ref(), |file| {
            let f = OpenOptions::new().read(true).write(true).open(file).map_err(|e| Error::io("open for writing", file, e))?;
            // Safety: dcr owns the target for the duration of the refit; a
            // concurrent writer would be caught by the final digest check.
            #[allow(unsafe_code)]
            unsafe { memmap2::MmapMut::map_mut(&f) }.map_err(|e| Error::io("mmap", file, e))
        })
    }

    /// Mutable views of every tensor, in canonical order.
    pub fn buffers_mut(&mut self) -> Vec<&mut [u8]> {
        let mut out: Vec<Option<&mut [u8]>> = (0..self.places.len()).map(|_| None).collect();
        let mut by_shard: Vec<Vec<usize>> = vec![Vec::new(); self.shards.len()];
        for (i, (k, _)) in self.places.iter().enumerate() {
            by_shard[*k].push(i);
        }
        // Split each map into disjoint tensor slices (ranges checked disjoint at open).
        for (shard, mut order) in self.shards.iter_mut().zip(by_shard) {
            order.sort_by_key(|&i| self.places[i].1.start);
            let mut rest: &mut [u8] = &mut shard.map[..];
            let mut consumed = 0usize;
            for i in order {
                let r = self.places[i].1.clone();
                if r.is_empty() {
                    out[i] = Some(&mut []);
                    continue;
                }
                let tail = std::mem::take(&mut rest);
                let (_, tail) = tail.split_at_mut(r.start - consumed);
                let (mine, tail) = tail.split_at_mut(r.len());
                consumed = r.end;
                rest = tail;
                out[i] = Some(mine);
            }
        }
        out.into_iter().map(|o| o.expect("every range assigned")).collect()
    }

    /// Flush written pages of every file to stable storage.
    pub fn flush(&self) -> Result<()> {
        for s in &self.shards {
            s.map.flush().map_err(|e| Error::io("flush", &s.path, e))?;
        }
        Ok(())
    }

    /// The file (shard index) and byte range within it of `bytes` of tensor `i`.
    pub fn file_range(&self, i: usize, bytes: Range<usize>) -> (usize, Range<usize>) {
        let (k, r) = &self.places[i];
        let start = r.start + bytes.start;
        (*k, start..start + bytes.len())
    }

    /// Flush a byte range of one file (one `msync` however many tensors it spans).
    pub fn flush_file_range(&self, shard: usize, bytes: Range<usize>) -> Result<()> {
        let s = &self.shards[shard];
        s.map.flush_range(bytes.start, bytes.len()).map_err(|e| Error::io("flush", &s.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::{Dtype, TensorView};

    /// Write a safetensors file of BF16 tensors given as raw bytes.
    fn write(path: &Path, tensors: &[(&str, Vec<u8>)]) {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(name, bytes)| (name.to_string(), TensorView::new(Dtype::BF16, vec![bytes.len() / 2], bytes).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    fn bytes(seed: u8, n: usize) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    fn index(dir: &Path, entries: &[(&str, &str)]) {
        let map: serde_json::Map<String, serde_json::Value> =
            entries.iter().map(|(t, f)| (t.to_string(), serde_json::Value::from(*f))).collect();
        let json = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
        std::fs::write(dir.join("model.safetensors.index.json"), json.to_string()).unwrap();
    }

    /// Two shards holding interleaved names, and the same tensors in one file.
    fn sharded(dir: &Path) -> PathBuf {
        let shards = dir.join("ckpt");
        std::fs::create_dir(&shards).unwrap();
        write(&shards.join("model-00001-of-00002.safetensors"), &[("b.w", bytes(1, 64)), ("d.w", bytes(2, 32))]);
        write(&shards.join("model-00002-of-00002.safetensors"), &[("a.w", bytes(3, 16)), ("c.w", bytes(4, 0))]);
        write(&dir.join("whole.safetensors"), &[("a.w", bytes(3, 16)), ("b.w", bytes(1, 64)), ("c.w", bytes(4, 0)), ("d.w", bytes(2, 32))]);
        shards
    }

    #[test]
    fn shards_are_one_checkpoint_in_canonical_order() {
        let dir = tempfile::tempdir().unwrap();
        let shards = sharded(dir.path());
        // Not a checkpoint file: hidden files are skipped.
        std::fs::write(shards.join(".partial.safetensors"), b"junk").unwrap();
        let ck = ReadOnlyCheckpoint::open(&shards).unwrap();
        let names: Vec<_> = ck.layout().tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a.w", "b.w", "c.w", "d.w"]);
        assert_eq!(ck.files().len(), 2);
        assert_eq!(ck.buffers(), [&bytes(3, 16)[..], &bytes(1, 64)[..], &[][..], &bytes(2, 32)[..]]);
        let whole = ReadOnlyCheckpoint::open(dir.path().join("whole.safetensors")).unwrap();
        assert_eq!(ck.layout(), whole.layout());
        assert_eq!(ck.checkpoint_digest(), whole.checkpoint_digest());
    }

    #[test]
    fn writes_land_in_the_shard_that_holds_the_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let shards = sharded(dir.path());
        {
            let mut ck = WritableCheckpoint::open_rw(&shards).unwrap();
            let mut bufs = ck.buffers_mut();
            bufs[0][3] ^= 0xff; // a.w, second shard
            bufs[3][0] ^= 0x01; // d.w, first shard
            drop(bufs);
            let (file, range) = ck.file_range(0, 3..4);
            assert_eq!(file, 1);
            ck.flush_file_range(file, range).unwrap();
            ck.flush().unwrap();
        }
        let first = ReadOnlyCheckpoint::open(shards.join("model-00001-of-00002.safetensors")).unwrap();
        let second = ReadOnlyCheckpoint::open(shards.join("model-00002-of-00002.safetensors")).unwrap();
        let (mut a, mut d) = (bytes(3, 16), bytes(2, 32));
        a[3] ^= 0xff;
        d[0] ^= 0x01;
        assert_eq!(second.tensor(second.layout().index_of("a.w").unwrap()), &a[..]);
        assert_eq!(first.tensor(first.layout().index_of("d.w").unwrap()), &d[..]);
        assert_eq!(first.tensor(first.layout().index_of("b.w").unwrap()), &bytes(1, 64)[..]);
    }

    fn refusal(path: &Path) -> String {
        match ReadOnlyCheckpoint::open(path) {
            Err(e @ Error::Checkpoint { .. }) => e.to_string(),
            Err(e) => panic!("expected a checkpoint error, got {e}"),
            Ok(_) => panic!("{} opened", path.display()),
        }
    }

    #[test]
    fn an_index_picks_the_shards_and_must_agree_with_them() {
        let dir = tempfile::tempdir().unwrap();
        let shards = sharded(dir.path());
        let (one, two) = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors");
        let right = [("a.w", two), ("b.w", one), ("c.w", two), ("d.w", one)];
        index(&shards, &right);
        // A stray file beside an index is not part of the checkpoint.
        write(&shards.join("stray.safetensors"), &[("a.w", bytes(9, 16))]);
        let ck = ReadOnlyCheckpoint::open(&shards).unwrap();
        assert_eq!(ck.files().len(), 2);
        let by_index = ReadOnlyCheckpoint::open(shards.join("model.safetensors.index.json")).unwrap();
        assert_eq!(by_index.checkpoint_digest(), ck.checkpoint_digest());

        index(&shards, &[("a.w", one), ("b.w", one), ("c.w", two), ("d.w", one)]);
        let msg = refusal(&shards);
        assert!(msg.contains("\"a.w\" is in model-00002-of-00002.safetensors but the index says model-00001"), "{msg}");
        assert!(msg.contains("stale"), "{msg}");
        index(&shards, &[("a.w", two), ("b.w", one), ("c.w", two), ("d.w", one), ("e.w", one)]);
        assert!(refusal(&shards).contains("lists tensor \"e.w\", which no shard holds"));
        index(&shards, &[("a.w", two), ("b.w", one), ("c.w", two)]);
        assert!(refusal(&shards).contains("\"d.w\" in model-00001-of-00002.safetensors is missing from the index"));
        index(&shards, &[("a.w", "../whole.safetensors")]);
        assert!(refusal(&shards).contains("plain file names"));
        std::fs::write(shards.join("model.safetensors.index.json"), "{\"weight_map\": 3}").unwrap();
        assert!(refusal(&shards).contains("no \"weight_map\" object"));
        std::fs::write(shards.join("model.safetensors.index.json"), "{\"weight_map\": {}}").unwrap();
        assert!(refusal(&shards).contains("the index's weight_map is empty"));
        std::fs::write(shards.join("model.safetensors.index.json"), "{\"weight_map\": {\"a.w\": 7}}").unwrap();
        assert!(refusal(&shards).contains("weight_map entry \"a.w\" is not a file name"));
        std::fs::write(shards.join("model.safetensors.index.json"), "{\"weight_map\"").unwrap();
        assert!(refusal(&shards).contains("the index is not JSON"));
        // An index larger than any real one is refused before it is parsed
        // (a sparse file: no disk is spent on it).
        std::fs::File::create(shards.join("model.safetensors.index.json")).unwrap().set_len(MAX_INDEX_BYTES + 1).unwrap();
        let msg = refusal(&shards);
        assert!(msg.contains(&format!("the index is {} bytes, over the limit of {MAX_INDEX_BYTES}", MAX_INDEX_BYTES + 1)), "{msg}");
        std::fs::write(shards.join("other.safetensors.index.json"), "{}").unwrap();
        assert!(refusal(&shards).contains("2 safetensors indexes"));
    }

    #[test]
    fn a_tensor_in_two_shards_or_no_shards_at_all_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let shards = sharded(dir.path());
        write(&shards.join("extra.safetensors"), &[("b.w", bytes(1, 64))]);
        let msg = refusal(&shards);
        assert!(msg.contains("\"b.w\" is stored twice"), "{msg}");
        assert!(msg.contains("extra.safetensors") && msg.contains("model-00001-of-00002.safetensors"), "{msg}");
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        assert!(refusal(&empty).contains("holds no .safetensors files"));
    }
}
