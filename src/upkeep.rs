//! Index upkeep that must not depend on traffic.
//!
//! When the index replaces a holder table (it grew or shrank) or a wide record, the old one is
//! retired, not freed: a query running at that moment may still read it. The writer that retired
//! it tries to free it straight away, but a query pinned at that instant holds it back, and if no
//! further write comes (an idle model, a quiet night) nothing would ever free it. This task frees
//! whatever is still retired on a fixed period, so retired memory lasts at most about one period
//! after the last query that could read it ends, even on an idle process.

use std::time::Duration;

use kv_epp_core::index::holders::{reclaim_retired, retired_tables};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

/// How often retired tables are looked for.
pub const RECLAIM_PERIOD: Duration = Duration::from_millis(500);

/// Frees retired index tables every `period` until `stop` turns true, and keeps `gauge` at the
/// number still retired. Reclaiming runs on the blocking pool: it may yield a few times while a
/// query that could still read a table finishes.
pub async fn reclaim(period: Duration, gauge: Gauge, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        if retired_tables() > 0 {
            // A panic there would be a bug in the index; the next tick tries again.
            let _ = tokio::task::spawn_blocking(reclaim_retired).await;
        }
        gauge.set(i64::try_from(retired_tables()).unwrap_or(i64::MAX));
    }
}
