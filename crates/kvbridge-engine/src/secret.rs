//! The cluster secret: one shared key from which every channel derives its
//! own (engine handshakes, zmq CURVE keys, bootstrap write tags, IPC
//! exports). It is read from a file or an environment variable, never from
//! a command line (which every process listing shows), and never printed.

use std::fmt;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use thiserror::Error;

/// Environment variable holding the path of a file with the secret.
pub const SECRET_FILE_ENV: &str = "KVBRIDGE_SECRET_FILE";
/// Environment variable holding the secret itself.
pub const SECRET_ENV: &str = "KVBRIDGE_SECRET";
/// Fewest bytes a secret may have.
pub const MIN_SECRET_LEN: usize = 16;
/// Most bytes a secret may have.
pub const MAX_SECRET_LEN: usize = 4096;

/// Why a secret could not be loaded.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SecretError {
    /// The secret file could not be read.
    #[error("cannot read the cluster secret file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The secret is shorter than [`MIN_SECRET_LEN`] or longer than [`MAX_SECRET_LEN`].
    #[error(
        "the cluster secret from {origin} has {len} bytes; it needs {MIN_SECRET_LEN} to {MAX_SECRET_LEN} \
         (generate one with `head -c 32 /dev/urandom | base64`)"
    )]
    Length {
        /// Where the secret came from.
        origin: String,
        /// Its length in bytes.
        len: usize,
    },
}

/// The shared cluster secret (redacted in `Debug`).
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Vec<u8>);

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

impl ClusterSecret {
    /// A secret from raw bytes; `origin` names their source in errors.
    pub fn new(bytes: impl Into<Vec<u8>>, origin: &str) -> Result<Self, SecretError> {
        let bytes = bytes.into();
        if !(MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&bytes.len()) {
            return Err(SecretError::Length {
                origin: origin.to_owned(),
                len: bytes.len(),
            });
        }
        Ok(Self(bytes))
    }

    /// A secret from text, with surrounding whitespace (a trailing newline) removed.
    pub fn from_text(text: &str, origin: &str) -> Result<Self, SecretError> {
        Self::new(text.trim().as_bytes().to_vec(), origin)
    }

    /// Reads the secret from `path` (surrounding whitespace removed).
    pub fn from_file(path: &Path) -> Result<Self, SecretError> {
        let text = std::fs::read_to_string(path).map_err(|source| SecretError::Read {
            path: path.to_owned(),
            source,
        })?;
        warn_if_readable_by_others(path);
        Self::from_text(&text, &path.display().to_string())
    }

    /// The secret named by the environment: the file in
    /// [`SECRET_FILE_ENV`], else the value of [`SECRET_ENV`]; `None` when
    /// neither is set (open mode).
    pub fn from_env() -> Result<Option<Self>, SecretError> {
        if let Some(path) = std::env::var_os(SECRET_FILE_ENV).filter(|p| !p.is_empty()) {
            return Self::from_file(Path::new(&path)).map(Some);
        }
        match std::env::var(SECRET_ENV) {
            Ok(v) if !v.is_empty() => Self::from_text(&v, SECRET_ENV).map(Some),
            _ => Ok(None),
        }
    }

    /// The secret from `file` when given, else from the environment.
    pub fn load(file: Option<&Path>) -> Result<Option<Self>, SecretError> {
        match file {
            Some(path) => Self::from_file(path).map(Some),
            None => Self::from_env(),
        }
    }

    /// A fresh random secret (64 hex characters), e.g. for a demo cluster.
    pub fn generate() -> Self {
        let bytes: [u8; 32] = rand::random();
        Self(hex(&bytes).into_bytes())
    }

    /// The secret as text, to hand to a child process through [`SECRET_ENV`].
    pub fn to_env_value(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    /// The raw secret bytes (for HMAC keys).
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// A 32-byte key for one purpose, independent of every other purpose's
    /// key: HMAC-SHA256(secret, "kvbridge/1 key " + label).
    pub fn derive(&self, label: &str) -> [u8; 32] {
        derive_key(&self.0, label)
    }

    /// HMAC-SHA256 of the concatenated `parts` under the secret.
    pub fn tag(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    /// Constant-time check that `tag` is [`ClusterSecret::tag`] of `parts`.
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
        for p in parts {
            m.update(p);
        }
        m.verify_slice(tag).is_ok()
    }
}

/// [`ClusterSecret::derive`] of raw secret bytes (an engine config holds
/// the secret as text).
pub fn derive_key(secret: &[u8], label: &str) -> [u8; 32] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
    m.update(b"kvbridge/1 key ");
    m.update(label.as_bytes());
    m.finalize().into_bytes().into()
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Bytes of lower- or upper-case hex; `None` for anything else.
pub fn unhex(text: &str) -> Option<Vec<u8>> {
    let text = text.as_bytes();
    if !text.len().is_multiple_of(2) {
        return None;
    }
    text.chunks(2)
        .map(|pair| {
            let s = std::str::from_utf8(pair).ok()?;
            u8::from_str_radix(s, 16).ok()
        })
        .collect()
}

fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(
            path = %path.display(),
            "the cluster secret file is readable by group or others; chmod 600 it"
        );
    }
}

/// Logs, once per process and role, that `role` runs without a secret.
pub fn warn_open_mode(role: &str) {
    tracing::warn!(
        role,
        "OPEN MODE: no cluster secret ({SECRET_FILE_ENV} / {SECRET_ENV} / --secret-file); \
         any host that can reach this process's ports can send it control messages and write \
         into its registered memory. Use open mode only for compatibility with stock sglang peers \
         on a trusted network."
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_keys_differ_per_label_and_secret() {
        let a = ClusterSecret::from_text("0123456789abcdef-a\n", "test").unwrap();
        let b = ClusterSecret::from_text("0123456789abcdef-b", "test").unwrap();
        assert_eq!(a.as_bytes(), b"0123456789abcdef-a");
        assert_ne!(a.derive("zmq"), a.derive("bootstrap"));
        assert_ne!(a.derive("zmq"), b.derive("zmq"));
        assert_eq!(a.derive("zmq"), a.clone().derive("zmq"));
        let t = a.tag(&[b"x", b"y"]);
        assert!(a.verify(&[b"xy"], &t));
        assert!(!b.verify(&[b"xy"], &t));
        assert!(!format!("{a:?}").contains("0123"));
    }

    #[test]
    fn short_and_long_secrets_are_refused() {
        assert!(matches!(
            ClusterSecret::from_text("short", "t"),
            Err(SecretError::Length { len: 5, .. })
        ));
        assert!(ClusterSecret::new(vec![b'x'; MAX_SECRET_LEN + 1], "t").is_err());
        let g = ClusterSecret::generate();
        assert_eq!(g.as_bytes().len(), 64);
        assert_eq!(ClusterSecret::from_text(&g.to_env_value(), "t").unwrap(), g);
    }

    #[test]
    fn hex_round_trips() {
        assert_eq!(hex(&[0, 0xab, 0xff]), "00abff");
        assert_eq!(unhex("00ABff"), Some(vec![0, 0xab, 0xff]));
        assert_eq!(unhex("0g"), None);
        assert_eq!(unhex("abc"), None);
    }
}
