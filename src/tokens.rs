//! Prompt token ids from a request header.
//!
//! An upstream tokenizer stage writes the prompt's token ids into a header in one of two
//! encodings. Both decode into the same thing: the token ids as little-endian `u32` bytes,
//! which is exactly the input of the block hash (see [`crate::hash`]), so nothing is
//! converted twice.
//!
//! - [`TokenEncoding::Decimal`]: `1,2,3` — readable, ~6 bytes a token.
//! - [`TokenEncoding::Base64LeU32`]: standard base64 (padding optional) of the ids as
//!   little-endian `u32` — 5.3 bytes a token *less* than decimal, and no number parsing.
//!   A 32k-token prompt is ~175 KB this way against ~200 KB in decimal.

use std::fmt;

/// How a token header's value is encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenEncoding {
    Decimal,
    Base64LeU32,
}

/// Why a header could not be read as token ids. Every variant routes the request by load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenError {
    /// Present but without a single token.
    Empty,
    /// More tokens than the configured maximum; the header is not decoded further.
    TooMany { max: usize },
    /// A byte that does not belong, at this offset of the header value.
    Malformed { offset: usize },
    /// A decimal id above `u32::MAX`.
    OutOfRange { offset: usize },
    /// Base64 that decodes to a length that is not a whole number of `u32`s.
    PartialToken { bytes: usize },
}

impl TokenError {
    /// Every [`TokenError::reason`].
    pub const REASONS: [&'static str; 5] = ["empty", "too_many", "malformed", "out_of_range", "partial_token"];

    /// A short, stable name, used as the suffix of the parse-error counter.
    pub fn reason(&self) -> &'static str {
        match self {
            TokenError::Empty => "empty",
            TokenError::TooMany { .. } => "too_many",
            TokenError::Malformed { .. } => "malformed",
            TokenError::OutOfRange { .. } => "out_of_range",
            TokenError::PartialToken { .. } => "partial_token",
        }
    }
}

impl fmt::Display for TokenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenError::Empty => write!(f, "no token ids"),
            TokenError::TooMany { max } => write!(f, "more than {max} token ids"),
            TokenError::Malformed { offset } => write!(f, "unexpected byte at offset {offset}"),
            TokenError::OutOfRange { offset } => {
                write!(f, "token id at offset {offset} does not fit in u32")
            }
            TokenError::PartialToken { bytes } => {
                write!(f, "{bytes} decoded bytes is not a whole number of u32 token ids")
            }
        }
    }
}

/// Decodes `value` into `out` (cleared first) as little-endian `u32` bytes and returns the
/// number of tokens. `out` is reused across requests so a steady state allocates nothing.
pub fn decode_tokens(
    value: &[u8],
    encoding: TokenEncoding,
    max_tokens: usize,
    out: &mut Vec<u8>,
) -> Result<usize, TokenError> {
    out.clear();
    let count = match encoding {
        TokenEncoding::Decimal => decode_decimal(value, max_tokens, out)?,
        TokenEncoding::Base64LeU32 => decode_base64(value, max_tokens, out)?,
    };
    if count == 0 {
        return Err(TokenError::Empty);
    }
    Ok(count)
}

/// `1,2,3`; ASCII spaces and tabs are allowed around each id. An empty item (`1,,2`, a
/// trailing comma) is malformed rather than skipped: a tokenizer never emits one, so it
/// means the header was mangled.
fn decode_decimal(value: &[u8], max_tokens: usize, out: &mut Vec<u8>) -> Result<usize, TokenError> {
    if value.iter().all(|b| matches!(b, b' ' | b'\t')) {
        return Err(TokenError::Empty);
    }
    // Each id takes at least two bytes but the last, so this bounds the work before parsing.
    let upper_bound = value.len() / 2 + 1;
    out.reserve(4 * upper_bound.min(max_tokens.saturating_add(1)));
    let mut count = 0usize;
    let mut i = 0usize;
    let n = value.len();
    loop {
        while i < n && matches!(value[i], b' ' | b'\t') {
            i += 1;
        }
        let start = i;
        let mut id: u64 = 0;
        while i < n && value[i].is_ascii_digit() {
            id = id * 10 + u64::from(value[i] - b'0');
            if id > u64::from(u32::MAX) {
                return Err(TokenError::OutOfRange { offset: start });
            }
            i += 1;
        }
        if i == start {
            return Err(TokenError::Malformed { offset: i });
        }
        count += 1;
        if count > max_tokens {
            return Err(TokenError::TooMany { max: max_tokens });
        }
        // id <= u32::MAX was checked above.
        out.extend_from_slice(&(id as u32).to_le_bytes());
        while i < n && matches!(value[i], b' ' | b'\t') {
            i += 1;
        }
        if i == n {
            return Ok(count);
        }
        if value[i] != b',' {
            return Err(TokenError::Malformed { offset: i });
        }
        i += 1;
    }
}

const INVALID: u8 = 0xFF;

const fn base64_table() -> [u8; 256] {
    let mut t = [INVALID; 256];
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut i = 0;
    while i < 64 {
        t[alphabet[i] as usize] = i as u8;
        i += 1;
    }
    t
}

static BASE64: [u8; 256] = base64_table();

/// Standard alphabet, `=` padding optional; no whitespace (a header value has none).
fn decode_base64(value: &[u8], max_tokens: usize, out: &mut Vec<u8>) -> Result<usize, TokenError> {
    let mut body = value;
    let mut pad = 0;
    while pad < 2 && body.last() == Some(&b'=') {
        body = &body[..body.len() - 1];
        pad += 1;
    }
    if body.is_empty() {
        return Err(TokenError::Empty);
    }
    if body.len() % 4 == 1 || (pad > 0 && !(body.len() + pad).is_multiple_of(4)) {
        return Err(TokenError::Malformed { offset: value.len() - 1 });
    }
    let decoded_len = body.len() / 4 * 3 + (body.len() % 4).saturating_sub(1);
    if !decoded_len.is_multiple_of(4) {
        return Err(TokenError::PartialToken { bytes: decoded_len });
    }
    if decoded_len / 4 > max_tokens {
        return Err(TokenError::TooMany { max: max_tokens });
    }
    out.resize(decoded_len, 0);
    let sextet = |offset: usize| -> Result<u32, TokenError> {
        match BASE64[body[offset] as usize] {
            INVALID => Err(TokenError::Malformed { offset }),
            v => Ok(u32::from(v)),
        }
    };
    // Whole quads: 16 characters at a time with SIMD where built for it; then (and on an
    // invalid character, to report its offset) four table lookups and one validity test
    // per quad (INVALID has the high bit set).
    let whole = body.len() / 4 * 4;
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    let first_quad = simd::decode_prefix(&body[..whole], out) / 4;
    #[cfg(target_arch = "x86_64")]
    let first_quad = simd_x86::decode_prefix(&body[..whole], out) / 4;
    #[cfg(not(any(all(target_arch = "wasm32", target_feature = "simd128"), target_arch = "x86_64")))]
    let first_quad = 0;
    for (q, quad) in body[..whole].chunks_exact(4).enumerate().skip(first_quad) {
        let [a, b, c, d] = [quad[0], quad[1], quad[2], quad[3]].map(|ch| BASE64[ch as usize]);
        if (a | b | c | d) & 0x80 != 0 {
            let bad = (0..4).find(|&k| BASE64[quad[k] as usize] == INVALID).unwrap_or(0);
            return Err(TokenError::Malformed { offset: q * 4 + bad });
        }
        let v = u32::from(a) << 18 | u32::from(b) << 12 | u32::from(c) << 6 | u32::from(d);
        out[q * 3..q * 3 + 3].copy_from_slice(&[(v >> 16) as u8, (v >> 8) as u8, v as u8]);
    }
    let o = whole / 4 * 3;
    match body.len() - whole {
        2 => {
            let v = sextet(whole)? << 18 | sextet(whole + 1)? << 12;
            out[o] = (v >> 16) as u8;
        }
        3 => {
            let v = sextet(whole)? << 18 | sextet(whole + 1)? << 12 | sextet(whole + 2)? << 6;
            out[o..o + 2].copy_from_slice(&[(v >> 16) as u8, (v >> 8) as u8]);
        }
        _ => {}
    }
    Ok(out.len() / 4)
}

/// Base64 decoding 16 characters at a time with wasm SIMD (simd128), after Muła and Lemire,
/// "Faster Base64 Encoding and Decoding Using AVX2 Instructions" (2018): nibble lookup
/// tables validate and translate each character, shifts and ors pack four 6-bit values
/// into three bytes. A 32k-token header is ~175 KB of base64, the largest input the filter
/// parses.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd {
    use core::arch::wasm32::*;

    /// Decodes whole 16-character chunks of `chars` into `out`, 12 bytes each, while every
    /// character is valid and a 16-byte store fits in `out`; returns the characters
    /// consumed (a multiple of 16). The caller decodes the rest, and reports an invalid
    /// character, with the scalar path.
    pub fn decode_prefix(chars: &[u8], out: &mut [u8]) -> usize {
        let lut_lo =
            i8x16(0x15, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x13, 0x1A, 0x1B, 0x1B, 0x1B, 0x1A);
        let lut_hi =
            i8x16(0x10, 0x10, 0x01, 0x02, 0x04, 0x08, 0x04, 0x08, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10);
        let lut_roll = i8x16(0, 16, 19, 4, -65, -65, -71, -71, 0, 0, 0, 0, 0, 0, 0, 0);
        let pack = i8x16(2, 1, 0, 6, 5, 4, 10, 9, 8, 14, 13, 12, -1, -1, -1, -1);
        let mut i = 0;
        while i + 16 <= chars.len() && i / 4 * 3 + 16 <= out.len() {
            // SAFETY: i + 16 <= chars.len(); wasm loads need no alignment.
            let v = unsafe { v128_load(chars.as_ptr().add(i).cast::<v128>()) };
            let hi = u8x16_shr(v, 4);
            let lo = v128_and(v, u8x16_splat(0x0f));
            if v128_any_true(v128_and(i8x16_swizzle(lut_lo, lo), i8x16_swizzle(lut_hi, hi))) {
                break;
            }
            // '/' shares its high nibble with '+': it takes the roll one slot lower.
            let roll = i8x16_swizzle(lut_roll, i8x16_add(i8x16_eq(v, u8x16_splat(b'/')), hi));
            let sextets = i8x16_add(v, roll);
            // Per 16-bit lane [a, b] → a << 6 | b; per 32-bit lane [ab, cd] → ab << 12 | cd.
            let ab = v128_or(i16x8_shl(v128_and(sextets, u16x8_splat(0x00ff)), 6), u16x8_shr(sextets, 8));
            let abcd = v128_or(i32x4_shl(v128_and(ab, u32x4_splat(0xffff)), 12), u32x4_shr(ab, 16));
            // SAFETY: i / 4 * 3 + 16 <= out.len(); the 4 bytes past the 12 decoded ones are
            // overwritten by the next chunk or the scalar tail.
            unsafe { v128_store(out.as_mut_ptr().add(i / 4 * 3).cast::<v128>(), i8x16_swizzle(abcd, pack)) };
            i += 16;
        }
        i
    }
}

/// The same decoding with x86-64's SSSE3 (the native build: an Envoy dynamic module, the
/// sidecar, the stage), chosen at run time: a CPU without SSSE3 takes the scalar path.
/// `pshufb` zeroes a lane whose index has its high bit set where wasm's swizzle zeroes one
/// whose index is 16 or more; every index here is 0..=15 or -1, so the tables are the same.
#[cfg(target_arch = "x86_64")]
mod simd_x86 {
    use core::arch::x86_64::*;

    /// As the wasm build's `simd::decode_prefix`: whole 16-character chunks while valid and
    /// while a 16-byte store fits in `out`; returns the characters consumed.
    pub fn decode_prefix(chars: &[u8], out: &mut [u8]) -> usize {
        if std::is_x86_feature_detected!("ssse3") {
            // SAFETY: the CPU has SSSE3 (checked just above).
            unsafe { decode_prefix_ssse3(chars, out) }
        } else {
            0
        }
    }

    #[target_feature(enable = "ssse3")]
    fn decode_prefix_ssse3(chars: &[u8], out: &mut [u8]) -> usize {
        let lut_lo = _mm_setr_epi8(
            0x15, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x13, 0x1A, 0x1B, 0x1B, 0x1B, 0x1A,
        );
        let lut_hi = _mm_setr_epi8(
            0x10, 0x10, 0x01, 0x02, 0x04, 0x08, 0x04, 0x08, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10,
        );
        let lut_roll = _mm_setr_epi8(0, 16, 19, 4, -65, -65, -71, -71, 0, 0, 0, 0, 0, 0, 0, 0);
        let pack = _mm_setr_epi8(2, 1, 0, 6, 5, 4, 10, 9, 8, 14, 13, 12, -1, -1, -1, -1);
        let nibble = _mm_set1_epi8(0x0f);
        let mut i = 0;
        while i + 16 <= chars.len() && i / 4 * 3 + 16 <= out.len() {
            // SAFETY: i + 16 <= chars.len(); an unaligned load.
            let v = unsafe { _mm_loadu_si128(chars.as_ptr().add(i).cast::<__m128i>()) };
            // x86 has no 8-bit shift: shift 32-bit lanes and mask each byte's high nibble.
            let hi = _mm_and_si128(_mm_srli_epi32(v, 4), nibble);
            let lo = _mm_and_si128(v, nibble);
            let bad = _mm_and_si128(_mm_shuffle_epi8(lut_lo, lo), _mm_shuffle_epi8(lut_hi, hi));
            if _mm_movemask_epi8(_mm_cmpeq_epi8(bad, _mm_setzero_si128())) != 0xFFFF {
                break;
            }
            let roll = _mm_shuffle_epi8(lut_roll, _mm_add_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(b'/' as i8)), hi));
            let sextets = _mm_add_epi8(v, roll);
            let ab = _mm_or_si128(
                _mm_slli_epi16(_mm_and_si128(sextets, _mm_set1_epi16(0x00ff)), 6),
                _mm_srli_epi16(sextets, 8),
            );
            let abcd =
                _mm_or_si128(_mm_slli_epi32(_mm_and_si128(ab, _mm_set1_epi32(0xffff)), 12), _mm_srli_epi32(ab, 16));
            // SAFETY: i / 4 * 3 + 16 <= out.len(); as in the wasm build, the 4 bytes past
            // the 12 decoded ones are overwritten by the next chunk or the scalar tail.
            unsafe {
                _mm_storeu_si128(out.as_mut_ptr().add(i / 4 * 3).cast::<__m128i>(), _mm_shuffle_epi8(abcd, pack))
            };
            i += 16;
        }
        i
    }
}

/// Encodes token ids as [`TokenEncoding::Base64LeU32`] (with padding): what a tokenizer
/// stage, a load generator or a test sends.
pub fn encode_base64(tokens: &[u32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let mut s = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let v = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for k in 0..4 {
            if k <= chunk.len() {
                s.push(ALPHABET[(v >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// Encodes token ids as [`TokenEncoding::Decimal`].
pub fn encode_decimal(tokens: &[u32]) -> String {
    let mut s = String::with_capacity(tokens.len() * 6);
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&t.to_string());
    }
    s
}

/// Token ids back from the little-endian bytes [`decode_tokens`] produced.
pub fn le_bytes_to_ids(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn decode(value: &str, enc: TokenEncoding, max: usize) -> Result<Vec<u32>, TokenError> {
        let mut out = Vec::new();
        let n = decode_tokens(value.as_bytes(), enc, max, &mut out)?;
        assert_eq!(n * 4, out.len());
        Ok(le_bytes_to_ids(&out))
    }

    #[test]
    fn decimal_parses_with_spaces() {
        assert_eq!(decode("1,2,3", TokenEncoding::Decimal, 10), Ok(vec![1, 2, 3]));
        assert_eq!(decode(" 7 , 4294967295\t", TokenEncoding::Decimal, 10), Ok(vec![7, u32::MAX]));
    }

    #[test]
    fn decimal_rejects_bad_input() {
        use TokenError::*;
        assert_eq!(decode("", TokenEncoding::Decimal, 10), Err(Empty));
        assert_eq!(decode("  ", TokenEncoding::Decimal, 10), Err(Empty));
        assert_eq!(decode("1,,2", TokenEncoding::Decimal, 10), Err(Malformed { offset: 2 }));
        assert_eq!(decode("1,2,", TokenEncoding::Decimal, 10), Err(Malformed { offset: 4 }));
        assert_eq!(decode("1;2", TokenEncoding::Decimal, 10), Err(Malformed { offset: 1 }));
        assert_eq!(decode("-1", TokenEncoding::Decimal, 10), Err(Malformed { offset: 0 }));
        assert_eq!(decode("1 2", TokenEncoding::Decimal, 10), Err(Malformed { offset: 2 }));
        assert_eq!(decode("4294967296", TokenEncoding::Decimal, 10), Err(OutOfRange { offset: 0 }));
        assert_eq!(decode("99999999999999999999999", TokenEncoding::Decimal, 10), Err(OutOfRange { offset: 0 }));
        assert_eq!(decode("1,2,3", TokenEncoding::Decimal, 2), Err(TooMany { max: 2 }));
    }

    #[test]
    fn base64_round_trips_every_length() {
        for n in 1..40u32 {
            let ids: Vec<u32> = (0..n).map(|i| i.wrapping_mul(2_654_435_761)).collect();
            let padded = encode_base64(&ids);
            assert_eq!(decode(&padded, TokenEncoding::Base64LeU32, 1000), Ok(ids.clone()));
            let unpadded = padded.trim_end_matches('=');
            assert_eq!(decode(unpadded, TokenEncoding::Base64LeU32, 1000), Ok(ids));
        }
    }

    #[test]
    fn base64_known_value() {
        // 1000, 1001 as LE u32 = e8 03 00 00 e9 03 00 00
        assert_eq!(encode_base64(&[1000, 1001]), "6AMAAOkDAAA=");
        assert_eq!(decode("6AMAAOkDAAA=", TokenEncoding::Base64LeU32, 10), Ok(vec![1000, 1001]));
    }

    #[test]
    fn base64_rejects_bad_input() {
        use TokenError::*;
        assert_eq!(decode("", TokenEncoding::Base64LeU32, 10), Err(Empty));
        assert_eq!(decode("==", TokenEncoding::Base64LeU32, 10), Err(Empty));
        assert_eq!(decode("6AMA", TokenEncoding::Base64LeU32, 10), Err(PartialToken { bytes: 3 }));
        assert_eq!(decode("6AMAA*kDAAA=", TokenEncoding::Base64LeU32, 10), Err(Malformed { offset: 5 }));
        assert_eq!(decode("6AMAAOkDAAA=", TokenEncoding::Base64LeU32, 1), Err(TooMany { max: 1 }));
        assert!(matches!(decode("6AMAA", TokenEncoding::Base64LeU32, 10), Err(Malformed { .. })));
        assert!(matches!(decode("6AMAAOkDAA=", TokenEncoding::Base64LeU32, 10), Err(Malformed { .. })));
    }

    #[test]
    fn base64_long_inputs_and_late_errors() {
        // Long enough for the SIMD path (where built) and its scalar tail, every alphabet
        // character included.
        let ids: Vec<u32> = (0..3001u32).map(|i| i.wrapping_mul(0x9E37_79B9) ^ (i << 7)).collect();
        let text = encode_base64(&ids);
        assert_eq!(decode(&text, TokenEncoding::Base64LeU32, 10_000), Ok(ids));
        let all = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".repeat(4);
        let mut out = Vec::new();
        assert_eq!(decode_tokens(all.as_bytes(), TokenEncoding::Base64LeU32, 100, &mut out), Ok(48));
        for bad_at in [0, 15, 16, 37, 200, text.len() - 20] {
            for bad in [b'*', b'-', b' ', b'=', 0x80, 0xFF, 0] {
                let mut t = text.as_bytes().to_vec();
                t[bad_at] = bad;
                assert_eq!(
                    decode_tokens(&t, TokenEncoding::Base64LeU32, 10_000, &mut out),
                    Err(TokenError::Malformed { offset: bad_at }),
                    "{bad:#x} at {bad_at}"
                );
            }
        }
    }

    /// The wasm32 tests must exercise the SIMD decoder the filter ships with
    /// (`.cargo/config.toml` enables simd128 for wasm32).
    #[cfg(target_arch = "wasm32")]
    #[test]
    fn wasm_build_has_simd() {
        assert!(cfg!(target_feature = "simd128"));
    }

    /// The native build's SSSE3 decoder takes every whole 16-character chunk of a valid
    /// value (the scalar path only the tail) and stops at the chunk of an invalid one.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn x86_simd_decodes_whole_chunks() {
        if !std::is_x86_feature_detected!("ssse3") {
            return;
        }
        let ids: Vec<u32> = (0..1000u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let text = encode_base64(&ids);
        let whole = text.len() / 16 * 16;
        let mut out = vec![0; ids.len() * 4 + 16];
        assert_eq!(simd_x86::decode_prefix(&text.as_bytes()[..whole], &mut out), whole);
        let decoded: Vec<u32> =
            out[..whole / 4 * 3].chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert_eq!(decoded, ids[..decoded.len()]);
        let mut bad = text.into_bytes();
        bad[100] = b'.';
        assert_eq!(simd_x86::decode_prefix(&bad[..whole], &mut out), 96);
    }

    #[test]
    fn encodings_agree() {
        let ids: Vec<u32> = (0..100).map(|i| i * 7919).collect();
        let a = decode(&encode_decimal(&ids), TokenEncoding::Decimal, 1000).unwrap();
        let b = decode(&encode_base64(&ids), TokenEncoding::Base64LeU32, 1000).unwrap();
        assert_eq!(a, ids);
        assert_eq!(b, ids);
    }
}
