//! Black-box tests of `kv-epp hash`: the spec's test vectors through the real binary.

use std::io::Write;
use std::process::{Command, Stdio};

fn hash(args: &[&str], stdin: &str) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kv-epp"))
        .arg("hash")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kv-epp");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn json(args: &[&str], tokens: &[u32]) -> serde_json::Value {
    let (ok, out, err) = hash(args, &serde_json::to_string(tokens).unwrap());
    assert!(ok, "kv-epp hash failed: {err}");
    serde_json::from_str(&out).unwrap()
}

fn u64s(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn every_spec_vector_through_the_binary() {
    let single = [0u32, 1, 2, 3];
    let cases: Vec<(&[&str], Vec<u64>)> = vec![
        (&[], vec![9143094415614847814]),
        (&["--lora", "adapter-a"], vec![6665157333201000639]),
        (&["--salt", "tenant-a"], vec![17009624042690211646]),
        (
            &["--salt", "tenant-a", "--lora", "adapter-a"],
            vec![8269515957840517240],
        ),
        (&["--lora", "tenant-a"], vec![582854293518545300]),
        (&["--salt", ""], vec![9143094415614847814]),
        (&["--lora", ""], vec![9143094415614847814]),
    ];
    for (extra, want) in cases {
        let mut args = vec!["--block-size", "4"];
        args.extend_from_slice(extra);
        let v = json(&args, &single);
        assert_eq!(u64s(&v["local"]), want, "args {args:?}");
    }
    let v = json(&["--block-size", "4"], &single);
    assert_eq!(u64s(&v["sequence"]), vec![9143094415614847814]);

    let t8: Vec<u32> = (1..=8).collect();
    let v = json(&["--block-size", "4"], &t8);
    assert_eq!(
        u64s(&v["local"]),
        vec![14643705804678351452, 16777012769546811212]
    );
    assert_eq!(
        u64s(&v["sequence"]),
        vec![14643705804678351452, 4945711292740353085]
    );
    let v = json(&["--block-size", "4", "--salt", "tenant-a"], &t8);
    assert_eq!(
        u64s(&v["local"]),
        vec![5738685477468498325, 11202231085456067787]
    );
    assert_eq!(
        u64s(&v["sequence"]),
        vec![5738685477468498325, 1076233986426276607]
    );

    let t48: Vec<u32> = (1..=48).collect();
    let v = json(&["--block-size", "16"], &t48);
    assert_eq!(
        u64s(&v["sequence"]),
        vec![
            16863443419780771464,
            12466389667045779788,
            960926348267535642
        ]
    );
    let v = json(&["--block-size", "16", "--salt", "tenant-a"], &t48);
    assert_eq!(
        u64s(&v["local"]),
        vec![
            8175209796170318505,
            13248293275458056256,
            2876216365566391037
        ]
    );
    assert_eq!(
        u64s(&v["sequence"]),
        vec![
            8175209796170318505,
            1199464708288223189,
            8909045955271374968
        ]
    );
    let v = json(&["--block-size", "16", "--lora", "lora-a"], &t48);
    assert_eq!(
        u64s(&v["sequence"]),
        vec![505115133176759089, 9189390670180411066, 2091250518290727944]
    );

    let t35: Vec<u32> = (0..35).collect();
    let v = json(&["--block-size", "16"], &t35);
    assert_eq!(
        u64s(&v["local"]),
        vec![15310707395893867146, 15292316782987903195]
    );
}

#[test]
fn bad_input_is_a_clear_error() {
    let (ok, _, err) = hash(&["--block-size", "4"], "[1, -2]");
    assert!(!ok);
    assert!(err.contains("JSON array of token IDs"), "{err}");
    let (ok, _, err) = hash(&["--block-size", "4"], "[4294967296]");
    assert!(!ok && err.contains("token IDs"), "{err}");
    let long = "s".repeat(1025);
    let (ok, _, err) = hash(&["--block-size", "4", "--salt", &long], "[1,2,3,4]");
    assert!(!ok && err.contains("1025 bytes"), "{err}");
    // block size 0 yields no hashes, never a crash
    let (ok, out, _) = hash(&["--block-size", "0"], "[1,2,3,4]");
    assert!(ok);
    assert_eq!(out.trim(), r#"{"local":[],"sequence":[]}"#);
}
