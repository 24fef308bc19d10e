//! What the prefill and decode managers share around their own threads:
//! the engine registration of their memory, the zmq control context, the
//! metrics endpoint, the threads with their stop signal, and teardown in
//! its one safe order.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use kvbridge_engine::{ClusterSecret, MemError, TransferEngine};

use crate::control::{ControlContext, ControlError, ControlSecurity, PullSocket, PushPool};
use crate::error::StartError;
use crate::kv_args::KvArgs;
use crate::local::LocalMemory;
use crate::metrics::{Metrics, MetricsServer};
use crate::stop::{StopSignal, StopTrigger, stop_pair};

/// Checks `kv_args`, lists all its buffers locally and registers the engine's share.
///
/// # Safety
/// As for [`TransferEngine::batch_register`]: every buffer `kv_args` names
/// stays valid until the registration is released or dropped.
pub(crate) unsafe fn register_memory(
    kv_args: &KvArgs,
    engine: &Arc<dyn TransferEngine>,
    nvlink_intra: bool,
    extra: &[(u64, u64)],
) -> Result<(LocalMemory, Registration), StartError> {
    kv_args.validate()?;
    let intra = nvlink_intra || !engine.moves_host_memory();
    // SAFETY: forwarded caller contract.
    let local = unsafe { LocalMemory::new(kv_args, intra, extra)? };
    // SAFETY: as above.
    let registration = unsafe { Registration::new(engine, &local.engine_regions)? };
    Ok((local, registration))
}

/// Memory registered with a transfer engine; dropping it deregisters it.
#[derive(Debug)]
pub(crate) struct Registration {
    engine: Arc<dyn TransferEngine>,
    addrs: Vec<u64>,
    registered: bool,
}

impl Registration {
    /// Registers `regions` (`(address, length)`) with `engine`.
    ///
    /// # Safety
    /// As for [`TransferEngine::batch_register`]: every region stays valid
    /// until this registration is released or dropped.
    pub(crate) unsafe fn new(
        engine: &Arc<dyn TransferEngine>,
        regions: &[(u64, u64)],
    ) -> Result<Self, MemError> {
        // SAFETY: forwarded caller contract.
        unsafe { engine.batch_register(regions)? };
        Ok(Self {
            engine: engine.clone(),
            addrs: regions.iter().map(|r| r.0).collect(),
            registered: true,
        })
    }

    /// Deregisters now, logging a failure (a failed start drops it silently).
    fn release(mut self) {
        self.registered = false;
        if let Err(e) = self.engine.batch_deregister(&self.addrs) {
            tracing::warn!(error = %e, "deregistering memory at teardown");
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if self.registered {
            let _ = self.engine.batch_deregister(&self.addrs);
        }
    }
}

/// A role's threads and what they run on, released by [`Lifecycle::shut_down`].
#[derive(Debug)]
pub(crate) struct Lifecycle {
    // Declared in teardown order: fields drop in that order too, so a start
    // that fails before any thread runs releases them the same way.
    stop: StopTrigger,
    threads: Vec<JoinHandle<()>>,
    metrics_server: Option<MetricsServer>,
    registration: Registration,
    context: ControlContext,
}

impl Lifecycle {
    /// Takes `registration`; makes the control context (warning in open mode) and stop signal.
    pub(crate) fn new(
        role: &str,
        registration: Registration,
        secret: Option<&ClusterSecret>,
    ) -> Result<(Self, StopSignal), StartError> {
        let security = ControlSecurity::from_secret(secret);
        if !security.is_secret() {
            kvbridge_engine::secret::warn_open_mode(role);
        }
        let context = ControlContext::new(security)?;
        let (stop, signal) = stop_pair();
        let lifecycle = Self {
            stop,
            threads: Vec::new(),
            metrics_server: None,
            registration,
            context,
        };
        Ok((lifecycle, signal))
    }

    /// The control context the role's sockets are made in.
    pub(crate) fn context(&self) -> &ControlContext {
        &self.context
    }

    /// Binds the role's inbox (a PULL socket on `host`, on `port` or, 0,
    /// any free port).
    pub(crate) fn bind_inbox(
        &self,
        host: &str,
        port: u16,
        max_message_bytes: usize,
    ) -> Result<PullSocket, ControlError> {
        PullSocket::bind(&self.context, host, port, max_message_bytes)
    }

    /// The role's metrics, served at `addr` when set.
    pub(crate) fn serve_metrics(
        &mut self,
        addr: Option<SocketAddr>,
    ) -> std::io::Result<Arc<Metrics>> {
        let metrics = Arc::new(Metrics::new());
        if let Some(addr) = addr {
            self.metrics_server = Some(MetricsServer::start(addr, metrics.clone())?);
        }
        Ok(metrics)
    }

    /// Where the metrics endpoint listens, when enabled.
    pub(crate) fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_server.as_ref().map(MetricsServer::local_addr)
    }

    /// Starts a named thread that teardown joins.
    pub(crate) fn spawn(
        &mut self,
        name: String,
        f: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<()> {
        let thread = std::thread::Builder::new().name(name).spawn(f)?;
        self.threads.push(thread);
        Ok(())
    }

    /// Stops and joins every thread (`wake` rouses those parked elsewhere), then releases the rest.
    pub(crate) fn shut_down(self, stopped: &AtomicBool, push: &PushPool, wake: impl FnOnce()) {
        let Self {
            mut stop,
            threads,
            metrics_server,
            registration,
            context,
        } = self;
        stopped.store(true, Ordering::SeqCst);
        stop.trigger();
        wake();
        // Joined first: no thread can still send, receive or read the
        // memory while what it uses goes away.
        for t in threads {
            let _ = t.join();
        }
        // Then the PUSH sockets and the metrics endpoint; the memory is
        // deregistered once nothing of ours can touch it.
        push.close_all();
        drop(metrics_server);
        registration.release();
        // Every socket is closed now (the inbox thread owned the PULL socket),
        // so terminating the context cannot block.
        drop(context);
    }
}

/// The next inbox message within `wait`; a failed receive is logged, backed off and reads as none.
pub(crate) fn next_message(
    socket: &PullSocket,
    wait: Duration,
    role: &str,
) -> Option<Vec<Vec<u8>>> {
    match socket.recv_timeout(wait) {
        Ok(frames) => frames,
        Err(e) => {
            tracing::error!(error = %e, "{role} socket receive failed");
            std::thread::sleep(Duration::from_millis(50));
            None
        }
    }
}

/// Counts and logs an inbox message of `frames` frames that did not decode.
pub(crate) fn drop_malformed(metrics: &Metrics, error: &dyn std::fmt::Display, frames: usize) {
    metrics.dropped("malformed");
    tracing::warn!(error = %error, frames, "dropping malformed message");
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use kvbridge_engine::LoopbackEngine;
    use kvbridge_mem::HostBuffer;

    use super::*;

    fn registered(buf: &HostBuffer) -> (Arc<dyn TransferEngine>, Registration) {
        let engine: Arc<dyn TransferEngine> = Arc::new(LoopbackEngine::new());
        // SAFETY: every test keeps the buffer alive past the registration.
        let r = unsafe { Registration::new(&engine, &[(buf.addr(), buf.len() as u64)]) }.unwrap();
        (engine, r)
    }

    #[test]
    fn a_dropped_registration_deregisters() {
        let buf = HostBuffer::new(4096).unwrap();
        let (engine, registration) = registered(&buf);
        drop(registration);
        assert!(
            engine.batch_deregister(&[buf.addr()]).is_err(),
            "already deregistered"
        );
    }

    #[test]
    fn shut_down_joins_every_thread_then_deregisters() {
        let buf = HostBuffer::new(4096).unwrap();
        let (engine, registration) = registered(&buf);
        let (mut lifecycle, signal) = Lifecycle::new("test", registration, None).unwrap();
        let push = PushPool::new(lifecycle.context(), Duration::from_secs(1));
        let finished = Arc::new(AtomicBool::new(false));
        let done = finished.clone();
        lifecycle
            .spawn("kvb-test".into(), move || {
                while !signal.wait(Duration::from_secs(10)) {}
                std::thread::sleep(Duration::from_millis(50));
                done.store(true, Ordering::SeqCst);
            })
            .unwrap();
        let stopped = AtomicBool::new(false);
        let woken = AtomicBool::new(false);
        lifecycle.shut_down(&stopped, &push, || woken.store(true, Ordering::SeqCst));
        assert!(stopped.load(Ordering::SeqCst) && woken.load(Ordering::SeqCst));
        assert!(finished.load(Ordering::SeqCst), "the thread was joined");
        assert!(engine.batch_deregister(&[buf.addr()]).is_err());
    }
}
