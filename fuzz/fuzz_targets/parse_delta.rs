//! Feed arbitrary bytes to the delta parser and, when they parse, apply them
//! to a zeroed target of the delta's own layout: never a panic, never an
//! allocation sized by an unchecked length.
//!
//! Run: `cargo +nightly fuzz run parse_delta` (from the repository root).
#![no_main]

use dcr_core::delta::{apply, read_delta};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The streaming parser must cope with every prefix.
    let mut pos = 0;
    if let Ok(Some(p)) = dcr_core::format::parse_preamble(data) {
        pos = p;
        while let Ok(Some((_, used))) = dcr_core::format::parse_frame(&data[pos..]) {
            pos += used;
        }
    }
    let _ = pos;
    if let Ok(delta) = read_delta(data) {
        let layout = delta.header.layout.clone();
        let total: u64 = layout.tensors().iter().map(|t| t.storage_bytes().unwrap_or(0)).sum();
        if total <= 1 << 20 {
            let mut bufs: Vec<Vec<u8>> =
                layout.tensors().iter().map(|t| vec![0u8; t.storage_bytes().unwrap() as usize]).collect();
            let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            let _ = apply(&delta, &layout, &mut views);
        }
    }
});
