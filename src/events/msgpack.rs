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
        for _ in 0..elements {
            // Values of a size known from their marker alone are stepped over; only containers
            // recurse.
            let size = self
                .buf
                .get(self.pos)
                .map_or(0, |&m| FIXED_SIZE[usize::from(m)]);
            if size > 0 {
                self.take(u64::from(size))?;
                continue;
            }
            let head = self.head()?;
            if matches!(head, Head::Array(_) | Head::Map(_)) {
                self.skip_elements(head, inner)?;
            }
        }
        Ok(())
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
}
