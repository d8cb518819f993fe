//! Spill of retained chunks to files (one per version) in a directory.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::PathBuf;

use crate::relay::store::{Spill, SpillRef};

/// Chunks beyond the memory budget, in `dir/dcr-spill-<pid>-v<version>`.
#[derive(Debug)]
pub struct FileSpill {
    dir: PathBuf,
    files: HashMap<u64, (File, u64)>,
}

impl FileSpill {
    /// A spill in `dir` (created if missing).
    pub fn new(dir: impl Into<PathBuf>) -> io::Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir)?;
        Ok(FileSpill {
            dir,
            files: HashMap::new(),
        })
    }

    fn path(&self, version: u64) -> PathBuf {
        self.dir
            .join(format!("dcr-spill-{}-v{version}", std::process::id()))
    }
}

impl Spill for FileSpill {
    fn put(&mut self, version: u64, data: &[u8]) -> io::Result<SpillRef> {
        if !self.files.contains_key(&version) {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(self.path(version))?;
            self.files.insert(version, (f, 0));
        }
        let (f, end) = self.files.get_mut(&version).expect("inserted");
        f.seek(SeekFrom::Start(*end))?;
        f.write_all(data)?;
        let r = SpillRef {
            version,
            offset: *end,
            len: data.len() as u32,
            crc: crate::checksum::crc32c(data),
        };
        *end += data.len() as u64;
        Ok(r)
    }

    fn get(&mut self, r: &SpillRef) -> io::Result<Vec<u8>> {
        let (f, _) = self
            .files
            .get_mut(&r.version)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "version not spilled"))?;
        f.seek(SeekFrom::Start(r.offset))?;
        let mut v = vec![0u8; r.len as usize];
        f.read_exact(&mut v)?;
        Ok(v)
    }

    fn drop_version(&mut self, version: u64) {
        if self.files.remove(&version).is_some() {
            let _ = std::fs::remove_file(self.path(version));
        }
    }
}

impl Drop for FileSpill {
    fn drop(&mut self) {
        let vs: Vec<u64> = self.files.keys().copied().collect();
        for v in vs {
            self.drop_version(v);
        }
    }
}
