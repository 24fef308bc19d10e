//! Keeps this rank's bootstrap registration alive: every
//! `bootstrap_refresh` it checks that the bootstrap server still holds it
//! and registers again when it does not, so that a restarted server can
//! send decodes here again, or when the slot names another endpoint (a
//! replayed or stale registration), so that it cannot stay hijacked. Says once when the server becomes unreachable
//! and once when it is back.

use crate::bootstrap::client::{Refresh, refresh_registration};

use super::Shared;

/// Checks until the manager stops.
pub(crate) fn run(shared: &Shared, rank_port: u16) {
    let every = shared.config.bootstrap_refresh;
    let page_size = shared.kv_args.layout.page_size;
    let mut unreachable = false;
    while !shared.stop_signal.wait(every) {
        let session = shared.engine.session_id();
        match refresh_registration(&shared.config, page_size, rank_port, session) {
            Ok(Refresh::Present) => {
                if std::mem::take(&mut unreachable) {
                    tracing::info!(addr = %shared.config.bootstrap_addr, "bootstrap server reachable again");
                }
            }
            Ok(Refresh::Reclaimed) => {
                unreachable = false;
                tracing::warn!(
                    addr = %shared.config.bootstrap_addr,
                    "took this rank's bootstrap slot back from another endpoint's registration"
                );
            }
            Ok(Refresh::Registered) => {
                unreachable = false;
                tracing::warn!(
                    addr = %shared.config.bootstrap_addr,
                    "the bootstrap server had lost this rank's registration (restarted?); registered again"
                );
            }
            Err(error) => {
                if !std::mem::replace(&mut unreachable, true) {
                    tracing::warn!(
                        %error,
                        "bootstrap server unreachable; this rank registers again once it is back"
                    );
                }
            }
        }
    }
}
