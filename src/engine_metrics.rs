//! Engine-reported load: scraping each worker's Prometheus `/metrics` (vLLM names) on an interval
//! and handing fresh figures to the scorer.
//!
//! Read: `vllm:num_requests_running`, `vllm:num_requests_waiting` (summed over distinct series)
//! and `vllm:kv_cache_usage_perc` (older name `vllm:gpu_cache_usage_perc`; the largest series).
//! The page is untrusted: capped at 4 MiB by the scrape, then parsed in one pass by the
//! small text-format reader below (why not a crate: see `parse`).
//! Staleness: figures older than `stale_after` are withdrawn, and the scorer falls back on
//! kv-epp's own in-flight count for that worker (a stale figure is never trusted, in either
//! direction).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::httpc;
use crate::workers::WorkerRuntime;
use kv_epp_core::scoring::EngineLoad;

/// Largest metrics page read (vLLM's is a few tens of KiB).
const MAX_PAGE: usize = 4 << 20;

/// Most requests a running or waiting figure may say; each sample is clamped to
/// `0..=MAX_REQUESTS` and so is the sum. Far above any engine's queue, and small enough that the
/// scorer's `running + waiting` and `queue / (queue + scale)` stay finite: an unclamped sum of
/// finite samples (two series at 1e308) was infinite, and the cost NaN.
const MAX_REQUESTS: f64 = 1e9;

/// Parses the figures the scorer uses from a Prometheus text page.
///
/// The page is untrusted and already capped in size by the scrape; parsing is one pass over it,
/// borrows every name and label set from it, and keeps only the series keys of the two summed
/// families (to count a repeated series once, the first sample, as Prometheus ingests it). Lines
/// that do not parse, and NaN or infinite values, are skipped; request counts are clamped to
/// `0..=MAX_REQUESTS`.
///
/// Why not a parser crate: `prometheus-parse` (the Apache-licensed one) matches metric names with
/// `\w+`, so it drops every `vllm:` name, and splits labels on `,` and `=` ignoring quotes;
/// `openmetrics-parser` is LGPL-3.0; the others are single releases left unmaintained. The text
/// format's sample line is simple enough that this reader, fuzzed by the tests below and by the
/// `engine_metrics` fuzz target, is safer.
pub(crate) fn parse(text: &str) -> Option<EngineLoad> {
    let mut running = None::<f64>;
    let mut waiting = None::<f64>;
    let mut usage = None::<f64>;
    let mut seen = HashSet::new();
    for line in text.lines() {
        let Some(sample) = Sample::parse(line) else {
            continue;
        };
        let sum = match sample.name {
            "vllm:num_requests_running" => &mut running,
            "vllm:num_requests_waiting" => &mut waiting,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                usage = Some(usage.map_or(sample.value, |u: f64| u.max(sample.value)));
                continue;
            }
            _ => continue,
        };
        if seen.insert((sample.name, sample.labels)) {
            let sum = sum.get_or_insert(0.0);
            *sum = (*sum + sample.value.clamp(0.0, MAX_REQUESTS)).min(MAX_REQUESTS);
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

/// One sample line of the text format: `name[{labels}] value [timestamp]`.
struct Sample<'a> {
    name: &'a str,
    /// The label block as written (between the braces); series identity for de-duplication.
    labels: &'a str,
    value: f64,
}

impl<'a> Sample<'a> {
    /// `None` for comments, blank lines, anything malformed, and non-finite values.
    fn parse(line: &'a str) -> Option<Self> {
        let line = line.trim_start();
        if line.starts_with('#') {
            return None;
        }
        let name_end = line.find(|c: char| c == '{' || c.is_ascii_whitespace())?;
        let (name, rest) = line.split_at(name_end);
        let (labels, rest) = match rest.strip_prefix('{') {
            Some(block) => {
                let end = label_block_end(block)?;
                (&block[..end], &block[end + 1..])
            }
            None => ("", rest),
        };
        // The value is the first field after the name and labels; a timestamp may follow.
        let value = rest.split_ascii_whitespace().next()?.parse::<f64>().ok()?;
        (!name.is_empty() && value.is_finite()).then_some(Sample {
            name,
            labels,
            value,
        })
    }
}

/// Index of the `}` closing a label block, skipping braces inside quoted (escaped) values.
fn label_block_end(block: &str) -> Option<usize> {
    let mut in_quotes = false;
    let mut escaped = false;
    for (i, b) in block.bytes().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if in_quotes => escaped = true,
            b'"' => in_quotes = !in_quotes,
            b'}' if !in_quotes => return Some(i),
            _ => {}
        }
    }
    None
}

/// Scrapes one worker until the task is aborted.
pub(crate) async fn scrape(worker: Arc<WorkerRuntime>, interval: Duration, stale_after: Duration) {
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
            Ok(r) if r.status() == httpc::StatusCode::OK => {
                parse(&String::from_utf8_lossy(r.body()))
            }
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

    #[test]
    fn hostile_figures_stay_finite_and_in_range() {
        // Two series near f64::MAX summed to infinity, which made the scorer's cost NaN.
        let page = "vllm:num_requests_running{a=\"1\"} 1e308\n\
                    vllm:num_requests_running{a=\"2\"} 1e308\n\
                    vllm:num_requests_waiting -1e308\n";
        let load = parse(page).unwrap();
        assert_eq!(load.running, MAX_REQUESTS);
        assert_eq!(load.waiting, 0.0);
        assert!((load.running + load.waiting).is_finite());
    }

    fn load(running: f64, waiting: f64, kv_usage: f64) -> Option<EngineLoad> {
        Some(EngineLoad {
            running,
            waiting,
            kv_usage,
        })
    }

    /// A page as vLLM (V1 engine, two data-parallel ranks) serves it, trimmed to the families we
    /// read and a few neighbours whose names share their prefixes.
    #[test]
    fn reads_a_real_vllm_page() {
        let page = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.41
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.125
# HELP vllm:num_requests_waiting_by_reason Requests waiting, by reason.
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 40.0
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 17.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 3.5
"#;
        assert_eq!(parse(page), load(3.0, 5.0, 0.41));
    }

    /// Timestamps follow the value; label values may hold spaces, braces, quotes and escapes.
    #[test]
    fn reads_timestamps_and_awkward_label_values() {
        let page = concat!(
            "vllm:num_requests_running{model_name=\"a } b 99\"} 2 1700000000000\n",
            "vllm:num_requests_waiting{model_name=\"q\\\"}\\\\\",x=\"\"}\t4\n",
            "  vllm:kv_cache_usage_perc 0.5   \n",
        );
        assert_eq!(parse(page), load(2.0, 4.0, 0.5));
    }

    /// The same series twice counts once (the first sample, as Prometheus ingests it), so an
    /// engine repeating its page cannot double its load; distinct series still add up.
    #[test]
    fn a_repeated_series_counts_once() {
        let page = "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3\n\
                    vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 30\n\
                    vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 1\n\
                    vllm:num_requests_running 2\nvllm:num_requests_running 2\n\
                    vllm:gpu_cache_usage_perc 0.2\nvllm:gpu_cache_usage_perc 0.3\n";
        assert_eq!(parse(page), load(2.0, 4.0, 0.3));
    }

    /// NaN and infinities (every spelling the format allows) never reach the scorer; usage is
    /// clamped to a fraction.
    #[test]
    fn non_finite_values_are_skipped_and_usage_clamped() {
        for v in ["NaN", "nan", "+Inf", "-Inf", "Inf", "inf", "1e999"] {
            let page = format!(
                "vllm:num_requests_running {v}\nvllm:num_requests_waiting{{model_name=\"m\"}} {v}\n\
                 vllm:kv_cache_usage_perc {v}\n"
            );
            assert_eq!(parse(&page), None, "{v}");
        }
        assert_eq!(parse("vllm:kv_cache_usage_perc 7\n"), load(0.0, 0.0, 1.0));
        assert_eq!(parse("vllm:kv_cache_usage_perc -3\n"), load(0.0, 0.0, 0.0));
    }

    /// Garbage of every shape: never a panic, never a figure invented from it.
    #[test]
    fn garbage_lines_are_skipped() {
        let page = concat!(
            "vllm:num_requests_running\n",
            "vllm:num_requests_running{model_name=\"m\" 3\n",
            "vllm:num_requests_running{model_name=\"unterminated} 3\n",
            "vllm:num_requests_running{} three\n",
            "{model_name=\"m\"} 3\n",
            " 3\n",
            "}{\"\\\n",
            "\u{0}\u{feff}vllm:num_requests_running 3\n",
            "vllm:num_requests_runningé 3\n",
            "# vllm:num_requests_running 3\n",
            "vllm:num_requests_waiting{model_name=\"m\"} 1\n",
        );
        assert_eq!(parse(page), load(0.0, 1.0, 0.0));
        assert_eq!(parse(""), None);
        assert_eq!(parse("\n\n\r\n"), None);
    }

    /// A label set of a hundred thousand labels, a label value of megabytes and a page of
    /// distinct series: linear, no panic, and the figures still right.
    #[test]
    fn huge_label_sets_parse_in_one_pass() {
        let labels: Vec<String> = (0..100_000).map(|i| format!("l{i}=\"v{i}\"")).collect();
        let mut page = format!("vllm:num_requests_running{{{}}} 3\n", labels.join(","));
        page.push_str(&format!(
            "vllm:num_requests_waiting{{model_name=\"{}\"}} 2\n",
            "}".repeat(2 << 20)
        ));
        for i in 0..50_000 {
            page.push_str(&format!("vllm:num_requests_waiting{{engine=\"{i}\"}} 1\n"));
        }
        let started = Instant::now();
        assert_eq!(parse(&page), load(3.0, 50_002.0, 0.0));
        // Generous for a debug build on a loaded machine; a quadratic scan would take minutes.
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{:?}",
            started.elapsed()
        );
    }
}
