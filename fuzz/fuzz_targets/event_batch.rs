//! A ZeroMQ payload frame (vLLM, SGLang, TensorRT-LLM dialects) applied to a worker's index.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kv_epp::fuzzing::event_batch(data));
