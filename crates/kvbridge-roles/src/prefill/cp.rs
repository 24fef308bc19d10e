//! What a prefill rank sends under attention context parallelism (CP):
//! every CP rank holds the whole KV once a prefill finishes, so by default
//! CP rank 0 sends it all and the others are dummies the decode never asks;
//! with all-ranks transfer (`SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`,
//! or a hybrid-MLA pool) each sends one contiguous share of the pages and
//! only rank 0 the replicated state.

use crate::config::ParallelRank;

/// This rank's part in a CP group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CpRole {
    /// No context parallelism, or CP rank 0 sending everything.
    Whole,
    /// A CP rank other than 0 without all-ranks transfer: sends nothing;
    /// its rooms wait for input from the start and succeed at the last chunk.
    Dummy,
    /// All-ranks transfer: CP rank `rank` of `size` sends its share of
    /// the pages (aux too), the state only when `rank == 0`.
    Share {
        /// CP rank.
        rank: u64,
        /// CP size.
        size: u64,
    },
}

impl CpRole {
    /// The role of `rank`; `all_ranks`: every CP rank transfers.
    pub(crate) fn new(rank: &ParallelRank, all_ranks: bool) -> Self {
        let (size, r) = (rank.attn_cp_size, rank.attn_cp_rank);
        if size <= 1 {
            CpRole::Whole
        } else if all_ranks {
            CpRole::Share { rank: r, size }
        } else if r != 0 {
            CpRole::Dummy
        } else {
            CpRole::Whole
        }
    }

    /// Whether this rank never transfers (sglang's `is_dummy_cp_rank`).
    pub(crate) fn is_dummy(self) -> bool {
        self == CpRole::Dummy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(size: u64, r: u64) -> ParallelRank {
        ParallelRank {
            attn_cp_size: size,
            attn_cp_rank: r,
            ..ParallelRank::default()
        }
    }

    #[test]
    fn roles_follow_sglang() {
        assert_eq!(CpRole::new(&rank(1, 0), true), CpRole::Whole);
        assert_eq!(CpRole::new(&rank(2, 0), false), CpRole::Whole);
        assert_eq!(CpRole::new(&rank(2, 1), false), CpRole::Dummy);
        assert_eq!(
            CpRole::new(&rank(4, 3), true),
            CpRole::Share { rank: 3, size: 4 }
        );
    }
}
