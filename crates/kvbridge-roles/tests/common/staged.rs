//! Staged rooms opened by hand on a [`Cluster`]: a room's receivers and
//! senders, sent in pieces, checked byte for byte, or aborted; and the
//! decode ranks' staging allocations.

use std::time::{Duration, Instant};

use kvbridge_roles::{KvPoll, KvReceiver, KvSender, StagingConfig, StagingMode};

use super::{Cluster, wait_for, wait_terminal};

pub const T: Duration = Duration::from_secs(20);

pub fn staging(chunk_tokens: u64, ring: u64, wait: Duration) -> StagingConfig {
    StagingConfig {
        mode: StagingMode::On,
        pool_bytes: ring,
        chunk_tokens,
        buffer_bytes: 1 << 20,
        wait_timeout: wait,
    }
}

/// One room opened on every rank: receivers with their metadata sent,
/// senders initialised and filled, not yet sent.
pub struct Room {
    pub id: u64,
    pub src: Vec<i32>,
    pub dst: Vec<i32>,
    pub aux: u64,
    pub rx: Vec<KvReceiver>,
    pub tx: Vec<KvSender>,
}

pub fn open(c: &mut Cluster, id: u64, src: Vec<i32>, dst: Vec<i32>, aux: u64) -> Room {
    open_expecting(c, id, src, dst, aux, KvPoll::WaitingForInput)
}

/// As [`open`]; each sender must reach at least `least` before the room is
/// handed back (`Failed` for a room the decode may refuse at once).
pub fn open_expecting(
    c: &mut Cluster,
    id: u64,
    src: Vec<i32>,
    dst: Vec<i32>,
    aux: u64,
    least: KvPoll,
) -> Room {
    let addr = c.bootstrap.local_addr().to_string();
    let mut rx = Vec::new();
    for (m, _) in &c.decode {
        let mut r = m.receiver(&addr, id);
        assert_eq!(r.init(0), KvPoll::WaitingForInput);
        r.send_metadata(&dst, aux, &[], None);
        rx.push(r);
    }
    let mut tx = Vec::new();
    for (m, pools) in &mut c.prefill {
        pools.fill(id, &src, aux);
        let mut t = m.sender(id);
        t.init(src.len() as u64, Some(aux));
        tx.push(t);
    }
    for t in &mut tx {
        let state = wait_for(T, KvPoll::WaitingForInput, || t.poll());
        assert!(state >= least, "room {id}: sender {state:?}");
    }
    Room {
        id,
        src,
        dst,
        aux,
        rx,
        tx,
    }
}

impl Room {
    /// Sends pages `[from, to)` of the room from every prefill rank.
    pub fn send(&mut self, from: usize, to: usize, chunk: usize) {
        for t in &mut self.tx {
            for pages in self.src[from..to].chunks(chunk) {
                t.send(pages, None, None).unwrap();
            }
        }
    }

    pub fn send_all(&mut self, chunk: usize) {
        self.send(0, self.src.len(), chunk);
    }

    /// Waits for every rank and checks every byte; clears the room.
    pub fn finish_ok(mut self, c: &Cluster) {
        for t in &mut self.tx {
            assert_eq!(
                wait_terminal(T, || t.poll()),
                KvPoll::Success,
                "room {}",
                self.id
            );
            t.clear();
        }
        for (r, (_, pools)) in self.rx.iter_mut().zip(&c.decode) {
            assert_eq!(
                wait_terminal(T, || r.poll()),
                KvPoll::Success,
                "room {}",
                self.id
            );
            let v = pools.verify(self.id, &self.dst, self.aux);
            assert_eq!(v.mismatched, 0, "room {}: {v:?}", self.id);
            r.clear();
        }
    }

    /// Aborts from the decode side, waits for the prefill ranks to fail it
    /// and acknowledge, and clears it everywhere.
    pub fn abort_from_decode(self) {
        self.abort_racing(false);
    }

    /// As [`Room::abort_from_decode`]; with `raced`, a prefill rank that
    /// finished its sends before the abort reached it may end in Success.
    pub fn abort_racing(mut self, raced: bool) {
        for r in &mut self.rx {
            r.abort();
        }
        for t in &mut self.tx {
            let end = wait_terminal(T, || t.poll());
            assert!(
                end == KvPoll::Failed || (raced && end == KvPoll::Success),
                "{end:?}"
            );
            t.clear();
        }
        for r in &mut self.rx {
            let deadline = Instant::now() + T;
            while !r.abort_acknowledged() {
                assert!(Instant::now() < deadline, "abort never acknowledged");
                std::thread::sleep(Duration::from_millis(5));
            }
            r.clear();
        }
    }
}

pub fn allocations(c: &Cluster) -> usize {
    c.decode
        .iter()
        .map(|(m, _)| m.staging_allocations().unwrap_or(0))
        .sum()
}

pub fn wait_allocations(c: &Cluster, at_least: usize) {
    let deadline = Instant::now() + T;
    while allocations(c) < at_least {
        assert!(Instant::now() < deadline, "the decode never allocated");
        std::thread::sleep(Duration::from_millis(5));
    }
}
