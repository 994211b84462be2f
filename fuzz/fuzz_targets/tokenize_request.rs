//! A client's request body as the tokenizer crate parses it, for each endpoint it serves.
#![no_main]

use kv_epp_tokenize::{Endpoint, parse_request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for endpoint in [
        Endpoint::ChatCompletions,
        Endpoint::Completions,
        Endpoint::Responses,
    ] {
        let _ = parse_request(endpoint, data);
    }
});
