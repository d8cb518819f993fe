//! Element types of canonical checkpoints and the stable codes the delta
//! format stores for them.

use crate::error::{Error, Result};
use safetensors::Dtype;

/// A checkpoint element type. The codec works on stored bits: every value is a
/// little-endian word of `word_bytes()` bytes and XOR/overwrite act on those
/// bits, so NaN payloads, -0.0, subnormals and integer patterns are exact.
/// Sub-byte types (F4, F6) are stored packed; the codec treats their storage
/// as bytes, which is still bit exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DType(pub Dtype);

/// (code stored in the format, safetensors dtype, canonical name). Codes are
/// part of the wire format: never renumber, only append.
const TABLE: &[(u8, Dtype, &str)] = &[
    (1, Dtype::BOOL, "BOOL"),
    (2, Dtype::U8, "U8"),
    (3, Dtype::I8, "I8"),
    (4, Dtype::F8_E5M2, "F8_E5M2"),
    (5, Dtype::F8_E4M3, "F8_E4M3"),
    (6, Dtype::F8_E8M0, "F8_E8M0"),
    (7, Dtype::I16, "I16"),
    (8, Dtype::U16, "U16"),
    (9, Dtype::F16, "F16"),
    (10, Dtype::BF16, "BF16"),
    (11, Dtype::I32, "I32"),
    (12, Dtype::U32, "U32"),
    (13, Dtype::F32, "F32"),
    (14, Dtype::C64, "C64"),
    (15, Dtype::F64, "F64"),
    (16, Dtype::I64, "I64"),
    (17, Dtype::U64, "U64"),
    (18, Dtype::F4, "F4"),
    (19, Dtype::F6_E2M3, "F6_E2M3"),
    (20, Dtype::F6_E3M2, "F6_E3M2"),
];

impl DType {
    pub fn code(self) -> u8 {
        TABLE.iter().find(|(_, d, _)| *d == self.0).map(|(c, _, _)| *c).expect("every safetensors dtype has a code")
    }

    pub fn from_code(code: u8) -> Result<Self> {
        TABLE
            .iter()
            .find(|(c, _, _)| *c == code)
            .map(|(_, d, _)| DType(*d))
            .ok_or_else(|| Error::UnknownCode { what: "dtype", code, context: "tensor table".into() })
    }

    pub fn name(self) -> &'static str {
        TABLE.iter().find(|(_, d, _)| *d == self.0).map(|(_, _, n)| *n).expect("every safetensors dtype has a name")
    }

    pub fn from_name(name: &str) -> Result<Self> {
        let upper = name.to_ascii_uppercase();
        TABLE
            .iter()
            .find(|(_, _, n)| *n == upper)
            .map(|(_, d, _)| DType(*d))
            .ok_or_else(|| Error::UnsupportedDtype {
                dtype: name.into(),
                detail: format!(
                    "expected one of {}",
                    TABLE.iter().map(|(_, _, n)| *n).collect::<Vec<_>>().join(", ")
                ),
            })
    }

    /// Width of one codec word in bytes (1, 2, 4 or 8).
    pub fn word_bytes(self) -> usize {
        match self.0.bitsize() {
            b if b < 8 => 1,
            b => b / 8,
        }
    }

    /// Whether the codec's element is a packed byte rather than a logical
    /// element (F4, F6).
    pub fn is_packed(self) -> bool {
        self.0.bitsize() < 8
    }

    /// Number of stored bytes of a tensor of this dtype with `numel` elements.
    pub fn storage_bytes(self, numel: u64) -> Result<u64> {
        let bits = numel
            .checked_mul(self.0.bitsize() as u64)
            .ok_or_else(|| Error::Invalid(format!("tensor of {numel} {} elements overflows u64", self.name())))?;
        Ok(bits.div_ceil(8))
    }

    pub fn all() -> impl Iterator<Item = DType> {
        TABLE.iter().map(|(_, d, _)| DType(*d))
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for d in DType::all() {
            assert_eq!(DType::from_code(d.code()).unwrap(), d);
            assert_eq!(DType::from_name(d.name()).unwrap(), d);
            assert_eq!(DType::from_name(&d.name().to_lowercase()).unwrap(), d);
        }
        assert!(DType::from_code(0).is_err());
        assert!(DType::from_name("F12").is_err());
    }

    #[test]
    fn widths() {
        assert_eq!(DType(Dtype::BF16).word_bytes(), 2);
        assert_eq!(DType(Dtype::F8_E4M3).word_bytes(), 1);
        assert_eq!(DType(Dtype::F64).word_bytes(), 8);
        assert_eq!(DType(Dtype::F4).word_bytes(), 1);
        assert_eq!(DType(Dtype::F4).storage_bytes(5).unwrap(), 3);
    }
}
