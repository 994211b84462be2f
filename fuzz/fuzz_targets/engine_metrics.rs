//! An engine's Prometheus `/metrics` page.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kv_epp::fuzzing::engine_metrics(data));
