//! Which prefill DP rank holds a room (sglang's `_resolve_prefill_dp_rank`
//! and `query_prefill_dp_ranks`): the router's hint, DP rank 0 of a
//! single-DP prefill, `room % dp_size` when its routing follows the
//! bootstrap room, else the rank the prefill registered with the bootstrap
//! server, asked for until the bootstrap timeout.

use std::collections::HashMap;
use std::time::Instant;

use kvbridge_wire::KvPoll;
use kvbridge_wire::bootstrap::QueryDpRanks;

use super::receiver::{Fetch, KvReceiver, ensure_parallel_info};

impl KvReceiver {
    /// The prefill DP rank that serves this room, to pass to
    /// [`KvReceiver::init`]: `hint` when the router gave one, else by the
    /// prefill's routing rule, else from the bootstrap server. `None`: not
    /// known yet (call again), or the room failed (past the bootstrap
    /// timeout, or an unusable answer; [`KvReceiver::poll`] says `Failed`).
    pub fn prefill_dp_rank(&mut self, hint: Option<u64>) -> Option<u64> {
        if let Some(dp) = hint {
            return Some(dp);
        }
        if self.conclude_state == Some(KvPoll::Failed) {
            return None;
        }
        let deadline = *self
            .dp_deadline
            .get_or_insert_with(|| Instant::now() + self.shared.config.bootstrap_timeout);
        let waited = |this: &mut Self, why: String| {
            if Instant::now() >= deadline {
                this.fail(format!(
                    "no prefill DP rank for room {} from {} within the bootstrap timeout: {why}",
                    this.room, this.bootstrap_addr
                ));
            }
            None
        };
        match ensure_parallel_info(&self.shared, &self.bootstrap_addr) {
            Fetch::Ready(_) => {}
            Fetch::Retry(why) => return waited(self, why),
            Fetch::Fatal(why) => {
                self.fail(why);
                return None;
            }
        }
        let summary = self
            .shared
            .prefills
            .lock()
            .servers
            .get(&self.bootstrap_addr)
            .copied()?;
        if summary.dp_size <= 1 {
            return Some(0);
        }
        if summary.follow_bootstrap_room && !self.shared.config.force_query_dp_rank {
            return Some(self.room % summary.dp_size);
        }
        match self.query_dp_rank() {
            Ok(Some(dp)) if dp < summary.dp_size => Some(dp),
            Ok(Some(dp)) => {
                self.fail(format!(
                    "the bootstrap server names DP rank {dp} for room {}, but the prefill has {} DP ranks",
                    self.room, summary.dp_size
                ));
                None
            }
            Ok(None) => waited(self, "the prefill has not registered the room yet".into()),
            Err(why) => waited(self, why),
        }
    }

    /// `POST /query_dp_ranks` for this room.
    fn query_dp_rank(&self) -> Result<Option<u64>, String> {
        let url = format!("http://{}/query_dp_ranks", self.bootstrap_addr);
        let body = serde_json::to_vec(&QueryDpRanks {
            bootstrap_rooms: vec![self.room],
        })
        .map_err(|e| e.to_string())?;
        let mut resp = self
            .shared
            .http
            .post(&url)
            .content_type("application/json")
            .send(&body[..])
            .map_err(|e| format!("{url}: {e}"))?;
        if resp.status() != 200 {
            return Err(format!("{url} answered {}", resp.status()));
        }
        let ranks: HashMap<String, u64> = resp
            .body_mut()
            .with_config()
            .limit(1 << 20)
            .read_json()
            .map_err(|e| format!("bad answer from {url}: {e}"))?;
        Ok(ranks.get(&self.room.to_string()).copied())
    }
}
