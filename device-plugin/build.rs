// Generates kubelet's device plugin API (proto/v1beta1.proto): the plugin's server and the
// Registration client, and for the test kubelet (tests/e2e) the other two sides.
fn main() {
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&["proto/v1beta1.proto"], &["proto"])
        .expect("generating the device plugin API from proto/v1beta1.proto (needs protoc: apt-get install protobuf-compiler)");
}
