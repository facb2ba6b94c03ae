//! A bounds-checked MessagePack reader over a byte slice: just what decoding KV events
//! needs. Every length is checked against the bytes left before anything is read or
//! allocated, and nesting is limited, so hostile input costs at most one pass over itself.

use std::fmt;

/// Nesting deeper than this is refused (events nest 4 deep; `extra_keys` a little more).
const MAX_DEPTH: u32 = 32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MsgpackError {
    pub at: usize,
    pub what: &'static str,
}

impl fmt::Display for MsgpackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at byte {}", self.what, self.at)
    }
}

pub type Result<T> = std::result::Result<T, MsgpackError>;

/// The family of the next value, enough to choose how to read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub fn is_at_end(&self) -> bool {
        self.pos == self.buf.len()
    }

    fn err<T>(&self, what: &'static str) -> Result<T> {
        Err(MsgpackError { at: self.pos, what })
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return self.err("truncated");
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn byte(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn be(&mut self, n: usize) -> Result<u64> {
        Ok(self.take(n)?.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    pub fn peek_kind(&self) -> Result<Kind> {
        let Some(&m) = self.buf.get(self.pos) else {
            return self.err("truncated");
        };
        Ok(match m {
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => Kind::Int,
            0x80..=0x8f | 0xde | 0xdf => Kind::Map,
            0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
            0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
            0xc0 => Kind::Nil,
            0xc2 | 0xc3 => Kind::Bool,
            0xc4..=0xc6 => Kind::Bin,
            0xca | 0xcb => Kind::Float,
            0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
            0xc1 => return self.err("reserved marker 0xc1"),
        })
    }

    /// Consumes a nil if one is next.
    pub fn nil(&mut self) -> Result<bool> {
        if self.peek_kind()? == Kind::Nil {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    /// The number of elements of the array that follows. The count is checked against the
    /// bytes left (each element takes at least one byte).
    pub fn array_len(&mut self) -> Result<usize> {
        let n = match self.byte()? {
            m @ 0x90..=0x9f => usize::from(m & 0x0f),
            0xdc => self.be(2)? as usize,
            0xdd => self.be(4)? as usize,
            _ => {
                self.pos -= 1;
                return self.err("expected an array");
            }
        };
        if n > self.remaining() {
            return self.err("array longer than its bytes");
        }
        Ok(n)
    }

    /// The number of key/value pairs of the map that follows (checked like `array_len`).
    pub fn map_len(&mut self) -> Result<usize> {
        let n = match self.byte()? {
            m @ 0x80..=0x8f => usize::from(m & 0x0f),
            0xde => self.be(2)? as usize,
            0xdf => self.be(4)? as usize,
            _ => {
                self.pos -= 1;
                return self.err("expected a map");
            }
        };
        if n.saturating_mul(2) > self.remaining() {
            return self.err("map longer than its bytes");
        }
        Ok(n)
    }

    pub fn str(&mut self) -> Result<&'a str> {
        let n = match self.byte()? {
            m @ 0xa0..=0xbf => usize::from(m & 0x1f),
            0xd9 => self.be(1)? as usize,
            0xda => self.be(2)? as usize,
            0xdb => self.be(4)? as usize,
            _ => {
                self.pos -= 1;
                return self.err("expected a string");
            }
        };
        let bytes = self.take(n)?;
        std::str::from_utf8(bytes).or_else(|_| self.err("string is not UTF-8"))
    }

    pub fn bin(&mut self) -> Result<&'a [u8]> {
        let n = match self.byte()? {
            0xc4 => self.be(1)? as usize,
            0xc5 => self.be(2)? as usize,
            0xc6 => self.be(4)? as usize,
            _ => {
                self.pos -= 1;
                return self.err("expected bytes");
            }
        };
        self.take(n)
    }

    /// An integer of any width and sign, widened to i128 so u64 and i64 both fit.
    pub fn int(&mut self) -> Result<i128> {
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f => i128::from(m),
            0xe0..=0xff => i128::from(m as i8),
            0xcc => i128::from(self.be(1)?),
            0xcd => i128::from(self.be(2)?),
            0xce => i128::from(self.be(4)?),
            0xcf => i128::from(self.be(8)?),
            0xd0 => i128::from(self.be(1)? as u8 as i8),
            0xd1 => i128::from(self.be(2)? as u16 as i16),
            0xd2 => i128::from(self.be(4)? as u32 as i32),
            0xd3 => i128::from(self.be(8)? as i64),
            _ => {
                self.pos -= 1;
                return self.err("expected an integer");
            }
        })
    }

    /// A non-negative integer that fits `u32`.
    pub fn u32(&mut self) -> Result<u32> {
        let at = self.pos;
        let v = self.int()?;
        u32::try_from(v).map_err(|_| MsgpackError { at, what: "integer out of u32 range" })
    }

    /// The next value as a `u32` if it is an integer (an error if out of range), or `None`
    /// with nothing read if it is not: one look at the marker, for values that are nearly
    /// always integers.
    pub fn u32_if_int(&mut self) -> Result<Option<u32>> {
        match self.buf.get(self.pos) {
            None => self.err("truncated"),
            Some(0x00..=0x7f | 0xcc..=0xd3 | 0xe0..=0xff) => self.u32().map(Some),
            Some(_) => Ok(None),
        }
    }

    /// A float or an integer, as f64 (timestamps).
    pub fn number(&mut self) -> Result<f64> {
        match self.peek_kind()? {
            Kind::Float => {
                let m = self.byte()?;
                if m == 0xca {
                    Ok(f64::from(f32::from_bits(self.be(4)? as u32)))
                } else {
                    Ok(f64::from_bits(self.be(8)?))
                }
            }
            Kind::Int => Ok(self.int()? as f64),
            _ => self.err("expected a number"),
        }
    }

    /// Skips one value of any kind, nested ones included.
    pub fn skip(&mut self) -> Result<()> {
        self.skip_depth(0)
    }

    fn skip_depth(&mut self, depth: u32) -> Result<()> {
        if depth > MAX_DEPTH {
            return self.err("nested too deep");
        }
        match self.peek_kind()? {
            Kind::Nil | Kind::Bool => {
                self.pos += 1;
            }
            Kind::Int => {
                self.int()?;
            }
            Kind::Float => {
                self.number()?;
            }
            Kind::Str => {
                // Skipping does not need valid UTF-8.
                let m = self.byte()?;
                let n = match m {
                    0xa0..=0xbf => usize::from(m & 0x1f),
                    0xd9 => self.be(1)? as usize,
                    0xda => self.be(2)? as usize,
                    _ => self.be(4)? as usize,
                };
                self.take(n)?;
            }
            Kind::Bin => {
                self.bin()?;
            }
            Kind::Array => {
                for _ in 0..self.array_len()? {
                    self.skip_depth(depth + 1)?;
                }
            }
            Kind::Map => {
                for _ in 0..self.map_len()? {
                    self.skip_depth(depth + 1)?;
                    self.skip_depth(depth + 1)?;
                }
            }
            Kind::Ext => {
                let m = self.byte()?;
                let n = match m {
                    0xd4 => 1,
                    0xd5 => 2,
                    0xd6 => 4,
                    0xd7 => 8,
                    0xd8 => 16,
                    0xc7 => self.be(1)? as usize,
                    0xc8 => self.be(2)? as usize,
                    _ => self.be(4)? as usize,
                };
                self.take(n + 1)?; // type byte + data
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_integer_width() {
        let cases: &[(&[u8], i128)] = &[
            (&[0x05], 5),
            (&[0xff], -1),
            (&[0xcc, 0xc8], 200),
            (&[0xcd, 0x01, 0x00], 256),
            (&[0xce, 0, 1, 0, 0], 65536),
            (&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff], u64::MAX as i128),
            (&[0xd0, 0x80], -128),
            (&[0xd1, 0xff, 0x00], -256),
            (&[0xd2, 0xff, 0xff, 0xff, 0xff], -1),
            (&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0], i64::MIN as i128),
        ];
        for (bytes, want) in cases {
            let mut r = Reader::new(bytes);
            assert_eq!(r.int().unwrap(), *want, "{bytes:02x?}");
            assert!(r.is_at_end());
        }
    }

    #[test]
    fn lengths_beyond_the_input_are_refused_before_reading() {
        // array32 claiming 4 billion elements in 5 bytes
        assert!(Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).array_len().is_err());
        assert!(Reader::new(&[0xdf, 0xff, 0xff, 0xff, 0xff]).map_len().is_err());
        assert!(Reader::new(&[0xc6, 0xff, 0xff, 0xff, 0xff, 1]).bin().is_err());
        assert!(Reader::new(&[0xa5, b'a']).str().is_err());
        assert!(Reader::new(&[]).peek_kind().is_err());
        assert!(Reader::new(&[0xc1]).skip().is_err());
    }

    #[test]
    fn skip_refuses_deep_nesting() {
        let deep = vec![0x91u8; 1000];
        assert_eq!(Reader::new(&deep).skip().unwrap_err().what, "nested too deep");
        let mut ok = vec![0x91u8; 10];
        ok.push(0xc0);
        let mut r = Reader::new(&ok);
        r.skip().unwrap();
        assert!(r.is_at_end());
    }

    #[test]
    fn skips_every_kind() {
        // [nil, true, 1.5 (f64), "ab", bin(2), {1: 2}, ext8]
        let bytes = [
            0x97, 0xc0, 0xc3, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0xa2, b'a', b'b', 0xc4, 2, 9, 9, 0x81, 1, 2, 0xd4, 1,
            7,
        ];
        let mut r = Reader::new(&bytes);
        r.skip().unwrap();
        assert!(r.is_at_end());
    }
}
