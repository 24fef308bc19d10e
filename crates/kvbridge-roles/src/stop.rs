//! Waking background threads promptly at teardown.

use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, bounded};

/// Fires the stop signal when triggered or dropped.
#[derive(Debug)]
pub(crate) struct StopTrigger(Option<Sender<()>>);

/// What a background thread waits on between rounds of work.
#[derive(Debug, Clone)]
pub(crate) struct StopSignal(Receiver<()>);

/// A connected trigger and signal.
pub(crate) fn stop_pair() -> (StopTrigger, StopSignal) {
    let (tx, rx) = bounded(0);
    (StopTrigger(Some(tx)), StopSignal(rx))
}

impl StopTrigger {
    /// Wakes every waiting thread; later waits return at once.
    pub(crate) fn trigger(&mut self) {
        self.0 = None;
    }
}

impl StopSignal {
    /// Sleeps up to `timeout`; returns `true` once the stop was triggered.
    pub(crate) fn wait(&self, timeout: Duration) -> bool {
        !matches!(self.0.recv_timeout(timeout), Err(RecvTimeoutError::Timeout))
    }
}
