//! kv-epp's view of each worker equals what the simulated vLLM worker really holds: after a
//! multi-tenant workload over HTTP, with events over real ZeroMQ (both layouts, both hash forms,
//! dropped batches filled by replay), `/query` for every prompt, tenant and worker matches the
//! worker's own cache; without replay a gap makes the worker cold until fresh events; after a
//! restart no stale block is credited.

mod common;

use std::time::{Duration, Instant};

use common::http;
use common::sim::{SimSpec, send, sim_worker, truth};
use kv_epp::config::Config;
use kv_epp::server::Server;
use kv_epp_sim::events::{EventLayout, HashForm};
use kv_epp_sim::server::SimWorker;
use kv_epp_sim::workload::{GeneratorSpec, generate};

const BS: usize = 16;

async fn sim(layout: EventLayout, hash_form: HashForm, drop: f64, replay: bool) -> SimWorker {
    sim_worker(SimSpec {
        block_size: BS,
        drop,
        replay,
        seed: 3,
        layout,
        hash_form,
        ..SimSpec::default()
    })
    .await
}

async fn kv_epp(workers: &[&SimWorker]) -> Server {
    let list: Vec<String> = workers
        .iter()
        .map(|w| {
            let replay = w
                .events
                .replay_endpoint
                .as_ref()
                .map(|r| format!(", replay_endpoint: '{r}'"))
                .unwrap_or_default();
            format!(
                "{{endpoint: '{}', model: m, events_endpoint: '{}'{replay}}}",
                w.http_addr, w.events.events_endpoint
            )
        })
        .collect();
    let yaml = format!(
        "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}}\n\
         engine_metrics: {{interval_ms: 0}}\nevents: {{zmq: {{replay_port: 0}}}}\nmodels: [{{name: m, block_size: {BS}}}]\nworkers: [{}]\n",
        list.join(", ")
    );
    let c = Config::from_yaml(&yaml).unwrap();
    c.validate().unwrap();
    let s = Server::start(&c).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while s
        .feeds
        .statuses()
        .iter()
        .any(|(_, _, st)| !st.connected.load(std::sync::atomic::Ordering::Relaxed))
    {
        assert!(Instant::now() < deadline, "subscribers connect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    s
}

async fn believed(server: &Server, w: &SimWorker, tokens: &[u32], tenant: &str) -> u64 {
    common::sim::believed(server.admin_addr, w.http_addr, tokens, Some(tenant)).await
}

/// Waits until kv-epp agrees with every worker on every probe (or fails with the first mismatch).
async fn converge(server: &Server, workers: &[&SimWorker], probes: &[(Vec<u32>, String)]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut mismatch = None;
        'outer: for w in workers {
            for (tokens, tenant) in probes {
                let (b, t) = (
                    believed(server, w, tokens, tenant).await,
                    truth(w, tokens, tenant),
                );
                if b != t {
                    mismatch = Some(format!(
                        "worker {} tenant {tenant}: kv-epp {b}, worker {t}",
                        w.http_addr
                    ));
                    break 'outer;
                }
            }
        }
        match mismatch {
            None => return,
            Some(m) if Instant::now() > deadline => panic!("{m}"),
            Some(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_equals_what_each_worker_holds_both_layouts_with_drops_and_replay() {
    let a = sim(EventLayout::Map, HashForm::Int, 0.0, true).await;
    let b = sim(EventLayout::Array, HashForm::Bytes, 0.3, true).await;
    let server = kv_epp(&[&a, &b]).await;
    let work = generate(&GeneratorSpec {
        tenants: 3,
        shared_prompt_tenants: 2,
        sessions_per_tenant: 3,
        turns: 3,
        system_prompt_tokens: 256,
        user_tokens: 64,
        output_tokens: 16,
        ..GeneratorSpec::default()
    });
    let mut probes = Vec::new();
    for (i, req) in work.iter().enumerate() {
        let tenant = req.tenant.clone().unwrap();
        send(if i % 2 == 0 { &a } else { &b }, &req.tokens, &tenant).await;
        probes.push((req.tokens.clone(), tenant));
    }
    // Cross-tenant probes: the same prompts under a tenant that never sent them.
    for req in work.iter().take(5) {
        probes.push((req.tokens.clone(), "tenant-x".into()));
    }
    converge(&server, &[&a, &b], &probes).await;
    let st = server.feeds.statuses();
    let gaps: u64 = st
        .iter()
        .map(|(_, _, s)| s.gaps.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    let replayed: u64 = st
        .iter()
        .map(|(_, _, s)| s.replayed.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    assert!(
        gaps > 0 && replayed == gaps,
        "drops were filled by replay: gaps {gaps}, replayed {replayed}"
    );
    // Restart worker a: sequence back to 0, cache empty. Fresh traffic makes kv-epp notice;
    // nothing stale may be credited.
    let r = http(a.http_addr, "POST", "/admin/restart", &[], b"")
        .await
        .unwrap();
    assert!(r.status < 300);
    send(&a, &(9000..9064).collect::<Vec<u32>>(), "tenant-0").await;
    converge(&server, &[&a, &b], &probes).await;
    for (tokens, tenant) in probes.iter().take(6) {
        assert_eq!(truth(&a, tokens, tenant), 0);
        assert_eq!(
            believed(&server, &a, tokens, tenant).await,
            0,
            "no stale credit after restart"
        );
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replay_a_lossy_worker_goes_cold_then_recovers() {
    let w = sim(EventLayout::Map, HashForm::Int, 0.5, false).await;
    let server = kv_epp(&[&w]).await;
    let mut probes = Vec::new();
    for i in 0..12u32 {
        let t: Vec<u32> = (i * 1000..i * 1000 + 64).collect();
        send(&w, &t, "tenant-0").await;
        probes.push((t, "tenant-0".to_string()));
    }
    let st = server.feeds.statuses()[0].2.clone();
    use std::sync::atomic::Ordering::Relaxed;
    assert!(
        common::eventually(15, || st.unfillable.load(Relaxed) > 0).await,
        "gaps without replay drop the state"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Whatever kv-epp credits, the worker holds (never more).
    for (t, tenant) in &probes {
        assert!(believed(&server, &w, t, tenant).await <= truth(&w, t, tenant));
    }
    // Fresh events are credited again: a new prompt whose batch arrives is fully known.
    let mut recovered = false;
    for i in 100..140u32 {
        let t: Vec<u32> = (i * 1000..i * 1000 + 64).collect();
        send(&w, &t, "tenant-0").await;
        let want = truth(&w, &t, "tenant-0");
        let deadline = Instant::now() + Duration::from_millis(500);
        while Instant::now() < deadline {
            if want > 0 && believed(&server, &w, &t, "tenant-0").await == want {
                recovered = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if recovered {
            break;
        }
    }
    assert!(
        recovered,
        "a cold worker is credited again from fresh events"
    );
    server.stop().await;
}
