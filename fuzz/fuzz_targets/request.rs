//! A client's request body: the two readers agree, and the salt rewrite changes only the salt.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kv_epp::fuzzing::request_body(data));
