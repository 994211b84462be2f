//! An engine's HTTP/1.1 response as kv-epp's client reads it (1 KiB body cap).
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
    RT.block_on(kv_epp::fuzzing::http_response(data));
});
