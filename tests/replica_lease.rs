//! Drain ownership decided by a Kubernetes Lease (`peers.coordination: lease`), black box: three
//! `kv-epp serve` processes against the fake API server (`common/kube_api.rs`, which serves
//! Leases with the real resourceVersion rules: 404, 201, 409 Conflict), two TensorRT-LLM-style
//! drain engines that record which process drained them, and a cuttable TCP relay in front of
//! every replica's peer port. One scenario, while events keep coming:
//!
//! 1. exactly one replica (the Lease's holder) drains, both engines;
//! 2. a symmetric peer partition (no replica reaches another, all reach the API server), which
//!    splits the drain under probes alone: the holder keeps draining, nobody else starts;
//! 3. the holder frozen (SIGSTOP) past the lease duration: another replica takes over; resumed
//!    (SIGCONT), the old holder never drains again and reports the lapse;
//! 4. the holder killed (-9): another takes over within the README's bound;
//! 5. the API server unreachable: nobody drains once the holder's lease could have expired,
//!    nobody takes over, and the lease counters move; back, draining resumes;
//! 6. the holder shut down (SIGTERM): it releases the Lease, and another takes over at once.
//!
//! Throughout: never two processes draining one engine at once, and (outside the outage) no
//! engine without a poller beyond the bound; afterwards every replica holds the same index.

mod common;
#[path = "common/kube_api.rs"]
mod kube_api;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::replicas::{
    Cutter, DrainEngine, Pusher, Replica, check_drains, converge, ports, recent_poller, round,
    track, wait_poller_among,
};
use kube_api::{FakeKube, Res};
use serde_json::Value;

/// Probe interval of the test replicas (`Replica::spawn` sets it).
const PROBE: Duration = Duration::from_millis(200);
/// `peers.lease_duration_seconds` and `peers.lease_renew_ms` of the test replicas.
const LEASE_SECS: u64 = 2;
const RENEW: Duration = Duration::from_millis(500);
/// The README's takeover bound under a Lease: the lease duration, two renew periods (the last
/// renewal seen up to one period late, expiry noticed up to one period late) and 15 probe
/// intervals (claim, handoff, scheduling slack on a busy machine).
fn takeover_bound() -> Duration {
    Duration::from_secs(LEASE_SECS) + RENEW * 2 + PROBE * 15
}
/// How long the partition lasts: longer than every probe timeout (stale after 4 intervals,
/// handoff 3) and than the lease duration.
const PARTITION: Duration = Duration::from_secs(3);

fn body(engines: &[std::net::SocketAddr], kubeconfig: &std::path::Path) -> String {
    let workers: Vec<String> = engines
        .iter()
        .map(|e| format!("{{endpoint: '{e}', model: m}}"))
        .collect();
    format!(
        "events: {{engine: trtllm, trtllm: {{poll_interval_ms: 50}}}}\n\
         workers: [{}]\n\
         pool: {{namespace: default, kubeconfig: '{}'}}\n",
        workers.join(", "),
        kubeconfig.display()
    )
}

const LEASE: &str =
    ", coordination: lease, lease_name: trt-drains, lease_duration_seconds: 2, lease_renew_ms: 500";

async fn lease(r: &Replica) -> Value {
    r.status()
        .await
        .map(|s| s["lease"].clone())
        .unwrap_or_default()
}

fn pid_of(name: &str) -> Option<u32> {
    name.rsplit_once('#')?.1.parse().ok()
}

/// Waits until a replica other than process `not` drains `engine`; its index.
async fn wait_new_poller(
    engine: &DrainEngine,
    names: &HashMap<u32, String>,
    rs: &[Replica],
    not: u32,
    secs: u64,
) -> usize {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(n) = recent_poller(engine, names)
            && let Some(p) = pid_of(&n)
            && p != not
            && let Some(i) = rs.iter().position(|r| r.pid() == Some(p))
        {
            return i;
        }
        assert!(
            Instant::now() < deadline,
            "no other replica took the engine over in {secs}s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// With the API server unreachable since `outage`: waits two lease durations past the point
/// where the holding could have expired, then asserts that no engine was drained after it.
async fn no_drain_after_expiry(engines: &[DrainEngine], outage: Instant) {
    let expiry = outage + Duration::from_secs(LEASE_SECS);
    let quiet_until = expiry + Duration::from_secs(LEASE_SECS) * 2;
    tokio::time::sleep(quiet_until.saturating_duration_since(Instant::now())).await;
    for (i, e) in engines.iter().enumerate() {
        let late = e.drains_between(expiry, Instant::now());
        assert!(
            late.is_empty(),
            "engine {i}: drained {} times while the API server was unreachable, after the holding could have expired",
            late.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_gives_every_drain_one_owner_through_partitions_pauses_kills_and_outages() {
    let fake = FakeKube::start().await;
    let kubeconfig = fake.kubeconfig(&common::test_dir("lease-kube"));
    let engines = [DrainEngine::default(), DrainEngine::default()];
    let addrs = [engines[0].start().await, engines[1].start().await];
    let body = body(&addrs, &kubeconfig);
    let ps = [ports(), ports(), ports()];
    // Every peer link goes through a relay the test can cut: cutting all of them is a
    // symmetric partition (the API server stays reachable).
    let mut links = Vec::new();
    for p in &ps {
        links.push(Cutter::start(format!("127.0.0.1:{}", p.peer)).await);
    }
    let peers: Vec<u16> = links.iter().map(|l| l.addr.port()).collect();
    let mut names: HashMap<u32, String> = HashMap::new();
    let mut rs: Vec<Replica> = ["a", "b", "c"]
        .iter()
        .zip(&ps)
        .map(|(n, p)| Replica::spawn_with(n, p, &body, &peers, LEASE))
        .collect();
    for r in &rs {
        track(&engines, r, &mut names);
    }
    for r in &rs {
        r.wait_ready(30).await;
    }
    let pusher = Pusher::start(&engines);
    let started = Instant::now();

    // 1. One holder drains every engine, and every replica names it.
    let (h, _) = wait_poller_among(&engines[0], &names, Some(&rs), 20).await;
    let (h1, _) = wait_poller_among(&engines[1], &names, Some(&rs), 20).await;
    assert_eq!(
        h, h1,
        "one Lease per replica set: its holder drains both engines"
    );
    let settled = Instant::now();
    let holder_id = format!(
        "kv-epp-{}",
        rs[h].status().await.unwrap()["instance"].as_str().unwrap()
    );
    for r in &rs {
        let ok = common::eventually_async(10, || async {
            let l = lease(r).await;
            l["holder"] == holder_id.as_str() && l["name"] == "trt-drains"
        })
        .await;
        assert!(ok, "{} names the holder: {}", r.name, lease(r).await);
    }
    assert_eq!(lease(&rs[h]).await["held"], true);
    let stored = fake.get(Res::Leases, "default", "trt-drains").unwrap();
    assert_eq!(stored["spec"]["holderIdentity"], holder_id.as_str());
    assert_eq!(stored["spec"]["leaseDurationSeconds"], LEASE_SECS);

    // 2. A symmetric partition: each replica alone, all still reaching the API server.
    for l in &links {
        l.set_cut(true);
    }
    let cut_at = Instant::now();
    for r in &rs {
        let alone = common::eventually_async(10, || async {
            r.status()
                .await
                .is_some_and(|s| s["peers"].as_array().is_some_and(Vec::is_empty))
        })
        .await;
        assert!(alone, "{} still sees peers", r.name);
    }
    tokio::time::sleep(PARTITION).await;
    let healed_at = Instant::now();
    for l in &links {
        l.set_cut(false);
    }
    let holder_pid = rs[h].pid().unwrap();
    for (i, e) in engines.iter().enumerate() {
        let during = e.drains_between(cut_at, healed_at);
        assert!(!during.is_empty(), "engine {i}: the holder kept draining");
        assert!(
            during.iter().all(|(_, p)| *p == Some(holder_pid)),
            "engine {i}: drained by another replica during the partition"
        );
    }

    // 3. The holder frozen past its lease: another takes over; resumed, it never drains again.
    let (h, _) = wait_poller_among(&engines[0], &names, Some(&rs), 20).await;
    let frozen_pid = rs[h].pid().unwrap();
    let frozen_id = format!(
        "kv-epp-{}",
        rs[h].status().await.unwrap()["instance"].as_str().unwrap()
    );
    rs[h].signal("STOP");
    let n = wait_new_poller(&engines[0], &names, &rs, frozen_pid, 20).await;
    rs[h].signal("CONT");
    let resumed_at = Instant::now();
    let ok = common::eventually_async(15, || async {
        let l = lease(&rs[h]).await;
        l["held"] == false
            && l["holder"].as_str().is_some_and(|x| x != frozen_id)
            && l["lapsed"].as_u64() >= Some(1)
    })
    .await;
    assert!(
        ok,
        "the resumed holder reports the lapse: {}\n{}",
        lease(&rs[h]).await,
        rs[h].log_tail()
    );
    let log = std::fs::read_to_string(&rs[h].log).unwrap();
    assert_eq!(
        log.matches("the drain lease ran out without a confirmed renewal")
            .count(),
        1,
        "logged once"
    );
    assert!(lease(&rs[n]).await["transitions"].as_u64() >= Some(1));

    // 4. The holder killed: another takes over within the bound (checked below).
    let (k, _) = wait_poller_among(&engines[1], &names, Some(&rs), 20).await;
    let killed_pid = rs[k].pid().unwrap();
    rs[k].kill();
    let killed_at = vec![Instant::now()];
    let survivor = wait_new_poller(&engines[1], &names, &rs, killed_pid, 20).await;
    wait_new_poller(&engines[0], &names, &rs, killed_pid, 20).await;
    // Back as a new instance: three replicas again.
    rs[k].restart();
    track(&engines, &rs[k], &mut names);
    rs[k].wait_ready(30).await;
    let holder = &rs[survivor];

    // 5. The API server unreachable: the holder stops once its lease could have expired and
    // nobody takes over; the counters move. Then it comes back and draining resumes.
    let before = lease(holder).await;
    fake.stop().await;
    let outage = Instant::now();
    let ok = common::eventually_async(20, || async {
        let l = lease(holder).await;
        l["lapsed"].as_u64() > before["lapsed"].as_u64()
            && l["api_errors"].as_u64() > before["api_errors"].as_u64()
            && l["held"] == false
    })
    .await;
    assert!(
        ok,
        "the holder's lease lapses and it counts the failures: {}",
        lease(holder).await
    );
    // Watch longer than a lease duration past the point where it could have expired: a
    // takeover would show as a drain.
    no_drain_after_expiry(&engines, outage).await;
    let metrics = common::http(
        format!("127.0.0.1:{}", ps[survivor].metrics)
            .parse::<std::net::SocketAddr>()
            .unwrap(),
        "GET",
        "/metrics",
        &[],
        b"",
    )
    .await
    .unwrap()
    .text();
    assert!(
        metrics.contains("kv_epp_replica_lease_events_total{event=\"lapsed\"}")
            && metrics.contains("kv_epp_replica_lease_held 0"),
        "{metrics}"
    );
    fake.restart().await;
    let back = Instant::now();
    for e in &engines {
        wait_poller_among(e, &names, Some(&rs), 20).await;
    }

    // 6. The holder shut down (SIGTERM, as in a rolling update): it stops draining, then empties
    // the Lease's holder, and another replica takes over at its next read.
    let (t, _) = wait_poller_among(&engines[0], &names, Some(&rs), 20).await;
    let term_pid = rs[t].pid().unwrap();
    let versions = fake.history(Res::Leases, "default", "trt-drains").len();
    rs[t].signal("TERM");
    let exited = common::eventually(20, || {
        rs[t]
            .child
            .as_mut()
            .is_some_and(|c| c.try_wait().is_ok_and(|s| s.is_some()))
    })
    .await;
    assert!(exited, "the holder exits on SIGTERM:\n{}", rs[t].log_tail());
    let exited_at = Instant::now();
    rs[t].kill();
    let holders: Vec<Option<String>> = fake.history(Res::Leases, "default", "trt-drains")
        [versions..]
        .iter()
        .map(|v| {
            v.as_ref()
                .and_then(|o| o["spec"]["holderIdentity"].as_str().map(str::to_owned))
        })
        .collect();
    assert!(
        holders.contains(&None),
        "the holder released the Lease on its way out: {holders:?}"
    );
    wait_new_poller(&engines[0], &names, &rs, term_pid, 20).await;
    wait_new_poller(&engines[1], &names, &rs, term_pid, 20).await;
    eprintln!(
        "after SIGTERM: the next holder drained {:?} after the old one exited",
        exited_at.elapsed()
    );

    let mut next = pusher.stop().await;
    assert!(common::eventually(10, || engines.iter().all(DrainEngine::is_drained)).await);

    let bound = takeover_bound();
    for (i, e) in engines.iter().enumerate() {
        // Until the kill, the new holder kept the lease (later, the resumed replica may
        // legitimately take over).
        let resumed = e.drains_between(resumed_at, killed_at[0]);
        assert!(
            resumed.iter().all(|(_, p)| *p != Some(frozen_pid)),
            "engine {i}: the resumed holder drained again"
        );
        // Before the outage: never two pollers, no gap beyond the bound.
        let gap = check_drains(
            &format!("engine {i}"),
            &e.drains_between(settled, outage),
            &names,
            &killed_at,
            PROBE,
            bound,
        );
        eprintln!("engine {i}: longest time without a poller {gap:?} (bound {bound:?})");
        check_drains(
            &format!("engine {i} after the outage"),
            &e.drains_between(back, Instant::now()),
            &names,
            &[exited_at],
            PROBE,
            bound,
        );
    }
    let alive: Vec<&Replica> = rs.iter().filter(|r| r.pid().is_some()).collect();
    let (_, blocks) = converge(&alive, 1, 60).await;
    let added = round(&engines, &mut next);
    assert!(common::eventually(10, || engines.iter().all(DrainEngine::is_drained)).await);
    let (_, after) = converge(&alive, blocks + added, 30).await;
    assert_eq!(after, blocks + added);
    let (writes, conflicts) = fake.lease_writes();
    eprintln!(
        "lease scenario took {:?}; {writes} lease writes, {conflicts} conflicts; final index {after} blocks",
        started.elapsed()
    );
}

/// While pools differ (a rollout that changes a static `workers` list part way through), the
/// Lease's holder may lack engines its peers have. It never drains those, and before, nobody
/// did until the holder had them too, while each engine's bounded event buffer lost what it
/// held. Now the replicas that have such an engine own it by the probe rules until the holder
/// lists it, and the holder chooses which one drains each (it delegates the engine in its
/// `Hello`) and only for as long as its own holding is confirmed. Here `b` has engine 0 only
/// and holds the Lease: it drains engine 0, and `a` and `c`, which have all four, drain
/// engines 1-3 between them, never two at once. With the API server unreachable nobody drains
/// once the holding could have expired (a replica cut off with the holder must not drain
/// beside a later holder elsewhere). When `b` shuts down, the next holder takes every engine
/// over, again never two at once and within the takeover bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_the_lease_holder_lacks_are_drained_by_the_replicas_that_have_them() {
    let fake = FakeKube::start().await;
    let kubeconfig = fake.kubeconfig(&common::test_dir("lease-kube"));
    let engines: Vec<DrainEngine> = (0..4).map(|_| DrainEngine::default()).collect();
    let mut addrs = Vec::new();
    for e in &engines {
        addrs.push(e.start().await);
    }
    let (all, old) = (body(&addrs, &kubeconfig), body(&addrs[..1], &kubeconfig));
    let ps = [ports(), ports(), ports()];
    let peers: Vec<u16> = ps.iter().map(|p| p.peer).collect();
    let mut names: HashMap<u32, String> = HashMap::new();
    // `b`, with the old list, starts alone and takes the Lease.
    let mut b = Replica::spawn_with("b", &ps[1], &old, &peers, LEASE);
    track(&engines, &b, &mut names);
    b.wait_ready(60).await;
    let holds = common::eventually_async(30, || async { lease(&b).await["held"] == true }).await;
    assert!(holds, "b takes the Lease: {}", lease(&b).await);
    let a = Replica::spawn_with("a", &ps[0], &all, &peers, LEASE);
    track(&engines, &a, &mut names);
    let c = Replica::spawn_with("c", &ps[2], &all, &peers, LEASE);
    track(&engines, &c, &mut names);
    for r in [&a, &c] {
        r.wait_ready(60).await;
    }
    let pollers = || {
        engines
            .iter()
            .map(|e| recent_poller(e, &names))
            .collect::<Vec<_>>()
    };
    let split = || {
        recent_poller(&engines[0], &names).is_some_and(|p| p.starts_with("b#"))
            && engines[1..].iter().all(|e| {
                recent_poller(e, &names).is_some_and(|p| p.starts_with("a#") || p.starts_with("c#"))
            })
    };
    assert!(
        common::eventually(60, split).await,
        "the holder drains its engine, the others drain the engines it lacks: {:?}\n{}\n{}",
        pollers(),
        a.log_tail(),
        c.log_tail()
    );
    let settled = Instant::now();
    tokio::time::sleep(PROBE * 10).await;
    assert_eq!(
        lease(&b).await["held"],
        true,
        "b still holds the Lease, so a and c drained under the probe rules"
    );
    let bound = takeover_bound();
    for (i, e) in engines.iter().enumerate() {
        let drains = e.drains_between(settled, Instant::now());
        assert!(!drains.is_empty(), "engine {i} was not drained");
        check_drains(&format!("engine {i}"), &drains, &names, &[], PROBE, bound);
    }

    // The API server unreachable: the holder's holding runs out, and the delegations with it.
    // Nobody drains any engine once the holding could have expired, so a replica cut off with
    // the holder cannot drain beside a later holder elsewhere (no drainer rather than two).
    let outage = Instant::now();
    fake.stop().await;
    no_drain_after_expiry(&engines, outage).await;
    fake.restart().await;
    let back = Instant::now();
    assert!(
        common::eventually(60, || engines
            .iter()
            .all(|e| recent_poller(e, &names).is_some()))
        .await,
        "draining resumes once the API server is back"
    );

    // The holder leaves (SIGTERM, as in a rolling update): the next holder has every engine,
    // so it owns them all under the Lease and the other stands down.
    b.signal("TERM");
    let exited = common::eventually(20, || {
        b.child
            .as_mut()
            .is_some_and(|c| c.try_wait().is_ok_and(|s| s.is_some()))
    })
    .await;
    assert!(exited, "b exits on SIGTERM:\n{}", b.log_tail());
    b.kill();
    let left = Instant::now();
    let one_holder = || {
        let p = pollers();
        p[0].is_some() && p.iter().all(|x| *x == p[0])
    };
    assert!(
        common::eventually(60, one_holder).await,
        "the new holder drains every engine: {:?}\n{}\n{}",
        pollers(),
        a.log_tail(),
        c.log_tail()
    );
    let holder = recent_poller(&engines[0], &names).unwrap_or_default();
    let held = if holder.starts_with("a#") { &a } else { &c };
    assert_eq!(lease(held).await["held"], true, "{holder} holds the Lease");
    tokio::time::sleep(PROBE * 10).await;
    for (i, e) in engines.iter().enumerate() {
        let gap = check_drains(
            &format!("engine {i}, since the API server came back"),
            &e.drains_between(back, Instant::now()),
            &names,
            &[],
            PROBE,
            bound,
        );
        eprintln!(
            "engine {i}: longest time without a poller {gap:?} (bound {bound:?}); the holder left {:?} ago",
            left.elapsed()
        );
    }
}
