//! One msgpack value read by the event decoder's reader: whatever it accepts, rmpv must read
//! too, to the same length.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(len) = kv_epp::fuzzing::msgpack_value(data) {
        let mut value = &data[..len];
        rmpv::decode::read_value(&mut value)
            .unwrap_or_else(|e| panic!("rmpv refuses what our reader accepted ({e}): {data:02x?}"));
        assert!(value.is_empty(), "rmpv read a shorter value: {data:02x?}");
    }
});
