//! Waiting for SIGINT / SIGTERM, for the long-running roles.

/// Blocks until SIGINT or SIGTERM arrives; returns the signal's name.
pub fn wait_for_termination() -> std::io::Result<&'static str> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        Ok(tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        })
    })
}
