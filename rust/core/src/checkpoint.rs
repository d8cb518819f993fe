//! The canonical checkpoint model: an ordered list of named tensors (name,
//! dtype, shape) and the digests that identify a version bit for bit.

use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
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
        self.tensors.par_iter().zip(buffers.par_iter()).map(|(t, b)| tensor_digest(b, t.dtype)).collect()
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


/// A safetensors file viewed in canonical order through a memory map.
pub struct SafetensorsFile<M> {
    path: PathBuf,
    map: M,
    layout: Layout,
    /// Byte range of each tensor (canonical order) within the file.
    ranges: Vec<Range<usize>>,
}

pub type ReadOnlyCheckpoint = SafetensorsFile<memmap2::Mmap>;
pub type WritableCheckpoint = SafetensorsFile<memmap2::MmapMut>;

fn parse_layout(path: &Path, bytes: &[u8]) -> Result<(Layout, Vec<Range<usize>>)> {
    let (header_len, meta) = SafeTensors::read_metadata(bytes)
        .map_err(|e| Error::Checkpoint { path: path.into(), detail: e.to_string() })?;
    let data_start = 8usize
        .checked_add(header_len)
        .ok_or_else(|| Error::Checkpoint { path: path.into(), detail: "header length overflows".into() })?;
    let mut specs = Vec::new();
    let mut by_name = Vec::new();
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
        by_name.push((name.clone(), range));
        specs.push(spec);
    }
    let layout = Layout::new(specs)?;
    by_name.sort_by(|a, b| a.0.cmp(&b.0));
    let ranges: Vec<_> = by_name.into_iter().map(|(_, r)| r).collect();
    let mut sorted: Vec<_> = ranges.iter().filter(|r| !r.is_empty()).cloned().collect();
    sorted.sort_by_key(|r| r.start);
    if sorted.windows(2).any(|w| w[0].end > w[1].start) {
        return Err(Error::Checkpoint { path: path.into(), detail: "two tensors share bytes".into() });
    }
    Ok((layout, ranges))
}

impl<M: std::ops::Deref<Target = [u8]>> SafetensorsFile<M> {
    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    pub fn tensor(&self, i: usize) -> &[u8] {
        &self.map[self.ranges[i].clone()]
    }
    pub fn buffers(&self) -> Vec<&[u8]> {
        self.ranges.iter().map(|r| &self.map[r.clone()]).collect()
    }
    pub fn digests(&self) -> Vec<Digest> {
        self.layout.tensor_digests(&self.buffers())
    }
    pub fn checkpoint_digest(&self) -> Digest {
        self.layout.checkpoint_digest(&self.digests())
    }
}

impl ReadOnlyCheckpoint {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
        // Safety: the map is read-only; a concurrent writer to the same file
        // could change bytes under us, which the digests then detect.
        #[allow(unsafe_code)]
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io("mmap", path, e))?;
        let (layout, ranges) = parse_layout(path, &map)?;
        Ok(SafetensorsFile { path: path.into(), map, layout, ranges })
    }
}

impl WritableCheckpoint {
    pub fn open_rw(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(|e| Error::io("open for writing", path, e))?;
        // Safety: dcr owns the target file for the duration of the refit; a
        // concurrent writer would be caught by the final digest check.
        #[allow(unsafe_code)]
        let map = unsafe { memmap2::MmapMut::map_mut(&file) }.map_err(|e| Error::io("mmap", path, e))?;
        let (layout, ranges) = parse_layout(path, &map)?;
        Ok(SafetensorsFile { path: path.into(), map, layout, ranges })
    }

    /// Mutable views of every tensor, in canonical order.
    pub fn buffers_mut(&mut self) -> Vec<&mut [u8]> {
        // Split the map into disjoint tensor slices (ranges checked disjoint at open).
        let mut order: Vec<usize> = (0..self.ranges.len()).collect();
        order.sort_by_key(|&i| self.ranges[i].start);
        let mut out: Vec<Option<&mut [u8]>> = (0..self.ranges.len()).map(|_| None).collect();
        let mut rest: &mut [u8] = &mut self.map[..];
        let mut consumed = 0usize;
        for i in order {
            let r = self.ranges[i].clone();
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
        out.into_iter().map(|o| o.expect("every range assigned")).collect()
    }

    /// Flush written pages to the file and the file to stable storage.
    pub fn flush(&self) -> Result<()> {
        self.map.flush().map_err(|e| Error::io("flush", &self.path, e))
    }

    /// Flush the bytes of tensor `i` within `bytes` (a sub-range of the tensor).
    pub fn flush_range(&self, i: usize, bytes: Range<usize>) -> Result<()> {
        let start = self.ranges[i].start + bytes.start;
        self.map.flush_range(start, bytes.len()).map_err(|e| Error::io("flush", &self.path, e))
    }

    /// The byte range within the file of `bytes` of tensor `i`.
    pub fn file_range(&self, i: usize, bytes: Range<usize>) -> Range<usize> {
        let start = self.ranges[i].start + bytes.start;
        start..start + bytes.len()
    }

    /// Flush a byte range of the file (one `msync` however many tensors it spans).
    pub fn flush_file_range(&self, bytes: Range<usize>) -> Result<()> {
        self.map.flush_range(bytes.start, bytes.len()).map_err(|e| Error::io("flush", &self.path, e))
    }
}
