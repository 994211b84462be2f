//! `kv-epp-sim workload` as a load tool reads it: one JSON request per line, arrivals in order,
//! every tenant's sessions growing turn by turn, the shared system prompt where asked for, and the
//! same output for the same seed.

use std::process::Command;

use serde_json::Value;

fn workload(args: &[&str]) -> Vec<Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_kv-epp-sim"))
        .arg("workload")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn prompt(v: &Value) -> Vec<u64> {
    v["body"]["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[test]
fn prints_a_replayable_multi_tenant_workload() {
    let args = [
        "--tenants",
        "3",
        "--shared-prompt-tenants",
        "2",
        "--sessions",
        "2",
        "--turns",
        "3",
        "--system-prompt-tokens",
        "32",
        "--model",
        "m",
        "--seed",
        "7",
    ];
    let lines = workload(&args);
    assert_eq!(lines.len(), 3 * 2 * 3);
    let times: Vec<u64> = lines.iter().map(|l| l["at_ms"].as_u64().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "arrivals in order");
    for l in &lines {
        assert_eq!(l["body"]["model"], "m");
        assert!(l["body"]["max_tokens"].as_u64().unwrap() > 0);
    }
    let of = |t: &str| -> Vec<Vec<u64>> {
        lines
            .iter()
            .filter(|l| l["tenant"] == t)
            .map(prompt)
            .collect()
    };
    let (t0, t1, t2) = (of("tenant-0"), of("tenant-1"), of("tenant-2"));
    assert_eq!((t0.len(), t1.len(), t2.len()), (6, 6, 6));
    // Tenants 0 and 1 share the system prompt; tenant 2 has its own.
    assert_eq!(t0[0][..32], t1[0][..32]);
    assert_ne!(t0[0][..32], t2[0][..32]);
    // Each later turn of a session extends an earlier prompt of the same tenant.
    for prompts in [&t0, &t1, &t2] {
        let extended = prompts
            .iter()
            .filter(|p| {
                prompts
                    .iter()
                    .any(|q| q.len() < p.len() && p.starts_with(q))
            })
            .count();
        assert!(extended >= 4, "two sessions of three turns: {extended}");
    }
    assert_eq!(
        workload(&args),
        lines,
        "the same seed prints the same workload"
    );
}

#[test]
fn refuses_nonsense_rates() {
    let out = Command::new(env!("CARGO_BIN_EXE_kv-epp-sim"))
        .args(["workload", "--rate", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--rate"));
}
