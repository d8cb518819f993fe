//! A simulated file system for testing the journal's crash safety: an
//! in-memory [`JournalIo`] that can fail the Nth write, the Nth sync or the
//! Nth operation of any kind, run out of space, or crash.
//!
//! The model is a machine with a page cache. Every write, truncation, create,
//! rename and remove first changes only the *current* view (what reads see).
//! `sync_data` makes one file's pending data and size *durable*; `sync_dir`
//! makes the pending directory entries under a directory durable. A
//! [`SimIo::crash`] throws the current view away and restarts from the
//! durable one, optionally keeping a prefix of the pending operations in the
//! order they were issued and a torn prefix of the first one it does not
//! keep whole (the "torn last write").
//!
//! Clones share one file system, so a test can keep a handle to inspect or
//! crash it after the journal that used it is gone.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::io::{JournalFile, JournalIo};

/// How much of the not-yet-durable state survives a [`SimIo::crash`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crash {
    /// Only what was synced survives.
    DropUnsynced,
    /// The first `ops` pending operations survive in issue order, plus the
    /// first `torn_bytes` bytes of the next one if it is a write.
    KeepPending { ops: usize, torn_bytes: usize },
    /// Pending operations persist out of order, as a disk reorders writes
    /// between flushes: operation `i` survives if bit `i % 64` of `mask` is
    /// set; operation `torn_op`, if it does not survive whole and is a write,
    /// leaves its first `torn_bytes` bytes.
    Reorder { mask: u64, torn_op: usize, torn_bytes: usize },
}

/// Operation counters since the file system was made (faults use the same
/// numbering: the first write is write 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounts {
    /// `write_at` calls.
    pub writes: u64,
    /// `sync_data` and `sync_dir` calls.
    pub syncs: u64,
    /// Calls of any kind, reads and opens included.
    pub ops: u64,
}

#[derive(Debug, Clone, Copy)]
enum OpKind {
    Read,
    Create,
    Open,
    Rename,
    Remove,
    SyncDir,
    Write,
    SetLen,
    SyncData,
}

#[derive(Debug, Clone, Default)]
struct Inode {
    current: Vec<u8>,
    durable: Vec<u8>,
}

#[derive(Debug, Clone)]
enum Pending {
    Write { ino: usize, offset: u64, data: Vec<u8> },
    SetLen { ino: usize, len: u64 },
    Create { path: PathBuf, ino: usize },
    Rename { from: PathBuf, to: PathBuf },
    Remove { path: PathBuf },
}

impl Pending {
    fn ino(&self) -> Option<usize> {
        match self {
            Pending::Write { ino, .. } | Pending::SetLen { ino, .. } => Some(*ino),
            _ => None,
        }
    }
    fn touches_dir(&self, dir: &Path) -> bool {
        let under = |p: &Path| parent_of(p) == dir;
        match self {
            Pending::Create { path, .. } | Pending::Remove { path } => under(path),
            Pending::Rename { from, to } => under(from) || under(to),
            _ => false,
        }
    }
}

fn parent_of(p: &Path) -> &Path {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

#[derive(Debug, Default)]
struct SimFs {
    inodes: Vec<Inode>,
    names: BTreeMap<PathBuf, usize>,
    durable_names: BTreeMap<PathBuf, usize>,
    pending: Vec<Pending>,
    counts: OpCounts,
    fail_write: Option<u64>,
    fail_sync: Option<u64>,
    fail_op: Option<u64>,
    power_cut_at_op: Option<u64>,
    capacity: Option<u64>,
}

fn write_into(buf: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let off = offset as usize;
    if buf.len() < off + data.len() {
        buf.resize(off + data.len(), 0);
    }
    buf[off..off + data.len()].copy_from_slice(data);
}

fn eio(what: String) -> io::Error {
    io::Error::other(format!("simulated I/O error: {what}"))
}

impl SimFs {
    /// Counts the call and returns the injected failure, if any.
    fn begin(&mut self, kind: OpKind) -> io::Result<()> {
        let op = self.counts.ops;
        self.counts.ops += 1;
        let mut fail = None;
        match kind {
            OpKind::Write => {
                let n = self.counts.writes;
                self.counts.writes += 1;
                if self.fail_write == Some(n) {
                    fail = Some(format!("write #{n} failed"));
                }
            }
            OpKind::SyncData | OpKind::SyncDir => {
                let n = self.counts.syncs;
                self.counts.syncs += 1;
                if self.fail_sync == Some(n) {
                    fail = Some(format!("sync #{n} failed"));
                }
            }
            _ => {}
        }
        if self.fail_op == Some(op) {
            fail = Some(format!("operation #{op} ({kind:?}) failed"));
        }
        if matches!(self.power_cut_at_op, Some(p) if op >= p) {
            return Err(eio(format!("power cut before operation #{op} ({kind:?})")));
        }
        match fail {
            Some(what) if matches!(kind, OpKind::Write) => Err(eio(what)), // caller tears it
            Some(what) => Err(eio(what)),
            None => Ok(()),
        }
    }

    fn used(&self) -> u64 {
        let mut inos: Vec<usize> = self.names.values().copied().collect();
        inos.sort_unstable();
        inos.dedup();
        inos.iter().map(|&i| self.inodes[i].current.len() as u64).sum()
    }

    fn apply_durable(&mut self, p: &Pending, torn: Option<usize>) {
        match p {
            Pending::Write { ino, offset, data } => {
                let n = torn.unwrap_or(data.len()).min(data.len());
                write_into(&mut self.inodes[*ino].durable, *offset, &data[..n]);
            }
            Pending::SetLen { ino, len } => self.inodes[*ino].durable.resize(*len as usize, 0),
            Pending::Create { path, ino } => {
                self.durable_names.insert(path.clone(), *ino);
            }
            Pending::Rename { from, to } => {
                if let Some(ino) = self.durable_names.remove(from) {
                    self.durable_names.insert(to.clone(), ino);
                }
            }
            Pending::Remove { path } => {
                self.durable_names.remove(path);
            }
        }
    }
}

/// The simulated file system. See the module documentation.
#[derive(Debug, Clone, Default)]
pub struct SimIo {
    fs: Arc<Mutex<SimFs>>,
}

/// An open file of a [`SimIo`].
#[derive(Debug)]
pub struct SimFile {
    fs: Arc<Mutex<SimFs>>,
    ino: usize,
}

impl SimIo {
    /// An empty file system with no faults.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, SimFs> {
        self.fs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Operation counters so far.
    pub fn counts(&self) -> OpCounts {
        self.lock().counts
    }

    /// Fails write number `n` (0-based, counted since creation) once. The
    /// failed write leaves its first half in the current view, as a short
    /// write would.
    pub fn fail_write(&self, n: u64) {
        self.lock().fail_write = Some(n);
    }

    /// Fails sync number `n` (`sync_data` and `sync_dir` counted together)
    /// once; nothing pending becomes durable.
    pub fn fail_sync(&self, n: u64) {
        self.lock().fail_sync = Some(n);
    }

    /// Fails operation number `n` of any kind once.
    pub fn fail_op(&self, n: u64) {
        self.lock().fail_op = Some(n);
    }

    /// Operation `n` and every later one fail and change nothing, as if the
    /// power went out just before it; follow with [`SimIo::crash`].
    pub fn power_cut_at_op(&self, n: u64) {
        self.lock().power_cut_at_op = Some(n);
    }

    /// Limits the total size of all linked files; a write or extension past
    /// it fails with `ErrorKind::StorageFull` (ENOSPC) after writing what
    /// fits. `None` removes the limit.
    pub fn set_capacity(&self, bytes: Option<u64>) {
        self.lock().capacity = bytes;
    }

    /// Bytes used by all linked files (current view).
    pub fn used_bytes(&self) -> u64 {
        self.lock().used()
    }

    /// Removes every injected fault and the capacity limit.
    pub fn clear_faults(&self) {
        let mut fs = self.lock();
        fs.fail_write = None;
        fs.fail_sync = None;
        fs.fail_op = None;
        fs.power_cut_at_op = None;
        fs.capacity = None;
    }

    /// Number of operations issued but not yet durable.
    pub fn pending_ops(&self) -> usize {
        self.lock().pending.len()
    }

    /// Crashes the machine: only the durable state (and what `mode` keeps of
    /// the pending operations) survives. Faults are cleared; counters go on.
    pub fn crash(&self, mode: Crash) {
        let mut fs = self.lock();
        let pending = std::mem::take(&mut fs.pending);
        match mode {
            Crash::DropUnsynced => {}
            Crash::KeepPending { ops, torn_bytes } => {
                for (i, p) in pending.iter().enumerate() {
                    if i < ops {
                        fs.apply_durable(p, None);
                    } else {
                        if matches!(p, Pending::Write { .. }) {
                            fs.apply_durable(p, Some(torn_bytes));
                        }
                        break;
                    }
                }
            }
            Crash::Reorder { mask, torn_op, torn_bytes } => {
                for (i, p) in pending.iter().enumerate() {
                    if mask & (1 << (i % 64)) != 0 {
                        fs.apply_durable(p, None);
                    } else if i == torn_op && matches!(p, Pending::Write { .. }) {
                        fs.apply_durable(p, Some(torn_bytes));
                    }
                }
            }
        }
        for ino in fs.inodes.iter_mut() {
            ino.current = ino.durable.clone();
        }
        fs.names = fs.durable_names.clone();
        drop(fs);
        self.clear_faults();
    }

    /// A copy of the file system as it would be after `crash(mode)`, leaving
    /// this one untouched.
    pub fn crashed_copy(&self, mode: Crash) -> SimIo {
        let fs = self.lock();
        let copy = SimFs {
            inodes: fs.inodes.clone(),
            names: fs.names.clone(),
            durable_names: fs.durable_names.clone(),
            pending: fs.pending.clone(),
            counts: fs.counts,
            ..SimFs::default()
        };
        drop(fs);
        let io = SimIo { fs: Arc::new(Mutex::new(copy)) };
        io.crash(mode);
        io
    }

    /// The current contents of `path`, if it exists.
    pub fn file_bytes(&self, path: &Path) -> Option<Vec<u8>> {
        let fs = self.lock();
        fs.names.get(path).map(|&i| fs.inodes[i].current.clone())
    }

    /// Replaces the contents of `path` (current and durable), creating it
    /// durably if needed: for planting corruption in tests.
    pub fn put_file_bytes(&self, path: &Path, bytes: &[u8]) {
        let mut fs = self.lock();
        let ino = match fs.names.get(path) {
            Some(&i) => i,
            None => {
                fs.inodes.push(Inode::default());
                let i = fs.inodes.len() - 1;
                fs.names.insert(path.to_path_buf(), i);
                fs.durable_names.insert(path.to_path_buf(), i);
                i
            }
        };
        fs.inodes[ino].current = bytes.to_vec();
        fs.inodes[ino].durable = bytes.to_vec();
    }

    /// Paths that currently exist.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.lock().names.keys().cloned().collect()
    }
}

impl JournalIo for SimIo {
    type File = SimFile;

    fn read(&mut self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        let mut fs = self.lock();
        fs.begin(OpKind::Read)?;
        Ok(fs.names.get(path).map(|&i| fs.inodes[i].current.clone()))
    }

    fn create(&mut self, path: &Path) -> io::Result<SimFile> {
        let mut fs = self.lock();
        fs.begin(OpKind::Create)?;
        let ino = match fs.names.get(path) {
            Some(&i) => {
                fs.inodes[i].current.clear();
                fs.pending.push(Pending::SetLen { ino: i, len: 0 });
                i
            }
            None => {
                fs.inodes.push(Inode::default());
                let i = fs.inodes.len() - 1;
                fs.names.insert(path.to_path_buf(), i);
                fs.pending.push(Pending::Create { path: path.to_path_buf(), ino: i });
                i
            }
        };
        Ok(SimFile { fs: self.fs.clone(), ino })
    }

    fn open(&mut self, path: &Path) -> io::Result<SimFile> {
        let mut fs = self.lock();
        fs.begin(OpKind::Open)?;
        match fs.names.get(path) {
            Some(&ino) => Ok(SimFile { fs: self.fs.clone(), ino }),
            None => Err(io::Error::new(io::ErrorKind::NotFound, format!("{} not found", path.display()))),
        }
    }

    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        let mut fs = self.lock();
        fs.begin(OpKind::Rename)?;
        let Some(ino) = fs.names.remove(from) else {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("{} not found", from.display())));
        };
        fs.names.insert(to.to_path_buf(), ino);
        fs.pending.push(Pending::Rename { from: from.to_path_buf(), to: to.to_path_buf() });
        Ok(())
    }

    fn remove(&mut self, path: &Path) -> io::Result<()> {
        let mut fs = self.lock();
        fs.begin(OpKind::Remove)?;
        if fs.names.remove(path).is_some() {
            fs.pending.push(Pending::Remove { path: path.to_path_buf() });
        }
        Ok(())
    }

    fn sync_dir(&mut self, dir: &Path) -> io::Result<()> {
        let mut fs = self.lock();
        fs.begin(OpKind::SyncDir)?;
        let pending = std::mem::take(&mut fs.pending);
        let mut keep = Vec::new();
        for p in pending {
            if p.touches_dir(dir) {
                fs.apply_durable(&p, None);
            } else {
                keep.push(p);
            }
        }
        fs.pending = keep;
        Ok(())
    }
}

impl JournalFile for SimFile {
    fn write_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        let mut fs = self.fs.lock().unwrap_or_else(|e| e.into_inner());
        let ino = self.ino;
        let (n, err) = match fs.begin(OpKind::Write) {
            Ok(()) => (buf.len(), None),
            // A power cut writes nothing; an injected failure tears the write.
            Err(e) if fs.power_cut_at_op.is_some_and(|p| fs.counts.ops > p) => return Err(e),
            Err(e) => (buf.len() / 2, Some(e)),
        };
        let (n, err) = match fs.capacity {
            Some(cap) => {
                let cur = fs.inodes[ino].current.len() as u64;
                let end = offset + n as u64;
                let growth = end.saturating_sub(cur);
                let used = fs.used();
                if used + growth > cap {
                    let room = cap.saturating_sub(used);
                    let fits = (cur + room).saturating_sub(offset).min(n as u64) as usize;
                    let e = io::Error::new(io::ErrorKind::StorageFull, "simulated ENOSPC: no space left on device");
                    (fits, Some(err.unwrap_or(e)))
                } else {
                    (n, err)
                }
            }
            None => (n, err),
        };
        if n > 0 {
            write_into(&mut fs.inodes[ino].current, offset, &buf[..n]);
            fs.pending.push(Pending::Write { ino, offset, data: buf[..n].to_vec() });
        }
        match err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn set_len(&mut self, len: u64) -> io::Result<()> {
        let mut fs = self.fs.lock().unwrap_or_else(|e| e.into_inner());
        fs.begin(OpKind::SetLen)?;
        let cur = fs.inodes[self.ino].current.len() as u64;
        if let Some(cap) = fs.capacity {
            if len > cur && fs.used() + (len - cur) > cap {
                return Err(io::Error::new(io::ErrorKind::StorageFull, "simulated ENOSPC: no space left on device"));
            }
        }
        fs.inodes[self.ino].current.resize(len as usize, 0);
        fs.pending.push(Pending::SetLen { ino: self.ino, len });
        Ok(())
    }

    fn sync_data(&mut self) -> io::Result<()> {
        let mut fs = self.fs.lock().unwrap_or_else(|e| e.into_inner());
        fs.begin(OpKind::SyncData)?;
        let pending = std::mem::take(&mut fs.pending);
        let mut keep = Vec::new();
        for p in pending {
            if p.ino() == Some(self.ino) {
                fs.apply_durable(&p, None);
            } else {
                keep.push(p);
            }
        }
        fs.pending = keep;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from("/j").join(s)
    }

    #[test]
    fn unsynced_data_and_names_are_lost_in_a_crash() {
        let mut io = SimIo::new();
        let mut f = io.create(&p("a")).unwrap();
        f.write_at(0, b"abc").unwrap();
        f.sync_data().unwrap();
        io.crash(Crash::DropUnsynced);
        // Data was synced but the name was not.
        assert_eq!(io.read(&p("a")).unwrap(), None);

        let mut f = io.create(&p("b")).unwrap();
        f.write_at(0, b"abc").unwrap();
        f.sync_data().unwrap();
        io.sync_dir(Path::new("/j")).unwrap();
        f.write_at(3, b"def").unwrap();
        io.crash(Crash::DropUnsynced);
        assert_eq!(io.read(&p("b")).unwrap().unwrap(), b"abc");
    }

    #[test]
    fn crash_keeps_a_torn_prefix() {
        let mut io = SimIo::new();
        let mut f = io.create(&p("a")).unwrap();
        io.sync_dir(Path::new("/j")).unwrap();
        f.write_at(0, b"0123").unwrap();
        f.write_at(4, b"456789").unwrap();
        assert_eq!(io.pending_ops(), 2);
        let c = io.crashed_copy(Crash::KeepPending { ops: 1, torn_bytes: 2 });
        assert_eq!(c.file_bytes(&p("a")).unwrap(), b"012345");
        // The original is untouched.
        assert_eq!(io.file_bytes(&p("a")).unwrap(), b"0123456789");
        let c = io.crashed_copy(Crash::Reorder { mask: 0b10, torn_op: 0, torn_bytes: 1 });
        assert_eq!(c.file_bytes(&p("a")).unwrap(), b"0\x00\x00\x00456789");
        io.crash(Crash::KeepPending { ops: 0, torn_bytes: 3 });
        assert_eq!(io.read(&p("a")).unwrap().unwrap(), b"012");
    }

    #[test]
    fn nth_write_and_sync_fail_once() {
        let mut io = SimIo::new();
        io.fail_write(1);
        io.fail_sync(0);
        let mut f = io.create(&p("a")).unwrap();
        f.write_at(0, b"abcd").unwrap();
        let e = f.write_at(4, b"efgh").unwrap_err();
        assert!(e.to_string().contains("write #1"), "{e}");
        // The failed write was torn: half of it landed.
        assert_eq!(io.file_bytes(&p("a")).unwrap(), b"abcdef");
        assert!(f.sync_data().is_err());
        f.sync_data().unwrap();
        f.write_at(6, b"gh").unwrap();
        assert_eq!(io.counts(), OpCounts { writes: 3, syncs: 2, ops: 6 });
    }

    #[test]
    fn capacity_gives_enospc_after_a_short_write() {
        let mut io = SimIo::new();
        io.set_capacity(Some(10));
        let mut f = io.create(&p("a")).unwrap();
        f.write_at(0, b"01234567").unwrap();
        let e = f.write_at(8, b"89ab").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
        assert_eq!(io.file_bytes(&p("a")).unwrap(), b"0123456789");
        // Overwriting in place needs no room.
        f.write_at(0, b"xy").unwrap();
        assert!(f.set_len(11).is_err());
        f.set_len(4).unwrap();
        f.write_at(4, b"zz").unwrap();
        assert_eq!(io.file_bytes(&p("a")).unwrap(), b"xy23zz");
    }

    #[test]
    fn power_cut_changes_nothing() {
        let mut io = SimIo::new();
        let mut f = io.create(&p("a")).unwrap();
        io.power_cut_at_op(2);
        f.write_at(0, b"ab").unwrap();
        assert!(f.write_at(2, b"cd").is_err());
        assert!(f.sync_data().is_err());
        assert_eq!(io.file_bytes(&p("a")).unwrap(), b"ab");
    }

    #[test]
    fn rename_replaces_and_needs_a_dir_sync() {
        let mut io = SimIo::new();
        let dir = Path::new("/j");
        let mut a = io.create(&p("a")).unwrap();
        a.write_at(0, b"old").unwrap();
        a.sync_data().unwrap();
        io.sync_dir(dir).unwrap();
        let mut t = io.create(&p("t")).unwrap();
        t.write_at(0, b"new").unwrap();
        t.sync_data().unwrap();
        io.rename(&p("t"), &p("a")).unwrap();
        assert_eq!(io.read(&p("a")).unwrap().unwrap(), b"new");
        assert_eq!(io.crashed_copy(Crash::DropUnsynced).file_bytes(&p("a")).unwrap(), b"old");
        io.sync_dir(dir).unwrap();
        io.crash(Crash::DropUnsynced);
        assert_eq!(io.read(&p("a")).unwrap().unwrap(), b"new");
        assert_eq!(io.read(&p("t")).unwrap(), None);
    }
}
