//! An SGLang worker's `/server_info` body.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kv_epp::fuzzing::server_info(data));
