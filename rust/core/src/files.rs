//! File-level operations used by the CLI and the bindings: diff two
//! safetensors files into a delta file (written atomically), apply a delta
//! file in place, compare, inspect.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use bytes::Bytes;

use crate::checkpoint::{ReadOnlyCheckpoint, WritableCheckpoint};
use crate::delta::{self, ApplyOutcome, Delta, DeltaStats, DiffOptions};
use crate::error::{Error, Result};

/// fsync a directory so a create or rename inside it is durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let dir = dir_or_here(dir);
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io("sync directory", dir, e))
}

/// Write a file atomically: a temporary sibling, fsync, rename, fsync the
/// directory. A crash leaves either the old file or the complete new one.
///
/// A path that already names something other than a regular file (a pipe,
/// `/dev/stdout`, a device) is written in place instead: renaming over it
/// would replace the pipe or device node with a file, and a write error
/// such as a full device must reach the caller.
///
/// A symbolic link is followed: the file it names is replaced, not the
/// link (so `-o /dev/stdout` redirected to a file writes that file).
pub fn write_atomically(path: &Path, write: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    if fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir()) {
        return write_in_place(path, write);
    }
    let resolved;
    let path = if fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
        resolved = fs::canonicalize(path).map_err(|e| Error::io("resolve the link", path, e))?;
        resolved.as_path()
    } else {
        path
    };
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let name = path.file_name().ok_or_else(|| Error::Invalid(format!("{} is not a file path", path.display())))?;
    let tmp: PathBuf = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let file = File::create(&tmp).map_err(|e| Error::io("create a temporary file in", dir_or_here(&dir), e))?;
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

/// A file's parent as `Path::parent` gives it, with "" (a bare file name)
/// read as the current directory.
fn dir_or_here(dir: &Path) -> &Path {
    if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    }
}

/// `write_atomically` into a pipe or device: opened for writing as it is
/// (never created or truncated), every byte flushed. There is nothing
/// durable to fsync.
fn write_in_place(path: &Path, write: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let file = fs::OpenOptions::new().write(true).open(path).map_err(|e| Error::io("open for writing", path, e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    write(&mut w)?;
    w.into_inner().map_err(|e| Error::io("write", path, e.into_error()))?;
    Ok(())
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

/// Read and fully validate a delta file (nothing applied). The chunk
/// payloads stay in the one buffer the file was read into.
pub fn read_delta_file(path: &Path) -> Result<(Delta<Bytes>, u64)> {
    let bytes = Bytes::from(fs::read(path).map_err(|e| Error::io("read", path, e))?);
    let delta = delta::read_delta(&bytes)?.map_payloads(|payload| bytes.slice_ref(payload));
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

pub fn inspect_file(path: &Path) -> Result<(Delta<Bytes>, DeltaStats)> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn fifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // Safety: a valid NUL-terminated path.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
        assert_eq!(rc, 0, "mkfifo {}", path.display());
    }

    #[test]
    fn a_pipe_is_written_through_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let pipe = dir.path().join("out.pipe");
        fifo(&pipe);
        let reader = {
            let pipe = pipe.clone();
            std::thread::spawn(move || fs::read(pipe).unwrap())
        };
        let payload: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7) as u8).collect();
        write_atomically(&pipe, |w| w.write_all(&payload).map_err(|e| Error::io("write", &pipe, e))).unwrap();
        // Checked before joining: a reader of a replaced pipe waits forever.
        use std::os::unix::fs::FileTypeExt;
        assert!(fs::metadata(&pipe).unwrap().file_type().is_fifo(), "the pipe was replaced by a file");
        assert_eq!(reader.join().unwrap(), payload);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1, "a temporary file was left behind");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_full_device_is_an_error_and_stays_a_device() {
        use std::os::unix::fs::FileTypeExt;
        let full = Path::new("/dev/full");
        assert!(fs::metadata(full).unwrap().file_type().is_char_device(), "/dev/full is not a device on this host");
        let err = write_atomically(full, |w| w.write_all(&[1u8; 1 << 21]).map_err(|e| Error::io("write", full, e))).unwrap_err();
        assert!(err.to_string().contains("/dev/full"), "{err}");
        assert!(fs::metadata(full).unwrap().file_type().is_char_device());
    }

    #[test]
    fn a_link_is_followed_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("real.dcr");
        let link = dir.path().join("link.dcr");
        fs::write(&target, b"old").unwrap();
        std::os::unix::fs::symlink(&target, &link).unwrap();
        write_atomically(&link, |w| w.write_all(b"new").map_err(|e| Error::io("write", &link, e))).unwrap();
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced");
        assert_eq!(fs::read(&target).unwrap(), b"new");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("delta.dcr");
        fs::write(&path, b"old").unwrap();
        let err = write_atomically(&path, |w| {
            w.write_all(b"partial").map_err(|e| Error::io("write", &path, e))?;
            Err(Error::Invalid("stopped halfway".into()))
        })
        .unwrap_err();
        assert!(err.to_string().contains("stopped halfway"));
        assert_eq!(fs::read(&path).unwrap(), b"old");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
