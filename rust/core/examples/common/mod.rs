//! What the profiling examples share.

/// With `COLD` set to anything but `0` or empty: write 256 MiB, one byte per cache
/// line, so that the next timed stage starts with its inputs out of every
/// cache level, as a refit does (on this VM even 10 ms of idling leaves
/// little of a 20 MB working set in the last-level cache).
pub fn evict_caches() {
    use std::sync::Mutex;
    static EVICT: Mutex<Vec<u8>> = Mutex::new(Vec::new());
    if !cold_runs() {
        return;
    }
    let mut buf = EVICT.lock().unwrap();
    if buf.is_empty() {
        buf.resize(256 << 20, 1);
    }
    for x in buf.iter_mut().step_by(64) {
        *x = x.wrapping_add(1);
    }
}

/// Whether `COLD` asks for cold repeats: set, and neither empty nor `0`
/// (`COLD=0` means warm, as a reader expects).
fn cold_runs() -> bool {
    std::env::var_os("COLD").is_some_and(|v| !v.is_empty() && v != "0")
}
