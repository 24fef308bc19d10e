//! Regions that peers *hold* through their control connections: the CUDA
//! IPC engine copies into a receiver's memory without a request per batch,
//! so the receiver must know which of its regions a peer may be writing.
//!
//! A `Lease` request adds regions to its connection's hold (checked
//! registered first); `Release` drops the whole hold. A deregistration that
//! touches a held region first removes the region (new leases of it are
//! refused), then *revokes* each hold on it (the serving thread is woken
//! through an eventfd and sends a `Revoke` frame) and waits until the peer
//! has released: the peer answers only after its copies in flight
//! finished. A hold ends with its connection, too. A peer that does not
//! answer within the I/O timeout has its connection shut down (as a
//! request that stalls past the timeout would).

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// The hold of one connection.
#[derive(Debug)]
struct Hold {
    /// The held ranges, in lease order; `seen` has the same ones, for
    /// constant-time duplicate checks (a lease is linear in its length).
    regions: Vec<(u64, u64)>,
    seen: HashSet<(u64, u64)>,
    revoke: bool,
    wake: Arc<OwnedFd>,
}

/// Every hold of an engine, by connection id.
#[derive(Debug, Default)]
pub(crate) struct Holds {
    map: Mutex<HashMap<u64, Hold>>,
    cond: Condvar,
}

/// A non-blocking eventfd that wakes a serving thread.
pub(crate) fn eventfd() -> std::io::Result<Arc<OwnedFd>> {
    // SAFETY: creates a new file descriptor; no pointers involved.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    Ok(Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Wake whoever polls `fd`.
fn signal(fd: RawFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live buffer to an eventfd we keep open.
    let _ = unsafe { libc::write(fd, one.as_ptr().cast(), one.len()) };
}

/// Consume the pending wake-ups of `fd`.
pub(crate) fn drain(fd: RawFd) {
    let mut b = [0u8; 8];
    // SAFETY: reads at most 8 bytes into a live buffer (non-blocking fd).
    let _ = unsafe { libc::read(fd, b.as_mut_ptr().cast(), b.len()) };
}

fn overlaps(a: &[(u64, u64)], b: &[(u64, u64)]) -> bool {
    a.iter().any(|&(s, l)| {
        b.iter()
            .any(|&(t, m)| s < t.saturating_add(m) && t < s.saturating_add(l))
    })
}

impl Holds {
    /// Add `regions` to the hold of connection `conn` (woken through
    /// `wake`). Linear in `regions.len()` (expected; hashed duplicate
    /// checks), whatever the connection already holds.
    pub(crate) fn add(&self, conn: u64, wake: &Arc<OwnedFd>, regions: &[(u64, u64)]) {
        let mut m = self.map.lock();
        let h = m.entry(conn).or_insert_with(|| Hold {
            regions: Vec::new(),
            seen: HashSet::new(),
            revoke: false,
            wake: wake.clone(),
        });
        h.seen.reserve(regions.len());
        for r in regions {
            if h.seen.insert(*r) {
                h.regions.push(*r);
            }
        }
    }

    /// Whether connection `conn` holds any region.
    pub(crate) fn holding(&self, conn: u64) -> bool {
        self.map.lock().contains_key(&conn)
    }

    /// Drop the hold of `conn` (its `Release`, or its end).
    pub(crate) fn release(&self, conn: u64) {
        if self.map.lock().remove(&conn).is_some() {
            self.cond.notify_all();
        }
    }

    /// Whether the hold of `conn` is being revoked.
    pub(crate) fn revoking(&self, conn: u64) -> bool {
        self.map.lock().get(&conn).is_some_and(|h| h.revoke)
    }

    /// Revoke every hold on a region overlapping `ranges` and wait until
    /// each is released, at most `timeout`; returns the connections still
    /// holding then (the caller shuts them down).
    pub(crate) fn revoke_and_wait(&self, ranges: &[(u64, u64)], timeout: Duration) -> Vec<u64> {
        if ranges.is_empty() {
            return Vec::new();
        }
        let deadline = Instant::now() + timeout;
        let mut m = self.map.lock();
        loop {
            let mut waiting = Vec::new();
            for (id, h) in m.iter_mut() {
                if overlaps(&h.regions, ranges) {
                    if !h.revoke {
                        h.revoke = true;
                        signal(h.wake.as_raw_fd());
                    }
                    waiting.push(*id);
                }
            }
            if waiting.is_empty() {
                return waiting;
            }
            if self.cond.wait_until(&mut m, deadline).timed_out() {
                return m
                    .iter()
                    .filter(|(_, h)| overlaps(&h.regions, ranges))
                    .map(|(id, _)| *id)
                    .collect();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revoke_waits_for_release() {
        let holds = Arc::new(Holds::default());
        let wake = eventfd().unwrap();
        holds.add(1, &wake, &[(0x1000, 0x100)]);
        holds.add(1, &wake, &[(0x1000, 0x100), (0x1000, 0x100)]);
        holds.add(2, &wake, &[(0x5000, 0x100)]);
        assert_eq!(holds.map.lock()[&1].regions, vec![(0x1000, 0x100)]);
        assert!(holds.holding(1) && !holds.holding(3));
        // Not overlapping: nothing to wait for.
        assert!(
            holds
                .revoke_and_wait(&[(0x2000, 0x10)], Duration::from_millis(1))
                .is_empty()
        );
        assert!(!holds.revoking(1));
        // Nobody releases: times out, names the holder.
        assert_eq!(
            holds.revoke_and_wait(&[(0x10f0, 0x100)], Duration::from_millis(5)),
            vec![1]
        );
        assert!(holds.revoking(1) && !holds.revoking(2));
        let h2 = holds.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            h2.release(1);
        });
        assert!(
            holds
                .revoke_and_wait(&[(0x1000, 1)], Duration::from_secs(10))
                .is_empty()
        );
        t.join().unwrap();
        drain(wake.as_raw_fd());
    }
}
