//! A ZeroMQ peer's bytes (greeting, handshake, frames) read by kv-epp's ZMTP client, each
//! message handed to a vLLM feed as a published message.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kv_epp::fuzzing::zmtp_peer(data));
