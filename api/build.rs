// Generates the ttrpc client/server code for proto/manager.proto with the pure-Rust
// protobuf parser: no protoc is needed to build the node components.
use std::path::PathBuf;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    ttrpc_codegen::Codegen::new()
        .out_dir(&out)
        .inputs(["proto/manager.proto"])
        .include("proto")
        .rust_protobuf()
        // The manager serves asynchronously (tokio); the hook and the CLI are short-lived
        // synchronous clients.
        .customize(ttrpc_codegen::Customize {
            async_server: true,
            ..Default::default()
        })
        .run()
        .expect("generating the ttrpc code for proto/manager.proto");
    // The generated files start with inner attributes (`#![allow(...)]`), which `include!`
    // cannot take; src/lib.rs puts the equivalent outer attributes on the modules instead.
    for name in ["manager.rs", "manager_ttrpc.rs"] {
        let path = out.join(name);
        let text = std::fs::read_to_string(&path).expect("reading generated code");
        let kept: Vec<&str> = text
            .lines()
            .filter(|l| !(l.trim_start().starts_with("#![") || l.trim_start().starts_with("//!")))
            .collect();
        std::fs::write(&path, kept.join("\n")).expect("writing generated code");
    }
    println!("cargo:rerun-if-changed=proto/manager.proto");
}
