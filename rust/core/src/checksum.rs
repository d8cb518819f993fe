//! The checksum of every frame, journal record and spooled piece: CRC-32C
//! (Castagnoli, the iSCSI polynomial), computed by `crc-fast` (carry-less
//! multiply folding: about 120 GB/s on an AVX-512 core against 32 GB/s
//! for three interleaved `crc32` instructions, which matters because a
//! diff and an apply each checksum the whole delta).

use crc_fast::{CrcAlgorithm, Digest};

/// The CRC-32C of `data`.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// The CRC-32C of the bytes whose CRC-32C is `crc`, followed by `data`.
#[inline]
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    // The register holds the checksum before its final inversion.
    let mut d = Digest::new_with_init_state(CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    d.update(data);
    d.finalize() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_castagnoli_check_value_and_appends_in_any_split() {
        // The catalogue's check value of CRC-32/ISCSI.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        let data: Vec<u8> = (0..5000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        let whole = crc32c(&data);
        for cut in [0, 1, 7, 16, 63, 64, 65, 255, 256, 1000, 4999, 5000] {
            assert_eq!(crc32c_append(crc32c(&data[..cut]), &data[cut..]), whole, "cut at {cut}");
        }
        assert_eq!(crc32c_append(crc32c_append(crc32c(&data[..10]), &data[10..300]), &data[300..]), whole);
    }
}
