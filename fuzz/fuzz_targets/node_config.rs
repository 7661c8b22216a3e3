//! The node config: `NodeConfig::from_toml` on config.toml text, the shim's lenient read of
//! `runc_path` from the same text, and the same bytes as the config a manager publishes
//! (`PublishedConfig::from_json`), which the shim and the device plugin read. Properties: no
//! panic; every refusal is one line; an accepted config published by a manager is read back
//! as the same config.

#![no_main]

use std::path::Path;

use gpu_mps_api::NodeConfig;
use gpu_mps_api::node_config::{MAX_ROOT_LEN, PublishedConfig};
use gpu_mps_fuzz::assert_one_line;
use gpu_mps_shim::node_files::runc_path_from_toml;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("/etc/gpu-mps/config.toml");

    if let Err(message) = runc_path_from_toml(text) {
        assert_one_line(&message);
    }
    if let Err(message) = PublishedConfig::from_json(text) {
        assert_one_line(&message);
    }

    let config = match NodeConfig::from_toml(text, path) {
        Ok(config) => config,
        Err(e) => {
            assert_one_line(&e);
            return;
        }
    };
    assert!(config.root.is_absolute() && config.root.as_os_str().len() <= MAX_ROOT_LEN);
    assert!((1..=48).contains(&config.limits.default_cuda_processes));
    if let Some(defaults) = config.limits.default_limits {
        assert_eq!(
            config
                .limits.maxima
                .check(defaults, config.limits.default_cuda_processes, "this node"),
            Ok(()),
            "the node defaults break its own maximums"
        );
    }
    let published = PublishedConfig::new(config.clone(), path, 1);
    let json = serde_json::to_string(&published).expect("a node config serializes");
    match PublishedConfig::from_json(&json) {
        Ok(read) => assert_eq!(read.config, config, "the published config reads back otherwise"),
        Err(message) => panic!("a manager's published config is refused: {message}"),
    }
});
