//! Compiles `proto/` (kv-epp's own gRPC APIs) with protox, a pure-Rust protobuf compiler, so a
//! fresh machine needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/kvepp/replica/v1/replica.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
