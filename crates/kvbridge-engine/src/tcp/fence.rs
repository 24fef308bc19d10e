//! Fencing: which peers (by the session id their hello announced) may no
//! longer write into our memory, and which accepted connections are busy
//! with a request right now.
//!
//! A serving thread is *admitted* after its handshake (refused if its peer
//! is fenced), marks itself busy for the span of each request
//! ([`Fences::begin`] refuses when its peer was fenced meanwhile) and leaves
//! when its connection ends. [`Fences::fence`] marks the session fenced,
//! then waits until none of its connections is busy: the request in
//! progress may finish for a grace period, after which it is aborted (its
//! serving thread checks the abort flag at least every `io::TICK`, also
//! while receiving a payload). The caller then closes those connections.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// One admitted connection.
#[derive(Debug)]
struct Entry {
    session: String,
    busy: bool,
    abort: Arc<AtomicBool>,
}

#[derive(Debug, Default)]
struct State {
    fenced: HashSet<String>,
    conns: HashMap<u64, Entry>,
}

/// The fenced sessions and the admitted connections of one engine.
#[derive(Debug, Default)]
pub(crate) struct Fences {
    state: Mutex<State>,
    cond: Condvar,
}

impl Fences {
    /// Admit connection `id` from the peer announcing `session`: its abort
    /// flag, or `None` when that peer is fenced.
    pub(crate) fn admit(&self, id: u64, session: &str) -> Option<Arc<AtomicBool>> {
        let mut s = self.state.lock();
        if s.fenced.contains(session) {
            return None;
        }
        let abort = Arc::new(AtomicBool::new(false));
        s.conns.insert(
            id,
            Entry {
                session: session.to_owned(),
                busy: false,
                abort: abort.clone(),
            },
        );
        Some(abort)
    }

    /// Mark connection `id` busy with a request; `false` (and not busy)
    /// when its peer has been fenced or the connection was never admitted.
    pub(crate) fn begin(&self, id: u64) -> bool {
        let mut s = self.state.lock();
        let State { fenced, conns } = &mut *s;
        match conns.get_mut(&id) {
            Some(e) if !fenced.contains(&e.session) && !e.abort.load(Ordering::Acquire) => {
                e.busy = true;
                true
            }
            _ => false,
        }
    }

    /// Connection `id` finished its request.
    pub(crate) fn end(&self, id: u64) {
        if let Some(e) = self.state.lock().conns.get_mut(&id) {
            e.busy = false;
        }
        self.cond.notify_all();
    }

    /// Connection `id` ended.
    pub(crate) fn leave(&self, id: u64) {
        self.state.lock().conns.remove(&id);
        self.cond.notify_all();
    }

    /// Fence `session`: new connections and requests from it are refused
    /// from now on; returns once none of its connections is busy any more
    /// (a request still running after `grace` is aborted), with the ids of
    /// its connections, which the caller closes.
    pub(crate) fn fence(&self, session: &str, grace: Duration) -> Vec<u64> {
        let deadline = Instant::now() + grace;
        let mut s = self.state.lock();
        s.fenced.insert(session.to_owned());
        loop {
            let busy: Vec<&Entry> = s
                .conns
                .values()
                .filter(|e| e.busy && e.session == session)
                .collect();
            if busy.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    %session,
                    "fence: a request of the fenced peer is still running after the grace period; aborting it"
                );
                for e in busy {
                    e.abort.store(true, Ordering::Release);
                }
                // An aborted serving thread leaves its request within a tick.
                self.cond.wait_for(&mut s, Duration::from_millis(50));
                continue;
            }
            self.cond.wait_until(&mut s, deadline);
        }
        let ids: Vec<u64> = s
            .conns
            .iter()
            .filter(|(_, e)| e.session == session)
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            if let Some(e) = s.conns.get(id) {
                e.abort.store(true, Ordering::Release);
            }
        }
        ids
    }

    /// Lift the fence of `session`.
    pub(crate) fn unfence(&self, session: &str) {
        self.state.lock().fenced.remove(session);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fence_refuses_and_waits_for_the_busy_request() {
        let f = Arc::new(Fences::default());
        let abort = f.admit(1, "a:1").unwrap();
        assert!(f.admit(2, "b:1").is_some());
        assert!(f.begin(1));
        let f2 = f.clone();
        let t = std::thread::spawn(move || f2.fence("a:1", Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !t.is_finished(),
            "fence returned while a request was running"
        );
        f.end(1);
        assert_eq!(t.join().unwrap(), vec![1]);
        assert!(abort.load(Ordering::Acquire));
        assert!(!f.begin(1), "a fenced connection starts no request");
        assert!(f.admit(3, "a:1").is_none(), "a fenced peer is not admitted");
        assert!(f.begin(2), "other peers are not affected");
        f.end(2);
        f.unfence("a:1");
        assert!(f.admit(4, "a:1").is_some());
        f.leave(1);
        f.leave(2);
        f.leave(4);
    }

    #[test]
    fn a_request_running_past_the_grace_period_is_aborted() {
        let f = Arc::new(Fences::default());
        let abort = f.admit(1, "a:1").unwrap();
        assert!(f.begin(1));
        let (f2, a2) = (f.clone(), abort.clone());
        // The "serving thread": ends its request once aborted.
        let t = std::thread::spawn(move || {
            while !a2.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(5));
            }
            f2.end(1);
        });
        assert_eq!(f.fence("a:1", Duration::from_millis(20)), vec![1]);
        t.join().unwrap();
    }
}
