//! `kv-epp demo --quick` as CI runs it: real Envoy, kv-epp and simulated vLLM workers on
//! loopback; kv-epp must beat round-robin on prefix-cache hits with no cross-tenant sharing.

mod common;

use std::process::Command;

#[test]
fn quick_demo_beats_round_robin_and_keeps_tenants_apart() {
    let Some(envoy) = common::envoy_binary() else {
        return;
    };
    let out = Command::new(env!("CARGO_BIN_EXE_kv-epp"))
        .args(["demo", "--quick", "--envoy", envoy.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("no cross-tenant sharing"), "{text}");
    let all = text
        .lines()
        .find(|l| l.starts_with("all "))
        .expect("summary row");
    let pct: Vec<f64> = all
        .split_whitespace()
        .filter_map(|w| w.strip_suffix('%'))
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(pct.len(), 2, "{all}");
    assert!(
        pct[0] > pct[1] + 10.0,
        "kv-epp hit rate {} vs round-robin {}",
        pct[0],
        pct[1]
    );
}
