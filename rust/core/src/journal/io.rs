//! The file operations the journal needs, behind a trait so tests can fail
//! any single write or sync, fill the disk, or crash the "machine" at any
//! point (see [`super::sim::SimIo`]), the way redb's fuzzer does.
//!
//! Only the operations the journal uses are here. Every method maps onto one
//! system call of the real implementation ([`StdIo`]), so a fault injected at
//! the Nth call means the same thing as a failure of the Nth system call.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::Path;

/// Directory-level operations plus opening files.
pub trait JournalIo {
    /// An open file handle.
    type File: JournalFile;

    /// Reads the whole file; `Ok(None)` if it does not exist.
    fn read(&mut self, path: &Path) -> io::Result<Option<Vec<u8>>>;
    /// Creates `path` (truncating it if it exists) and opens it for writing.
    fn create(&mut self, path: &Path) -> io::Result<Self::File>;
    /// Opens an existing file for writing.
    fn open(&mut self, path: &Path) -> io::Result<Self::File>;
    /// Atomically renames `from` to `to`, replacing `to`.
    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes `path`; `Ok(())` if it did not exist.
    fn remove(&mut self, path: &Path) -> io::Result<()>;
    /// Makes the directory entries of `dir` (creates, renames, removes) durable.
    fn sync_dir(&mut self, dir: &Path) -> io::Result<()>;
}

/// Operations on one open file.
pub trait JournalFile {
    /// Writes all of `buf` at `offset` (extending the file if needed).
    fn write_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()>;
    /// Truncates or extends the file to `len` bytes.
    fn set_len(&mut self, len: u64) -> io::Result<()>;
    /// Makes the file's data and size durable (`fdatasync`).
    fn sync_data(&mut self) -> io::Result<()>;
}

/// The real file system through `std::fs`.
#[derive(Debug, Clone, Copy, Default)]
pub struct StdIo;

/// A [`JournalFile`] over a `std::fs::File`.
#[derive(Debug)]
pub struct StdFile(File);

impl JournalIo for StdIo {
    type File = StdFile;

    fn read(&mut self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        match File::open(path) {
            Ok(mut f) => {
                let mut buf = Vec::new();
                f.read_to_end(&mut buf)?;
                Ok(Some(buf))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn create(&mut self, path: &Path) -> io::Result<StdFile> {
        let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
        Ok(StdFile(f))
    }

    fn open(&mut self, path: &Path) -> io::Result<StdFile> {
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        Ok(StdFile(f))
    }

    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove(&mut self, path: &Path) -> io::Result<()> {
        match std::fs::remove_file(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            r => r,
        }
    }

    #[cfg(unix)]
    fn sync_dir(&mut self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    /// Windows cannot open a directory as a file; NTFS journals its metadata.
    #[cfg(not(unix))]
    fn sync_dir(&mut self, _dir: &Path) -> io::Result<()> {
        Ok(())
    }
}

impl JournalFile for StdFile {
    fn write_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.0.seek(SeekFrom::Start(offset))?;
        self.0.write_all(buf)
    }

    fn set_len(&mut self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }

    fn sync_data(&mut self) -> io::Result<()> {
        self.0.sync_data()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn std_io_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a");
        let q = dir.path().join("b");
        let mut io = StdIo;
        assert!(io.read(&p).unwrap().is_none());
        let mut f = io.create(&p).unwrap();
        f.write_at(0, b"hello").unwrap();
        f.write_at(3, b"LOWORLD").unwrap();
        f.sync_data().unwrap();
        assert_eq!(io.read(&p).unwrap().unwrap(), b"helLOWORLD");
        f.set_len(4).unwrap();
        assert_eq!(io.read(&p).unwrap().unwrap(), b"helL");
        io.rename(&p, &q).unwrap();
        io.sync_dir(dir.path()).unwrap();
        assert!(io.read(&p).unwrap().is_none());
        let mut g = io.open(&q).unwrap();
        g.write_at(4, b"!").unwrap();
        assert_eq!(io.read(&q).unwrap().unwrap(), b"helL!");
        io.remove(&q).unwrap();
        io.remove(&q).unwrap();
        assert!(io.read(&q).unwrap().is_none());
    }
}
