//! Object-storage transport against `InMemory` and the local filesystem.

use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use object_store::memory::InMemory;
use object_store::{ObjectStoreExt, PutPayload};

use super::*;
use crate::checkpoint::digest_hex;
use crate::delta::DiffOptions;

/// Write a safetensors file of BF16 tensors (raw u16 words).
fn write_st(path: &FsPath, tensors: &[(&str, Vec<u64>, Vec<u16>)]) {
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    let mut sorted: Vec<_> = tensors.iter().collect();
    sorted.sort_by_key(|t| t.0);
    for (name, shape, data) in &sorted {
        let n = data.len() * 2;
        header.insert(name.to_string(), serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [off, off + n]}));
        off += n;
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    for (_, _, data) in &sorted {
        for w in data {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
    std::fs::write(path, out).unwrap();
}

/// Versions 0..=n of a small checkpoint, each changing ~3% of the words.
fn versions(dir: &FsPath, n: usize) -> Vec<PathBuf> {
    let mut state: u64 = 0x9e3779b97f4a7c15;
    let mut rnd = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut a: Vec<u16> = (0..64 * 1024).map(|_| (rnd() as u16) & 0x3fff).collect();
    let mut b: Vec<u16> = (0..3000).map(|_| (rnd() as u16) & 0x3fff).collect();
    let mut paths = Vec::new();
    for v in 0..=n {
        if v > 0 {
            for w in a.iter_mut().chain(b.iter_mut()) {
                if rnd() % 33 == 0 {
                    *w ^= 1 + (rnd() as u16 & 3);
                }
            }
        }
        let p = dir.join(format!("v{v}.safetensors"));
        write_st(&p, &[("layer.weight", vec![256, 256], a.clone()), ("norm.weight", vec![3000], b.clone())]);
        paths.push(p);
    }
    paths
}

fn small_chunks() -> DiffOptions {
    DiffOptions { chunk_bytes: 16 << 10, ..Default::default() }
}

fn memory_store() -> Store {
    Store::from_object_store(Arc::new(InMemory::new()), "runs/r1", "memory://test/runs/r1").unwrap()
}

fn publish_all(store: &Store, paths: &[PathBuf]) {
    for w in paths.windows(2) {
        publish_diff(store, &w[0], &w[1], &small_chunks(), PublishOptions::default(), &mut |_, _| {}).unwrap();
    }
}

fn receiver_copy(dir: &FsPath, from: &FsPath, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::copy(from, &p).unwrap();
    p
}

#[test]
fn publish_then_receive_is_bit_exact_through_the_chain() {
    let dir = tempfile::tempdir().unwrap();
    let paths = versions(dir.path(), 3);
    let store = memory_store();
    publish_all(&store, &paths);
    let ms = store.committed().unwrap();
    assert_eq!(ms.iter().map(|m| m.version).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert!(ms[0].objects.len() > 2, "header plus several chunk objects");
    let target = receiver_copy(dir.path(), &paths[0], "r.safetensors");
    let opts = ReceiveOptions { receiver_id: Some("r1".into()), ..Default::default() };
    let s = receive(&store, &target, &opts, &mut |_| {}).unwrap();
    assert_eq!(s.applied, vec![1, 2, 3]);
    assert_eq!(s.version, Some(3));
    assert_eq!(std::fs::read(&target).unwrap(), std::fs::read(&paths[3]).unwrap());
    // At the newest: nothing to do.
    let s = receive(&store, &target, &opts, &mut |_| {}).unwrap();
    assert!(s.applied.is_empty());
    assert_eq!(s.version, Some(3));
    // A receiver at v2 applies only v3.
    let mid = receiver_copy(dir.path(), &paths[2], "mid.safetensors");
    let s = receive(&store, &mid, &ReceiveOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(s.applied, vec![3]);
}

#[test]
fn local_filesystem_url_and_multipart() {
    let dir = tempfile::tempdir().unwrap();
    let paths = versions(dir.path(), 1);
    let url = format!("file://{}/bucket/prefix", dir.path().display());
    let store = Store::open(&url).unwrap();
    // Every object large enough goes up in parts.
    let opts = PublishOptions { multipart_bytes: 200, part_bytes: 128, ..Default::default() };
    let (s, _) = publish_diff(&store, &paths[0], &paths[1], &small_chunks(), opts, &mut |_, _| {}).unwrap();
    assert!(s.multipart_objects > 0);
    assert!(dir.path().join("bucket/prefix/v1/manifest.json").exists());
    let target = receiver_copy(dir.path(), &paths[0], "r.safetensors");
    let s = receive(&Store::open(&url).unwrap(), &target, &ReceiveOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(s.applied, vec![1]);
    assert_eq!(std::fs::read(&target).unwrap(), std::fs::read(&paths[1]).unwrap());
}

#[test]
fn uploads_without_a_manifest_are_invisible() {
    let dir = tempfile::tempdir().unwrap();
    let paths = versions(dir.path(), 1);
    let store = memory_store();
    let opts = PublishOptions { commit: false, ..Default::default() };
    let (s, _) = publish_diff(&store, &paths[0], &paths[1], &small_chunks(), opts, &mut |_, _| {}).unwrap();
    assert!(!s.committed && s.objects > 1);
    assert!(store.committed().unwrap().is_empty());
    let target = receiver_copy(dir.path(), &paths[0], "r.safetensors");
    let before = std::fs::read(&target).unwrap();
    let r = receive(&store, &target, &ReceiveOptions::default(), &mut |_| {}).unwrap();
    assert!(r.applied.is_empty() && r.version.is_none());
    assert_eq!(std::fs::read(&target).unwrap(), before);
}

#[test]
fn second_publisher_racing_for_a_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let paths = versions(dir.path(), 2);
    let store = memory_store();
    let bytes = |a: &FsPath, b: &FsPath| {
        let out = dir.path().join("d.dcr");
        crate::files::diff_files(a, b, &out, &small_chunks(), &mut |_, _| {}).unwrap();
        std::fs::read(out).unwrap()
    };
    let d1 = bytes(&paths[0], &paths[1]);
    let d2 = bytes(&paths[0], &paths[2]);
    let mut p1 = Publisher::begin(&store, PublishOptions::default()).unwrap();
    let mut p2 = Publisher::begin(&store, PublishOptions::default()).unwrap();
    assert_eq!((p1.version(), p2.version()), (1, 1));
    p1.push(&d1).unwrap();
    p2.push(&d2).unwrap();
    p1.finish().unwrap();
    let e = p2.finish().unwrap_err();
    assert!(matches!(e, Error::VersionExists { version: 1, next: 2, .. }), "{e}");
    assert!(e.to_string().contains("already committed"), "{e}");
    // The winner's version is what receivers see.
    let ms = store.committed().unwrap();
    assert_eq!(ms.len(), 1);
    assert_eq!(ms[0].target_digest, digest_hex(&crate::checkpoint::ReadOnlyCheckpoint::open(&paths[1]).unwrap().checkpoint_digest()));
    // Asking for a committed version up front is refused before any upload.
    let e = Publisher::begin(&store, PublishOptions { version: Some(1), ..Default::default() }).err().unwrap();
    assert!(matches!(e, Error::VersionExists { .. }));
}

#[test]
fn a_delta_that_does_not_extend_the_chain_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let paths = versions(dir.path(), 2);
    let store = memory_store();
    publish_all(&store, &paths[..2]);
    // 0 -> 2 again has base v0, but the newest committed holds v1.
    let e = publish_diff(&store, &paths[0], &paths[2], &small_chunks(), PublishOptions::default(), &mut |_, _| {}).unwrap_err();
    assert!(matches!(e, Error::VersionChain { .. }), "{e}");
    assert!(store.committed().unwrap().len() == 1);
}

#[test]
fn corrupted_object_is_refused_and_the_target_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let paths = versions(dir.path(), 1);
    let store = memory_store();
    publish_all(&store, &paths);
    let m = store.manifest(1).unwrap().unwrap();
    let victim = store.object_path(1, &m.objects[1].name);
    let rt = runtime();
    let mut bytes = rt.block_on(async { store.inner.get(&victim).await.unwrap().bytes().await.unwrap() }).to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    rt.block_on(store.inner.put(&victim, PutPayload::from(bytes))).unwrap();
    let target = receiver_copy(dir.path(), &paths[0], "r.safetensors");
    let before = std::fs::read(&target).unwrap();
    let e = receive(&store, &target, &ReceiveOptions::default(), &mut |_| {}).unwrap_err();
    assert!(matches!(e, Error::Checksum { .. }), "{e}");
    assert!(e.to_string().contains(victim.as_ref()), "names the object: {e}");
    assert_eq!(std::fs::read(&target).unwrap(), before);
}

/// An object rewritten with other bytes of the same size in a valid frame
/// (what a writer other than the publisher could leave: only its name, the
/// hash of its bytes, tells), replaced by another object of the delta, cut
/// short, or missing: each refused by what is wrong with it, naming the
/// object, and the target left as it was.
#[test]
fn swapped_cut_or_missing_objects_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let paths = versions(dir.path(), 1);
    let rt = runtime();
    let get = |store: &Store, path: &object_store::path::Path| rt.block_on(async { store.inner.get(path).await.unwrap().bytes().await.unwrap() }).to_vec();
    type Damage<'a> = &'a dyn Fn(&Store, &object_store::path::Path, &object_store::path::Path);
    let rewritten: Damage = &|store, victim, _| {
        let Ok(Some((crate::format::Frame::Chunk(mut c), _))) = crate::format::parse_frame(&get(store, victim)) else { panic!("a chunk object") };
        c.payload[0] ^= 1;
        rt.block_on(store.inner.put(victim, PutPayload::from(c.to_frame()))).unwrap();
    };
    let swapped: Damage = &|store, victim, other| {
        let bytes = get(store, other);
        rt.block_on(store.inner.put(victim, PutPayload::from(bytes))).unwrap();
    };
    let cut: Damage = &|store, victim, _| {
        let bytes = get(store, victim);
        rt.block_on(store.inner.put(victim, PutPayload::from(bytes[..bytes.len() - 1].to_vec()))).unwrap();
    };
    let missing: Damage = &|store, victim, _| rt.block_on(store.inner.delete(victim)).unwrap();
    for (what, damage, expected) in [
        ("rewritten", rewritten, "hash to"),
        ("swapped", swapped, "the manifest says"),
        ("cut", cut, "the manifest says"),
        ("missing", missing, "is missing"),
    ] {
        let store = memory_store();
        publish_all(&store, &paths);
        let m = store.manifest(1).unwrap().unwrap();
        assert!(m.objects.len() > 3, "{} objects", m.objects.len());
        let (victim, other) = (store.object_path(1, &m.objects[1].name), store.object_path(1, &m.objects[2].name));
        // Another object of the same size fails the name check instead.
        let expected = if what == "swapped" && m.objects[1].size == m.objects[2].size { "hash to" } else { expected };
        damage(&store, &victim, &other);
        let target = receiver_copy(dir.path(), &paths[0], "r.safetensors");
        let before = std::fs::read(&target).unwrap();
        let e = receive(&store, &target, &ReceiveOptions::default(), &mut |_| {}).unwrap_err().to_string();
        assert!(e.contains(expected) && e.contains(victim.as_ref()), "{what}: {e}");
        assert_eq!(std::fs::read(&target).unwrap(), before, "{what}");
    }
}

/// A manifest that is not JSON, of another format, naming another version,
/// with a trailer that is not hex, or too large: each refused by what is
/// wrong, the target untouched.
#[test]
fn tampered_manifests_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let paths = versions(dir.path(), 1);
    let rt = runtime();
    type Edit = fn(&mut Manifest);
    let cases: [(&str, Option<Edit>, &str); 6] = [
        ("not JSON", None, "not a dcr manifest"),
        ("another format", Some(|m| m.format = "dcr-objstore-manifest/9".into()), "format \"dcr-objstore-manifest/9\", this dcr reads"),
        ("another version", Some(|m| m.version = 2), "it names version 2"),
        ("no objects", Some(|m| m.objects.clear()), "with 0 objects"),
        ("an odd-length trailer", Some(|m| { m.trailer.pop(); }), "odd-length hex"),
        ("a trailer not hex", Some(|m| m.trailer.replace_range(0..2, "zz")), "not hex"),
    ];
    for (what, edit, expected) in cases {
        let store = memory_store();
        publish_all(&store, &paths);
        let path = store.manifest_path(1);
        let bytes = match edit {
            None => b"{\"format\": ".to_vec(),
            Some(edit) => {
                let mut m = store.manifest(1).unwrap().unwrap();
                edit(&mut m);
                serde_json::to_vec(&m).unwrap()
            }
        };
        rt.block_on(store.inner.put(&path, PutPayload::from(bytes))).unwrap();
        let target = receiver_copy(dir.path(), &paths[0], "r.safetensors");
        let before = std::fs::read(&target).unwrap();
        let e = receive(&store, &target, &ReceiveOptions::default(), &mut |_| {}).unwrap_err().to_string();
        assert!(e.contains(expected), "{what}: {e}");
        assert_eq!(std::fs::read(&target).unwrap(), before, "{what}");
    }
    // Larger than any manifest: refused by its size.
    let store = memory_store();
    publish_all(&store, &paths);
    rt.block_on(store.inner.put(&store.manifest_path(1), PutPayload::from(vec![b' '; MAX_MANIFEST_BYTES as usize + 1]))).unwrap();
    let target = receiver_copy(dir.path(), &paths[0], "r.safetensors");
    let e = receive(&store, &target, &ReceiveOptions::default(), &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("exceeds the limit"), "{e}");
}

#[test]
fn target_from_elsewhere_is_refused_with_advice() {
    let dir = tempfile::tempdir().unwrap();
    let paths = versions(dir.path(), 1);
    let other = dir.path().join("o");
    std::fs::create_dir(&other).unwrap();
    let stranger = versions(&other, 0);
    let store = memory_store();
    publish_all(&store, &paths);
    std::fs::write(&stranger[0], {
        let mut b = std::fs::read(&stranger[0]).unwrap();
        let n = b.len();
        b[n - 1] ^= 1;
        b
    })
    .unwrap();
    let e = receive(&store, &stranger[0], &ReceiveOptions::default(), &mut |_| {}).unwrap_err();
    assert!(matches!(e, Error::VersionChain { .. }), "{e}");
    assert!(e.to_string().contains("dense refit"), "{e}");
}

#[test]
fn receiver_started_mid_stream_prefetches_then_commits() {
    let dir = tempfile::tempdir().unwrap();
    let paths = versions(dir.path(), 1);
    let store = memory_store();
    // The objects are up (the manifest is not) when the receiver starts.
    let opts = PublishOptions { commit: false, ..Default::default() };
    publish_diff(&store, &paths[0], &paths[1], &small_chunks(), opts, &mut |_, _| {}).unwrap();
    let target = receiver_copy(dir.path(), &paths[0], "r.safetensors");
    let (s2, t2) = (store.clone(), target.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    let th = std::thread::spawn(move || {
        let o = ReceiveOptions { wait: Duration::from_secs(60), poll: Duration::from_millis(20), ..Default::default() };
        receive(&s2, &t2, &o, &mut |e| {
            if let ReceiveEvent::Prefetched { objects, .. } = e {
                let _ = tx.send(objects);
            }
        })
    });
    // Commit only once the receiver has fetched objects from the stream.
    assert!(rx.recv_timeout(Duration::from_secs(50)).unwrap() > 0);
    publish_diff(&store, &paths[0], &paths[1], &small_chunks(), PublishOptions { version: Some(1), ..Default::default() }, &mut |_, _| {})
        .unwrap();
    let r = th.join().unwrap().unwrap();
    assert_eq!(r.applied, vec![1]);
    assert!(r.prefetched > 0, "objects were fetched before the manifest: {r:?}");
    assert_eq!(std::fs::read(&target).unwrap(), std::fs::read(&paths[1]).unwrap());
}

#[test]
fn gc_deletes_what_every_receiver_acknowledged_and_keeps_the_newest() {
    let dir = tempfile::tempdir().unwrap();
    let paths = versions(dir.path(), 3);
    let store = memory_store();
    publish_all(&store, &paths);
    // No registered receiver: nothing goes.
    assert!(gc(&store, false).unwrap().deleted.is_empty());
    let fast = receiver_copy(dir.path(), &paths[0], "fast.safetensors");
    let slow = receiver_copy(dir.path(), &paths[1], "slow.safetensors");
    receive(&store, &fast, &ReceiveOptions { receiver_id: Some("fast".into()), ..Default::default() }, &mut |_| {}).unwrap();
    // slow holds v1 and acknowledges it without applying anything newer yet.
    std::fs::copy(&paths[1], &slow).unwrap();
    let rt = runtime();
    rt.block_on(store.put_json(&store.path(&["receivers", "slow"]), &serde_json::json!({}), PutMode::Overwrite)).unwrap();
    rt.block_on(super::receive::ack(&store, "slow", 1, "d")).unwrap();
    let s = gc(&store, false).unwrap();
    assert_eq!(s.acknowledged_by_all, Some(1));
    assert_eq!(s.deleted, vec![1]);
    assert_eq!(store.committed().unwrap().iter().map(|m| m.version).collect::<Vec<_>>(), vec![2, 3]);
    // slow still catches up from v1.
    let r = receive(&store, &slow, &ReceiveOptions { receiver_id: Some("slow".into()), ..Default::default() }, &mut |_| {}).unwrap();
    assert_eq!(r.applied, vec![2, 3]);
    let s = gc(&store, false).unwrap();
    assert_eq!(s.deleted, vec![2], "v3 is the newest and stays");
    assert_eq!(store.committed().unwrap().len(), 1);
    let left: Vec<_> = rt.block_on(async { futures::TryStreamExt::try_collect::<Vec<_>>(store.inner.list(Some(&store.path(&["v2"])))).await }).unwrap();
    assert!(left.is_empty());
}

#[test]
fn receiver_ids_are_checked() {
    assert!(check_receiver_id("rollout-07.node_3").is_ok());
    for bad in ["", ".hidden", "a/b", "x y", &"z".repeat(129)] {
        assert!(check_receiver_id(bad).is_err(), "{bad:?}");
    }
}

/// A receiver killed mid-apply (journal: refit in flight, some chunks
/// applied, one torn; the spooled delta beside it) finishes that version
/// from its spool on the next `receive`, then goes on to the newest.
#[test]
fn a_receive_killed_mid_apply_finishes_from_its_spool() {
    use crate::checkpoint::WritableCheckpoint;
    use crate::receiver::{self, MemTarget, RefitOptions, TargetCrash};

    let dir = tempfile::tempdir().unwrap();
    let paths = versions(dir.path(), 2);
    let store = memory_store();
    publish_all(&store, &paths);
    let target = receiver_copy(dir.path(), &paths[0], "r.safetensors");
    let journal = receiver::default_journal_path(&target);

    // What a killed receive leaves: the spool, a journal with the refit in
    // flight, and a target with some chunks applied and one half-written.
    let spooled = dir.path().join("v1.dcr");
    crate::files::diff_files(&paths[0], &paths[1], &spooled, &small_chunks(), &mut |_, _| {}).unwrap();
    let bytes = std::fs::read(&spooled).unwrap();
    let delta = crate::delta::read_delta(&bytes).unwrap();
    assert!(delta.chunks.len() > 3);
    let mut ck = WritableCheckpoint::open_rw(&target).unwrap();
    let layout = ck.layout().clone();
    let mut mem = MemTarget::new(layout, ck.buffers().iter().map(|b| b.to_vec()).collect()).unwrap();
    mem.fail_flush(2);
    let opts = RefitOptions { batch_chunks: 1, ..Default::default() };
    receiver::refit(&journal, crate::journal::StdIo, &delta, &mut mem, &opts).unwrap_err();
    mem.crash(TargetCrash::Mix(11));
    for (dst, src) in ck.buffers_mut().into_iter().zip(&mem.current) {
        dst.copy_from_slice(src);
    }
    ck.flush().unwrap();
    drop(ck);
    std::fs::write(receiver::spool_path(&journal), &bytes).unwrap();
    let before = receiver::status_file(&target, None).unwrap();
    assert!(before.state.refit.as_ref().is_some_and(|r| r.touched() > 0), "{before:?}");
    assert_ne!(std::fs::read(&target).unwrap(), std::fs::read(&paths[0]).unwrap());

    let mut resumed = Vec::new();
    let s = receive(&store, &target, &ReceiveOptions::default(), &mut |e| {
        if let ReceiveEvent::Resumed { version, .. } = e {
            resumed.push(version);
        }
    })
    .unwrap();
    assert_eq!(resumed, vec![1], "the interrupted version is finished from the spool");
    assert_eq!(s.applied, vec![2], "then the next version is fetched and applied");
    assert_eq!(std::fs::read(&target).unwrap(), std::fs::read(&paths[2]).unwrap());
    assert!(!receiver::spool_path(&journal).exists(), "the spool is removed once committed");
    let after = receiver::status_file(&target, None).unwrap();
    assert!(after.state.refit.is_none() && after.state.committed.is_some_and(|c| c.version == 2), "{after:?}");
}

/// The spool of a received delta: a corrupt or truncated delta is refused
/// with the target untouched and nothing left behind; one dropped before it
/// finished leaves nothing either; a whole one commits and is removed.
#[test]
fn a_received_spool_refuses_damage_and_cleans_up() {
    use crate::receiver::{self, ReceivedSpool, RefitOptions, RefitOutcome};

    let dir = tempfile::tempdir().unwrap();
    let paths = versions(dir.path(), 1);
    let target = receiver_copy(dir.path(), &paths[0], "r.safetensors");
    let journal = receiver::default_journal_path(&target);
    let spooled = dir.path().join("v1.dcr");
    crate::files::diff_files(&paths[0], &paths[1], &spooled, &small_chunks(), &mut |_, _| {}).unwrap();
    let bytes = std::fs::read(&spooled).unwrap();
    let base = std::fs::read(&target).unwrap();
    let leftovers = || {
        std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".dcrj.delta"))
            .collect::<Vec<_>>()
    };

    // Truncated, then one flipped byte in a chunk payload.
    let mut flipped = bytes.clone();
    let at = bytes.len() / 2;
    flipped[at] ^= 0x10;
    for bad in [&bytes[..bytes.len() - 7], &flipped[..]] {
        let mut spool = ReceivedSpool::create(&target, None).unwrap();
        spool.append(bad).unwrap();
        let e = spool.refit(&RefitOptions::default()).unwrap_err();
        let msg = e.to_string().to_lowercase();
        assert!(["checksum", "truncat", "ends", "corrupt"].iter().any(|k| msg.contains(k)), "{msg}");
        assert_eq!(std::fs::read(&target).unwrap(), base, "the target is untouched");
        assert!(leftovers().is_empty(), "{:?}", leftovers());
    }
    // Dropped half-way (a stream that ended early).
    let mut spool = ReceivedSpool::create(&target, None).unwrap();
    spool.append(&bytes[..100]).unwrap();
    drop(spool);
    assert!(leftovers().is_empty(), "{:?}", leftovers());
    // While a spool is open, a second receiver (or `dcr apply`) is refused.
    let spool = ReceivedSpool::create(&target, None).unwrap();
    assert!(ReceivedSpool::create(&target, None).is_err());
    drop(spool);
    // Whole: committed, the spool removed.
    let mut spool = ReceivedSpool::create(&target, None).unwrap();
    for piece in bytes.chunks(1000) {
        spool.append(piece).unwrap();
    }
    assert!(matches!(spool.refit(&RefitOptions::default()).unwrap(), RefitOutcome::Committed(_)));
    assert_eq!(std::fs::read(&target).unwrap(), std::fs::read(&paths[1]).unwrap());
    assert!(leftovers().is_empty(), "{:?}", leftovers());
    assert!(receiver::status_file(&target, Some(&journal)).unwrap().state.target_is_committed());
}
