//! The bootstrap HTTP server: where decode ranks find prefill ranks.
//!
//! Routes and JSON follow sglang 0.5.23's `CommonKVBootstrapServer` field for
//! field ([`state`] holds the logic); bodies are parsed as JSON whatever
//! their `Content-Type`, and bad input gets a 4xx with a reason.

//!
//! Trust boundary (docs/roles.md, "Bootstrap trust boundary"): reads
//! (`GET /route`, `GET /health`, `POST /query_dp_ranks`) are open, as stock
//! sglang decode ranks need; with a cluster secret every write (`PUT
//! /route`, `POST /register_dp_rank`) must be signed ([`auth`]). Values are
//! range-checked, a live prefill's slot is never silently re-pointed, and
//! connections, header time, body time and body size are bounded
//! ([`BootstrapLimits`]). Every refusal is counted ([`BootstrapStats`]).

pub mod auth;
pub mod client;
mod guard;
pub mod state;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use kvbridge_engine::ClusterSecret;
use kvbridge_wire::bootstrap::{PrefillRankInfo, QueryDpRanks, RegisterDpRank, RouteRegistration};
use parking_lot::Mutex;

use crate::http::{ConnLimits, ServerThread};
use auth::{
    AUTH_HEADER, AuthError, BODY_HEADER, NONCE_HEADER, Presented, ReplayGuard, SERVER_HEADER,
    TIME_HEADER, WriteAuth, unix_now,
};
use guard::Guard;
pub use guard::{
    BootstrapLimits, BootstrapStats, DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_DP_RANK_ENTRIES,
    DEFAULT_MAX_PENDING_BODIES, Refusal,
};
pub use state::{Answer, BootstrapState, Replace};

/// How often expired `register_dp_rank` entries are dropped, and their age
/// limit (`SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL`).
pub const DEFAULT_ENTRY_CLEANUP_INTERVAL: Duration = Duration::from_secs(120);

/// The DP-rank entries' cleanup interval from
/// `SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL` (whole seconds;
/// unset or malformed: [`DEFAULT_ENTRY_CLEANUP_INTERVAL`]).
pub fn entry_cleanup_interval(get: crate::config::Vars<'_>) -> Duration {
    get("SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL")
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_ENTRY_CLEANUP_INTERVAL, Duration::from_secs)
}
/// How long the server waits to learn whether a slot's old prefill is still
/// alive (open mode) before letting a new address replace it.
pub const REPLACE_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// A bootstrap server's settings.
#[derive(Debug, Clone, Default)]
pub struct BootstrapConfig {
    /// The cluster secret: when set, every write must be signed with it
    /// ([`auth`]); `None` is sglang-compatible open mode.
    pub secret: Option<ClusterSecret>,
    /// Cleanup period and age limit of `register_dp_rank` entries
    /// (zero: [`DEFAULT_ENTRY_CLEANUP_INTERVAL`]).
    pub cleanup_interval: Duration,
    /// Connection, time and size limits.
    pub limits: BootstrapLimits,
}

impl BootstrapConfig {
    /// Open mode with the given cleanup interval and default limits.
    pub fn open(cleanup_interval: Duration) -> Self {
        Self {
            cleanup_interval,
            ..Self::default()
        }
    }

    /// Secret mode (signed writes) with default cleanup and limits.
    pub fn with_secret(secret: ClusterSecret) -> Self {
        Self {
            secret: Some(secret),
            ..Self::default()
        }
    }
}

/// What the handlers share.
#[derive(Debug)]
struct Ctx {
    state: Mutex<BootstrapState>,
    /// This instance's id, on every answer; signed writes must name it.
    server_id: String,
    /// Permits for request bodies being read.
    bodies: tokio::sync::Semaphore,
    auth: Option<WriteAuth>,
    replay: Mutex<ReplayGuard>,
    guard: Guard,
    limits: BootstrapLimits,
}

type Shared = Arc<Ctx>;

/// A running bootstrap server; stops when [`BootstrapServer::shutdown`] is
/// called or the value is dropped.
#[derive(Debug)]
pub struct BootstrapServer {
    addr: SocketAddr,
    ctx: Shared,
    server: ServerThread,
}

impl BootstrapServer {
    /// Binds `addr` (port 0 picks a free port) and serves in open mode with
    /// default limits on a thread of its own.
    pub fn start(addr: SocketAddr, cleanup_interval: Duration) -> std::io::Result<Self> {
        Self::start_with(addr, BootstrapConfig::open(cleanup_interval))
    }

    /// Binds `addr` (port 0 picks a free port) and serves with `config` on a
    /// thread of its own. Open mode (no secret) is the caller's to announce
    /// (`kvbridge bootstrap` does, after its `listening on` line).
    pub fn start_with(addr: SocketAddr, config: BootstrapConfig) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let cleanup_interval = if config.cleanup_interval.is_zero() {
            DEFAULT_ENTRY_CLEANUP_INTERVAL
        } else {
            config.cleanup_interval
        };
        let limits = config.limits;
        let ctx: Shared = Arc::new(Ctx {
            state: Mutex::new(BootstrapState::with_dp_rank_capacity(
                limits.max_dp_rank_entries,
            )),
            server_id: auth::new_server_id(),
            bodies: tokio::sync::Semaphore::new(limits.max_pending_bodies.max(1)),
            auth: config.secret.as_ref().map(WriteAuth::new),
            replay: Mutex::new(ReplayGuard::default()),
            guard: Guard::default(),
            limits,
        });
        let cleanup_state = ctx.clone();
        let cleanup = async move {
            let mut tick = tokio::time::interval(cleanup_interval);
            tick.tick().await;
            loop {
                tick.tick().await;
                let n = cleanup_state
                    .state
                    .lock()
                    .cleanup(Instant::now(), cleanup_interval);
                if n > 0 {
                    tracing::debug!(expired = n, "dropped expired dp-rank entries");
                }
            }
        };
        let conn_limits = ConnLimits {
            max_connections: limits.max_connections,
            header_timeout: limits.header_timeout,
        };
        let server = ServerThread::spawn(
            "bootstrap",
            listener,
            router(ctx.clone()),
            conn_limits,
            ctx.guard.conn.clone(),
            Some(Box::pin(cleanup)),
        )?;
        tracing::info!(%addr, "bootstrap server listening");
        Ok(Self { addr, ctx, server })
    }

    /// The address the server accepts connections on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// This instance's id (random per start), which every answer carries
    /// in `X-Kvbridge-Server` and every signed write must name.
    pub fn instance_id(&self) -> &str {
        &self.ctx.server_id
    }

    /// Whether every expected prefill rank has registered.
    pub fn is_ready(&self) -> bool {
        self.ctx.state.lock().is_ready()
    }

    /// What the server refused and replaced so far.
    pub fn stats(&self) -> BootstrapStats {
        let replaced = self.ctx.state.lock().replaced_count();
        self.ctx.guard.stats(replaced)
    }

    /// Stops serving and waits for the server thread.
    pub fn shutdown(mut self) {
        self.server.stop();
    }
}

fn router(ctx: Shared) -> Router {
    Router::new()
        .route("/route", any(route))
        .route("/register_dp_rank", post(register_dp_rank))
        .route("/query_dp_ranks", post(query_dp_ranks))
        .route("/health", get(|| async { "OK" }))
        .layer(axum::middleware::map_response_with_state(
            ctx.clone(),
            announce_server,
        ))
        .with_state(ctx)
}

/// Every answer names this server instance (what signed writes must name).
async fn announce_server(State(ctx): State<Shared>, mut response: Response) -> Response {
    if let Ok(id) = header::HeaderValue::from_str(&ctx.server_id) {
        response.headers_mut().insert(SERVER_HEADER, id);
    }
    response
}

/// A refusal answered before the body is read: the connection closes after
/// it, so the unread body is never waited for.
fn refuse_unread(ctx: &Ctx, cause: Refusal, code: u16, route: &str, reason: String) -> Response {
    let mut response = refuse(ctx, cause, code, route, reason);
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
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

/// Counts and logs a refusal, and answers it.
fn refuse(ctx: &Ctx, cause: Refusal, code: u16, route: &str, reason: String) -> Response {
    ctx.guard.refuse(cause, route, &reason);
    respond(Answer::Text(code, reason))
}

/// Answers a state answer, counting it when it is a refusal.
fn finish(ctx: &Ctx, route: &str, answer: Answer) -> Response {
    if let (Answer::Text(code, reason), Some(cause)) =
        (&answer, Refusal::from_status(answer.status()))
    {
        ctx.guard.refuse(cause, route, reason);
        tracing::debug!(code, route, "refused by the bootstrap state");
    }
    respond(answer)
}

/// The body within the size and time limits.
async fn read_body(ctx: &Ctx, route: &str, body: Body) -> Result<Bytes, Response> {
    let Ok(_permit) = ctx.bodies.try_acquire() else {
        return Err(refuse_unread(
            ctx,
            Refusal::Full,
            503,
            route,
            format!(
                "{} request bodies are being read already; retry later",
                ctx.limits.max_pending_bodies
            ),
        ));
    };
    let limited = Limited::new(body, ctx.limits.max_body_bytes);
    match tokio::time::timeout(ctx.limits.body_timeout, limited.collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => Err(refuse(
            ctx,
            Refusal::BodyTooLarge,
            413,
            route,
            format!("body longer than {} bytes", ctx.limits.max_body_bytes),
        )),
        Ok(Err(e)) => Err(refuse(
            ctx,
            Refusal::Invalid,
            400,
            route,
            format!("cannot read the body: {e}"),
        )),
        Err(_) => Err(refuse(
            ctx,
            Refusal::BodyTimeout,
            408,
            route,
            format!("body not received within {:?}", ctx.limits.body_timeout),
        )),
    }
}

/// A write's body, read within the limits. In secret mode its signed head
/// is checked first (a stranger's write is refused before a byte of its
/// body is read), then the body against the head and the replay memory.
async fn admit_write(
    ctx: &Ctx,
    route: &str,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Body,
) -> Result<Bytes, Response> {
    let head = match &ctx.auth {
        None => None,
        Some(auth) => {
            let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
            let presented = Presented {
                server: header(SERVER_HEADER),
                time: header(TIME_HEADER),
                nonce: header(NONCE_HEADER),
                body_sha256: header(BODY_HEADER),
                auth: header(AUTH_HEADER),
            };
            let target = uri.path_and_query().map_or(uri.path(), |pq| pq.as_str());
            match auth.verify_head(
                &ctx.server_id,
                method.as_str(),
                target,
                &presented,
                unix_now(),
            ) {
                Ok(head) => Some(head),
                Err(e) => {
                    return Err(refuse_unread(
                        ctx,
                        Refusal::Unauthorized,
                        401,
                        route,
                        e.to_string(),
                    ));
                }
            }
        }
    };
    let bytes = read_body(ctx, route, body).await?;
    let Some(head) = head else {
        return Ok(bytes);
    };
    let checked = head
        .check_body(&bytes)
        .and_then(|()| ctx.replay.lock().admit(head.tag, head.sent, unix_now()));
    match checked {
        Ok(()) => Ok(bytes),
        Err(AuthError::Busy) => Err(refuse(
            ctx,
            Refusal::Full,
            503,
            route,
            AuthError::Busy.to_string(),
        )),
        Err(e) => Err(refuse(
            ctx,
            Refusal::Unauthorized,
            401,
            route,
            e.to_string(),
        )),
    }
}

/// Whether something accepts TCP connections at a slot's registered address.
async fn endpoint_alive(info: &PrefillRankInfo) -> bool {
    let host = info
        .rank_ip
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let connect = tokio::net::TcpStream::connect((host, info.rank_port));
    matches!(
        tokio::time::timeout(REPLACE_PROBE_TIMEOUT, connect).await,
        Ok(Ok(_))
    )
}

async fn route(
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    State(ctx): State<Shared>,
    Query(params): Query<HashMap<String, String>>,
    body: Body,
) -> Response {
    match method {
        Method::PUT => match put_route(&ctx, &method, &uri, &headers, body).await {
            Ok(r) | Err(r) => r,
        },
        Method::GET => respond(ctx.state.lock().get_route(&params)),
        _ => respond(Answer::Text(405, "Method not allowed".to_owned())),
    }
}

/// `PUT /route`. An occupied slot with another address is replaced when the
/// write is signed (secret mode: a restart), or in open mode when nothing
/// answers at the old address any more; otherwise it is a 409.
async fn put_route(
    ctx: &Ctx,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, Response> {
    const ROUTE: &str = "PUT /route";
    let bytes = admit_write(ctx, ROUTE, method, uri, headers, body).await?;
    let reg = serde_json::from_slice::<RouteRegistration>(&bytes).map_err(|e| {
        refuse(
            ctx,
            Refusal::Invalid,
            400,
            ROUTE,
            format!("invalid /route registration body: {e}"),
        )
    })?;
    let occupant = match reg.validate() {
        Ok(()) => ctx.state.lock().occupant(&reg),
        Err(_) => None,
    };
    let replace = match occupant {
        None => Replace::Refuse,
        Some(old) if ctx.auth.is_some() => Replace::From(old),
        Some(old) if endpoint_alive(&old).await => Replace::Refuse,
        Some(old) => Replace::From(old),
    };
    let answer = ctx.state.lock().put_route(reg, replace);
    Ok(finish(ctx, ROUTE, answer))
}

async fn register_dp_rank(
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    State(ctx): State<Shared>,
    body: Body,
) -> Response {
    const ROUTE: &str = "POST /register_dp_rank";
    let bytes = match admit_write(&ctx, ROUTE, &method, &uri, &headers, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    match serde_json::from_slice::<RegisterDpRank>(&bytes) {
        Ok(r) => {
            let answer =
                ctx.state
                    .lock()
                    .register_dp_rank(r.bootstrap_room, r.dp_rank, Instant::now());
            finish(&ctx, ROUTE, answer)
        }
        Err(e) => refuse(
            &ctx,
            Refusal::Invalid,
            400,
            ROUTE,
            format!("invalid /register_dp_rank body: {e}"),
        ),
    }
}

async fn query_dp_ranks(State(ctx): State<Shared>, body: Body) -> Response {
    const ROUTE: &str = "POST /query_dp_ranks";
    let bytes = match read_body(&ctx, ROUTE, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    match serde_json::from_slice::<QueryDpRanks>(&bytes) {
        Ok(q) => respond(ctx.state.lock().query_dp_ranks(&q.bootstrap_rooms)),
        Err(e) => refuse(
            &ctx,
            Refusal::Invalid,
            400,
            ROUTE,
            format!("invalid /query_dp_ranks body: {e}"),
        ),
    }
}
