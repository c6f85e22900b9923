//! The API's limits, in one place (docs/openapi.json and docs/SERVER.md state them too).

use std::time::Duration;

/// Time a request head (and then its body) may take to arrive, and a kept-alive
/// connection may idle between requests (408 for a body, a closed connection for a head).
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(10);
/// A connection that moves no byte for this long, with no request of it in a handler, is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest a request may take in all, its handler included (503 past it): longer than
/// any merge of a promotion should take, short enough that a stuck store is noticed.
pub const HANDLER_TIMEOUT: Duration = Duration::from_secs(600);
/// Requests in handlers at once, all connections together (more wait their turn).
pub const MAX_IN_FLIGHT: usize = 256;
/// Largest request body.
pub const MAX_BODY: usize = 1 << 20;
/// Largest agent report (`PUT /api/v1/targets/{id}/agent`).
pub const MAX_AGENT_REPORT: usize = 64 << 10;
/// Largest request head (request line and header fields).
pub const MAX_HEAD: usize = 16 << 10;
/// Most header fields in a request.
pub const MAX_HEADERS: usize = 64;

/// How many connections the API keeps open at most: a quarter of the soft limit on open
/// files (the rest is for the NBD side and the store's files), between 64 and 16,384.
pub fn connection_limit() -> usize {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into `rl`, a live local of the right type.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0 {
        rl.rlim_cur
    } else {
        1024
    };
    let soft = usize::try_from(soft).unwrap_or(usize::MAX);
    (soft / 4).clamp(64, 16_384)
}

/// Event streams (`GET /api/v1/events`, events.rs) open at most; 503 past it.
pub const MAX_EVENT_STREAMS: usize = 64;
/// Event streams one caller (a token, a client certificate, the local users of an open
/// API) may hold at once; 429 past it. The rest are kept for the others: one read-only
/// token cannot take the administrator's console's place.
pub const MAX_EVENT_STREAMS_PER_CALLER: usize = 8;
