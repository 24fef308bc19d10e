//! Zero-copy views of the packed integer arrays sglang puts in frames.
//!
//! Two layouts exist on the wire:
//! - a plain little-endian array (`struct.pack("<nQ")`, `ndarray.tobytes()`),
//!   viewed by [`PackedArray`];
//! - `pack_int_lists`: a little-endian `u32` count `n`, then `n` `u32` byte
//!   lengths, then the concatenated arrays, viewed by [`PackedLists`].
//!
//! Both hold the frame's bytes (borrowed when decoded, owned when built from
//! values) and read elements on demand, so decoding never copies or
//! allocates in proportion to the input and never needs aligned memory.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use crate::error::DecodeError;
use crate::limits::Limits;

/// An integer type that appears packed in frames.
pub trait Element: Copy + fmt::Debug + PartialEq + 'static {
    /// Bytes per element.
    const WIDTH: usize;
    /// Reads one element from exactly `WIDTH` little-endian bytes.
    fn read_le(bytes: &[u8]) -> Self;
    /// Appends this element as `WIDTH` little-endian bytes.
    fn write_le(self, out: &mut Vec<u8>);
}

macro_rules! element {
    ($t:ty, $w:expr) => {
        impl Element for $t {
            const WIDTH: usize = $w;
            fn read_le(bytes: &[u8]) -> Self {
                let mut raw = [0u8; $w];
                raw.copy_from_slice(&bytes[..$w]);
                <$t>::from_le_bytes(raw)
            }
            fn write_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    };
}
element!(u64, 8);
element!(u32, 4);
element!(i32, 4);

/// A packed little-endian array of `T` (sglang `struct` format `Q`, `I`, `i`).
#[derive(Clone)]
pub struct PackedArray<'a, T: Element> {
    bytes: Cow<'a, [u8]>,
    _element: PhantomData<T>,
}

impl<'a, T: Element> PackedArray<'a, T> {
    /// Views `bytes` as an array, checking the length and the element limit.
    pub fn decode(
        field: &'static str,
        bytes: &'a [u8],
        limits: &Limits,
    ) -> Result<Self, DecodeError> {
        check_array(field, bytes.len(), T::WIDTH, limits)?;
        Ok(Self::from_cow(Cow::Borrowed(bytes)))
    }

    fn from_cow(bytes: Cow<'a, [u8]>) -> Self {
        Self {
            bytes,
            _element: PhantomData,
        }
    }

    /// An empty array.
    pub fn empty() -> Self {
        Self::from_cow(Cow::Borrowed(&[]))
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / T::WIDTH
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Element `i`, if in range.
    pub fn get(&self, i: usize) -> Option<T> {
        let start = i.checked_mul(T::WIDTH)?;
        let end = start.checked_add(T::WIDTH)?;
        self.bytes.get(start..end).map(T::read_le)
    }

    /// The elements in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = T> + '_ {
        self.bytes.chunks_exact(T::WIDTH).map(T::read_le)
    }

    /// Copies the elements into a `Vec`.
    pub fn to_vec(&self) -> Vec<T> {
        self.iter().collect()
    }

    /// The encoded bytes, exactly as they travel.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// A borrowed view of the same bytes.
    pub fn borrowed(&self) -> PackedArray<'_, T> {
        PackedArray::from_cow(Cow::Borrowed(&self.bytes))
    }

    /// Detaches the array from the frame it borrows.
    pub fn into_owned(self) -> PackedArray<'static, T> {
        PackedArray::from_cow(Cow::Owned(self.bytes.into_owned()))
    }
}

impl<T: Element> From<&[T]> for PackedArray<'static, T> {
    fn from(values: &[T]) -> Self {
        let mut bytes = Vec::with_capacity(values.len() * T::WIDTH);
        for &v in values {
            v.write_le(&mut bytes);
        }
        Self::from_cow(Cow::Owned(bytes))
    }
}

impl<T: Element> From<Vec<T>> for PackedArray<'static, T> {
    fn from(values: Vec<T>) -> Self {
        Self::from(values.as_slice())
    }
}

impl<T: Element> PartialEq for PackedArray<'_, T> {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}
impl<T: Element> Eq for PackedArray<'_, T> {}

impl<T: Element> fmt::Debug for PackedArray<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: Element> Default for PackedArray<'_, T> {
    fn default() -> Self {
        Self::from_cow(Cow::Borrowed(&[]))
    }
}

fn check_array(
    field: &'static str,
    len: usize,
    width: usize,
    limits: &Limits,
) -> Result<(), DecodeError> {
    if !len.is_multiple_of(width) {
        return Err(DecodeError::Misaligned { field, len, width });
    }
    if len / width > limits.max_array_len {
        return Err(DecodeError::Oversized {
            field,
            len: (len / width) as u64,
            limit: limits.max_array_len as u64,
        });
    }
    Ok(())
}

/// A `pack_int_lists` frame: a list of packed arrays of `T`.
#[derive(Clone)]
pub struct PackedLists<'a, T: Element> {
    bytes: Cow<'a, [u8]>,
    _element: PhantomData<T>,
}

const HEADER_WORD: usize = 4;

fn read_u32(bytes: &[u8], word: usize) -> Option<usize> {
    let start = word.checked_mul(HEADER_WORD)?;
    let raw: [u8; 4] = bytes.get(start..start + HEADER_WORD)?.try_into().ok()?;
    usize::try_from(u32::from_le_bytes(raw)).ok()
}

impl<'a, T: Element> PackedLists<'a, T> {
    /// Views a `pack_int_lists` frame, checking that the header matches the
    /// body exactly and that every inner array is whole.
    pub fn decode(
        field: &'static str,
        bytes: &'a [u8],
        limits: &Limits,
    ) -> Result<Self, DecodeError> {
        if bytes.is_empty() {
            return Ok(Self::empty());
        }
        let bad = |reason| DecodeError::BadPackedLists { field, reason };
        let count = read_u32(bytes, 0).ok_or(bad("shorter than its 4-byte count"))?;
        if count > limits.max_lists {
            return Err(DecodeError::Oversized {
                field,
                len: count as u64,
                limit: limits.max_lists as u64,
            });
        }
        let header = (count + 1) * HEADER_WORD;
        if bytes.len() < header {
            return Err(bad("header longer than the frame"));
        }
        let mut body: usize = 0;
        for i in 0..count {
            let len = read_u32(bytes, i + 1).ok_or(bad("header longer than the frame"))?;
            check_array(field, len, T::WIDTH, limits)?;
            body = body.checked_add(len).ok_or(bad("lengths overflow"))?;
        }
        if body != bytes.len() - header {
            return Err(bad("lengths in the header do not match the body"));
        }
        Ok(Self::from_cow(Cow::Borrowed(bytes)))
    }

    fn from_cow(bytes: Cow<'a, [u8]>) -> Self {
        Self {
            bytes,
            _element: PhantomData,
        }
    }

    /// No lists (encodes as an empty frame, like `pack_int_lists([])`).
    pub fn empty() -> Self {
        Self::from_cow(Cow::Borrowed(&[]))
    }

    /// Number of inner lists.
    pub fn len(&self) -> usize {
        read_u32(&self.bytes, 0).unwrap_or(0)
    }

    /// Whether there are no inner lists.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The inner arrays in order.
    pub fn iter(&self) -> impl Iterator<Item = PackedArray<'_, T>> + '_ {
        let count = self.len();
        let mut offset = (count + 1) * HEADER_WORD;
        (0..count).map(move |i| {
            let len = read_u32(&self.bytes, i + 1).unwrap_or(0);
            let end = offset + len;
            let slice = self.bytes.get(offset..end).unwrap_or(&[]);
            offset = end;
            PackedArray::from_cow(Cow::Borrowed(slice))
        })
    }

    /// Inner list `i`, if in range.
    pub fn get(&self, i: usize) -> Option<PackedArray<'_, T>> {
        self.iter().nth(i)
    }

    /// Copies the lists into nested `Vec`s.
    pub fn to_vecs(&self) -> Vec<Vec<T>> {
        self.iter().map(|a| a.to_vec()).collect()
    }

    /// The encoded bytes, exactly as they travel.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Detaches the lists from the frame they borrow.
    pub fn into_owned(self) -> PackedLists<'static, T> {
        PackedLists::from_cow(Cow::Owned(self.bytes.into_owned()))
    }

    /// Packs lists the way `pack_int_lists(lists, fmt)` does.
    pub fn from_lists<L: AsRef<[T]>>(lists: &[L]) -> PackedLists<'static, T> {
        if lists.is_empty() {
            return PackedLists::from_cow(Cow::Owned(Vec::new()));
        }
        let body: usize = lists.iter().map(|l| l.as_ref().len() * T::WIDTH).sum();
        let mut bytes = Vec::with_capacity((lists.len() + 1) * HEADER_WORD + body);
        push_u32(&mut bytes, lists.len());
        for l in lists {
            push_u32(&mut bytes, l.as_ref().len() * T::WIDTH);
        }
        for l in lists {
            for &v in l.as_ref() {
                v.write_le(&mut bytes);
            }
        }
        PackedLists::from_cow(Cow::Owned(bytes))
    }
}

fn push_u32(out: &mut Vec<u8>, value: usize) {
    // Lengths beyond u32 cannot be packed by sglang either; saturate rather
    // than wrap so a broken frame is visibly broken.
    let v = u32::try_from(value).unwrap_or(u32::MAX);
    out.extend_from_slice(&v.to_le_bytes());
}

impl<T: Element> PartialEq for PackedLists<'_, T> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().zip(other.iter()).all(|(a, b)| a == b)
    }
}
impl<T: Element> Eq for PackedLists<'_, T> {}

impl<T: Element> fmt::Debug for PackedLists<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: Element> Default for PackedLists<'_, T> {
    fn default() -> Self {
        Self::empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits::DEFAULT;

    #[test]
    fn array_round_trip_and_misalignment() {
        let a = PackedArray::<u64>::from(vec![1, u64::MAX, 7]);
        assert_eq!(a.as_bytes().len(), 24);
        let b = PackedArray::<u64>::decode("f", a.as_bytes(), &L).unwrap();
        assert_eq!(b.to_vec(), vec![1, u64::MAX, 7]);
        assert_eq!(b.get(1), Some(u64::MAX));
        assert_eq!(b.get(3), None);
        assert!(matches!(
            PackedArray::<u64>::decode("f", &[0u8; 12], &L),
            Err(DecodeError::Misaligned {
                len: 12,
                width: 8,
                ..
            })
        ));
        let neg = PackedArray::<i32>::from(vec![-1, 5]);
        assert_eq!(neg.as_bytes(), &[0xff, 0xff, 0xff, 0xff, 5, 0, 0, 0]);
    }

    #[test]
    fn lists_match_pack_int_lists() {
        // pack_int_lists([[1, 2], []], "I") in sglang.
        let expected = [2, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0];
        let packed = PackedLists::<u32>::from_lists(&[vec![1u32, 2], vec![]]);
        assert_eq!(packed.as_bytes(), &expected);
        let decoded = PackedLists::<u32>::decode("f", &expected, &L).unwrap();
        assert_eq!(decoded.to_vecs(), vec![vec![1, 2], vec![]]);
        assert_eq!(
            PackedLists::<u32>::from_lists::<Vec<u32>>(&[]).as_bytes(),
            b""
        );
        assert!(PackedLists::<u32>::decode("f", b"", &L).unwrap().is_empty());
    }

    #[test]
    fn lists_reject_mismatched_headers() {
        let good = PackedLists::<u32>::from_lists(&[vec![1u32, 2]])
            .as_bytes()
            .to_vec();
        let mut long = good.clone();
        long.push(0);
        let short = &good[..good.len() - 1];
        for bad in [&long[..], short, &good[..3], &[5, 0, 0, 0][..]] {
            assert!(PackedLists::<u32>::decode("f", bad, &L).is_err(), "{bad:?}");
        }
        // An inner length that is not a multiple of the element width.
        let odd = [1, 0, 0, 0, 3, 0, 0, 0, 1, 2, 3];
        assert!(matches!(
            PackedLists::<u32>::decode("f", &odd, &L),
            Err(DecodeError::Misaligned { .. })
        ));
        // A hostile count is refused without allocating for it.
        let huge = [0xff, 0xff, 0xff, 0xff];
        assert!(matches!(
            PackedLists::<u32>::decode("f", &huge, &L),
            Err(DecodeError::Oversized { .. })
        ));
    }
}
