//! The journal file: a header and a log of checksummed records, appended in
//! batches that each end with an explicit commit marker.
//!
//! This layer knows nothing about what the records mean. See `docs/journal.md`
//! for the format and the recovery rules; in short:
//!
//! ```text
//! header  = magic "DCRJRNL\0" | version u16 | flags u16 (0) | crc32c(previous 12 bytes) u32
//! record  = len u32 | payload (len bytes) | crc32c(len || payload) u32 | marker [4]
//! marker  = "CONT" (more records of this batch follow) | "CMIT" (batch committed)
//! ```
//!
//! All integers are little-endian. An append is two-phase: the batch is
//! written with the last marker left as four zero bytes and synced, then the
//! `CMIT` marker is written and synced. So a marker on disk implies that the
//! record bytes before it were already durable, and a bad checksum under a
//! marker is corruption, never a torn write.

use std::path::{Path, PathBuf};

use super::io::{JournalFile, JournalIo};
use crate::error::{Error, Result};

/// First 8 bytes of every journal.
pub const MAGIC: [u8; 8] = *b"DCRJRNL\0";
/// The format version this code reads and writes. Version 2: the records'
/// checkpoint digests are those of delta format version 9 (AES rounds);
/// version 1 held the earlier digests, which this code cannot check.
pub const FORMAT_VERSION: u16 = 2;
/// Length of the file header in bytes.
pub const HEADER_LEN: usize = 16;
/// Largest payload of one record; longer lengths are rejected before any
/// allocation.
pub const MAX_RECORD_LEN: usize = 1 << 20;
/// Bytes a record takes besides its payload: length, crc32c, marker.
pub const RECORD_OVERHEAD: usize = 12;
/// Marker of a record that is followed by more records of the same batch.
pub const MARK_CONTINUE: [u8; 4] = *b"CONT";
/// Marker of the last record of a batch: the batch is committed.
pub const MARK_COMMIT: [u8; 4] = *b"CMIT";
const MARK_NONE: [u8; 4] = [0; 4];

/// One committed record as found on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawRecord {
    /// Byte offset of the record (its length field) in the file.
    pub offset: u64,
    pub payload: Vec<u8>,
}

/// An uncommitted tail found and cut off when the journal was opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    /// Where the tail started (the end of the last committed batch).
    pub offset: u64,
    /// How many bytes were cut off.
    pub len: u64,
    /// What made it a torn tail.
    pub reason: &'static str,
}

/// The result of reading a journal file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scan {
    /// Every record of every committed batch, in order.
    pub records: Vec<RawRecord>,
    /// Offset just past the last committed batch.
    pub committed_end: u64,
    /// The uncommitted tail, if there was one.
    pub torn: Option<TornTail>,
}

fn corrupt(path: &Path, offset: usize, detail: String) -> Error {
    Error::JournalCorrupt { path: path.to_path_buf(), offset: offset as u64, detail }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The 16-byte header of an empty journal.
pub fn encode_header() -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..8].copy_from_slice(&MAGIC);
    h[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    // h[10..12]: flags, zero in version 1.
    let crc = crate::checksum::crc32c(&h[..12]);
    h[12..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Checks the header of a journal's bytes.
pub fn check_header(path: &Path, bytes: &[u8]) -> Result<()> {
    if bytes.len() < HEADER_LEN {
        return Err(corrupt(
            path,
            0,
            format!(
                "the file has {} bytes, but a journal starts with a {HEADER_LEN}-byte header (journals are created whole by a rename, so this file was not written by dcr)",
                bytes.len()
            ),
        ));
    }
    if bytes[..8] != MAGIC {
        return Err(corrupt(
            path,
            0,
            format!(
                "expected magic {:?}, found {:?}: this is not a dcr journal",
                MAGIC.escape_ascii().to_string(),
                bytes[..8].escape_ascii().to_string()
            ),
        ));
    }
    let version = u16::from_le_bytes([bytes[8], bytes[9]]);
    if version != FORMAT_VERSION {
        return Err(Error::JournalVersion { path: path.to_path_buf(), found: version, supported: FORMAT_VERSION });
    }
    let stored = u32_at(bytes, 12);
    let computed = crate::checksum::crc32c(&bytes[..12]);
    if stored != computed {
        return Err(corrupt(
            path,
            12,
            format!("header has crc32c {stored:#010x} but its bytes hash to {computed:#010x}"),
        ));
    }
    let flags = u16::from_le_bytes([bytes[10], bytes[11]]);
    if flags != 0 {
        return Err(corrupt(
            path,
            10,
            format!("header flags are {flags:#06x}, but format version {FORMAT_VERSION} defines none (expected 0)"),
        ));
    }
    Ok(())
}

/// Appends the records of one batch to `out`: every marker is
/// [`MARK_CONTINUE`] except the last record's, which is `last`.
fn encode_batch<P: AsRef<[u8]>>(out: &mut Vec<u8>, payloads: &[P], last: [u8; 4]) {
    for (i, p) in payloads.iter().enumerate() {
        let p = p.as_ref();
        let start = out.len();
        out.extend_from_slice(&(p.len() as u32).to_le_bytes());
        out.extend_from_slice(p);
        let crc = crate::checksum::crc32c(&out[start..]);
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(if i + 1 == payloads.len() { &last } else { &MARK_CONTINUE });
    }
}

/// Reads a journal's bytes: the committed records, where they end, and the
/// torn tail after them, if any. Pure: truncating the tail is up to the
/// caller.
///
/// Rules: a batch counts only once its `CMIT` marker is read. Running out of
/// bytes inside a record, or a marker that is still four zero bytes, ends the
/// log: everything after the last committed batch is a torn tail. A record
/// with a wrong checksum or an unknown marker is an error only if a `CMIT`
/// marker closes its batch (the two-phase append makes that impossible for a
/// crash); otherwise it is part of the torn tail. A length above
/// [`MAX_RECORD_LEN`] is an error unless an earlier record of the same
/// unfinished batch was already damaged: a torn write mixes the bytes written
/// with zeros, so on its own it can only make a length smaller, but a smaller
/// length makes the scan read payload bytes as the next header.
pub fn scan(path: &Path, bytes: &[u8]) -> Result<Scan> {
    check_header(path, bytes)?;
    let mut pos = HEADER_LEN;
    let mut committed_end = HEADER_LEN;
    let mut records = Vec::new();
    let mut batch = Vec::new();
    let mut suspect: Option<(usize, String)> = None;
    let torn = loop {
        let rest = bytes.len() - pos;
        if rest == 0 {
            if batch.is_empty() {
                break None;
            }
            break Some("the last batch has no commit marker");
        }
        if rest < 4 {
            break Some("the file ends inside a record length");
        }
        let len = u32_at(bytes, pos) as usize;
        if len > MAX_RECORD_LEN {
            if suspect.is_some() {
                // Parsing is already off track inside an unfinished batch
                // (a torn length made us read payload bytes as a header).
                break Some("a record of an unfinished batch is damaged");
            }
            return Err(corrupt(path, pos, format!("record length is {len} bytes, but the limit is {MAX_RECORD_LEN}")));
        }
        let total = RECORD_OVERHEAD + len;
        if rest < total {
            break Some("the file ends inside a record");
        }
        let body_end = pos + 4 + len;
        let marker: [u8; 4] = [bytes[body_end + 4], bytes[body_end + 5], bytes[body_end + 6], bytes[body_end + 7]];
        if marker == MARK_NONE {
            break Some("a record has no commit marker");
        }
        let stored = u32_at(bytes, body_end);
        let computed = crate::checksum::crc32c(&bytes[pos..body_end]);
        if stored != computed && suspect.is_none() {
            suspect = Some((
                pos,
                format!("the record there has crc32c {stored:#010x}, but its {} bytes of length and payload hash to {computed:#010x}", 4 + len),
            ));
        }
        if marker != MARK_COMMIT && marker != MARK_CONTINUE && suspect.is_none() {
            suspect = Some((
                body_end + 4,
                format!(
                    "the commit marker there is {:?}, expected \"CONT\" or \"CMIT\"",
                    marker.escape_ascii().to_string()
                ),
            ));
        }
        batch.push(RawRecord { offset: pos as u64, payload: bytes[pos + 4..body_end].to_vec() });
        pos += total;
        if marker == MARK_COMMIT {
            if let Some((offset, detail)) = suspect.take() {
                return Err(corrupt(path, offset, detail));
            }
            records.append(&mut batch);
            committed_end = pos;
        }
    };
    let torn =
        torn.map(|reason| TornTail { offset: committed_end as u64, len: (bytes.len() - committed_end) as u64, reason });
    Ok(Scan { records, committed_end: committed_end as u64, torn })
}

fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The temporary file next to `path` that compaction and creation write
/// before renaming it over `path`.
pub fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".compact");
    path.with_file_name(name)
}

/// An open journal file that appends committed batches.
///
/// After an I/O failure whose effect on the file is uncertain (a failed sync,
/// rename or directory sync) the handle is poisoned and every later call
/// returns [`Error::JournalPoisoned`]: reopen the journal to recover. A failed
/// write is rolled back (the file is truncated to its last committed end) and
/// the handle stays usable, so a full disk can be retried after freeing space.
pub struct Journal<I: JournalIo> {
    io: I,
    path: PathBuf,
    tmp: PathBuf,
    dir: PathBuf,
    file: I::File,
    end: u64,
    poisoned: Option<String>,
}

impl<I: JournalIo> std::fmt::Debug for Journal<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("path", &self.path)
            .field("committed_len", &self.end)
            .field("poisoned", &self.poisoned)
            .finish_non_exhaustive()
    }
}

impl<I: JournalIo> Journal<I> {
    /// Opens the journal at `path`, creating an empty one if it does not
    /// exist (created whole: temp file, sync, rename, directory sync).
    /// A torn tail is truncated and the truncation synced before this
    /// returns; it is reported in [`Scan::torn`].
    pub fn open(path: impl AsRef<Path>, mut io: I) -> Result<(Self, Scan)> {
        let path = path.as_ref().to_path_buf();
        let tmp = temp_path(&path);
        let dir = parent_dir(&path);
        let ioerr = |op: &'static str, source| Error::JournalIo { path: path.clone(), op, source };
        // A leftover temp file is from a creation or compaction that never
        // reached its rename: it holds nothing the journal depends on.
        io.remove(&tmp).map_err(|e| ioerr("remove leftover temp file", e))?;
        let Some(bytes) = io.read(&path).map_err(|e| ioerr("read", e))? else {
            let (file, end) = write_fresh::<I, &[u8]>(&mut io, &path, &tmp, &dir, &[]).map_err(|(e, _)| e)?;
            let scan = Scan { records: Vec::new(), committed_end: end, torn: None };
            return Ok((Journal { io, path, tmp, dir, file, end, poisoned: None }, scan));
        };
        let scan = scan(&path, &bytes)?;
        drop(bytes);
        let mut file = io.open(&path).map_err(|e| ioerr("open", e))?;
        if scan.torn.is_some() {
            file.set_len(scan.committed_end).map_err(|e| ioerr("truncate torn tail", e))?;
            file.sync_data().map_err(|e| ioerr("sync after truncating torn tail", e))?;
        }
        let end = scan.committed_end;
        Ok((Journal { io, path, tmp, dir, file, end, poisoned: None }, scan))
    }

    /// The journal's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Offset just past the last committed batch (the file's logical length).
    pub fn committed_len(&self) -> u64 {
        self.end
    }

    /// The I/O implementation.
    pub fn io(&self) -> &I {
        &self.io
    }

    /// Why this handle is unusable, if it is.
    pub fn poisoned(&self) -> Option<&str> {
        self.poisoned.as_deref()
    }

    fn check_usable(&self) -> Result<()> {
        match &self.poisoned {
            Some(cause) => Err(Error::JournalPoisoned { path: self.path.clone(), cause: cause.clone() }),
            None => Ok(()),
        }
    }

    fn check_sizes<P: AsRef<[u8]>>(&self, payloads: &[P]) -> Result<()> {
        match payloads.iter().map(|p| p.as_ref().len()).find(|&l| l > MAX_RECORD_LEN) {
            Some(len) => Err(Error::JournalRecordTooLarge { path: self.path.clone(), len, max: MAX_RECORD_LEN }),
            None => Ok(()),
        }
    }

    fn io_error(&self, op: &'static str, source: std::io::Error) -> Error {
        Error::JournalIo { path: self.path.clone(), op, source }
    }

    /// After a failed write: cut the file back to its committed end so the
    /// next append does not leave stray bytes after its records.
    fn roll_back(&mut self, op: &'static str, source: std::io::Error) -> Error {
        if let Err(e2) = self.file.set_len(self.end) {
            self.poisoned =
                Some(format!("{op} failed ({source}), then truncating back to byte {} failed ({e2})", self.end));
        }
        self.io_error(op, source)
    }

    fn poison(&mut self, op: &'static str, source: std::io::Error) -> Error {
        self.poisoned = Some(format!("{op} failed: {source}"));
        self.io_error(op, source)
    }

    /// Appends one record as its own batch; durable when this returns `Ok`.
    pub fn append(&mut self, payload: &[u8]) -> Result<()> {
        self.append_batch(&[payload])
    }

    /// Appends records as one batch: after `Ok` all of them are durable;
    /// after a crash at any point, either all of them or none are recovered.
    /// Costs two `sync_data` calls however many records there are.
    pub fn append_batch<P: AsRef<[u8]>>(&mut self, payloads: &[P]) -> Result<()> {
        self.check_usable()?;
        self.check_sizes(payloads)?;
        if payloads.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::with_capacity(payloads.iter().map(|p| p.as_ref().len() + RECORD_OVERHEAD).sum());
        encode_batch(&mut buf, payloads, MARK_NONE);
        let start = self.end;
        let marker_at = start + buf.len() as u64 - 4;
        // Phase 1: the records, with no commit marker yet.
        if let Err(e) = self.file.write_at(start, &buf) {
            return Err(self.roll_back("write records", e));
        }
        if let Err(e) = self.file.sync_data() {
            return Err(self.poison("sync records", e));
        }
        // Phase 2: the commit marker.
        if let Err(e) = self.file.write_at(marker_at, &MARK_COMMIT) {
            return Err(self.roll_back("write commit marker", e));
        }
        if let Err(e) = self.file.sync_data() {
            return Err(self.poison("sync commit marker", e));
        }
        self.end = start + buf.len() as u64;
        Ok(())
    }

    /// Replaces the whole journal with one batch of `payloads` (compaction):
    /// writes a temp file, syncs it, renames it over the journal and syncs
    /// the directory. After a crash the journal holds either the old records
    /// or exactly these. A failure before the rename leaves the handle
    /// usable; one at or after it poisons the handle.
    pub fn rewrite<P: AsRef<[u8]>>(&mut self, payloads: &[P]) -> Result<()> {
        self.check_usable()?;
        self.check_sizes(payloads)?;
        match write_fresh(&mut self.io, &self.path, &self.tmp, &self.dir, payloads) {
            Ok((file, end)) => {
                self.file = file;
                self.end = end;
                Ok(())
            }
            Err((e, poison)) => {
                if poison {
                    self.poisoned = Some(format!("compaction failed after its rename: {e}"));
                }
                Err(e)
            }
        }
    }
}

/// Writes a complete journal holding `payloads` as one batch to `tmp`,
/// syncs it, renames it to `path` and syncs `dir`. On error, the flag says
/// whether the rename may have happened.
#[allow(clippy::type_complexity)]
fn write_fresh<I: JournalIo, P: AsRef<[u8]>>(
    io: &mut I,
    path: &Path,
    tmp: &Path,
    dir: &Path,
    payloads: &[P],
) -> std::result::Result<(I::File, u64), (Error, bool)> {
    let err = |op: &'static str, source| Error::JournalIo { path: path.to_path_buf(), op, source };
    let mut buf = encode_header().to_vec();
    encode_batch(&mut buf, payloads, MARK_COMMIT);
    let mut file = io.create(tmp).map_err(|e| (err("create temp file", e), false))?;
    let before_rename = |io: &mut I, e: Error| {
        // Best effort: a leftover temp file is also removed by the next open.
        let _ = io.remove(tmp);
        (e, false)
    };
    if let Err(e) = file.write_at(0, &buf) {
        return Err(before_rename(io, err("write temp file", e)));
    }
    if let Err(e) = file.sync_data() {
        return Err(before_rename(io, err("sync temp file", e)));
    }
    io.rename(tmp, path).map_err(|e| (err("rename temp file over journal", e), true))?;
    io.sync_dir(dir).map_err(|e| (err("sync journal directory", e), true))?;
    Ok((file, buf.len() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::sim::{Crash, SimIo};

    fn jpath() -> PathBuf {
        PathBuf::from("/j/test.dcrj")
    }

    fn payloads(scan: &Scan) -> Vec<Vec<u8>> {
        scan.records.iter().map(|r| r.payload.clone()).collect()
    }

    #[test]
    fn header_roundtrip_and_errors() {
        let p = jpath();
        let h = encode_header();
        assert_eq!(&h[..8], b"DCRJRNL\0");
        check_header(&p, &h).unwrap();
        // An older journal (version 1: the digests of delta format 8 and
        // earlier) and a newer one are both refused by number.
        for found in [1u16, 3] {
            let mut bad = h;
            bad[8..10].copy_from_slice(&found.to_le_bytes());
            assert!(matches!(check_header(&p, &bad), Err(Error::JournalVersion { found: f, supported: 2, .. }) if f == found));
        }
        let mut bad = h;
        bad[13] ^= 1;
        assert!(matches!(check_header(&p, &bad), Err(Error::JournalCorrupt { offset: 12, .. })));
        let mut bad = h;
        bad[0] = b'X';
        let e = check_header(&p, &bad).unwrap_err().to_string();
        assert!(e.contains("not a dcr journal"), "{e}");
        assert!(matches!(check_header(&p, &h[..5]), Err(Error::JournalCorrupt { offset: 0, .. })));
    }

    #[test]
    fn scan_reads_batches_and_reports_torn_tails() {
        let p = jpath();
        let mut b = encode_header().to_vec();
        encode_batch(&mut b, &[b"one".as_slice()], MARK_COMMIT);
        encode_batch(&mut b, &[b"two".as_slice(), b"three"], MARK_COMMIT);
        let full = b.len();
        let s = scan(&p, &b).unwrap();
        assert_eq!(payloads(&s), vec![b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]);
        assert_eq!(s.committed_end, full as u64);
        assert_eq!(s.torn, None);
        assert_eq!(s.records[1].offset, (HEADER_LEN + RECORD_OVERHEAD + 3) as u64);

        // Every prefix of an uncommitted batch is a torn tail.
        let mut t = b.clone();
        encode_batch(&mut t, &[b"four".as_slice(), b"five"], MARK_NONE);
        for cut in full + 1..=t.len() {
            let s = scan(&p, &t[..cut]).unwrap();
            assert_eq!(s.records.len(), 3, "cut {cut}");
            assert_eq!(s.committed_end, full as u64);
            let torn = s.torn.unwrap();
            assert_eq!((torn.offset, torn.len), (full as u64, (cut - full) as u64));
        }
        // A batch cut after a CONT marker is torn as well.
        let mut t = b.clone();
        encode_batch(&mut t, &[b"four".as_slice(), b"five"], MARK_COMMIT);
        let s = scan(&p, &t[..full + RECORD_OVERHEAD + 4]).unwrap();
        assert_eq!(s.records.len(), 3);
        assert_eq!(s.torn.unwrap().reason, "the last batch has no commit marker");
        // Trailing zeros (an extended but unwritten tail) are torn too.
        let mut z = b.clone();
        z.extend_from_slice(&[0; 100]);
        assert_eq!(scan(&p, &z).unwrap().committed_end, full as u64);
    }

    #[test]
    fn a_torn_length_that_derails_the_scan_is_still_a_torn_tail() {
        let p = jpath();
        let mut b = encode_header().to_vec();
        encode_batch(&mut b, &[b"one".as_slice()], MARK_COMMIT);
        let committed = b.len();
        encode_batch(&mut b, &[b"xxxxabcdefghijklmnopqrstuvwxyz".as_slice()], MARK_NONE);
        // The high byte of the length persisted, the low one did not: length 0.
        b[committed] = 0;
        let s = scan(&p, &b).unwrap();
        assert_eq!(s.records.len(), 1);
        assert_eq!(s.torn.unwrap().reason, "a record of an unfinished batch is damaged");
        // The same bytes closed by a commit marker are corruption.
        let mut c = b[..committed].to_vec();
        encode_batch(&mut c, &[b"x".as_slice()], MARK_COMMIT);
        c[committed + 4] = b'y';
        assert!(matches!(scan(&p, &c), Err(Error::JournalCorrupt { offset, .. }) if offset == committed as u64));
    }

    #[test]
    fn scan_rejects_corrupt_committed_records_with_their_offset() {
        let p = jpath();
        let mut b = encode_header().to_vec();
        encode_batch(&mut b, &[b"one".as_slice()], MARK_COMMIT);
        let second = b.len();
        encode_batch(&mut b, &[b"two".as_slice(), b"three"], MARK_COMMIT);
        // Flip every payload or crc byte in turn: always a hard error at the
        // start of the record that holds it.
        for i in HEADER_LEN..b.len() {
            let rec_start = if i < second {
                HEADER_LEN
            } else if i < second + RECORD_OVERHEAD + 3 {
                second
            } else {
                second + RECORD_OVERHEAD + 3
            };
            let in_len = i < rec_start + 4;
            let rec_len = if rec_start == second + RECORD_OVERHEAD + 3 { 5 } else { 3 };
            let in_marker = i >= rec_start + 4 + rec_len + 4;
            if in_len || in_marker {
                continue;
            }
            let mut c = b.clone();
            c[i] ^= 0x40;
            match scan(&p, &c) {
                Err(Error::JournalCorrupt { offset, ref detail, .. }) => {
                    assert_eq!(offset, rec_start as u64, "byte {i}: {detail}");
                    assert!(detail.contains("crc32c"), "{detail}");
                }
                other => panic!("byte {i}: expected JournalCorrupt, got {other:?}"),
            }
        }
        // A bad marker under a committed batch.
        let mut c = b.clone();
        let m = second + RECORD_OVERHEAD + 3 - 4;
        c[m] = b'X';
        assert!(matches!(scan(&p, &c), Err(Error::JournalCorrupt { offset, .. }) if offset == m as u64));
        // A length beyond the limit.
        let mut c = b.clone();
        c[second..second + 4].copy_from_slice(&(MAX_RECORD_LEN as u32 + 1).to_le_bytes());
        let e = scan(&p, &c).unwrap_err();
        assert!(matches!(e, Error::JournalCorrupt { offset, .. } if offset == second as u64), "{e}");
        assert!(e.to_string().contains("limit"), "{e}");
        // u32::MAX is rejected without allocating 4 GiB.
        c[second..second + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(scan(&p, &c).is_err());
    }

    #[test]
    fn open_creates_appends_truncates_and_continues() {
        let io = SimIo::new();
        let p = jpath();
        let (mut j, s) = Journal::open(&p, io.clone()).unwrap();
        assert!(s.records.is_empty() && s.torn.is_none());
        j.append(b"a").unwrap();
        j.append_batch(&[b"b".as_slice(), b"c"]).unwrap();
        let end = j.committed_len();
        drop(j);
        // Everything acknowledged survives a crash that drops unsynced data.
        io.crash(Crash::DropUnsynced);
        let (j, s) = Journal::open(&p, io.clone()).unwrap();
        assert_eq!(payloads(&s), vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
        // Plant a torn tail: an uncommitted record.
        let mut bytes = io.file_bytes(&p).unwrap();
        encode_batch(&mut bytes, &[b"torn".as_slice()], MARK_NONE);
        bytes.truncate(bytes.len() - 3);
        io.put_file_bytes(&p, &bytes);
        drop(j);
        let (mut j, s) = Journal::open(&p, io.clone()).unwrap();
        assert_eq!(s.records.len(), 3);
        assert_eq!(s.torn.as_ref().unwrap().offset, end);
        // The truncation itself was synced.
        assert_eq!(io.crashed_copy(Crash::DropUnsynced).file_bytes(&p).unwrap().len() as u64, end);
        j.append(b"d").unwrap();
        drop(j);
        let (j, s) = Journal::open(&p, io.clone()).unwrap();
        assert_eq!(s.records.last().unwrap().payload, b"d");
        assert!(s.torn.is_none());
        assert_eq!(j.committed_len(), end + RECORD_OVERHEAD as u64 + 1);
    }

    #[test]
    fn a_new_journal_is_durable_once_open_returns() {
        let io = SimIo::new();
        let p = jpath();
        let (j, _) = Journal::open(&p, io.clone()).unwrap();
        drop(j);
        let c = io.crashed_copy(Crash::DropUnsynced);
        assert_eq!(c.file_bytes(&p).unwrap(), encode_header());
        assert_eq!(c.paths(), vec![p.clone()], "no temp file left behind");
    }

    #[test]
    fn rewrite_replaces_the_contents_atomically() {
        let io = SimIo::new();
        let p = jpath();
        let (mut j, _) = Journal::open(&p, io.clone()).unwrap();
        for i in 0..10u8 {
            j.append(&[i; 7]).unwrap();
        }
        j.rewrite(&[b"x".as_slice(), b"y"]).unwrap();
        let c = io.crashed_copy(Crash::DropUnsynced);
        j.append(b"z").unwrap();
        drop(j);
        let (_, s) = Journal::open(&p, c).unwrap();
        assert_eq!(payloads(&s), vec![b"x".to_vec(), b"y".to_vec()]);
        let (_, s) = Journal::open(&p, io.clone()).unwrap();
        assert_eq!(payloads(&s), vec![b"x".to_vec(), b"y".to_vec(), b"z".to_vec()]);
        assert_eq!(io.paths(), vec![p]);
    }

    #[test]
    fn oversized_records_are_refused_before_writing() {
        let io = SimIo::new();
        let (mut j, _) = Journal::open(jpath(), io.clone()).unwrap();
        let before = io.counts();
        let big = vec![0u8; MAX_RECORD_LEN + 1];
        assert!(matches!(j.append(&big), Err(Error::JournalRecordTooLarge { .. })));
        assert_eq!(io.counts().writes, before.writes);
        j.append(&vec![1u8; MAX_RECORD_LEN]).unwrap();
    }

    #[test]
    fn failed_write_rolls_back_and_failed_sync_poisons() {
        let io = SimIo::new();
        let p = jpath();
        let (mut j, _) = Journal::open(&p, io.clone()).unwrap();
        j.append(b"keep").unwrap();
        let w = io.counts().writes;
        io.fail_write(w);
        // Half of this lands, more than the next append overwrites.
        assert!(j.append(&[b'L'; 40]).is_err());
        assert!(j.poisoned().is_none());
        // The torn half-write was cut off; the next append lands cleanly.
        j.append(b"ok").unwrap();
        let (_, s) = Journal::open(&p, io.crashed_copy(Crash::KeepPending { ops: usize::MAX, torn_bytes: 0 })).unwrap();
        assert_eq!(payloads(&s), vec![b"keep".to_vec(), b"ok".to_vec()]);
        assert_eq!(s.torn, None, "stray bytes after the last record");
        let s = io.counts().syncs;
        io.fail_sync(s);
        assert!(j.append(b"maybe").is_err());
        let e = j.append(b"after").unwrap_err();
        assert!(matches!(e, Error::JournalPoisoned { .. }), "{e}");
        assert!(e.to_string().contains("reopen"), "{e}");
        drop(j);
        let (_, s) = Journal::open(&p, io.clone()).unwrap();
        let got = payloads(&s);
        assert_eq!(&got[..2], &[b"keep".to_vec(), b"ok".to_vec()]);
        assert!(got.len() == 2 || got[2] == b"maybe", "{got:?}");
    }
}
