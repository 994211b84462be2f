//! The pipeline's behaviour: bookings, tenant isolation, constraints, refusals, explanations.

use std::sync::Arc;

use super::*;
use crate::config::Config;
use crate::metrics::Metrics;
use kv_epp_core::hashing::HashSeed;
use kv_epp_core::index::{EngineBlockHash, Medium, StoreBlocks};

fn router(extra: &str) -> Picker {
    let yaml = format!(
        "models: [{{name: m, block_size: 4, lora_adapters: [ad]}}]
workers: [{{endpoint: '10.0.0.1:8000', model: m}}, {{endpoint: '10.0.0.2:8000', model: m}}]
{extra}"
    );
    let c = Config::from_yaml(&yaml).unwrap();
    c.validate().unwrap();
    c.picker(Arc::new(Metrics::new())).unwrap()
}

fn body(model: &str, tokens: &[u32]) -> Vec<u8> {
    serde_json::json!({"model": model, "prompt": tokens})
        .to_string()
        .into_bytes()
}

fn parts<'a>(tenant: &'a [&'a [u8]], body: &'a [u8]) -> RequestParts<'a> {
    RequestParts {
        path: "/v1/completions",
        tenant,
        body: Some(body),
        ..RequestParts::default()
    }
}

/// Stores 4 blocks of `tokens` for `tenant` on `holder`.
fn store(r: &Picker, holder: WorkerId, tokens: &[u32], tenant: &str) {
    let hashes: Vec<EngineBlockHash> = (1..=4).map(EngineBlockHash).collect();
    r.models
        .index("m")
        .unwrap()
        .store(
            &holder,
            &StoreBlocks {
                parent: None,
                root_seed: Some(HashSeed::new(None, Some(tenant))),
                engine_hashes: &hashes,
                tokens: &tokens[..16],
                medium: Medium::Device,
            },
        )
        .unwrap();
}

#[test]
fn bookings_release_exactly_once_on_drop() {
    let r = router("");
    let a = decide(&r, &RequestParts::default()).unwrap();
    let b = decide(&r, &RequestParts::default()).unwrap();
    assert_eq!(r.workers.total_inflight(), 2);
    assert_ne!(a.pick, b.pick, "load spreads");
    drop(a);
    assert_eq!(r.workers.total_inflight(), 1);
    drop(b);
    assert_eq!(r.workers.total_inflight(), 0);
}

#[test]
fn routes_to_the_prefix_holder_only_under_the_same_salt() {
    let r = router("");
    let holder: WorkerId = "10.0.0.2:8000".parse().unwrap();
    let tokens: Vec<u32> = (0..16).collect();
    store(&r, holder, &tokens, "tenant-a");
    let b = body("m", &tokens);
    for _ in 0..3 {
        let d = decide(&r, &parts(&[b"tenant-a"], &b)).unwrap();
        assert_eq!(d.pick, holder);
        assert_eq!(d.cached_blocks, 4.0);
        assert_eq!(d.booking.as_ref().map(Booking::worker), Some(&holder));
    }
    let d = decide(&r, &parts(&[b"tenant-b"], &b)).unwrap();
    assert_eq!(d.cached_blocks, 0.0, "another tenant gets no credit");
}

#[test]
fn subset_saturation_and_unknown_models() {
    let r = router("routing: {max_inflight_per_worker: 1, unknown_model: reject}");
    let only2: SocketAddr = "10.0.0.2:8000".parse().unwrap();
    let b = body("m", &[1, 2, 3]);
    let subset = [only2];
    let req = RequestParts {
        subset: Some(&subset),
        ..parts(&[], &b)
    };
    let d = decide(&r, &req).unwrap();
    assert_eq!(d.pick.endpoint, only2);
    let err = decide(&r, &req).unwrap_err();
    assert!(matches!(err, Reject::Saturated { .. }), "{err:?}");
    assert_eq!((err.status(), err.outcome()), (429, "rejected_saturated"));
    let empty = RequestParts {
        subset: Some(&[]),
        ..parts(&[], &b)
    };
    let err = decide(&r, &empty).unwrap_err();
    assert_eq!((err.status(), err.reason()), (503, "rejected-no-endpoints"));
    let nope = body("nope", &[1]);
    let err = decide(&r, &parts(&[], &nope)).unwrap_err();
    assert_eq!((err.status(), err.reason()), (404, "model-not-found"));
    assert_eq!(
        err.model_label(),
        "unknown",
        "a client-chosen name is no label"
    );
    let lora = body("ad", &[1]);
    let d = decide(&r, &parts(&[], &lora)).unwrap();
    assert_eq!(d.request.model.lora.as_deref(), Some("ad"));
    assert_eq!(d.request.model.base.as_deref(), Some("m"));
}

#[test]
fn explain_is_the_same_decision_without_a_booking() {
    let r = router("");
    let holder: WorkerId = "10.0.0.1:8000".parse().unwrap();
    let tokens: Vec<u32> = (0..18).collect();
    store(&r, holder, &tokens, "tenant-a");
    let b = body("m", &tokens);
    let e = explain(&r, &parts(&[b"tenant-a"], &b)).unwrap();
    assert!(e.booking.is_none());
    assert_eq!(r.workers.total_inflight(), 0, "explaining books nothing");
    let d = decide(&r, &parts(&[b"tenant-a"], &b)).unwrap();
    assert_eq!(e.pick, d.pick);
    assert_eq!(e.request.tokens, d.request.tokens);
    assert_eq!(e.request.hashes, d.request.hashes);
    assert_eq!(
        e.request.hashes.sequence.len(),
        4,
        "the partial block is not hashed"
    );
    assert_eq!(
        e.request.salt.as_ref().map(Salt::fingerprint),
        d.request.salt.as_ref().map(Salt::fingerprint)
    );
    // The loser is explained with the scoring terms the pick used.
    let loser = e.candidates.iter().find(|c| c.worker != holder).unwrap();
    let Standing::Lost(s, Loss::HigherCost(by)) = loser.standing else {
        panic!("{:?}", loser.standing)
    };
    let Standing::Picked(p) = e
        .candidates
        .iter()
        .find(|c| c.worker == holder)
        .unwrap()
        .standing
    else {
        panic!()
    };
    assert!((s.cost - p.cost - by).abs() < 1e-12);
    assert!((s.terms.prefix + s.terms.queue + s.terms.kv_usage - s.cost).abs() < 1e-12);
    assert_eq!((p.candidate.device_blocks, p.cached_blocks), (4, 4.0));
}

#[test]
fn conformance_order_is_a_candidate_constraint() {
    let r = router("");
    let order: Vec<IpAddr> = vec!["10.0.0.9".parse().unwrap(), "10.0.0.2".parse().unwrap()];
    let req = RequestParts {
        conformance: Some(&order),
        ..RequestParts::default()
    };
    for _ in 0..3 {
        let d = explain(&r, &req).unwrap();
        assert_eq!(d.pick.to_string(), "10.0.0.2:8000");
        let other = d.candidates.iter().find(|c| c.worker != d.pick).unwrap();
        assert_eq!(
            other.standing,
            Standing::Excluded(Exclusion::NotInConformanceList)
        );
    }
    let both: Vec<IpAddr> = vec!["10.0.0.2".parse().unwrap(), "10.0.0.1".parse().unwrap()];
    let d = explain(
        &r,
        &RequestParts {
            conformance: Some(&both),
            ..RequestParts::default()
        },
    )
    .unwrap();
    assert_eq!(d.pick.to_string(), "10.0.0.2:8000");
    let other = d.candidates.iter().find(|c| c.worker != d.pick).unwrap();
    assert_eq!(
        other.standing,
        Standing::Excluded(Exclusion::ConformanceOrder("10.0.0.2".parse().unwrap()))
    );
    let none: Vec<IpAddr> = vec!["10.9.9.9".parse().unwrap()];
    let err = explain(
        &r,
        &RequestParts {
            conformance: Some(&none),
            ..RequestParts::default()
        },
    )
    .unwrap_err();
    assert_eq!(err.to_string(), "no ready endpoint in the requested subset");
}

#[test]
fn refusals_in_pipeline_order() {
    let c = Config::from_yaml(
        "models: [{name: m, block_size: 4, max_prompt_tokens: 3}]
workers: [{endpoint: '10.0.0.1:8000', model: m}]",
    )
    .unwrap();
    let r = c.picker(Arc::new(Metrics::new())).unwrap();
    type Case<'a> = (&'a [u8], &'a [&'a [u8]], &'a str);
    let cases: Vec<Case> = vec![
        (b"not json", &[], "rejected_bad_request"),
        (
            br#"{"model":"m","prompt":[1]}"#,
            &[b"a", b"b"],
            "rejected_bad_salt",
        ),
        (
            br#"{"model":"m","prompt":[1,2,3,4]}"#,
            &[],
            "rejected_prompt_too_long",
        ),
    ];
    for (b, tenant, outcome) in cases {
        let err = understand(&r, &parts(tenant, b)).unwrap_err();
        assert_eq!(err.outcome(), outcome, "{err}");
        assert_eq!(err.status(), 400);
    }
}

#[test]
fn debug_output_never_shows_the_salt() {
    let r = router("");
    let b = br#"{"model":"m","prompt":[1,2,3,4],"cache_salt":"secret-body"}"#;
    let d = decide(&r, &parts(&[b"secret-tenant"], b)).unwrap();
    let text = format!("{d:?} {:?}", parts(&[b"secret-tenant"], b));
    assert!(!text.contains("secret"), "{text}");
    let salt = d.request.salt.as_ref().unwrap();
    assert!(text.contains(&salt.fingerprint().to_string()), "{text}");
    assert_eq!(salt.source(), SaltSource::Header);
    let forwarded = String::from_utf8(d.request.rewritten_body.clone().unwrap()).unwrap();
    assert!(forwarded.contains("kvepp:secret-tenant") && !forwarded.contains("secret-body"));
}

#[test]
fn a_text_prompt_over_the_limit_is_refused_before_it_is_tokenized_whole() {
    let fixtures = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tokenizer/small-bpe"
    );
    let c = Config::from_yaml(&format!(
        "models: [{{name: m, block_size: 4, max_prompt_tokens: 50, tokenizer: {{path: '{fixtures}'}}}}]
workers: [{{endpoint: '10.0.0.1:8000', model: m}}]"
    ))
    .unwrap();
    let r = c.picker(Arc::new(Metrics::new())).unwrap();
    let chat = |text: String| {
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": text}]})
            .to_string()
            .into_bytes()
    };
    let chat_parts = |b: &'static [u8]| RequestParts {
        path: "/v1/chat/completions",
        body: Some(b),
        ..RequestParts::default()
    };
    let short: &'static [u8] = chat("hello there".into()).leak();
    assert!(understand(&r, &chat_parts(short)).is_ok());
    // Far over: known from the length, or after the first segments; the count is a lower bound.
    let long: &'static [u8] = chat("many words on many lines\n".repeat(20_000)).leak();
    let err = understand(&r, &chat_parts(long)).unwrap_err();
    assert_eq!(err.outcome(), "rejected_prompt_too_long", "{err}");
    assert_eq!(err.status(), 400);
    match err {
        Reject::PromptTooLong { tokens, max, .. } => {
            assert_eq!(max, 50);
            assert!(tokens > 50 && tokens < 10_000, "{tokens}");
        }
        other => panic!("{other}"),
    }
}

/// A picker whose model `m` renders chats with the llama3 fixture template (which raises on a
/// conversation that does not alternate user/assistant).
fn chat_router(policy: &str) -> Picker {
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizer");
    let yaml = format!(
        "routing: {{unrenderable: {policy}}}
models: [{{name: m, block_size: 4, tokenizer: {{path: '{fixtures}/small-bpe', chat_template: '{fixtures}/templates/llama3.jinja'}}}}]
workers: [{{endpoint: '10.0.0.1:8000', model: m}}]"
    );
    let c = Config::from_yaml(&yaml).unwrap();
    c.validate().unwrap();
    c.picker(Arc::new(Metrics::new())).unwrap()
}

fn chat_parts(body: &[u8]) -> RequestParts<'_> {
    RequestParts {
        path: "/v1/chat/completions",
        body: Some(body),
        ..RequestParts::default()
    }
}

#[test]
fn unrenderable_requests_route_on_load_or_are_refused_as_configured() {
    let raises = br#"{"model":"m","messages":[{"role":"assistant","content":"first"},{"role":"user","content":"hi"}]}"#;
    let untrusted =
        br#"{"model":"m","chat_template":"{{ 'x' }}","messages":[{"role":"user","content":"hi"}]}"#;
    let malformed = br#"{"model":"m","messages":[]}"#;
    let fine = br#"{"model":"m","messages":[{"role":"developer","content":"be brief"},{"role":"user","content":"hi"}]}"#;

    let load_only = chat_router("load_only");
    for (body, reason) in [
        (&raises[..], "template_rejected"),
        (&untrusted[..], "request_chat_template"),
    ] {
        let d = decide(&load_only, &chat_parts(body)).unwrap();
        assert_eq!(d.request.unrenderable_reason(), Some(reason));
        assert!(d.request.tokens.is_none() && d.request.hashes.sequence.is_empty());
        assert_eq!(d.cached_blocks, 0.0);
    }
    let d = decide(&load_only, &chat_parts(fine)).unwrap();
    assert_eq!(d.request.unrenderable_reason(), None);
    assert!(
        d.request.tokens.is_some(),
        "developer is rendered as system"
    );
    assert!(matches!(
        decide(&load_only, &chat_parts(malformed)),
        Err(Reject::BadPrompt { .. })
    ));

    let reject = chat_router("reject");
    for body in [&raises[..], &untrusted[..], &malformed[..]] {
        let e = decide(&reject, &chat_parts(body)).unwrap_err();
        assert!(matches!(e, Reject::BadPrompt { .. }), "{e:?}");
        assert_eq!(e.status(), 400);
    }
    assert!(Config::from_yaml("routing: {unrenderable: maybe}").is_err());

    // /v1/responses: messages are tokenized; items not mapped yet route on load, counted.
    let responses = |body: &'static [u8]| RequestParts {
        path: "/v1/responses",
        body: Some(body),
        ..RequestParts::default()
    };
    let d = decide(
        &load_only,
        &responses(br#"{"model":"m","input":"hi","instructions":"be brief"}"#),
    )
    .unwrap();
    assert!(d.request.tokens.as_ref().is_some_and(|t| !t.is_empty()));
    let d = decide(
        &load_only,
        &responses(
            br#"{"model":"m","input":[{"type":"function_call_output","call_id":"c","output":"x"}]}"#,
        ),
    )
    .unwrap();
    assert_eq!(d.request.unrenderable_reason(), Some("responses_input"));
}

/// `tokenizer.max_word_bytes`: a chat with a longer word is routed on load (`long_word`), or
/// refused with 400 under `routing.unrenderable: reject`; shorter words are tokenized; 0 is
/// refused at start.
#[test]
fn the_word_limit_is_a_model_setting() {
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizer");
    let router = |policy: &str, max: usize| {
        let yaml = format!(
            "routing: {{unrenderable: {policy}}}
models: [{{name: m, block_size: 4, tokenizer: {{path: '{fixtures}/small-bpe', max_word_bytes: {max}}}}}]
workers: [{{endpoint: '10.0.0.1:8000', model: m}}]"
        );
        let c = Config::from_yaml(&yaml).unwrap();
        c.validate().unwrap();
        c.picker(Arc::new(Metrics::new()))
    };
    let short = br#"{"model":"m","messages":[{"role":"user","content":"a few short words"}]}"#;
    let long = br#"{"model":"m","messages":[{"role":"user","content":"a few short words, then supercalifragilistic"}]}"#;
    let load_only = router("load_only", 12).unwrap();
    let d = decide(&load_only, &chat_parts(short)).unwrap();
    assert!(d.request.tokens.is_some());
    let d = decide(&load_only, &chat_parts(long)).unwrap();
    assert_eq!(d.request.unrenderable_reason(), Some("long_word"));
    assert!(d.request.tokens.is_none());
    let reject = router("reject", 12).unwrap();
    let e = decide(&reject, &chat_parts(long)).unwrap_err();
    assert_eq!(e.status(), 400);
    assert!(e.to_string().contains("split point"), "{e}");
    assert!(decide(&reject, &chat_parts(short)).is_ok());
    assert!(router("load_only", 0).is_err());
}

#[test]
fn tokens_digest_is_xxh3_of_the_little_endian_token_bytes() {
    for n in [0usize, 1, 255, 256, 257, 5000] {
        let tokens: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(
            super::tokens_digest(&tokens),
            xxhash_rust::xxh3::xxh3_64(&bytes),
            "{n} tokens"
        );
    }
}
