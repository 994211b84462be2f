//! A msgpack pull reader over one byte slice that never allocates.
//!
//! It reads one value's head at a time ([`Reader::head`]): scalars whole, strings and binaries
//! as borrowed slices, arrays and maps as their element counts, whose elements the caller reads
//! next. Every count the peer claims is checked against the bytes left before it is returned
//! (each element takes at least one byte, so a claim larger than what is left is malformed), and
//! [`Reader::skip`] refuses nesting deeper than its limit. A hostile frame therefore costs time
//! proportional to its size and no memory; what the caller allocates from a count is its own
//! decision, made after these checks.

use rmp::Marker;

/// Why bytes are not (bounded) msgpack.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Malformed {
    /// The value needs more bytes than are left.
    #[error("truncated: {need} byte(s) needed, {left} left")]
    Truncated {
        /// Bytes the next item needs.
        need: u64,
        /// Bytes left.
        left: usize,
    },
    /// An array or map claims more elements than the bytes left could hold.
    #[error("container claims {claimed} element(s), {left} byte(s) left")]
    Claim {
        /// Elements claimed (a map's keys and values both count).
        claimed: u64,
        /// Bytes left.
        left: usize,
    },
    /// The marker msgpack reserves and never uses (0xc1).
    #[error("reserved marker 0xc1")]
    Reserved,
    /// Containers nested deeper than the caller's limit.
    #[error("containers nested too deep")]
    TooDeep,
}

/// The head of one value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Head<'a> {
    /// `nil`.
    Nil,
    /// A boolean.
    Bool(bool),
    /// A non-negative integer, whatever its marker (signed markers included).
    Uint(u64),
    /// A negative integer.
    Neg(i64),
    /// A float (f32 widened).
    Float(f64),
    /// A string's bytes (not checked to be UTF-8).
    Str(&'a [u8]),
    /// A binary's bytes.
    Bin(&'a [u8]),
    /// An extension value (skipped whole).
    Ext,
    /// An array of this many elements, which follow.
    Array(u32),
    /// A map of this many key/value pairs, which follow.
    Map(u32),
}

/// A cursor over one byte slice.
#[derive(Clone, Debug)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `buf`.
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    #[inline]
    fn take(&mut self, n: u64) -> Result<&'a [u8], Malformed> {
        let left = self.left();
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n <= left)
            .ok_or(Malformed::Truncated { need: n, left })?;
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    #[inline(always)]
    fn be<const N: usize>(&mut self) -> Result<[u8; N], Malformed> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N as u64)?);
        Ok(out)
    }

    fn len8(&mut self) -> Result<u64, Malformed> {
        Ok(u64::from(u8::from_be_bytes(self.be()?)))
    }

    fn len16(&mut self) -> Result<u64, Malformed> {
        Ok(u64::from(u16::from_be_bytes(self.be()?)))
    }

    fn len32(&mut self) -> Result<u64, Malformed> {
        Ok(u64::from(u32::from_be_bytes(self.be()?)))
    }

    /// A container count, checked against the bytes left (`per` elements per entry: 2 for a map).
    fn count(&self, n: u64, per: u64) -> Result<u32, Malformed> {
        let left = self.left();
        if n * per > left as u64 {
            return Err(Malformed::Claim {
                claimed: n * per,
                left,
            });
        }
        // Counts come from at most 32 bits on the wire.
        u32::try_from(n).map_err(|_| Malformed::Claim { claimed: n, left })
    }

    /// Reads the head of the next value. An array's or map's elements are not read: the caller
    /// reads (or skips) exactly that many values (twice as many for a map) next.
    #[inline]
    pub(crate) fn head(&mut self) -> Result<Head<'a>, Malformed> {
        let [byte] = self.be()?;
        Ok(match Marker::from_u8(byte) {
            Marker::Null => Head::Nil,
            Marker::Reserved => return Err(Malformed::Reserved),
            Marker::False => Head::Bool(false),
            Marker::True => Head::Bool(true),
            Marker::FixPos(n) => Head::Uint(u64::from(n)),
            Marker::FixNeg(n) => Head::Neg(i64::from(n)),
            Marker::U8 => Head::Uint(u64::from(u8::from_be_bytes(self.be()?))),
            Marker::U16 => Head::Uint(u64::from(u16::from_be_bytes(self.be()?))),
            Marker::U32 => Head::Uint(u64::from(u32::from_be_bytes(self.be()?))),
            Marker::U64 => Head::Uint(u64::from_be_bytes(self.be()?)),
            Marker::I8 => int(i64::from(i8::from_be_bytes(self.be()?))),
            Marker::I16 => int(i64::from(i16::from_be_bytes(self.be()?))),
            Marker::I32 => int(i64::from(i32::from_be_bytes(self.be()?))),
            Marker::I64 => int(i64::from_be_bytes(self.be()?)),
            Marker::F32 => Head::Float(f64::from(f32::from_be_bytes(self.be()?))),
            Marker::F64 => Head::Float(f64::from_be_bytes(self.be()?)),
            Marker::FixStr(n) => Head::Str(self.take(u64::from(n))?),
            Marker::Str8 => Head::Str(self.take_len(Self::len8)?),
            Marker::Str16 => Head::Str(self.take_len(Self::len16)?),
            Marker::Str32 => Head::Str(self.take_len(Self::len32)?),
            Marker::Bin8 => Head::Bin(self.take_len(Self::len8)?),
            Marker::Bin16 => Head::Bin(self.take_len(Self::len16)?),
            Marker::Bin32 => Head::Bin(self.take_len(Self::len32)?),
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => self.ext_len(Self::len8)?,
            Marker::Ext16 => self.ext_len(Self::len16)?,
            Marker::Ext32 => self.ext_len(Self::len32)?,
            Marker::FixArray(n) => Head::Array(self.count(u64::from(n), 1)?),
            Marker::Array16 => {
                let n = self.len16()?;
                Head::Array(self.count(n, 1)?)
            }
            Marker::Array32 => {
                let n = self.len32()?;
                Head::Array(self.count(n, 1)?)
            }
            Marker::FixMap(n) => Head::Map(self.count(u64::from(n), 2)?),
            Marker::Map16 => {
                let n = self.len16()?;
                Head::Map(self.count(n, 2)?)
            }
            Marker::Map32 => {
                let n = self.len32()?;
                Head::Map(self.count(n, 2)?)
            }
        })
    }

    fn take_len(
        &mut self,
        len: fn(&mut Self) -> Result<u64, Malformed>,
    ) -> Result<&'a [u8], Malformed> {
        let n = len(self)?;
        self.take(n)
    }

    /// An extension of `n` data bytes after its type byte.
    fn ext(&mut self, n: u64) -> Result<Head<'a>, Malformed> {
        self.take(1 + n)?;
        Ok(Head::Ext)
    }

    fn ext_len(
        &mut self,
        len: fn(&mut Self) -> Result<u64, Malformed>,
    ) -> Result<Head<'a>, Malformed> {
        let n = len(self)?;
        self.ext(n)
    }

    /// Skips one whole value, refusing containers nested more than `depth` deep (the value
    /// itself, if a container, is at depth 1). Recursion is bounded by `depth`; time by the
    /// bytes skipped.
    pub(crate) fn skip(&mut self, depth: usize) -> Result<(), Malformed> {
        let head = self.head()?;
        self.skip_elements(head, depth)
    }

    /// Skips the elements of a container whose head was just read (nothing for a scalar).
    pub(crate) fn skip_elements(&mut self, head: Head<'a>, depth: usize) -> Result<(), Malformed> {
        let elements = match head {
            Head::Array(n) => u64::from(n),
            Head::Map(n) => 2 * u64::from(n),
            _ => return Ok(()),
        };
        let inner = depth.checked_sub(1).ok_or(Malformed::TooDeep)?;
        let mut left = elements;
        while left > 0 {
            // A run of values whose size the marker alone gives (token ids, hashes) is stepped
            // over in a tight loop, bounds checked once at its end; only containers recurse.
            let (buf, start) = (self.buf, self.pos);
            let mut pos = start;
            let mut last = 0;
            while left > 0
                && let Some(&m) = buf.get(pos)
            {
                let size = usize::from(FIXED_SIZE[usize::from(m)]);
                if size == 0 {
                    break;
                }
                last = size;
                pos += size;
                left -= 1;
            }
            if pos > buf.len() {
                return Err(Malformed::Truncated {
                    need: last as u64,
                    left: buf.len() - (pos - last),
                });
            }
            self.pos = pos;
            if left == 0 {
                break;
            }
            left -= 1;
            let head = self.head()?;
            if matches!(head, Head::Array(_) | Head::Map(_)) {
                self.skip_elements(head, inner)?;
            }
        }
        Ok(())
    }

    /// Reads `n` array elements that must be integers in `0..=u32::MAX` (token ids) into `out`;
    /// `Ok(false)` at the first element that is not (what was read stays in `out`). The common
    /// encodings (fixint, uint8/16/32) are read in a tight loop; any other marker goes through
    /// [`Reader::head`], so every encoding of such an integer is accepted as before.
    pub(crate) fn u32s(&mut self, n: usize, out: &mut Vec<u32>) -> Result<bool, Malformed> {
        out.reserve(n);
        for _ in 0..n {
            let buf = &self.buf[self.pos..];
            let (value, size) = match buf {
                [m @ 0x00..=0x7f, ..] => (u32::from(*m), 1),
                [0xcc, b, ..] => (u32::from(*b), 2),
                [0xcd, b @ ..] if b.len() >= 2 => (u32::from(u16::from_be_bytes([b[0], b[1]])), 3),
                [0xce, b @ ..] if b.len() >= 4 => (u32::from_be_bytes([b[0], b[1], b[2], b[3]]), 5),
                _ => match self.head()? {
                    Head::Uint(t) => match u32::try_from(t) {
                        Ok(t) => {
                            out.push(t);
                            continue;
                        }
                        Err(_) => return Ok(false),
                    },
                    _ => return Ok(false),
                },
            };
            self.pos += size;
            out.push(value);
        }
        Ok(true)
    }

    /// [`Reader::value`] for a value that is usually an array of at most `cap` token ids: such
    /// an array is read into `out` (cleared first) while it is stepped over, and `true` returned;
    /// anything else is skipped as [`Reader::value`] does, `out` is left empty and `false`
    /// returned. One pass over the ids instead of a skip now and a decode later.
    pub(crate) fn value_u32s(
        &mut self,
        depth: usize,
        cap: usize,
        out: &mut Vec<u32>,
    ) -> Result<(&'a [u8], bool), Malformed> {
        let start = self.pos;
        out.clear();
        if let Ok(Head::Array(n)) = self.head() {
            if usize::try_from(n).is_ok_and(|n| n <= cap) && self.u32s(n as usize, out)? {
                return Ok((&self.buf[start..self.pos], true));
            }
            out.clear();
        }
        self.pos = start;
        self.value(depth).map(|v| (v, false))
    }

    /// Skips one whole value (as [`Reader::skip`]) and returns its bytes.
    pub(crate) fn value(&mut self, depth: usize) -> Result<&'a [u8], Malformed> {
        let start = self.pos;
        self.skip(depth)?;
        Ok(&self.buf[start..self.pos])
    }
}

/// The encoded size of a value, marker included, for the markers that alone determine it; 0 for
/// the others (containers, length-prefixed strings, binaries and extensions, the reserved byte).
const FIXED_SIZE: [u8; 256] = {
    let mut size = [0u8; 256];
    let mut m = 0;
    while m < 256 {
        size[m] = match Marker::from_u8(m as u8) {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::False | Marker::True => {
                1
            }
            Marker::U8 | Marker::I8 => 2,
            Marker::U16 | Marker::I16 => 3,
            Marker::U32 | Marker::I32 | Marker::F32 => 5,
            Marker::U64 | Marker::I64 | Marker::F64 => 9,
            Marker::FixStr(n) => 1 + n,
            Marker::FixExt1 => 3,
            Marker::FixExt2 => 4,
            Marker::FixExt4 => 6,
            Marker::FixExt8 => 10,
            Marker::FixExt16 => 18,
            _ => 0,
        };
        m += 1;
    }
    size
};

/// A signed integer: non-negative values read as [`Head::Uint`] whatever their marker.
fn int(i: i64) -> Head<'static> {
    u64::try_from(i).map_or(Head::Neg(i), Head::Uint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_sizes_agree_with_the_reader() {
        for m in 0..=255u8 {
            let mut buf = vec![m];
            buf.resize(64, 0);
            let mut rd = Reader::new(&buf);
            let head = rd.head();
            let size = FIXED_SIZE[usize::from(m)];
            if size > 0 {
                assert!(head.is_ok(), "{m:#04x}");
                assert_eq!(rd.pos, usize::from(size), "{m:#04x}");
            } else {
                // Only containers, length-prefixed values and the reserved byte vary.
                assert!(
                    matches!(
                        Marker::from_u8(m),
                        Marker::FixArray(_)
                            | Marker::Array16
                            | Marker::Array32
                            | Marker::FixMap(_)
                            | Marker::Map16
                            | Marker::Map32
                            | Marker::Str8
                            | Marker::Str16
                            | Marker::Str32
                            | Marker::Bin8
                            | Marker::Bin16
                            | Marker::Bin32
                            | Marker::Ext8
                            | Marker::Ext16
                            | Marker::Ext32
                            | Marker::Reserved
                    ),
                    "{m:#04x}: {head:?} has a fixed size"
                );
            }
        }
    }

    #[test]
    fn integers_read_by_sign_not_marker() {
        fn head(b: &[u8]) -> Head<'_> {
            Reader::new(b).head().unwrap()
        }
        assert_eq!(head(b"\xd0\x05"), Head::Uint(5));
        assert_eq!(head(b"\xd0\xfb"), Head::Neg(-5));
        assert_eq!(head(b"\xff"), Head::Neg(-1));
        assert_eq!(
            head(b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff"),
            Head::Uint(u64::MAX)
        );
        assert_eq!(
            head(b"\xd3\x80\0\0\0\0\0\0\0"),
            Head::Neg(i64::MIN),
            "i64::MIN"
        );
    }

    #[test]
    fn counts_are_checked_against_the_bytes_left() {
        fn head(b: &[u8]) -> Result<Head<'_>, Malformed> {
            Reader::new(b).head()
        }
        assert_eq!(head(b"\x92\xc0\xc0"), Ok(Head::Array(2)));
        assert_eq!(
            head(b"\x92\xc0"),
            Err(Malformed::Claim {
                claimed: 2,
                left: 1
            })
        );
        // A map's keys and values both count.
        assert_eq!(
            head(b"\x81\xc0"),
            Err(Malformed::Claim {
                claimed: 2,
                left: 1
            })
        );
        assert_eq!(
            head(b"\xdd\xff\xff\xff\xff\xc0"),
            Err(Malformed::Claim {
                claimed: u64::from(u32::MAX),
                left: 1
            })
        );
        assert_eq!(
            head(b"\xdb\xff\xff\xff\xff\xc0"),
            Err(Malformed::Truncated {
                need: u64::from(u32::MAX),
                left: 1
            })
        );
        assert_eq!(head(b"\xc1"), Err(Malformed::Reserved));
        assert!(head(b"").is_err());
    }

    #[test]
    fn skip_stops_at_the_depth_limit() {
        let nested = |depth: usize| {
            let mut b = vec![0x91; depth];
            b.push(0xc0);
            b
        };
        for depth in 0..=4 {
            let bytes = nested(depth);
            let mut rd = Reader::new(&bytes);
            assert_eq!(rd.value(4), Ok(&bytes[..]), "depth {depth}");
        }
        assert_eq!(Reader::new(&nested(5)).skip(4), Err(Malformed::TooDeep));
        // Scalars need no depth at all.
        assert_eq!(Reader::new(b"\x01").skip(0), Ok(()));
    }

    #[test]
    fn token_ids_read_alike_in_every_integer_encoding() {
        let mut values: Vec<i64> = vec![0, 1, 127, 128, 255, 256, 65_535, 65_536];
        values.extend([i64::from(u32::MAX), i64::from(u32::MAX) + 1, -1, -200]);
        for v in values {
            let mut encodings: Vec<Vec<u8>> = Vec::new();
            if let Ok(u) = u64::try_from(v) {
                let mut b = Vec::new();
                rmp::encode::write_uint(&mut b, u).unwrap();
                encodings.push(b);
                let mut b = vec![0xcf];
                b.extend_from_slice(&u.to_be_bytes());
                encodings.push(b);
            }
            let mut b = Vec::new();
            rmp::encode::write_sint(&mut b, v).unwrap();
            encodings.push(b);
            let mut b = vec![0xd3];
            b.extend_from_slice(&v.to_be_bytes());
            encodings.push(b);
            for enc in encodings {
                // The generic reader decides what is a token id; `u32s` must agree.
                let want = match Reader::new(&enc).head() {
                    Ok(Head::Uint(u)) => u32::try_from(u).ok(),
                    _ => None,
                };
                let mut bytes = enc.repeat(3);
                bytes.push(0xc0);
                let mut rd = Reader::new(&bytes);
                let mut out = Vec::new();
                let ok = rd.u32s(3, &mut out).unwrap();
                assert_eq!(ok, want.is_some(), "{v} as {enc:02x?}");
                if let Some(w) = want {
                    assert_eq!(out, [w; 3]);
                    assert_eq!(rd.head(), Ok(Head::Nil), "the reader ends after the 3 ids");
                }
                // Cut anywhere inside the ids: an error, never a panic or a short read.
                for cut in 0..enc.len() * 3 {
                    if want.is_some() {
                        let mut out = Vec::new();
                        assert!(Reader::new(&bytes[..cut]).u32s(3, &mut out).is_err());
                    }
                }
            }
        }
    }

    #[test]
    fn runs_of_fixed_size_values_skip_like_single_values() {
        // [1, 300, nil, "ab", [7, 70000], 2.5] and every truncation of it.
        let bytes =
            b"\x96\x01\xcd\x01\x2c\xc0\xa2ab\x92\x07\xce\x00\x01\x11\x70\xcb\x40\x04\0\0\0\0\0\0";
        assert_eq!(Reader::new(bytes).value(4), Ok(&bytes[..]));
        for cut in 1..bytes.len() {
            assert!(Reader::new(&bytes[..cut]).skip(4).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn values_that_hold_token_ids_are_read_while_skipped() {
        let mut out = vec![9];
        // [1, 300, 70000] then nil.
        let ids = b"\x93\x01\xcd\x01\x2c\xce\x00\x01\x11\x70\xc0";
        let mut rd = Reader::new(ids);
        assert_eq!(rd.value_u32s(4, 3, &mut out), Ok((&ids[..10], true)));
        assert_eq!(out, [1, 300, 70_000]);
        assert_eq!(rd.head(), Ok(Head::Nil));
        // Over the cap, not all ids, or no array: skipped like `value`, nothing read.
        for (bytes, cap) in [
            (&ids[..], 2),
            (&b"\x92\x01\xa1x\xc0"[..], 3),
            (&b"\x92\x01\xd0\xff\xc0"[..], 3),
            (&b"\x81\x01\x02\xc0"[..], 3),
            (&b"\xc0\xc0"[..], 3),
        ] {
            let want = Reader::new(bytes).value(4);
            let mut rd = Reader::new(bytes);
            assert_eq!(rd.value_u32s(4, cap, &mut out), want.map(|v| (v, false)));
            assert!(out.is_empty());
            assert_eq!(rd.head(), Ok(Head::Nil));
        }
        // Truncated: an error, as `value` gives.
        assert!(Reader::new(&ids[..7]).value_u32s(4, 3, &mut out).is_err());
    }
}
