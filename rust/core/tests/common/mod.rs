//! What the integration tests share.

/// A xorshift64 generator from `seed` (any value: a zero seed is made odd).
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed | 1;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}
