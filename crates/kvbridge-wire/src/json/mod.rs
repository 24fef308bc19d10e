//! The JSON form of messages used by `kvbridge wire decode|encode`
//! (`docs/cli.md`): sglang's field names, byte strings as
//! lowercase hex, integer arrays as JSON arrays, absent optionals as `null`.

use serde::Deserialize;
use thiserror::Error;

use crate::{Limits, Side, ToDecode, ToPrefill};

mod convert;
mod types;

pub use types::{
    AbortAckJson, AbortJson, AuxDataJson, ChunkReadyJson, RegisterJson, StagingReqJson,
    StagingRspJson, StateDataJson, StatusJson, TransferJson, WatermarkJson, WireJson,
};

/// Input that is not the JSON docs/cli.md describes (exit status 2).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum InputError {
    /// Not JSON, or not the expected object.
    #[error("invalid input JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// `to` is neither `prefill` nor `decode`.
    #[error("unknown `to`: {0:?} (expected \"prefill\" or \"decode\")")]
    UnknownSide(String),
    /// A frame that is not even-length hex.
    #[error("frame {index} is not even-length hex")]
    BadHex {
        /// Position of the frame.
        index: usize,
    },
}

#[derive(Deserialize)]
struct DecodeInput {
    to: String,
    frames: Vec<String>,
}

/// Runs `wire decode`: `{"to", "frames"}` in, one JSON object out (the
/// message, or `{"error": reason}` for frames that are not a valid message).
pub fn decode_command(input: &str, limits: &Limits) -> Result<String, InputError> {
    let parsed: DecodeInput = serde_json::from_str(input)?;
    let side = match parsed.to.as_str() {
        "prefill" => Side::Prefill,
        "decode" => Side::Decode,
        other => return Err(InputError::UnknownSide(other.to_owned())),
    };
    let frames = parsed
        .frames
        .iter()
        .enumerate()
        .map(|(index, f)| hex_decode(f).ok_or(InputError::BadHex { index }))
        .collect::<Result<Vec<_>, _>>()?;
    let message = match side {
        Side::Prefill => ToPrefill::decode(&frames, limits).map(|m| WireJson::from_prefill(&m)),
        Side::Decode => ToDecode::decode(&frames, limits).map(|m| WireJson::from_decode(&m)),
    };
    Ok(match message {
        Ok(json) => serde_json::to_string(&json)?,
        Err(e) => error_json(&e.to_string()),
    })
}

/// Runs `wire encode`: a message object in, `{"frames": [hex…]}` out, or
/// `{"error": reason}` when the object is not a valid message.
pub fn encode_command(input: &str) -> Result<String, InputError> {
    let value: serde_json::Value = serde_json::from_str(input)?;
    if !value.is_object() {
        return Err(InputError::Json(serde::de::Error::custom(
            "expected a JSON object",
        )));
    }
    let frames = serde_json::from_value::<WireJson>(value)
        .map_err(|e| e.to_string())
        .and_then(|m| m.to_frames());
    Ok(match frames {
        Ok(frames) => {
            let hex: Vec<String> = frames.iter().map(|f| hex_encode(f)).collect();
            serde_json::json!({ "frames": hex }).to_string()
        }
        Err(reason) => error_json(&reason),
    })
}

fn error_json(reason: &str) -> String {
    serde_json::json!({ "error": reason.replace('\n', " ") }).to_string()
}

/// Lowercase hex of `bytes`.
pub fn hex_encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
}

/// Bytes of even-length hex (either case), or `None`.
pub fn hex_decode(text: &str) -> Option<Vec<u8>> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let raw = text.as_bytes();
    if !raw.len().is_multiple_of(2) {
        return None;
    }
    raw.chunks_exact(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

/// Byte strings as lowercase hex in serde.
pub(crate) mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::hex_encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        super::hex_decode(&text).ok_or_else(|| D::Error::custom("expected even-length hex"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        assert_eq!(hex_encode(&[0, 0xab, 0x10]), "00ab10");
        assert_eq!(hex_decode("00AB10"), Some(vec![0, 0xab, 0x10]));
        assert_eq!(hex_decode("abc"), None);
        assert_eq!(hex_decode("zz"), None);
        assert_eq!(hex_decode(""), Some(vec![]));
    }

    #[test]
    fn decode_command_reports_errors_as_json() {
        let out =
            decode_command(r#"{"to": "decode", "frames": ["3432"]}"#, &Limits::DEFAULT).unwrap();
        assert!(out.starts_with(r#"{"error":"#), "{out}");
        assert!(matches!(
            decode_command(r#"{"to": "sideways", "frames": []}"#, &Limits::DEFAULT),
            Err(InputError::UnknownSide(_))
        ));
        assert!(matches!(
            decode_command(r#"{"to": "decode", "frames": ["abc"]}"#, &Limits::DEFAULT),
            Err(InputError::BadHex { index: 0 })
        ));
        assert!(decode_command("not json", &Limits::DEFAULT).is_err());
    }
}
