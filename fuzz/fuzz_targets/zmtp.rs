//! A ZeroMQ peer's bytes (greeting, handshake, frames) read by kv-epp's ZMTP client, each
//! message handed to a vLLM feed as a published message.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use tokio::runtime::{Builder, Runtime};

static RT: LazyLock<Runtime> = LazyLock::new(|| {
    Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime")
});

fuzz_target!(|data: &[u8]| {
    RT.block_on(kv_epp::fuzzing::zmtp_peer(data));
});
