//! Server processes under measurement for the benches that put load on an ext_proc server
//! (`extproc_load`, `e2e`): the real `kv-epp serve` binary and the bench's own echo ext_proc
//! server (see `echo.rs`) run as child processes, so the CPU each one uses is its own process's,
//! never the load generator's. A bench includes it with `#[path = "support/child.rs"] mod
//! child;` next to `tests/common` mounted as `common`.
#![allow(dead_code)] // each bench uses the part it reports

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::ChildGuard;

/// What `kv-epp serve` prints once it listens, then the ext_proc address.
pub(crate) const KV_EPP_BANNER: &str = "kv-epp serving ext_proc on ";

/// A server process under load.
pub(crate) struct Target {
    pub(crate) pid: u32,
    pub(crate) grpc: SocketAddr,
    /// kv-epp's admin API (`None` for the echo server).
    pub(crate) admin: Option<SocketAddr>,
    _child: ChildGuard,
}

/// Starts `cmd` with stdout piped, waits for the line starting with `banner` and returns the
/// child and that line's remainder; the rest of its output is read and dropped.
fn spawn_until(mut cmd: Command, banner: &'static str) -> (ChildGuard, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start server process");
    let stdout = child.stdout.take().expect("stdout");
    let guard = ChildGuard(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix(banner)
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(rest.to_owned());
            }
        }
    });
    let rest = rx
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("no `{banner}` line within 30 s"));
    (guard, rest)
}

/// This tree's `kv-epp` binary, built by cargo for the bench.
pub(crate) fn this_kv_epp() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kv-epp"))
}

/// Runs `bin serve` on the configuration `yaml` (its ports should be 0: ephemeral), logs at
/// warn, and waits until it listens.
pub(crate) fn start_kv_epp(bin: &Path, yaml: &str) -> Target {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("kv-epp-bench-{}-{n}.yaml", std::process::id()));
    std::fs::write(&path, yaml).expect("write config");
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--config-file"])
        .arg(&path)
        .env("KV_EPP_LOG", "warn");
    let (child, rest) = spawn_until(cmd, KV_EPP_BANNER);
    // Read once at start.
    let _ = std::fs::remove_file(&path);
    // "<grpc> (health <a>, metrics <a>, admin <a>)"
    let grpc = rest.split_whitespace().next().and_then(|a| a.parse().ok());
    let admin = rest
        .split("admin ")
        .nth(1)
        .and_then(|a| a.trim_end_matches(')').parse().ok());
    Target {
        pid: child.0.id(),
        grpc: grpc.expect("kv-epp's ext_proc address"),
        admin: Some(admin.expect("kv-epp's admin address")),
        _child: child,
    }
}

/// This bench binary re-executed as the echo server (see `echo.rs`), naming `pick` as every
/// request's destination.
pub(crate) fn start_echo(pick: &str) -> Target {
    let mut cmd = Command::new(std::env::current_exe().expect("own path"));
    cmd.args([crate::echo::ECHO_FLAG, pick]);
    let (child, rest) = spawn_until(cmd, crate::echo::ECHO_BANNER);
    Target {
        pid: child.0.id(),
        grpc: rest.trim().parse().expect("echo's address"),
        admin: None,
        _child: child,
    }
}

/// CPU time (user plus system) a process has used so far, in seconds.
///
/// The sum of its live threads' `/proc/<pid>/task/<tid>/schedstat` run times (nanoseconds);
/// `/proc/<pid>/stat` counts in clock ticks (10 ms), too coarse for a step of a few hundred
/// sub-millisecond requests. A thread that exits between two readings takes its time with it, so
/// a server that ends threads mid-step is under-counted; the servers measured here keep theirs.
pub(crate) fn cpu_seconds(pid: u32) -> f64 {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("read /proc task list");
    let mut nanos = 0u64;
    for task in tasks.flatten() {
        let Ok(s) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue; // the thread ended while we looked
        };
        nanos += s
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    nanos as f64 / 1e9
}
