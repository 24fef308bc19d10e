//! The rate limit of repeated warnings: a hostile peer must not flood the
//! log, and a warning must still say how often it happened.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Quiet time after which a repeated warning is logged again.
const LOG_QUIET: Duration = Duration::from_secs(10);

/// Rate limit of one repeated warning: the first of a burst is logged, the
/// rest are counted, and the next one after [`LOG_QUIET`] is logged with
/// how many were suppressed in between.
#[derive(Debug, Default)]
pub(crate) struct Burst {
    state: Mutex<(Option<Instant>, u64)>,
}

impl Burst {
    /// `Some(suppressed since the last logged one)` when this occurrence should be logged.
    pub(crate) fn hit(&self) -> Option<u64> {
        let now = Instant::now();
        let mut s = self.state.lock();
        match s.0 {
            Some(last) if now.duration_since(last) < LOG_QUIET => {
                s.1 += 1;
                None
            }
            _ => {
                let suppressed = std::mem::take(&mut s.1);
                s.0 = Some(now);
                Some(suppressed)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_logs_its_first_occurrence_only() {
        let b = Burst::default();
        assert_eq!(b.hit(), Some(0));
        assert_eq!(b.hit(), None);
        assert_eq!(b.hit(), None);
        // After the quiet time the next one is logged with the count.
        b.state.lock().0 = Some(Instant::now() - LOG_QUIET);
        assert_eq!(b.hit(), Some(2));
    }
}
