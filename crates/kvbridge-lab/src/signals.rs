//! SIGINT / SIGTERM / SIGHUP: waited for by the long-running roles, watched
//! by the demo so that it stops its rank processes and removes its files.

use std::sync::OnceLock;

use tokio::runtime::Runtime;
use tokio::signal::unix::{Signal, SignalKind, signal};

/// The first termination signal [`watch_termination`] saw.
static RECEIVED: OnceLock<&'static str> = OnceLock::new();

/// Handlers for the signals that ask a process to stop.
pub struct StopSignals {
    runtime: Runtime,
    term: Signal,
    int: Signal,
    hup: Signal,
}

impl std::fmt::Debug for StopSignals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopSignals").finish_non_exhaustive()
    }
}

impl StopSignals {
    /// Installs the handlers before it returns.
    pub fn install() -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()?;
        let (term, int, hup) = runtime.block_on(async {
            std::io::Result::Ok((
                signal(SignalKind::terminate())?,
                signal(SignalKind::interrupt())?,
                signal(SignalKind::hangup())?,
            ))
        })?;
        Ok(Self {
            runtime,
            term,
            int,
            hup,
        })
    }

    /// Blocks until one arrives (also one that arrived since
    /// [`StopSignals::install`]); returns its name.
    pub fn wait(mut self) -> &'static str {
        self.runtime.block_on(async {
            tokio::select! {
                _ = self.term.recv() => "SIGTERM",
                _ = self.int.recv() => "SIGINT",
                _ = self.hup.recv() => "SIGHUP",
            }
        })
    }
}

/// Installs handlers for SIGINT, SIGTERM and SIGHUP now and records the
/// first that arrives (read with [`termination`]); the process no longer
/// dies of them, so its owner must poll.
pub fn watch_termination() -> std::io::Result<()> {
    let signals = StopSignals::install()?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let _ = RECEIVED.set(signals.wait());
        })?;
    Ok(())
}

/// The termination signal received since [`watch_termination`], if any.
pub fn termination() -> Option<&'static str> {
    RECEIVED.get().copied()
}

/// The error a watcher returns when a termination signal stopped its work.
#[derive(Debug, Clone, Copy)]
pub struct Stopped(pub &'static str);

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stopped by {}", self.0)
    }
}

impl std::error::Error for Stopped {}

impl Stopped {
    /// The shell's exit status for death by this signal (128 + its number).
    pub fn exit_code(self) -> u8 {
        match self.0 {
            "SIGHUP" => 129,
            "SIGINT" => 130,
            _ => 143,
        }
    }
}

/// `Err(Stopped)` once a watched termination signal arrived.
pub fn check_termination() -> Result<(), Stopped> {
    termination().map_or(Ok(()), |s| Err(Stopped(s)))
}
