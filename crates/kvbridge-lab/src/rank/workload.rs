//! The synthetic workload every rank derives identically from a seed: which
//! rooms, how long each prompt is, how it is chunked.

use kvbridge_plan::rng::mix;
use kvbridge_roles::synthetic::RequestSlots;
use serde::{Deserialize, Serialize};

/// A deterministic list of requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// Number of requests.
    pub requests: u64,
    /// Mean prompt length in tokens (each request varies ±25%).
    pub prompt_tokens: u64,
    /// Tokens per prefill chunk.
    pub chunk_tokens: u64,
    /// Requests in flight at once per rank.
    pub concurrency: usize,
    /// Seed for rooms and lengths.
    pub seed: u64,
    /// Decode ranks: fraction of requests to abort mid-transfer.
    #[serde(default)]
    pub abort_fraction: f64,
    /// Only these request indices (a restarted decode resumes the rest).
    #[serde(default)]
    pub only: Option<Vec<u64>>,
    /// Only requests from this index on (a role switch resumes there).
    #[serde(default)]
    pub from: u64,
    /// Decode ranks: give up on a room after this many seconds.
    #[serde(default = "default_room_timeout")]
    pub room_timeout_s: f64,
    /// Prefill ranks: seconds of simulated forward pass between a room's
    /// destination arriving and its first chunk being sent.
    #[serde(default)]
    pub forward_s: f64,
    /// Prefill DP groups the rooms are dispatched over (1: none).
    #[serde(default = "one")]
    pub dp_size: u64,
    /// Prefill ranks: only the rooms dispatched to this DP group.
    #[serde(default)]
    pub dp_rank: Option<u64>,
    /// Dispatch by request index (a router's round robin, which decodes
    /// must query) instead of by the bootstrap room.
    #[serde(default)]
    pub dp_round_robin: bool,
}

fn one() -> u64 {
    1
}

fn default_room_timeout() -> f64 {
    60.0
}

/// One request of the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Position in the workload.
    pub index: u64,
    /// The room id all ranks agree on.
    pub room: u64,
    /// Prompt length in tokens.
    pub tokens: u64,
}

impl Request {
    /// Where the request lives in a rank's pools: its `pages`, and `aux`
    /// as its aux, mamba and tail-ring slot.
    pub fn slots(&self, pages: &[i32], aux: i32) -> RequestSlots {
        RequestSlots {
            tokens: self.tokens,
            pages: pages.to_vec(),
            slot: u64::try_from(aux).unwrap_or(0),
        }
    }
}

impl Workload {
    /// The DP group request `r` is dispatched to.
    pub fn dp_of(&self, r: &Request) -> u64 {
        let n = self.dp_size.max(1);
        if self.dp_round_robin {
            r.index % n
        } else {
            r.room % n
        }
    }

    /// The requests, in order (from `from`, restricted to `only` when set, and on a
    /// prefill rank of a DP group to that group's).
    pub fn requests(&self) -> Vec<Request> {
        let all = self.all_requests();
        match self.dp_rank {
            Some(g) => all.into_iter().filter(|r| self.dp_of(r) == g).collect(),
            None => all,
        }
    }

    fn all_requests(&self) -> Vec<Request> {
        let only: Option<std::collections::HashSet<u64>> =
            self.only.as_ref().map(|o| o.iter().copied().collect());
        (self.from..self.requests)
            .filter(|i| only.as_ref().is_none_or(|o| o.contains(i)))
            .map(|index| {
                let h = mix(self.seed ^ mix(index + 1));
                let spread = self.prompt_tokens / 2;
                let tokens = if spread == 0 {
                    self.prompt_tokens
                } else {
                    self.prompt_tokens - spread / 2 + h % (spread + 1)
                };
                Request {
                    index,
                    room: h >> 1,
                    tokens: tokens.max(1),
                }
            })
            .collect()
    }

    /// Pages a request of `tokens` tokens needs at `page_size`.
    pub fn pages(tokens: u64, page_size: u64) -> u64 {
        tokens.div_ceil(page_size.max(1))
    }

    /// Whether request `index` is one the decode aborts.
    pub fn aborts(&self, index: u64) -> bool {
        if self.abort_fraction <= 0.0 {
            return false;
        }
        let u = (mix(self.seed ^ 0xab0 ^ mix(index)) >> 11) as f64 / (1u64 << 53) as f64;
        u < self.abort_fraction
    }
}

/// Hands out and takes back page numbers.
#[derive(Debug)]
pub struct PageAllocator {
    free: Vec<i32>,
}

impl PageAllocator {
    /// Pages `0..pages`, handed out lowest first.
    pub fn new(pages: u64) -> Self {
        let top = i32::try_from(pages).unwrap_or(i32::MAX);
        Self {
            free: (0..top).rev().collect(),
        }
    }

    /// `n` pages, or `None` when too few are free.
    pub fn alloc(&mut self, n: u64) -> Option<Vec<i32>> {
        let n = usize::try_from(n).ok()?;
        if n > self.free.len() {
            return None;
        }
        let at = self.free.len() - n;
        let mut pages = self.free.split_off(at);
        pages.reverse();
        Some(pages)
    }

    /// Returns pages.
    pub fn free(&mut self, pages: &[i32]) {
        self.free.extend(pages.iter().rev());
    }
}

/// `n` pages and one aux slot for a request, or neither: when one of the
/// two runs out, what the other handed out goes back (a half allocation
/// kept would leak until the rank stalls).
pub fn alloc_request(
    pages: &mut PageAllocator,
    aux: &mut PageAllocator,
    n: u64,
) -> Option<(Vec<i32>, i32)> {
    match (pages.alloc(n), aux.alloc(1)) {
        (Some(p), Some(a)) => Some((p, a[0])),
        (p, a) => {
            if let Some(p) = p {
                pages.free(&p);
            }
            if let Some(a) = a {
                aux.free(&a);
            }
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w() -> Workload {
        Workload {
            requests: 20,
            prompt_tokens: 100,
            chunk_tokens: 32,
            concurrency: 4,
            seed: 3,
            abort_fraction: 0.25,
            only: None,
            from: 0,
            room_timeout_s: 60.0,
            forward_s: 0.0,
            dp_size: 1,
            dp_rank: None,
            dp_round_robin: false,
        }
    }

    #[test]
    fn workload_is_deterministic_and_bounded() {
        let a = w().requests();
        assert_eq!(a, w().requests());
        assert_eq!(a.len(), 20);
        assert!(a.iter().all(|r| (75..=125).contains(&r.tokens)));
        let mut rooms: Vec<u64> = a.iter().map(|r| r.room).collect();
        rooms.sort_unstable();
        rooms.dedup();
        assert_eq!(rooms.len(), 20);
        let aborted = (0..20).filter(|i| w().aborts(*i)).count();
        assert!((1..12).contains(&aborted));
        let only = Workload {
            only: Some(vec![3, 5]),
            ..w()
        }
        .requests();
        assert_eq!(only.iter().map(|r| r.index).collect::<Vec<_>>(), vec![3, 5]);
    }

    #[test]
    fn a_request_takes_pages_and_a_slot_or_neither() {
        let (mut pages, mut aux) = (PageAllocator::new(5), PageAllocator::new(1));
        let (p, a) = alloc_request(&mut pages, &mut aux, 3).unwrap();
        assert_eq!((p.len(), a), (3, 0));
        // No aux slot left: the 2 pages it could have had stay free.
        assert!(alloc_request(&mut pages, &mut aux, 2).is_none());
        assert_eq!(pages.alloc(2).map(|p| p.len()), Some(2));
        // No pages left: the freed aux slot stays free.
        aux.free(&[a]);
        assert!(alloc_request(&mut pages, &mut aux, 1).is_none());
        assert_eq!(aux.alloc(1), Some(vec![0]));
    }

    #[test]
    fn allocator_reuses_pages() {
        let mut a = PageAllocator::new(5);
        let x = a.alloc(3).unwrap();
        assert_eq!(x, vec![0, 1, 2]);
        assert!(a.alloc(3).is_none());
        a.free(&x);
        assert_eq!(a.alloc(5).unwrap().len(), 5);
    }
}
