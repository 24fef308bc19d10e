//! The bootstrap HTTP server: where decode ranks find prefill ranks.
//!
//! Routes and JSON follow sglang 0.5.23's `CommonKVBootstrapServer` field for
//! field ([`state`] holds the logic); bodies are parsed as JSON whatever
//! their `Content-Type`, and bad input gets a 4xx with a reason.

pub mod state;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use kvbridge_wire::bootstrap::{QueryDpRanks, RegisterDpRank, RouteRegistration};
use parking_lot::Mutex;
use tokio::sync::oneshot;

pub use state::{Answer, BootstrapState};

/// How often expired `register_dp_rank` entries are dropped, and their age
/// limit (`SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL`).
pub const DEFAULT_ENTRY_CLEANUP_INTERVAL: Duration = Duration::from_secs(120);

type Shared = Arc<Mutex<BootstrapState>>;

/// A running bootstrap server; stops when [`BootstrapServer::shutdown`] is
/// called or the value is dropped.
#[derive(Debug)]
pub struct BootstrapServer {
    addr: SocketAddr,
    state: Shared,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl BootstrapServer {
    /// Binds `addr` (port 0 picks a free port) and serves on a thread of its own.
    pub fn start(addr: SocketAddr, cleanup_interval: Duration) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let state: Shared = Arc::new(Mutex::new(BootstrapState::new()));
        let (stop, stopped) = oneshot::channel::<()>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()?;
        let app = router(state.clone());
        let cleanup_state = state.clone();
        let thread = std::thread::Builder::new()
            .name("kvb-bootstrap".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, "bootstrap server cannot listen");
                            return;
                        }
                    };
                    let cleanup = tokio::spawn(async move {
                        let mut tick = tokio::time::interval(cleanup_interval);
                        tick.tick().await;
                        loop {
                            tick.tick().await;
                            let n = cleanup_state
                                .lock()
                                .cleanup(Instant::now(), cleanup_interval);
                            if n > 0 {
                                tracing::debug!(expired = n, "dropped expired dp-rank entries");
                            }
                        }
                    });
                    let served = axum::serve(listener, app)
                        .with_graceful_shutdown(async {
                            let _ = stopped.await;
                        })
                        .await;
                    cleanup.abort();
                    if let Err(e) = served {
                        tracing::error!(error = %e, "bootstrap server stopped with an error");
                    }
                });
            })?;
        tracing::info!(%addr, "bootstrap server listening");
        Ok(Self {
            addr,
            state,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The address the server accepts connections on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether every expected prefill rank has registered.
    pub fn is_ready(&self) -> bool {
        self.state.lock().is_ready()
    }

    /// Stops serving and waits for the server thread.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

fn router(state: Shared) -> Router {
    Router::new()
        .route("/route", any(route))
        .route("/register_dp_rank", post(register_dp_rank))
        .route("/query_dp_ranks", post(query_dp_ranks))
        .route("/health", get(|| async { "OK" }))
        .with_state(state)
}

fn respond(answer: Answer) -> Response {
    match answer {
        Answer::Json(value) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json; charset=utf-8")],
            value.to_string(),
        )
            .into_response(),
        Answer::Text(code, text) => (
            StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            text,
        )
            .into_response(),
    }
}

fn bad_request(what: &str, error: &serde_json::Error) -> Response {
    respond(Answer::Text(400, format!("invalid {what} body: {error}")))
}

async fn route(
    method: Method,
    State(state): State<Shared>,
    Query(params): Query<HashMap<String, String>>,
    body: Bytes,
) -> Response {
    match method {
        Method::PUT => match serde_json::from_slice::<RouteRegistration>(&body) {
            Ok(reg) => respond(state.lock().put_route(reg)),
            Err(e) => bad_request("/route registration", &e),
        },
        Method::GET => respond(state.lock().get_route(&params)),
        _ => respond(Answer::Text(405, "Method not allowed".to_owned())),
    }
}

async fn register_dp_rank(State(state): State<Shared>, body: Bytes) -> Response {
    match serde_json::from_slice::<RegisterDpRank>(&body) {
        Ok(r) => respond(state.lock().register_dp_rank(
            r.bootstrap_room,
            r.dp_rank,
            Instant::now(),
        )),
        Err(e) => bad_request("/register_dp_rank", &e),
    }
}

async fn query_dp_ranks(State(state): State<Shared>, body: Bytes) -> Response {
    match serde_json::from_slice::<QueryDpRanks>(&body) {
        Ok(q) => respond(state.lock().query_dp_ranks(&q.bootstrap_rooms)),
        Err(e) => bad_request("/query_dp_ranks", &e),
    }
}
