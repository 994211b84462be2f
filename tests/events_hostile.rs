//! Black-box: `kv-epp serve` against hand-written ZMTP 3.0 peers on a worker's event and replay
//! ports that lie about lengths, never end a message, or greet with garbage. The process must
//! stay up without allocating what the peers claim, count each refusal per worker and reason on
//! `/metrics`, keep other workers' feeds running, and apply a valid batch afterwards.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{ChildGuard, eventually_async, free_port, http, metric};
use rmpv::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// A ZMTP 3.0 NULL greeting.
fn greeting() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Greeting plus a READY command announcing `socket_type`.
fn hello(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    let mut out = greeting();
    out.extend_from_slice(&[COMMAND, body.len() as u8]);
    out.extend_from_slice(&body);
    out
}

/// One frame, short or long.
fn frame(more: bool, body: &[u8]) -> Vec<u8> {
    let flags = if more { MORE } else { 0 };
    let mut out = Vec::with_capacity(body.len() + 9);
    match u8::try_from(body.len()) {
        Ok(n) => out.extend_from_slice(&[flags, n]),
        Err(_) => {
            out.push(flags | LONG);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(body);
    out
}

/// A frame header claiming `len` bytes (8-byte size).
fn claim(len: u64) -> Vec<u8> {
    let mut out = vec![LONG];
    out.extend_from_slice(&len.to_be_bytes());
    out
}

/// Reads kv-epp's greeting and READY (its first 64 + 2 + body bytes).
async fn read_hello(s: &mut TcpStream) {
    let mut g = [0u8; 66];
    s.read_exact(&mut g).await.unwrap();
    assert_eq!(g[0], 0xFF, "kv-epp greets as ZMTP");
    assert_eq!(g[64], COMMAND, "then sends READY");
    let mut body = vec![0u8; usize::from(g[65])];
    s.read_exact(&mut body).await.unwrap();
    assert!(body.starts_with(b"\x05READY"));
}

/// Reads one message (short frames only, as kv-epp sends).
async fn read_message(s: &mut TcpStream) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    loop {
        let flags = s.read_u8().await.unwrap();
        let len = s.read_u8().await.unwrap();
        let mut body = vec![0u8; usize::from(len)];
        s.read_exact(&mut body).await.unwrap();
        frames.push(body);
        if flags & MORE == 0 {
            return frames;
        }
    }
}

/// Waits until kv-epp drops the connection (reads and discards whatever it still sends).
async fn until_closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

/// A live event message `[topic, seq, batch]` storing one block of `tokens` under `hash`.
fn batch_message(seq: u64, hash: u64, tokens: &[u32]) -> Vec<u8> {
    let ev = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(vec![Value::from(hash)]),
        Value::Nil,
        Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        Value::from(tokens.len()),
    ]);
    let mut payload = Vec::new();
    let batch = Value::Array(vec![Value::F64(1.0), Value::Array(vec![ev])]);
    rmpv::encode::write_value(&mut payload, &batch).unwrap();
    let mut out = frame(true, b"");
    out.extend(frame(true, &seq.to_be_bytes()));
    out.extend(frame(false, &payload));
    out
}

/// Accepts kv-epp's SUB and completes the handshake as a PUB, through its subscription.
async fn accept_sub(l: &TcpListener) -> TcpStream {
    let (mut s, _) = tokio::time::timeout(Duration::from_secs(60), l.accept())
        .await
        .expect("kv-epp reconnects")
        .unwrap();
    s.write_all(&hello("PUB")).await.unwrap();
    read_hello(&mut s).await;
    let sub = read_message(&mut s).await;
    assert_eq!(sub, vec![vec![0x01]], "subscribes to every topic");
    s
}

fn blocks_of(workers: &serde_json::Value, endpoint: &str) -> u64 {
    workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker"] == endpoint)
        .and_then(|w| w["blocks"].as_u64())
        .unwrap_or(0)
}

async fn workers(admin: u16) -> serde_json::Value {
    let r = http(("127.0.0.1", admin), "GET", "/workers", &[], b"")
        .await
        .unwrap();
    serde_json::from_slice(&r.body).unwrap()
}

/// Peak resident memory of a process, from /proc.
fn peak_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_event_peers_are_refused_counted_and_survived() {
    let hostile = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let replay = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let good = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = |l: &TcpListener| l.local_addr().unwrap().port();
    let (metrics, admin) = (free_port(), free_port());
    let config = format!(
        "server: {{bind_address: 127.0.0.1, grpc_port: {}, grpc_health_port: {}, metrics_port: {metrics}, admin_port: {admin}}}\n\
         models: [{{name: m, block_size: 4}}]\n\
         workers:\n\
         - {{endpoint: '127.0.0.1:18101', model: m, events_endpoint: 'tcp://127.0.0.1:{}', replay_endpoint: 'tcp://127.0.0.1:{}'}}\n\
         - {{endpoint: '127.0.0.1:18102', model: m, events_endpoint: 'tcp://127.0.0.1:{}'}}\n",
        free_port(),
        free_port(),
        port(&hostile),
        port(&replay),
        port(&good),
    );
    let path = std::env::temp_dir().join(format!("kv-epp-hostile-{}.yaml", std::process::id()));
    std::fs::write(&path, config).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_kv-epp"))
        .args(["serve", "--config-file", path.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut guard = ChildGuard(child);

    // The well-behaved worker publishes its first batch.
    let mut good_conn = accept_sub(&good).await;
    good_conn
        .write_all(&batch_message(0, 501, &[5, 5, 5, 5]))
        .await
        .unwrap();
    assert!(
        eventually_async(60, || async {
            blocks_of(&workers(admin).await, "127.0.0.1:18102") == 1
        })
        .await,
        "the good worker's batch is applied"
    );

    // The replay socket of the hostile worker answers every request with a 2^40-byte claim.
    let replay_task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = replay.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let _ = s.write_all(&hello("ROUTER")).await;
                read_hello(&mut s).await;
                let request = read_message(&mut s).await;
                assert_eq!(request.len(), 2, "[b\"\", start sequence]");
                let mut answer = frame(true, b"");
                answer.extend(claim(1 << 40));
                let _ = s.write_all(&answer).await;
                until_closed(&mut s).await;
            });
        }
    });

    // One hostile connection per attack; kv-epp reconnects after each with backoff.
    let attacks: Vec<(&str, Vec<u8>)> = vec![
        ("2^40", claim(1 << 40)),
        ("2^62", claim(1 << 62)),
        ("1 GiB with 64 KiB sent", {
            let mut a = claim(1 << 30);
            a.extend(vec![7u8; 64 << 10]);
            a
        }),
        (
            "an endless multipart message",
            frame(true, b"x").repeat(100_000),
        ),
    ];
    for (what, attack) in attacks {
        let mut s = accept_sub(&hostile).await;
        // kv-epp may close before everything is written; that is the point.
        let _ = s.write_all(&attack).await;
        assert!(
            until_closed(&mut s).await,
            "{what}: kv-epp drops the connection"
        );
    }
    // 1 MiB claimed (under the limit), 100 KiB sent, then the peer hangs up.
    let mut s = accept_sub(&hostile).await;
    let mut short = claim(1 << 20);
    short.extend(vec![1u8; 100 << 10]);
    s.write_all(&short).await.unwrap();
    drop(s);
    // Garbage instead of a greeting, and a socket that is not a publisher.
    for greeting in [vec![b'G'; 64], hello("ROUTER")] {
        let (mut s, _) = hostile.accept().await.unwrap();
        let _ = s.write_all(&greeting).await;
        assert!(until_closed(&mut s).await);
    }

    // Still alive; a valid batch from the same worker is applied, and the good worker's feed
    // kept running throughout.
    let mut s = accept_sub(&hostile).await;
    s.write_all(&batch_message(0, 101, &[1, 2, 3, 4]))
        .await
        .unwrap();
    good_conn
        .write_all(&batch_message(1, 502, &[6, 6, 6, 6]))
        .await
        .unwrap();
    assert!(
        eventually_async(60, || async {
            let w = workers(admin).await;
            blocks_of(&w, "127.0.0.1:18101") == 1 && blocks_of(&w, "127.0.0.1:18102") == 2
        })
        .await,
        "both workers' valid batches are applied: {}",
        workers(admin).await
    );
    assert!(
        guard.0.try_wait().unwrap().is_none(),
        "kv-epp is still running"
    );

    // Each refusal is counted per worker and reason.
    let text = http(("127.0.0.1", metrics), "GET", "/metrics", &[], b"")
        .await
        .unwrap()
        .text();
    let errors = |socket: &str, reason: &str| {
        metric(
            &text,
            &format!(
                "kv_epp_event_connection_errors_total{{worker=\"127.0.0.1:18101\",socket=\"{socket}\",reason=\"{reason}\"}}"
            ),
        )
    };
    assert!(errors("events", "oversize") >= 3.0, "{text}");
    assert!(errors("events", "too_many_frames") >= 1.0, "{text}");
    assert!(errors("events", "closed") >= 1.0, "{text}");
    assert!(errors("events", "greeting") >= 1.0, "{text}");
    assert!(errors("events", "handshake") >= 1.0, "{text}");
    assert!(errors("replay", "oversize") >= 1.0, "{text}");
    assert!(
        !text.contains("worker=\"127.0.0.1:18102\",socket=\"events\""),
        "the good worker's event connection never failed: {text}"
    );
    // Nothing of the claims was allocated: the whole process peaked far below even one.
    let peak = peak_rss_bytes(pid);
    assert!(peak < 256 << 20, "peak RSS {peak} bytes");
    replay_task.abort();
    let _ = std::fs::remove_file(path);
}
