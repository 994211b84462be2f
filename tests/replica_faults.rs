//! Fault injection against replicas sharing TensorRT-LLM-style drains, black box: real
//! `kv-epp serve` processes on loopback, two drain engines that record which process drained
//! them (by socket owner, through `/proc`), and a TCP relay in front of one replica's peer port.
//! While events keep coming, one scenario runs every fault in turn: a replica with the wrong
//! peer token (then fixed in place, the old token as a second line), the owner frozen (SIGSTOP) for longer than every timeout then resumed, an owner
//! killed (-9) and restarted, one replica's peer link cut and restored, and a late joiner.
//! Throughout: never two replicas draining one engine at once, no engine without a poller for
//! longer than the takeover bound the README documents, the wrong-token replica never drains,
//! is not ready and says why; afterwards every replica holds the same index, and a fresh round
//! arrives whole everywhere. A second scenario isolates a one-way cut: a replica that cannot
//! see the drainer claims its engines, and the drainer must stop first even when its claims
//! outrank the newcomer's. A third has replicas whose pools differ: every engine is still
//! drained, by one replica at a time. A fourth changes a worker's model (its pod's label, under
//! discovery) while it is drained: the drain resumes, and events reach the new model's index.

mod common;
#[path = "common/kube_api.rs"]
mod kube_api;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::replicas::{
    BS, Cutter, DrainEngine, Pusher, Replica, check_drains, converge, ports, recent_poller, round,
    track, trt_stored, wait_poller, wait_poller_among,
};
use kube_api::{FakeKube, Res, pod, pool_v1};
use serde_json::{Value, json};

/// Probe interval of the test replicas (`Replica::spawn` sets it).
const PROBE: Duration = Duration::from_millis(200);
/// The README's takeover bound: an engine is without a poller for at most 15 probe intervals
/// (4 unanswered probes, the 3-interval handoff, lease and scheduling slack on a busy machine).
const TAKEOVER_INTERVALS: u32 = 15;
/// How long a fault lasts: longer than every timeout (stale after 4 intervals, handoff 3, lease
/// 2.5; relay streams' 5 s are not waited for).
const FAULT: Duration = Duration::from_secs(3);

/// A replica's config: TensorRT-LLM events polled every 50 ms from `engines`, model `m`.
fn body(engines: &[std::net::SocketAddr]) -> String {
    let workers: Vec<String> = engines
        .iter()
        .map(|a| format!("{{endpoint: '{a}', model: m}}"))
        .collect();
    format!(
        "events: {{engine: trtllm, trtllm: {{poll_interval_ms: 50}}}}\nworkers: [{}]\n",
        workers.join(", ")
    )
}

/// `n` drain engines, started, and their addresses.
async fn drain_engines(n: usize) -> (Vec<DrainEngine>, Vec<std::net::SocketAddr>) {
    let engines: Vec<DrainEngine> = (0..n).map(|_| DrainEngine::default()).collect();
    let mut addrs = Vec::new();
    for e in &engines {
        addrs.push(e.start().await);
    }
    (engines, addrs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_never_split_a_drain_nor_strand_an_engine() {
    let engines = [DrainEngine::default(), DrainEngine::default()];
    let addrs = [engines[0].start().await, engines[1].start().await];
    let body = body(&addrs);
    let ps = [ports(), ports(), ports(), ports()];
    // c's peers reach it through a relay the test can cut (c reaches them directly).
    let link_c = Cutter::start(format!("127.0.0.1:{}", ps[2].peer)).await;
    let peers = [ps[0].peer, ps[1].peer, link_c.addr.port(), ps[3].peer];
    let mut names: HashMap<u32, String> = HashMap::new();
    let mut rs: Vec<Replica> = ["a", "b", "c"]
        .iter()
        .zip(&ps)
        .map(|(n, p)| Replica::spawn(n, p, &body, &peers))
        .collect();
    for r in &rs {
        track(&engines, r, &mut names);
    }
    for r in &rs {
        r.wait_ready(30).await;
    }
    let pusher = Pusher::start(&engines);
    let started = Instant::now();
    for e in &engines {
        wait_poller(e, &names, 15).await;
    }
    // Attribution starts once ownership settled: the first handoff is not a fault.
    let settled = Instant::now();

    // 1. A replica with the wrong peer token: refused, it stays not ready, owns nothing, says so.
    let w = Replica::spawn_full("wrong", &ports(), &body, &peers, "", "not-the-peer-token");
    track(&engines, &w, &mut names);
    assert!(
        common::eventually_async(20, || async {
            w.status()
                .await
                .is_some_and(|s| s["token_refused"] == true && s["ready"] == false)
        })
        .await,
        "the wrong-token replica reports it is refused:\n{}",
        w.log_tail()
    );
    let ws = w.status().await.unwrap();
    assert!(ws["refused_by"].as_array().unwrap().len() >= 3, "{ws}");
    assert!(ws["counters"]["refused_by_peers"].as_u64().unwrap() > 0);
    let warned = std::fs::read_to_string(&w.log).unwrap();
    assert_eq!(
        warned
            .matches("every peer that answers refuses this replica's token")
            .count(),
        1,
        "logged once"
    );
    assert!(
        !warned.contains("not-the-peer-token"),
        "the token is never logged"
    );
    // Its peers see it as refusing them, and stay ready.
    for r in &rs {
        let s = r.status().await.unwrap();
        assert_eq!(s["ready"], true, "{}", r.name);
    }
    // The token file fixed in place, the old token kept as a second line (a rotation): picked
    // up without a restart, the replica turns ready.
    let fixed_at = Instant::now();
    common::write_file(
        &w.token,
        format!("{}\nnot-the-peer-token\n", common::replicas::TOKEN),
    );
    w.wait_ready(20).await;
    assert_eq!(w.status().await.unwrap()["token_refused"], false);
    let wrong_pid = w.pid().unwrap();
    drop(w);
    let mut killed_at = vec![Instant::now()];

    // 2. The owner of engine 0 frozen for longer than every timeout, then resumed.
    let (frozen, _) = wait_poller_among(&engines[0], &names, Some(&rs), 15).await;
    rs[frozen].signal("STOP");
    tokio::time::sleep(FAULT).await;
    rs[frozen].signal("CONT");
    for r in &rs {
        r.wait_ready(30).await;
    }

    // 3. The owner of engine 1 killed (-9) and restarted: a new instance.
    let (killed, _) = wait_poller_among(&engines[1], &names, Some(&rs), 15).await;
    rs[killed].kill();
    killed_at.push(Instant::now());
    tokio::time::sleep(FAULT).await;
    rs[killed].restart();
    track(&engines, &rs[killed], &mut names);
    rs[killed].wait_ready(30).await;

    // 4. c's peer link cut (its peers lose it, it still sees them), then restored.
    link_c.set_cut(true);
    tokio::time::sleep(FAULT).await;
    link_c.set_cut(false);

    // 5. A late joiner.
    let d = Replica::spawn("d", &ps[3], &body, &peers);
    track(&engines, &d, &mut names);
    d.wait_ready(30).await;
    rs.push(d);
    tokio::time::sleep(FAULT).await;

    let mut next = pusher.stop().await;
    assert!(common::eventually(10, || engines.iter().all(DrainEngine::is_drained)).await);

    let bound = PROBE * TAKEOVER_INTERVALS;
    for (i, e) in engines.iter().enumerate() {
        let drains = e.drains_between(settled, Instant::now());
        assert!(
            drains
                .iter()
                .all(|(t, p)| *p != Some(wrong_pid) || *t > fixed_at),
            "engine {i}: the wrong-token replica drained it"
        );
        let gap = check_drains(
            &format!("engine {i}"),
            &drains,
            &names,
            &killed_at,
            PROBE,
            bound,
        );
        eprintln!("engine {i}: longest time without a poller {gap:?} (bound {bound:?})");
    }
    let all: Vec<&Replica> = rs.iter().collect();
    let (_, blocks) = converge(&all, 1, 60).await;
    // Nothing lost from now on: a fresh round arrives whole on every replica.
    let added = round(&engines, &mut next);
    assert!(common::eventually(10, || engines.iter().all(DrainEngine::is_drained)).await);
    let (_, after) = converge(&all, blocks + added, 30).await;
    assert_eq!(after, blocks + added);
    eprintln!(
        "fault scenario took {:?}; final index {after} blocks",
        started.elapsed()
    );
}

/// Whether `name` made the last drain of every engine, within the last second.
fn polled_by(engines: &[DrainEngine], names: &HashMap<u32, String>, name: &str) -> bool {
    engines
        .iter()
        .all(|e| recent_poller(e, names).as_deref() == Some(name))
}

/// Every drain source of `r` as `(worker, owner, polling, epoch)`, in the order of its status.
async fn sources(r: &Replica) -> Vec<(String, Option<String>, bool, Option<u64>)> {
    let Some(s) = r.status().await else {
        return Vec::new();
    };
    let mut v: Vec<_> = s["single_reader_sources"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|v| {
            (
                v["worker"].as_str().unwrap_or_default().to_owned(),
                v["owner"].as_str().map(str::to_owned),
                v["polling"] == true,
                v["epoch"].as_u64(),
            )
        })
        .collect();
    v.sort();
    v
}

/// A replica that cannot see the one draining a worker (a one-way cut) claims the worker, and
/// under the same view it would start after its handoff. The drainer sees that claim: it must
/// stop before then even when it outranks the claim (its epoch is higher), or both drain at once.
/// `x` takes every engine over from `z` (so its claims are at epoch 2), then `y` starts behind
/// a cut link to `x` (it claims everything at epoch 1); `x` sees `y`, ready, and keeps about
/// half of the engines by rendezvous. Then the link heals and ownership settles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drainer_stops_for_a_claim_made_without_seeing_it() {
    let (engines, addrs) = drain_engines(8).await;
    let body = body(&addrs);
    let (pz, px, py) = (ports(), ports(), ports());
    // y reaches x only through this link, cut from the start; x reaches y directly.
    let link = Cutter::start(format!("127.0.0.1:{}", px.peer)).await;
    link.set_cut(true);
    let mut names: HashMap<u32, String> = HashMap::new();
    let mut z = Replica::spawn("z", &pz, &body, &[pz.peer, px.peer]);
    track(&engines, &z, &mut names);
    z.wait_ready(30).await;
    let x = Replica::spawn("x", &px, &body, &[pz.peer, px.peer, py.peer]);
    track(&engines, &x, &mut names);
    x.wait_ready(30).await;
    z.kill();
    let x_name = names[&x.pid().unwrap()].clone();
    assert!(
        common::eventually(30, || polled_by(&engines, &names, &x_name)).await,
        "x drains every engine once z is gone:\n{}",
        x.log_tail()
    );
    let settled = Instant::now();
    // x's claims were made above z's: they outrank the claims a fresh replica makes.
    let before = sources(&x).await;
    assert!(
        before.len() == engines.len() && before.iter().all(|s| s.2 && s.3 >= Some(2)),
        "{before:?}"
    );

    let y = Replica::spawn("y", &py, &body, &[pz.peer, link.addr.port(), py.peer]);
    track(&engines, &y, &mut names);
    y.wait_ready(30).await;
    let y_name = names[&y.pid().unwrap()].clone();
    // x sees y ready: the engines it still owns by rendezvous are those where the old rule
    // (stand down only before a higher claim, or an active one) let both drain.
    let y_instance = y.status().await.unwrap()["instance"].clone();
    let sees_y = common::eventually_async(10, || async {
        x.status().await.is_some_and(|s| {
            s["peers"].as_array().is_some_and(|ps| {
                ps.iter()
                    .any(|p| p["instance"] == y_instance && p["ready"] == true)
            })
        })
    })
    .await;
    assert!(sees_y, "x sees y, ready");
    let x_instance = x.status().await.unwrap()["instance"].clone();
    let kept = sources(&x)
        .await
        .iter()
        .filter(|s| s.1.as_deref() == x_instance.as_str())
        .count();
    eprintln!(
        "x is the rendezvous owner of {kept} of {} engines",
        engines.len()
    );
    assert!(
        common::eventually(30, || polled_by(&engines, &names, &y_name)).await,
        "y, which sees no peer, drains every engine:\n{}",
        y.log_tail()
    );
    assert!(
        common::eventually_async(10, || async { sources(&x).await.iter().all(|s| !s.2) }).await,
        "x stopped polling:\n{}",
        x.log_tail()
    );

    // Healed: y sees x, and ownership settles by rendezvous with one poller per engine.
    link.set_cut(false);
    let agreed = common::eventually_async(30, || async {
        let (sx, sy) = (sources(&x).await, sources(&y).await);
        sx.len() == engines.len()
            && sy.len() == engines.len()
            && sx
                .iter()
                .zip(&sy)
                .all(|(a, b)| a.1.is_some() && a.1 == b.1 && a.2 != b.2)
    })
    .await;
    assert!(
        agreed,
        "x and y agree on every engine's owner and exactly one polls it"
    );

    let bound = PROBE * TAKEOVER_INTERVALS;
    for (i, e) in engines.iter().enumerate() {
        let drains = e.drains_between(settled, Instant::now());
        check_drains(&format!("engine {i}"), &drains, &names, &[], PROBE, bound);
    }
}

/// Replicas whose pools differ (a rollout that changes `workers` reaches them one by one): a
/// replica that does not have a worker must not win its ownership, or nobody drains it and the
/// engine's bounded event buffer loses what it held. `b` has none of the engines; `a` and `c`
/// have all of them: every engine is drained, never by two at once. (Were `b` ranked, it would
/// win none of 16 engines in (2/3)^16, 0.15%, of runs: the test would pass without the rule
/// only that rarely.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_missing_from_one_replicas_pool_is_drained_by_one_that_has_it() {
    let (engines, addrs) = drain_engines(16).await;
    let (with, without) = (body(&addrs), body(&[]));
    let (pa, pb, pc) = (ports(), ports(), ports());
    let all = [pa.peer, pb.peer, pc.peer];
    let mut names: HashMap<u32, String> = HashMap::new();
    let c = Replica::spawn("c", &pc, &with, &all);
    track(&engines, &c, &mut names);
    let b = Replica::spawn("b", &pb, &without, &all);
    track(&engines, &b, &mut names);
    let a = Replica::spawn("a", &pa, &with, &all);
    track(&engines, &a, &mut names);
    for r in [&a, &b, &c] {
        r.wait_ready(30).await;
    }
    // Every engine polled (all three replicas see each other; b has none to poll).
    let one_each = || {
        engines.iter().all(|e| {
            recent_poller(e, &names).is_some_and(|p| p.starts_with("a#") || p.starts_with("c#"))
        })
    };
    assert!(
        common::eventually(60, one_each).await,
        "an engine without a poller: {:?}\n{}",
        engines
            .iter()
            .map(|e| recent_poller(e, &names))
            .collect::<Vec<_>>(),
        b.log_tail()
    );
    let settled = Instant::now();
    tokio::time::sleep(PROBE * 10).await;
    let bound = PROBE * TAKEOVER_INTERVALS;
    for (i, e) in engines.iter().enumerate() {
        let drains = e.drains_between(settled, Instant::now());
        check_drains(&format!("engine {i}"), &drains, &names, &[], PROBE, bound);
        assert!(
            !drains.is_empty(),
            "engine {i} was not drained after settling"
        );
    }
}

/// `r`'s workers (from discovery) as `(worker, model, blocks)`.
async fn workers(r: &Replica) -> Vec<(String, String, Option<u64>)> {
    let Some(w) = r.get("/workers").await else {
        return Vec::new();
    };
    w["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| {
            (
                w["worker"].as_str().unwrap_or_default().to_owned(),
                w["model"].as_str().unwrap_or_default().to_owned(),
                w["blocks"].as_u64(),
            )
        })
        .collect()
}

/// A rollout relabels a pod with another model while a replica drains it: every replica stops
/// the worker's feed and starts it again under the new model, in one step. The drainer's claim
/// outlives that restart, so its peers keep deferring to it: unless the drainer polls again the
/// engine is drained by nobody, for good, and its bounded event buffer loses everything. The
/// drain must resume, by one replica at a time, and fresh events must reach the new model's
/// index on every replica. Under the drain Lease (the default with a pool) and under probe
/// fencing alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_model_changes_under_a_leased_drain_is_drained_again() {
    model_change_under_a_drain("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_model_changes_under_a_probed_drain_is_drained_again() {
    model_change_under_a_drain(", coordination: probes").await;
}

/// The scenario above; `peers_extra` is added to the replicas' `peers` section.
async fn model_change_under_a_drain(peers_extra: &str) {
    let (engines, addrs) = drain_engines(1).await;
    let fake = FakeKube::start().await;
    let labels = |model: &str| json!({"app": "trt", "kv-epp.io/model": model});
    let selector = json!({"app": "trt"});
    fake.put(
        Res::PoolV1,
        "default",
        pool_v1("trt", selector, &[addrs[0].port()]),
    );
    fake.put(
        Res::Pods,
        "default",
        pod("p0", "127.0.0.1", true, labels("a")),
    );
    let kubeconfig = fake.kubeconfig(&common::replicas::dir());
    let body = format!(
        "models: [{{name: a, block_size: {BS}}}, {{name: b, block_size: {BS}}}]\n\
         events: {{engine: trtllm, trtllm: {{poll_interval_ms: 50}}}}\n\
         pool: {{name: trt, namespace: default, kubeconfig: '{}'}}\n",
        kubeconfig.display()
    );
    let (px, py) = (ports(), ports());
    let all = [px.peer, py.peer];
    let mut names: HashMap<u32, String> = HashMap::new();
    let x = Replica::spawn_with("x", &px, &body, &all, peers_extra);
    track(&engines, &x, &mut names);
    let y = Replica::spawn_with("y", &py, &body, &all, peers_extra);
    track(&engines, &y, &mut names);
    for r in [&x, &y] {
        r.wait_ready(30).await;
    }
    let drainer = wait_poller(&engines[0], &names, 60).await;
    let worker = addrs[0].to_string();
    let serves = |model: &'static str, blocks: Option<u64>| {
        let (x, y, worker) = (&x, &y, worker.clone());
        async move {
            for r in [x, y] {
                let ws = workers(r).await;
                if !ws
                    .iter()
                    .any(|w| w.0 == worker && w.1 == model && (blocks.is_none() || w.2 == blocks))
                {
                    return false;
                }
            }
            true
        }
    };
    assert!(
        common::eventually_async(30, || serves("a", None)).await,
        "both replicas serve the worker as model a"
    );

    fake.put(
        Res::Pods,
        "default",
        pod("p0", "127.0.0.1", true, labels("b")),
    );
    assert!(
        common::eventually_async(30, || serves("b", None)).await,
        "both replicas serve the worker as model b"
    );
    let changed = Instant::now();
    // The drain resumes. A drain in flight when the feed restarted is thrown away with the old
    // feed (its events were the old model's), so fresh events are pushed once the engine has
    // been drained a few times since the change: they must reach both replicas' index of `b`.
    let resumed = common::eventually(30, || {
        engines[0].drains_between(changed, Instant::now()).len() >= 3
    })
    .await;
    let status = |v: Option<Value>| v.map(|s| s["single_reader_sources"].clone());
    assert!(
        resumed,
        "nobody drains the engine since its model changed (it was drained by {drainer}):\n\
         x: {:?}\ny: {:?}\n{}\n{}",
        status(x.status().await),
        status(y.status().await),
        x.log_tail(),
        y.log_tail()
    );
    engines[0].push(trt_stored(7_000, "t"));
    assert!(
        common::eventually(30, || engines[0].is_drained()).await,
        "the fresh event is drained"
    );
    assert!(
        common::eventually_async(30, || serves("b", Some(2))).await,
        "the drained blocks reach both replicas' index of model b: x {:?}, y {:?}",
        workers(&x).await,
        workers(&y).await
    );
    let bound = PROBE * TAKEOVER_INTERVALS;
    tokio::time::sleep(PROBE * 10).await;
    let drains = engines[0].drains_between(changed, Instant::now());
    check_drains("the engine", &drains, &names, &[], PROBE, bound);
}
