//! An engine's HTTP/1.1 response as kv-epp's client reads it (1 KiB body cap).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kv_epp::fuzzing::http_response(data));
