//! The small HTTP client the roles use (bootstrap registration and queries,
//! heartbeats): blocking, with a deadline on every call; and the accept loop
//! of their HTTP servers (bootstrap, metrics): a connection cap with
//! eviction of idle connections, a header read timeout, and accept errors
//! (out of file descriptors, …) that are logged and backed off from rather
//! than fatal.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::oneshot;
use tokio::task::AbortHandle;

/// An agent whose every call finishes within `timeout`, and that returns
/// non-2xx answers as responses rather than errors.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .build()
        .into()
}

/// First wait after an accept error; doubled per consecutive error.
const MIN_ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
/// Longest wait after an accept error.
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);
/// Most bytes of request line and headers read before a request is refused.
const MAX_HEADER_BUF: usize = 16 * 1024;
/// Most headers in one request.
const MAX_HEADERS: usize = 64;
/// Refusals of one cause closer together than this are one burst (one log line).
pub(crate) const BURST_QUIET: Duration = Duration::from_secs(10);

/// Logs a cause once per burst: the first occurrence, then nothing until
/// [`BURST_QUIET`] has passed, when the next one is logged with the number
/// suppressed in between.
#[derive(Debug, Default)]
pub(crate) struct BurstLog {
    last: Mutex<HashMap<&'static str, (Instant, u64)>>,
}

impl BurstLog {
    /// Whether `cause` should be logged now, and how many occurrences were
    /// suppressed since it last was.
    pub(crate) fn should_log(&self, cause: &'static str) -> Option<u64> {
        let now = Instant::now();
        let mut last = self.last.lock();
        match last.get_mut(cause) {
            Some((at, suppressed)) if now.duration_since(*at) < BURST_QUIET => {
                *suppressed += 1;
                None
            }
            Some((at, suppressed)) => {
                *at = now;
                Some(std::mem::take(suppressed))
            }
            None => {
                last.insert(cause, (now, 0));
                Some(0)
            }
        }
    }
}

/// Connection limits of one HTTP server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConnLimits {
    /// Most connections served at once; a new one beyond evicts the oldest
    /// idle connection, or is closed when every connection is busy.
    pub max_connections: usize,
    /// Close a connection that has not sent a whole request head within
    /// this long (also between keep-alive requests).
    pub header_timeout: Duration,
}

/// What an HTTP server's accept loop did (readable while it runs).
#[derive(Debug, Default)]
pub(crate) struct ConnCounters {
    /// Accept calls that failed with something other than a reset peer.
    pub accept_errors: AtomicU64,
    /// Connections closed at once: the cap was reached and none was idle.
    pub refused: AtomicU64,
    /// Idle connections closed to make room for a new one.
    pub evicted: AtomicU64,
    /// Connections closed for not sending a request head in time.
    pub header_timeouts: AtomicU64,
    log: BurstLog,
}

impl ConnCounters {
    /// Logs (burst-limited per `kind`) that server `name` hit its
    /// connection cap `max` and what it does about it.
    fn warn_limit(&self, kind: &'static str, name: &'static str, max: usize, what: &str) {
        if let Some(suppressed) = self.log.should_log(kind) {
            tracing::warn!(
                server = name,
                max,
                suppressed,
                "connection limit reached; {what}"
            );
        }
    }
}

/// A source of connections: a TCP listener, or a test double.
pub(crate) trait Acceptor: Send + 'static {
    /// The connection type.
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The next connection.
    fn accept(&mut self) -> impl Future<Output = std::io::Result<Self::Io>> + Send;
}

impl Acceptor for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;

    async fn accept(&mut self) -> std::io::Result<Self::Io> {
        tokio::net::TcpListener::accept(self).await.map(|(s, _)| s)
    }
}

/// One served connection, as the eviction rule sees it.
#[derive(Debug, Default)]
struct ConnState {
    /// Requests being handled now.
    busy: AtomicUsize,
    /// Requests handled so far.
    served: AtomicU64,
}

#[derive(Debug)]
struct Entry {
    state: Arc<ConnState>,
    task: Option<AbortHandle>,
}

/// Live connections by id (ids grow, so the first is the oldest).
type Table = Arc<Mutex<BTreeMap<u64, Entry>>>;

/// The connection to close for a newcomer: the oldest idle one that never
/// sent a request (a stray or hostile socket), else the oldest idle one.
fn victim(table: &BTreeMap<u64, Entry>) -> Option<u64> {
    let idle = |e: &Entry| e.task.is_some() && e.state.busy.load(Ordering::SeqCst) == 0;
    let never_served = table
        .iter()
        .find(|(_, e)| idle(e) && e.state.served.load(Ordering::SeqCst) == 0);
    never_served
        .or_else(|| table.iter().find(|(_, e)| idle(e)))
        .map(|(id, _)| *id)
}

/// Removes a connection's entry when its task ends (or is aborted).
struct Leave(Table, u64);

impl Drop for Leave {
    fn drop(&mut self) {
        self.0.lock().remove(&self.1);
    }
}

/// Marks a connection busy while one request is handled.
struct Busy(Arc<ConnState>);

impl Busy {
    fn enter(state: &Arc<ConnState>) -> Self {
        state.busy.fetch_add(1, Ordering::SeqCst);
        Self(state.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.served.fetch_add(1, Ordering::SeqCst);
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    )
}

/// Serves `app` on connections from `acceptor` within `limits` until `stop`
/// fires (or its sender is dropped); then closes every connection.
pub(crate) async fn serve<A: Acceptor>(
    mut acceptor: A,
    app: Router,
    limits: ConnLimits,
    counters: Arc<ConnCounters>,
    name: &'static str,
    mut stop: oneshot::Receiver<()>,
) {
    let table: Table = Arc::default();
    let mut next_id = 0u64;
    let mut backoff = MIN_ACCEPT_BACKOFF;
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => break,
            r = acceptor.accept() => r,
        };
        let io = match accepted {
            Ok(io) => {
                backoff = MIN_ACCEPT_BACKOFF;
                io
            }
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                counters.accept_errors.fetch_add(1, Ordering::Relaxed);
                if let Some(suppressed) = counters.log.should_log("accept") {
                    tracing::error!(server = name, error = %e, suppressed, backoff = ?backoff,
                        "accept failed; retrying");
                }
                tokio::select! {
                    _ = &mut stop => break,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_ACCEPT_BACKOFF);
                continue;
            }
        };
        next_id += 1;
        let id = next_id;
        let state = Arc::new(ConnState::default());
        let evicted = {
            let mut t = table.lock();
            let evicted = if t.len() >= limits.max_connections.max(1) {
                match victim(&t).and_then(|v| t.remove(&v)) {
                    Some(entry) => Some(entry),
                    None => {
                        drop(t);
                        counters.refused.fetch_add(1, Ordering::Relaxed);
                        let what = "every connection busy; closing new connections";
                        counters.warn_limit("refused", name, limits.max_connections, what);
                        continue;
                    }
                }
            } else {
                None
            };
            t.insert(
                id,
                Entry {
                    state: state.clone(),
                    task: None,
                },
            );
            evicted
        };
        if let Some(entry) = evicted {
            counters.evicted.fetch_add(1, Ordering::Relaxed);
            let what = "closing the oldest idle connections";
            counters.warn_limit("evicted", name, limits.max_connections, what);
            if let Some(task) = entry.task {
                task.abort();
                // Let the runtime drop the aborted task (and close its
                // socket) before the next accept: under a flood of new
                // connections the accept loop stays ready, and evicted
                // sockets must not pile up past the cap meanwhile.
                tokio::task::yield_now().await;
            }
        }
        let task = tokio::spawn(connection(
            io,
            app.clone(),
            limits,
            counters.clone(),
            state,
            Leave(table.clone(), id),
        ));
        if let Some(entry) = table.lock().get_mut(&id) {
            entry.task = Some(task.abort_handle());
        }
    }
    let all: Vec<Entry> = std::mem::take(&mut *table.lock()).into_values().collect();
    for task in all.into_iter().filter_map(|e| e.task) {
        task.abort();
    }
}

/// Serves one connection; `_leave` drops its table entry when it ends.
async fn connection<I: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: I,
    app: Router,
    limits: ConnLimits,
    counters: Arc<ConnCounters>,
    state: Arc<ConnState>,
    _leave: Leave,
) {
    let inner = TowerToHyperService::new(app);
    let service = hyper::service::service_fn(move |req| {
        let busy = Busy::enter(&state);
        let answer = hyper::service::Service::call(&inner, req);
        async move {
            let answer = answer.await;
            drop(busy);
            answer
        }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(MAX_HEADER_BUF)
        .max_headers(MAX_HEADERS);
    if let Err(e) = builder.serve_connection(TokioIo::new(io), service).await {
        if e.is_timeout() {
            counters.header_timeouts.fetch_add(1, Ordering::Relaxed);
        } else {
            tracing::debug!(error = %e, "connection ended with an error");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bursts_are_logged_once() {
        let log = BurstLog::default();
        assert_eq!(log.should_log("a"), Some(0));
        assert_eq!(log.should_log("a"), None);
        assert_eq!(log.should_log("b"), Some(0));
        log.last
            .lock()
            .insert("a", (Instant::now() - BURST_QUIET * 2, 5));
        assert_eq!(log.should_log("a"), Some(5));
    }

    #[test]
    fn idle_never_served_connections_are_evicted_first() {
        let entry = |busy: usize, served: u64| Entry {
            state: Arc::new(ConnState {
                busy: AtomicUsize::new(busy),
                served: AtomicU64::new(served),
            }),
            task: Some(
                tokio::runtime::Builder::new_current_thread()
                    .build()
                    .map(|rt| rt.spawn(async {}).abort_handle())
                    .unwrap_or_else(|e| panic!("runtime: {e}")),
            ),
        };
        let mut t = BTreeMap::new();
        t.insert(1, entry(1, 0));
        t.insert(2, entry(0, 3));
        t.insert(3, entry(0, 0));
        assert_eq!(victim(&t), Some(3));
        t.remove(&3);
        assert_eq!(victim(&t), Some(2));
        t.remove(&2);
        assert_eq!(victim(&t), None);
    }

    /// Yields `errors` accept errors (as an exhausted file table would),
    /// then the connections of a real listener.
    struct Flaky {
        errors: usize,
        listener: tokio::net::TcpListener,
    }

    impl Acceptor for Flaky {
        type Io = tokio::net::TcpStream;

        async fn accept(&mut self) -> std::io::Result<Self::Io> {
            if self.errors > 0 {
                self.errors -= 1;
                return Err(std::io::Error::from_raw_os_error(24)); // EMFILE
            }
            tokio::net::TcpListener::accept(&self.listener)
                .await
                .map(|(s, _)| s)
        }
    }

    #[test]
    fn accept_errors_are_survived() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .unwrap_or_else(|e| panic!("bind: {e}"));
            let addr = listener
                .local_addr()
                .unwrap_or_else(|e| panic!("addr: {e}"));
            let counters = Arc::new(ConnCounters::default());
            let app = Router::new().route("/x", axum::routing::get(|| async { "ok" }));
            let (stop, stopped) = oneshot::channel();
            let limits = ConnLimits {
                max_connections: 4,
                header_timeout: Duration::from_secs(5),
            };
            let server = tokio::spawn(serve(
                Flaky {
                    errors: 5,
                    listener,
                },
                app,
                limits,
                counters.clone(),
                "test",
                stopped,
            ));
            let answer = tokio::task::spawn_blocking(move || {
                agent(Duration::from_secs(10))
                    .get(&format!("http://{addr}/x"))
                    .call()
                    .map(|r| r.status().as_u16())
            })
            .await
            .unwrap_or_else(|e| panic!("join: {e}"));
            assert_eq!(answer.ok(), Some(200));
            assert_eq!(counters.accept_errors.load(Ordering::Relaxed), 5);
            let _ = stop.send(());
            server.await.unwrap_or_else(|e| panic!("join: {e}"));
        });
    }
}

/// An HTTP server (`serve`) running on a thread and runtime of its own,
/// stopped and joined on [`ServerThread::stop`] or drop.
#[derive(Debug)]
pub(crate) struct ServerThread {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ServerThread {
    /// Serves `app` on `listener` (non-blocking) on a thread named
    /// `kvb-{name}`, with `background` running beside it until it stops.
    pub(crate) fn spawn(
        name: &'static str,
        listener: std::net::TcpListener,
        app: Router,
        limits: ConnLimits,
        counters: Arc<ConnCounters>,
        background: Option<std::pin::Pin<Box<dyn Future<Output = ()> + Send>>>,
    ) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("kvb-{name}"))
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, server = name, "cannot listen");
                            return;
                        }
                    };
                    let background = background.map(tokio::spawn);
                    serve(listener, app, limits, counters, name, stopped).await;
                    if let Some(task) = background {
                        task.abort();
                    }
                });
            })?;
        Ok(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Stops serving (every connection closed) and joins the thread.
    pub(crate) fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for ServerThread {
    fn drop(&mut self) {
        self.stop();
    }
}
