//! Engine-reported load: scraping each worker's Prometheus `/metrics` (vLLM names) on an interval
//! and handing fresh figures to the scorer.
//!
//! Read: `vllm:num_requests_running`, `vllm:num_requests_waiting` (summed over series) and
//! `vllm:kv_cache_usage_perc` (older name `vllm:gpu_cache_usage_perc`; the largest series).
//! Staleness: figures older than `stale_after` are withdrawn, and the scorer falls back on
//! kv-epp's own in-flight count for that worker (a stale figure is never trusted, in either
//! direction).

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::StatusCode;

use crate::httpc;
use crate::router::WorkerRuntime;
use crate::scoring::EngineLoad;

/// Largest metrics page read.
const MAX_PAGE: usize = 4 << 20;

/// Parses the figures the scorer uses from a Prometheus text page.
pub fn parse(text: &str) -> Option<EngineLoad> {
    let mut running = None::<f64>;
    let mut waiting = None::<f64>;
    let mut usage = None::<f64>;
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        let Some(value) = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())
        else {
            continue;
        };
        match name {
            "vllm:num_requests_running" => *running.get_or_insert(0.0) += value,
            "vllm:num_requests_waiting" => *waiting.get_or_insert(0.0) += value,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                usage = Some(usage.map_or(value, |u: f64| u.max(value)));
            }
            _ => {}
        }
    }
    if running.is_none() && waiting.is_none() && usage.is_none() {
        return None;
    }
    Some(EngineLoad {
        running: running.unwrap_or(0.0),
        waiting: waiting.unwrap_or(0.0),
        kv_usage: usage.unwrap_or(0.0).clamp(0.0, 1.0),
    })
}

/// Scrapes one worker until the task is aborted.
pub async fn scrape(worker: Arc<WorkerRuntime>, interval: Duration, stale_after: Duration) {
    let mut last_ok = None::<Instant>;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let limits = httpc::Limits {
            deadline: interval.max(Duration::from_millis(200)),
            max_body: MAX_PAGE,
        };
        let load = match httpc::get(worker.id.endpoint, "/metrics", limits).await {
            Ok(r) if r.status() == StatusCode::OK => parse(&String::from_utf8_lossy(r.body())),
            _ => None,
        };
        match load {
            Some(l) => {
                last_ok = Some(Instant::now());
                worker.set_engine_load(Some(l));
            }
            None if last_ok.is_none_or(|t| t.elapsed() > stale_after) => {
                worker.set_engine_load(None);
            }
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_names_and_ignores_the_rest() {
        let page = r#"# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 12.0
other_metric 99
"#;
        assert_eq!(
            parse(page),
            Some(EngineLoad {
                running: 4.0,
                waiting: 7.0,
                kv_usage: 0.5
            })
        );
        assert_eq!(
            parse("vllm:gpu_cache_usage_perc 0.9\n"),
            Some(EngineLoad {
                running: 0.0,
                waiting: 0.0,
                kv_usage: 0.9
            })
        );
        assert_eq!(parse("garbage\nvllm:num_requests_running NaN\n"), None);
    }
}
