//! Typed transfer errors.

use std::fmt;

/// Which side's memory a block fell outside of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The source, in this engine's registered memory.
    Local,
    /// The destination, in the peer's registered memory.
    Remote,
}

/// Why a transfer failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The peer could not be reached (no route, connection refused, bad address).
    Unreachable,
    /// The peer refused the request (protocol version, malformed request, shutting down).
    Refused,
    /// Connection set-up failed authentication (wrong or missing cluster secret).
    Auth,
    /// A block lies outside the registered regions of one side.
    OutOfRegion(Side),
    /// A connect, read or write took longer than its timeout.
    Timeout,
    /// The peer closed or reset the connection mid-transfer.
    PeerClosed,
    /// Another I/O error, or a memory access error while staging.
    Io,
    /// The call itself was malformed (e.g. a session id that is not `host:port`).
    InvalidArgument,
    /// This engine is shutting down.
    Shutdown,
    /// The process answering at the session is not the incarnation the
    /// batch was planned for (the peer restarted); nothing was written.
    PeerRestarted,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            ErrorKind::Unreachable => "unreachable",
            ErrorKind::Refused => "refused",
            ErrorKind::Auth => "authentication failed",
            ErrorKind::OutOfRegion(Side::Local) => "source out of local registered regions",
            ErrorKind::OutOfRegion(Side::Remote) => "destination out of peer's registered regions",
            ErrorKind::Timeout => "timeout",
            ErrorKind::PeerClosed => "peer closed the connection",
            ErrorKind::Io => "i/o error",
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::Shutdown => "engine shut down",
            ErrorKind::PeerRestarted => "peer restarted (another incarnation answers)",
        };
        f.write_str(s)
    }
}

/// A failed transfer (or probe): which session, which block when known, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
#[error("transfer to {session}{}: {kind}: {detail}", BlockSuffix(*.block))]
pub struct TransferError {
    /// The peer session (`host:port`).
    pub session: String,
    /// Index (in the submitted batch) of the failing block, when known.
    pub block: Option<usize>,
    /// The category of failure.
    pub kind: ErrorKind,
    /// Human-readable detail (OS error, address range, ...).
    pub detail: String,
}

impl TransferError {
    /// A new error.
    pub fn new(
        session: impl Into<String>,
        block: Option<usize>,
        kind: ErrorKind,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            session: session.into(),
            block,
            kind,
            detail: detail.into(),
        }
    }

    /// Classify an OS I/O error met while talking to `session`.
    pub fn from_io(session: &str, block: Option<usize>, e: &std::io::Error) -> Self {
        use std::io::ErrorKind as K;
        let kind = match e.kind() {
            K::TimedOut | K::WouldBlock => ErrorKind::Timeout,
            K::UnexpectedEof | K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe => {
                ErrorKind::PeerClosed
            }
            K::ConnectionRefused
            | K::AddrNotAvailable
            | K::HostUnreachable
            | K::NetworkUnreachable
            | K::NotConnected => ErrorKind::Unreachable,
            _ => ErrorKind::Io,
        };
        Self::new(session, block, kind, e.to_string())
    }
}

struct BlockSuffix(Option<usize>);

impl fmt::Display for BlockSuffix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(i) => write!(f, " (block {i})"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_session_block_and_reason() {
        let e = TransferError::new(
            "10.0.0.1:7000",
            Some(3),
            ErrorKind::OutOfRegion(Side::Remote),
            "0x10+4",
        );
        assert_eq!(
            e.to_string(),
            "transfer to 10.0.0.1:7000 (block 3): destination out of peer's registered regions: 0x10+4"
        );
        let t = TransferError::from_io("h:1", None, &std::io::ErrorKind::TimedOut.into());
        assert_eq!(t.kind, ErrorKind::Timeout);
    }
}
