//! Both token-header encodings ([`kvroute::tokens::decode_tokens`]).
//!
//! Input: a selector byte (even: decimal, odd: base64), then the header value.
//! - base64 is checked against a plain scalar decoder written here from RFC 4648 (the
//!   filter's decoder has SIMD paths with `unsafe` loads and stores): same acceptance, same
//!   bytes, and the same offset for the first invalid character;
//! - decimal: a decoded list re-encoded canonically (`1,2,3`) decodes to the same ids;
//! - both: the output is 4 bytes a token and never more than `max_tokens` tokens.

use kvroute::tokens::{decode_tokens, TokenEncoding, TokenError};

/// Small enough that the fuzzer reaches the cap, large enough for SIMD's 16-char chunks.
const MAX_TOKENS: usize = 64;

pub fn check(data: &[u8]) {
    let (sel, value) = crate::selector(data);
    let encoding = if sel % 2 == 0 { TokenEncoding::Decimal } else { TokenEncoding::Base64LeU32 };
    let mut out = Vec::new();
    let got = decode_tokens(value, encoding, MAX_TOKENS, &mut out);
    if let Ok(n) = got {
        assert!((1..=MAX_TOKENS).contains(&n), "{n} tokens");
        assert_eq!(out.len(), 4 * n, "output length");
    }
    match encoding {
        TokenEncoding::Base64LeU32 => {
            let want = reference_base64(value, MAX_TOKENS);
            match (&got, &want) {
                (Ok(_), Ok(bytes)) => assert_eq!(&out, bytes, "SIMD and scalar base64 disagree"),
                (Err(a), Err(b)) => assert_eq!(a, b, "base64 errors disagree"),
                _ => panic!("base64 decoder says {got:?}, reference says {want:?}"),
            }
        }
        TokenEncoding::Decimal => {
            if got.is_ok() {
                let ids: Vec<String> =
                    out.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]).to_string()).collect();
                let mut again = Vec::new();
                let n = decode_tokens(ids.join(",").as_bytes(), encoding, MAX_TOKENS, &mut again);
                assert_eq!((n, &again), (got.clone(), &out), "canonical decimal does not round-trip");
            }
        }
    }
}

/// RFC 4648 base64, one character at a time, with the filter's documented rules: standard
/// alphabet, up to two `=` of padding optional (but if present it must complete the last
/// quad), no whitespace, and a decoded length that is a whole number of `u32`s.
fn reference_base64(value: &[u8], max_tokens: usize) -> Result<Vec<u8>, TokenError> {
    let pad = value.iter().rev().take(2).take_while(|&&b| b == b'=').count();
    let body = &value[..value.len() - pad];
    if body.is_empty() {
        return Err(TokenError::Empty);
    }
    if body.len() % 4 == 1 || (pad > 0 && !(body.len() + pad).is_multiple_of(4)) {
        return Err(TokenError::Malformed { offset: value.len() - 1 });
    }
    let len = body.len() / 4 * 3 + (body.len() % 4).saturating_sub(1);
    if !len.is_multiple_of(4) {
        return Err(TokenError::PartialToken { bytes: len });
    }
    if len / 4 > max_tokens {
        return Err(TokenError::TooMany { max: max_tokens });
    }
    let sextet = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut bits = 0u32;
    let mut n_bits = 0;
    let mut out = Vec::with_capacity(len);
    for (offset, &c) in body.iter().enumerate() {
        let v = sextet(c).ok_or(TokenError::Malformed { offset })?;
        bits = bits << 6 | u32::from(v);
        n_bits += 6;
        if n_bits >= 8 {
            n_bits -= 8;
            out.push((bits >> n_bits) as u8);
            bits &= (1 << n_bits) - 1;
        }
    }
    Ok(out)
}
