//! File-level operations used by the CLI and the bindings: diff two
//! safetensors files into a delta file (written atomically), apply a delta
//! file in place, compare, inspect.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::checkpoint::{ReadOnlyCheckpoint, WritableCheckpoint};
use crate::delta::{self, ApplyOutcome, Delta, DeltaStats, DiffOptions};
use crate::error::{Error, Result};

/// fsync a directory so a create or rename inside it is durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io("sync directory", dir, e))
}

/// Write a file atomically: a temporary sibling, fsync, rename, fsync the
/// directory. A crash leaves either the old file or the complete new one.
pub fn write_atomically(path: &Path, write: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let name = path.file_name().ok_or_else(|| Error::Invalid(format!("{} is not a file path", path.display())))?;
    let tmp: PathBuf = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let file = File::create(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        write(&mut w)?;
        let file = w.into_inner().map_err(|e| Error::io("write", &tmp, e.into_error()))?;
        file.sync_all().map_err(|e| Error::io("sync", &tmp, e))?;
        fs::rename(&tmp, path).map_err(|e| Error::io("rename into place", path, e))?;
        sync_dir(&dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

pub fn diff_files(
    old: &Path,
    new: &Path,
    out: &Path,
    opts: &DiffOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<DeltaStats> {
    let old_ck = ReadOnlyCheckpoint::open(old)?;
    let new_ck = ReadOnlyCheckpoint::open(new)?;
    old_ck.layout().ensure_same(new_ck.layout(), &format!("{} against {}", new.display(), old.display()))?;
    let mut stats = None;
    write_atomically(out, |w| {
        stats = Some(delta::diff(
            old_ck.layout(),
            &old_ck.buffers(),
            &new_ck.buffers(),
            opts,
            &mut |bytes| w.write_all(bytes).map_err(|e| Error::io("write", out, e)),
            progress,
        )?);
        Ok(())
    })?;
    Ok(stats.expect("diff ran"))
}

/// Read and fully validate a delta file (nothing applied).
pub fn read_delta_file(path: &Path) -> Result<(Delta, u64)> {
    let bytes = fs::read(path).map_err(|e| Error::io("read", path, e))?;
    let delta = delta::read_delta(&bytes)?;
    Ok((delta, bytes.len() as u64))
}

pub fn apply_file(delta_path: &Path, target: &Path) -> Result<ApplyOutcome> {
    let (delta, _) = read_delta_file(delta_path)?;
    let mut ck = WritableCheckpoint::open_rw(target)?;
    let layout = ck.layout().clone();
    let outcome = {
        let mut buffers = ck.buffers_mut();
        delta::apply(&delta, &layout, &mut buffers)?
    };
    ck.flush()?;
    Ok(outcome)
}

pub fn inspect_file(path: &Path) -> Result<(Delta, DeltaStats)> {
    let (delta, len) = read_delta_file(path)?;
    let stats = delta::summarize(&delta, len);
    Ok((delta, stats))
}

/// Names of tensors whose bits differ.
pub fn compare_files(a: &Path, b: &Path) -> Result<Vec<String>> {
    let ca = ReadOnlyCheckpoint::open(a)?;
    let cb = ReadOnlyCheckpoint::open(b)?;
    delta::compare(ca.layout(), &ca.buffers(), cb.layout(), &cb.buffers())
}
