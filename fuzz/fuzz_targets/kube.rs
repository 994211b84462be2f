//! JSON from the Kubernetes API server (pools, Leases, EndpointSlices).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kv_epp::fuzzing::kube_object(data));
