//! A TensorRT-LLM `/kv_cache_events` drain response.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kv_epp::fuzzing::trtllm_drain(data));
