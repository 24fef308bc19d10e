//! Completion handles of submitted batches.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::TransferError;

#[derive(Default)]
struct Completion {
    result: Mutex<Option<Result<(), TransferError>>>,
    cond: Condvar,
}

/// The handle of a submitted batch: poll it or wait on it. Cloneable.
#[derive(Clone)]
pub struct BatchHandle {
    inner: Arc<Completion>,
}

impl BatchHandle {
    /// A handle that is already complete with `result`.
    pub fn ready(result: Result<(), TransferError>) -> Self {
        let (h, c) = Self::pending();
        c.complete(result);
        h
    }

    /// A pending handle and the completer that finishes it.
    pub(crate) fn pending() -> (Self, Completer) {
        let inner = Arc::new(Completion::default());
        (
            Self {
                inner: inner.clone(),
            },
            Completer { inner },
        )
    }

    /// The result if the batch has finished, without blocking.
    pub fn poll(&self) -> Option<Result<(), TransferError>> {
        self.inner.result.lock().clone()
    }

    /// Whether the batch has finished.
    pub fn is_done(&self) -> bool {
        self.inner.result.lock().is_some()
    }

    /// Block until the batch finishes. Engines bound every I/O step with a
    /// timeout, so this returns even when the peer dies.
    pub fn wait(&self) -> Result<(), TransferError> {
        let mut g = self.inner.result.lock();
        loop {
            if let Some(r) = g.as_ref() {
                return r.clone();
            }
            self.inner.cond.wait(&mut g);
        }
    }

    /// Block up to `timeout`; `None` if the batch is still running then.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<(), TransferError>> {
        let deadline = Instant::now() + timeout;
        let mut g = self.inner.result.lock();
        loop {
            if let Some(r) = g.as_ref() {
                return Some(r.clone());
            }
            if self.inner.cond.wait_until(&mut g, deadline).timed_out() {
                return g.as_ref().cloned();
            }
        }
    }
}

impl fmt::Debug for BatchHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchHandle")
            .field("result", &*self.inner.result.lock())
            .finish()
    }
}

/// Finishes a [`BatchHandle`] exactly once.
pub(crate) struct Completer {
    inner: Arc<Completion>,
}

impl Completer {
    /// Publish the result and wake every waiter.
    pub(crate) fn complete(self, result: Result<(), TransferError>) {
        let mut g = self.inner.result.lock();
        if g.is_none() {
            *g = Some(result);
        }
        drop(g);
        self.inner.cond.notify_all();
    }
}

impl Drop for Completer {
    /// A completer dropped without a result (an engine thread that ended
    /// early) completes its batch with a `Shutdown` error, so no waiter
    /// waits for ever (as tokio's oneshot sender does on drop).
    fn drop(&mut self) {
        let mut g = self.inner.result.lock();
        if g.is_none() {
            *g = Some(Err(TransferError::new(
                String::new(),
                None,
                crate::ErrorKind::Shutdown,
                "the engine dropped the batch without finishing it",
            )));
            drop(g);
            self.inner.cond.notify_all();
        }
    }
}

impl fmt::Debug for Completer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Completer")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_completer_fails_its_batch() {
        let (handle, completer) = BatchHandle::pending();
        assert!(!handle.is_done());
        let waiter = {
            let h = handle.clone();
            std::thread::spawn(move || h.wait())
        };
        drop(completer);
        let err = waiter
            .join()
            .expect("waiter")
            .expect_err("dropped batch fails");
        assert_eq!(err.kind, crate::ErrorKind::Shutdown);
        let (done, completer) = BatchHandle::pending();
        completer.complete(Ok(()));
        assert_eq!(
            done.poll(),
            Some(Ok(())),
            "completing then dropping keeps the result"
        );
    }
}
