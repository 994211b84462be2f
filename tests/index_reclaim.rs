//! Memory follows what is held even on an idle process: index tables replaced while a query
//! could still read them are freed by kv-epp's upkeep task, without waiting for another write.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kv_epp_core::hashing::HashSeed;
use kv_epp_core::index::holders::retired_tables;
use kv_epp_core::index::{EngineBlockHash, IndexLimits, KvIndex, Medium, StoreBlocks};
use kv_epp_core::worker::WorkerId;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

const BLOCK: usize = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retired_tables_are_freed_without_another_write() {
    let index = KvIndex::new(BLOCK, IndexLimits::default());
    let addr: SocketAddr = "10.0.0.1:8000".parse().expect("address");
    let worker = WorkerId::new(addr);
    assert!(index.add_worker(worker));

    // A query in progress as far as reclamation can tell: a reader pinned on another thread
    // while the tables grow, so the writer cannot free the tables it replaces.
    let (pinned_tx, pinned_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let reader = std::thread::spawn(move || {
        let _guard = crossbeam_epoch::pin();
        pinned_tx.send(()).expect("pinned");
        let _ = release_rx.recv();
    });
    pinned_rx.recv().expect("reader pinned");
    for chunk in 0..40u32 {
        let first = chunk * 256 * BLOCK as u32;
        let tokens: Vec<u32> = (first..first + (256 * BLOCK) as u32).collect();
        let hashes: Vec<EngineBlockHash> = (0..256u64)
            .map(|b| EngineBlockHash(u64::from(chunk) << 32 | b))
            .collect();
        index
            .store(
                &worker,
                &StoreBlocks {
                    parent: None,
                    root_seed: Some(HashSeed::UNSALTED),
                    engine_hashes: &hashes,
                    tokens: &tokens,
                    medium: Medium::Device,
                },
            )
            .expect("store");
    }
    release_tx.send(()).expect("release");
    reader.join().expect("reader");
    // No write follows, so the writers' own reclamation never runs again.
    assert!(
        retired_tables() > 0,
        "tables replaced while the reader was pinned are still retired"
    );

    let gauge = Gauge::default();
    let (stop_tx, stop_rx) = watch::channel(false);
    let upkeep = tokio::spawn(kv_epp::upkeep::reclaim(
        Duration::from_millis(50),
        gauge.clone(),
        stop_rx,
    ));
    // The bound is a period or two; the deadline is generous for a loaded machine.
    let deadline = Instant::now() + Duration::from_secs(60);
    while retired_tables() > 0 || gauge.get() != 0 {
        assert!(
            Instant::now() < deadline,
            "{} retired tables still held after 60 s (gauge {})",
            retired_tables(),
            gauge.get()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_tx.send(true).expect("stop");
    upkeep.await.expect("upkeep task ends on stop");
    // The index itself is untouched by reclamation.
    assert_eq!(index.worker_blocks(&worker).expect("registered"), 40 * 256);
}
