//! Commands a supervised rank reads from its stdin, one per line, and the
//! state they set for the workload loop:
//! - `pause`: a decode rank starts no new room and reports how far it got
//!   ([`super::events::Event::Paused`]);
//! - `drain N`: only requests with an index below `N` still run; the rest
//!   are never started (a prefill rank gives up those it set up but no
//!   decode asked for).
//!
//! End of input means the supervisor is gone or done with the rank: the
//! process exits.

use std::io::BufRead;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use anyhow::{Context, Result};

/// The supervisor's commands so far.
#[derive(Debug)]
pub struct Control {
    paused: AtomicBool,
    /// `u64::MAX`: no drain asked.
    drain_below: AtomicU64,
}

/// This process's commands (one supervisor per process).
pub static CONTROL: Control = Control {
    paused: AtomicBool::new(false),
    drain_below: AtomicU64::new(u64::MAX),
};

/// One parsed command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Start no new room; report how far the rank got.
    Pause,
    /// Run only requests below this index.
    Drain(u64),
}

impl Command {
    /// Parses one line (`pause`, `drain 1200`); `None` for anything else.
    pub fn parse(line: &str) -> Option<Self> {
        let mut words = line.split_whitespace();
        let command = match (words.next()?, words.next()) {
            ("pause", None) => Self::Pause,
            // `u64::MAX` is reserved: it stands for "no drain".
            ("drain", Some(n)) => Self::Drain(n.parse().ok().filter(|n| *n != u64::MAX)?),
            _ => return None,
        };
        words.next().is_none().then_some(command)
    }
}

impl Control {
    /// Applies `command`.
    pub fn apply(&self, command: Command) {
        match command {
            Command::Pause => self.paused.store(true, Ordering::Release),
            Command::Drain(below) => {
                self.drain_below.fetch_min(below, Ordering::AcqRel);
                // The drain says which requests still run: no longer paused.
                self.paused.store(false, Ordering::Release);
            }
        }
    }

    /// Whether the rank was paused (and not drained since).
    pub fn paused(&self) -> bool {
        self.paused.load(Ordering::Acquire)
    }

    /// The index below which requests still run, once a drain was asked.
    pub fn drain_below(&self) -> Option<u64> {
        Some(self.drain_below.load(Ordering::Acquire)).filter(|b| *b != u64::MAX)
    }
}

/// Reads the supervisor's commands on a thread of its own; exits the
/// process when stdin closes.
pub fn follow_supervisor() -> Result<()> {
    std::thread::Builder::new()
        .name("supervisor".into())
        .spawn(|| {
            // Read errors also end the loop: stdin is gone either way.
            for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                match Command::parse(&line) {
                    Some(command) => {
                        tracing::info!(?command, "from the supervisor");
                        CONTROL.apply(command);
                    }
                    None if line.trim().is_empty() => {}
                    None => tracing::warn!(line, "not a supervisor command; ignored"),
                }
            }
            tracing::info!("stdin closed: the supervisor is gone; exiting");
            std::process::exit(0);
        })
        .context("starting the stdin watcher")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_commands_and_refuses_the_rest() {
        assert_eq!(Command::parse("pause"), Some(Command::Pause));
        assert_eq!(Command::parse(" drain 12 "), Some(Command::Drain(12)));
        let reserved = u64::MAX.to_string();
        for bad in [
            "",
            "drain",
            "drain x",
            "drain 1 2",
            "pause now",
            "stop",
            &reserved,
        ] {
            assert_eq!(Command::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_drain_ends_the_pause_and_only_ever_lowers_its_bound() {
        let c = Control {
            paused: AtomicBool::new(false),
            drain_below: AtomicU64::new(u64::MAX),
        };
        assert_eq!(c.drain_below(), None);
        c.apply(Command::Pause);
        assert!(c.paused());
        c.apply(Command::Drain(40));
        assert!(!c.paused());
        c.apply(Command::Drain(90));
        assert_eq!(c.drain_below(), Some(40));
    }
}
