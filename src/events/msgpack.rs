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
        let elements = match self.head()? {
            Head::Array(n) => u64::from(n),
            Head::Map(n) => 2 * u64::from(n),
            _ => return Ok(()),
        };
        let inner = depth.checked_sub(1).ok_or(Malformed::TooDeep)?;
        for _ in 0..elements {
            self.skip(inner)?;
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

/// A signed integer: non-negative values read as [`Head::Uint`] whatever their marker.
fn int(i: i64) -> Head<'static> {
    u64::try_from(i).map_or(Head::Neg(i), Head::Uint)
}
