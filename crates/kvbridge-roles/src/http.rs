//! The small HTTP client the roles use (bootstrap registration and queries,
//! heartbeats): blocking, with a deadline on every call.

use std::time::Duration;

/// An agent whose every call finishes within `timeout`, and that returns
/// non-2xx answers as responses rather than errors.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .build()
        .into()
}
