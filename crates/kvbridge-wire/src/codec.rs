//! Frame-level primitives: strict ASCII integers and text, and a cursor over
//! the frames of one message.

use std::borrow::Cow;

use crate::error::{DecodeError, IntegerError};

/// The frames of one encoded multipart message, borrowed where possible.
pub type Frames<'a> = Vec<Cow<'a, [u8]>>;

/// Parses `0|[1-9][0-9]*` into a `u64`.
pub(crate) fn parse_u64(field: &'static str, bytes: &[u8]) -> Result<u64, DecodeError> {
    digits(bytes).map_err(|reason| DecodeError::BadInteger { field, reason })
}

/// Parses `-?(0|[1-9][0-9]*)` into an `i64`.
pub(crate) fn parse_i64(field: &'static str, bytes: &[u8]) -> Result<i64, DecodeError> {
    let bad = |reason| DecodeError::BadInteger { field, reason };
    match bytes.split_first() {
        Some((b'-', rest)) => {
            let magnitude = digits(rest).map_err(bad)?;
            // i64::MIN has no positive counterpart; go through i128.
            i64::try_from(-i128::from(magnitude)).map_err(|_| bad(IntegerError::OutOfRange))
        }
        _ => {
            let value = digits(bytes).map_err(bad)?;
            i64::try_from(value).map_err(|_| bad(IntegerError::OutOfRange))
        }
    }
}

/// Parses an unsigned decimal that must fit `T`.
pub(crate) fn parse_uint<T: TryFrom<u64>>(
    field: &'static str,
    bytes: &[u8],
) -> Result<T, DecodeError> {
    let value = parse_u64(field, bytes)?;
    T::try_from(value).map_err(|_| DecodeError::BadInteger {
        field,
        reason: IntegerError::OutOfRange,
    })
}

fn digits(bytes: &[u8]) -> Result<u64, IntegerError> {
    match bytes {
        [] => Err(IntegerError::Empty),
        [b'0'] => Ok(0),
        [b'0', ..] if bytes.iter().all(u8::is_ascii_digit) => Err(IntegerError::LeadingZero),
        _ => {
            let mut value: u64 = 0;
            for &b in bytes {
                if !b.is_ascii_digit() {
                    return Err(IntegerError::NotDecimal);
                }
                value = value
                    .checked_mul(10)
                    .and_then(|v| v.checked_add(u64::from(b - b'0')))
                    .ok_or(IntegerError::OutOfRange)?;
            }
            Ok(value)
        }
    }
}

/// Borrows an ASCII text frame.
pub(crate) fn ascii<'a>(
    field: &'static str,
    bytes: &'a [u8],
    max_len: usize,
) -> Result<&'a str, DecodeError> {
    if bytes.len() > max_len {
        return Err(DecodeError::Oversized {
            field,
            len: bytes.len() as u64,
            limit: max_len as u64,
        });
    }
    if !bytes.is_ascii() {
        return Err(DecodeError::NotAscii { field });
    }
    std::str::from_utf8(bytes).map_err(|_| DecodeError::NotAscii { field })
}

/// Encodes an integer as the decimal ASCII frame sglang writes (`str(n)`).
pub(crate) fn int_frame<'a>(value: impl std::fmt::Display) -> Cow<'a, [u8]> {
    Cow::Owned(value.to_string().into_bytes())
}

/// Borrows a text field as its frame.
pub(crate) fn text_frame<'a>(text: &'a str) -> Cow<'a, [u8]> {
    Cow::Borrowed(text.as_bytes())
}

/// A cursor over the frames of one message, for the field-by-field decoders.
pub(crate) struct FrameCursor<'f, F> {
    frames: &'f [F],
}

impl<'f, F: AsRef<[u8]>> FrameCursor<'f, F> {
    /// Wraps `frames`, requiring at least `min` of them.
    pub(crate) fn new(
        kind: &'static str,
        frames: &'f [F],
        min: usize,
    ) -> Result<Self, DecodeError> {
        if frames.len() < min {
            return Err(DecodeError::FrameCount {
                kind,
                min,
                got: frames.len(),
            });
        }
        Ok(Self { frames })
    }

    /// Frame `i`; callers only ask for indices below the checked minimum.
    pub(crate) fn req(&self, i: usize) -> &'f [u8] {
        self.frames.get(i).map_or(&[], AsRef::as_ref)
    }

    /// Frame `i` if present and non-empty: sglang's `len(msg) > i and msg[i] != b""`.
    pub(crate) fn opt(&self, i: usize) -> Option<&'f [u8]> {
        self.frames
            .get(i)
            .map(AsRef::as_ref)
            .filter(|f| !f.is_empty())
    }

    /// Frame `i` if present (possibly empty).
    pub(crate) fn present(&self, i: usize) -> Option<&'f [u8]> {
        self.frames.get(i).map(AsRef::as_ref)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_are_strict() {
        assert_eq!(parse_u64("f", b"0"), Ok(0));
        assert_eq!(parse_u64("f", b"18446744073709551615"), Ok(u64::MAX));
        for bad in [
            &b""[..],
            b"+5",
            b"05",
            b" 5",
            b"1_0",
            b"5 ",
            b"-1",
            b"0x1",
            b"1e3",
        ] {
            assert!(parse_u64("f", bad).is_err(), "{bad:?} accepted");
        }
        assert!(matches!(
            parse_u64("f", b"18446744073709551616"),
            Err(DecodeError::BadInteger {
                reason: IntegerError::OutOfRange,
                ..
            })
        ));
        assert!(matches!(
            parse_u64("f", b"007"),
            Err(DecodeError::BadInteger {
                reason: IntegerError::LeadingZero,
                ..
            })
        ));
        assert_eq!(parse_i64("f", b"-1"), Ok(-1));
        assert_eq!(parse_i64("f", b"-2"), Ok(-2));
        assert_eq!(parse_i64("f", b"-9223372036854775808"), Ok(i64::MIN));
        assert!(parse_i64("f", b"9223372036854775808").is_err());
        assert!(parse_i64("f", b"-9223372036854775809").is_err());
        assert!(parse_i64("f", b"--1").is_err());
        assert!(parse_i64("f", b"-").is_err());
        assert!(parse_i64("f", b"-01").is_err());
        assert_eq!(parse_uint::<u16>("port", b"65535"), Ok(65535));
        assert!(parse_uint::<u16>("port", b"65536").is_err());
    }

    #[test]
    fn text_must_be_ascii_and_bounded() {
        assert_eq!(ascii("f", b"127.0.0.1:5000", 64), Ok("127.0.0.1:5000"));
        assert_eq!(
            ascii("f", "é".as_bytes(), 64),
            Err(DecodeError::NotAscii { field: "f" })
        );
        assert!(matches!(
            ascii("f", b"abcdef", 3),
            Err(DecodeError::Oversized { .. })
        ));
    }
}
