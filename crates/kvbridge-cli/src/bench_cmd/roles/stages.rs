//! `bench roles --stages`: where a room's latency goes. A `tracing` layer
//! records when each room reaches each of the roles' stages
//! ([`kvbridge_roles::stage`]); the report is the median and p90 time
//! between consecutive stages over the timed rooms, ending with the lag
//! until the driving thread noticed the room's conclusion.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use kvbridge_roles::stage::{Stage, TARGET};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

use kvbridge_lab::demo::summary::percentile;

/// When one room reached each stage (the first time), and when the
/// driving thread noticed it concluded.
#[derive(Debug, Default, Clone, Copy)]
struct Marks {
    at: [Option<Instant>; Stage::ALL.len()],
    noticed: Option<Instant>,
}

/// Every room's marks since the last [`clear`].
fn rooms() -> MutexGuard<'static, HashMap<u64, Marks>> {
    static ROOMS: OnceLock<Mutex<HashMap<u64, Marks>>> = OnceLock::new();
    // A panic while recording leaves nothing half-written: keep going.
    ROOMS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Whether the layer was made (the driving thread's marks are kept then).
static ON: AtomicBool = AtomicBool::new(false);

/// The layer that records stage events (installed only for `--stages`).
pub(crate) fn layer<S>() -> impl Layer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    ON.store(true, Ordering::Relaxed);
    StageLayer.with_filter(tracing_subscriber::filter::filter_fn(|m| {
        m.target() == TARGET
    }))
}

struct StageLayer;

/// The `room` and `stage` fields of a stage event.
#[derive(Default)]
struct Fields {
    room: Option<u64>,
    stage: Option<Stage>,
}

impl Visit for Fields {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "room" {
            self.room = Some(value);
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "stage" {
            self.stage = Stage::from_name(value);
        }
    }

    fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber> Layer<S> for StageLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let now = Instant::now();
        let mut fields = Fields::default();
        event.record(&mut fields);
        let (Some(room), Some(stage)) = (fields.room, fields.stage) else {
            return;
        };
        let mut rooms = rooms();
        let at = &mut rooms.entry(room).or_default().at[stage as usize];
        at.get_or_insert(now);
    }
}

/// Forgets every room's marks (room numbers repeat from one size to the next).
pub(super) fn clear() {
    rooms().clear();
}

/// Records that the driving thread noticed `room` concluded.
pub(super) fn noticed(room: u64) {
    if !ON.load(Ordering::Relaxed) {
        return;
    }
    let now = Instant::now();
    rooms().entry(room).or_default().noticed.get_or_insert(now);
}

/// The time between two consecutive stages, over the timed rooms.
#[derive(Debug, serde::Serialize)]
pub(super) struct StageGap {
    from: &'static str,
    to: &'static str,
    p50_us: f64,
    p90_us: f64,
    /// Rooms that reached both stages.
    rooms: usize,
}

/// The gaps between consecutive stages of rooms in `timed`: first the
/// destinations' way to the prefill (ahead of the room's send), then a
/// room's way from its send to its noticed conclusion.
pub(super) fn gaps(timed: std::ops::Range<u64>) -> Vec<StageGap> {
    let rooms = rooms();
    let marks: Vec<&Marks> = rooms
        .iter()
        .filter(|(room, _)| timed.contains(room))
        .map(|(_, m)| m)
        .collect();
    let path = [
        (Stage::DestSent, Stage::DestKnown),
        (Stage::Queued, Stage::Taken),
        (Stage::Taken, Stage::Submitted),
        (Stage::Submitted, Stage::Written),
        (Stage::Written, Stage::Concluded),
        (Stage::Concluded, Stage::StatusIn),
        (Stage::StatusIn, Stage::Seen),
    ];
    let mut out: Vec<StageGap> = path
        .into_iter()
        .map(|(from, to)| {
            gap(
                from.name(),
                to.name(),
                marks
                    .iter()
                    .filter_map(|m| Some((m.at[from as usize]?, m.at[to as usize]?))),
            )
        })
        .collect();
    out.push(gap(
        Stage::Seen.name(),
        "noticed",
        marks
            .iter()
            .filter_map(|m| Some((m.at[Stage::Seen as usize]?, m.noticed?))),
    ));
    out
}

impl std::fmt::Display for StageGap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:>10} → {:<10} p50 {:>8.1} µs  p90 {:>8.1} µs  ({} rooms)",
            self.from, self.to, self.p50_us, self.p90_us, self.rooms
        )
    }
}

/// The p50 and p90 of `to - from` over `pairs` (zero where `to` came first).
fn gap(
    from: &'static str,
    to: &'static str,
    pairs: impl Iterator<Item = (Instant, Instant)>,
) -> StageGap {
    let secs: Vec<f64> = pairs
        .map(|(a, b)| b.saturating_duration_since(a).as_secs_f64())
        .collect();
    StageGap {
        from,
        to,
        p50_us: percentile(&secs, 0.5) * 1e6,
        p90_us: percentile(&secs, 0.9) * 1e6,
        rooms: secs.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn stage_events_of_timed_rooms_become_gaps_in_order() {
        let subscriber = tracing_subscriber::registry().with(layer());
        tracing::subscriber::with_default(subscriber, || {
            clear();
            for room in [7u64, 1_000, 1_001] {
                for stage in Stage::ALL {
                    tracing::trace!(target: TARGET, room, stage = stage.name());
                }
                noticed(room);
            }
            // Another target is not a stage, nor is an unknown stage name.
            tracing::trace!(room = 1_000u64, stage = "queued");
            tracing::trace!(target: TARGET, room = 1_000u64, stage = "later");
        });
        let g = gaps(1_000..1_002);
        let names: Vec<(&str, &str)> = g.iter().map(|g| (g.from, g.to)).collect();
        assert_eq!(names.first(), Some(&("dest_sent", "dest_known")));
        assert_eq!(names.get(1), Some(&("queued", "taken")));
        assert_eq!(names.last(), Some(&("seen", "noticed")));
        assert_eq!(g.len(), 8);
        // Room 7 is outside the timed range: two rooms per gap.
        assert!(g.iter().all(|g| g.rooms == 2), "{g:?}");
        assert!(g.iter().all(|g| g.p50_us >= 0.0 && g.p90_us >= g.p50_us));
        clear();
        assert!(gaps(0..u64::MAX).iter().all(|g| g.rooms == 0));
    }
}
