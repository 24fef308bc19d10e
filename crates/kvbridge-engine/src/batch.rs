//! Completion handles of submitted batches.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::TransferError;

/// What runs once when a batch finishes (on the thread that finishes it).
type Waker = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Completion {
    state: Mutex<State>,
    cond: Condvar,
}

#[derive(Default)]
struct State {
    result: Option<Result<(), TransferError>>,
    wakers: Vec<Waker>,
}

impl Completion {
    /// Publishes `result` unless one is there, wakes every waiter and runs
    /// the wakers.
    fn finish(&self, result: Result<(), TransferError>) {
        let mut g = self.state.lock();
        if g.result.is_some() {
            return;
        }
        g.result = Some(result);
        let wakers = std::mem::take(&mut g.wakers);
        drop(g);
        self.cond.notify_all();
        for wake in wakers {
            wake();
        }
    }
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
        self.inner.state.lock().result.clone()
    }

    /// Runs `wake` once the batch finishes: at once when it has, else on the
    /// engine thread that finishes it, so `wake` must be quick and never
    /// block (a channel's `try_send`, an unpark).
    pub fn on_done(&self, wake: impl FnOnce() + Send + 'static) {
        let mut g = self.inner.state.lock();
        if g.result.is_some() {
            drop(g);
            wake();
        } else {
            g.wakers.push(Box::new(wake));
        }
    }

    /// Whether the batch has finished.
    pub fn is_done(&self) -> bool {
        self.inner.state.lock().result.is_some()
    }

    /// Block until the batch finishes. Engines bound every I/O step with a
    /// timeout, so this returns even when the peer dies.
    pub fn wait(&self) -> Result<(), TransferError> {
        let mut g = self.inner.state.lock();
        loop {
            if let Some(r) = g.result.as_ref() {
                return r.clone();
            }
            self.inner.cond.wait(&mut g);
        }
    }

    /// Block up to `timeout`; `None` if the batch is still running then.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<(), TransferError>> {
        let deadline = Instant::now() + timeout;
        let mut g = self.inner.state.lock();
        loop {
            if let Some(r) = g.result.as_ref() {
                return Some(r.clone());
            }
            if self.inner.cond.wait_until(&mut g, deadline).timed_out() {
                return g.result.clone();
            }
        }
    }
}

impl fmt::Debug for BatchHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchHandle")
            .field("result", &self.inner.state.lock().result)
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
        self.inner.finish(result);
    }
}

impl Drop for Completer {
    /// A completer dropped without a result (an engine thread that ended
    /// early) completes its batch with a `Shutdown` error, so no waiter
    /// waits for ever (as tokio's oneshot sender does on drop).
    fn drop(&mut self) {
        // Checked first so that the usual drop, after `complete`, builds no error.
        if self.inner.state.lock().result.is_none() {
            self.inner.finish(Err(TransferError::new(
                String::new(),
                None,
                crate::ErrorKind::Shutdown,
                "the engine dropped the batch without finishing it",
            )));
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

    #[test]
    fn on_done_runs_once_whenever_it_is_registered() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let count = Arc::new(AtomicUsize::new(0));
        let counter = || {
            let c = count.clone();
            move || {
                c.fetch_add(1, Ordering::SeqCst);
            }
        };
        // Registered before the result: runs when it comes, once.
        let (handle, completer) = BatchHandle::pending();
        handle.on_done(counter());
        handle.on_done(counter());
        assert_eq!(count.load(Ordering::SeqCst), 0);
        completer.complete(Ok(()));
        assert_eq!(count.load(Ordering::SeqCst), 2);
        // Registered after: runs at once.
        handle.on_done(counter());
        assert_eq!(count.load(Ordering::SeqCst), 3);
        // A dropped completer runs them too.
        let (handle, completer) = BatchHandle::pending();
        handle.on_done(counter());
        drop(completer);
        assert_eq!(count.load(Ordering::SeqCst), 4);
        assert!(handle.poll().is_some_and(|r| r.is_err()));
    }
}
