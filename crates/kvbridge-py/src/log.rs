//! Logging: the Rust side's `tracing` events go to stderr, filtered by
//! `KVBRIDGE_LOG` (else `RUST_LOG`, else `warn`), set up once per process;
//! failures reported as return codes also go to Python's `kvbridge` logger
//! when the application configured Python logging.
//!
//! **Never:** replaces a subscriber someone else installed, or raises from
//! a logging call.

use std::sync::Once;

use pyo3::prelude::*;

/// Environment variable with kvbridge's log filter (`tracing` syntax).
pub const LOG_ENV: &str = "KVBRIDGE_LOG";

/// Installs the stderr subscriber once (a no-op when one is installed).
pub fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        use tracing_subscriber::EnvFilter;
        let filter = EnvFilter::try_from_env(LOG_ENV)
            .or_else(|_| EnvFilter::try_from_default_env())
            .unwrap_or_else(|_| EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init();
    });
}

/// `err` and its sources, `": "`-separated, on one line.
pub fn chain(err: &dyn std::error::Error) -> String {
    let mut msg = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !msg.ends_with(&text) {
            msg.push_str(": ");
            msg.push_str(&text);
        }
        source = s.source();
    }
    msg
}

/// `msg` as a warning on Python's `kvbridge` logger, when logging is
/// configured (a handler on it or an ancestor); otherwise the `tracing`
/// line already on stderr is the only one.
pub fn to_python(py: Python<'_>, msg: &str) {
    let logger = py
        .import("logging")
        .and_then(|m| m.call_method1("getLogger", ("kvbridge",)));
    if let Ok(logger) = logger
        && logger
            .call_method0("hasHandlers")
            .and_then(|h| h.is_truthy())
            .unwrap_or(false)
    {
        let _ = logger.call_method1("warning", ("%s", msg));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn chain_lists_every_cause_once() {
        let e = Outer(std::io::Error::other("inner"));
        assert_eq!(chain(&e), "outer: inner");
        assert_eq!(chain(&std::io::Error::other("alone")), "alone");
    }
}
