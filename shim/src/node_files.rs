//! The node's files the shim reads: the node config and GPU inventory (shared with the other
//! components, gpu_mps_api::node_files), and, before anything else, the runc to exec.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use gpu_mps_api::NodeConfig;
use gpu_mps_api::message::{one_line, printable};
pub use gpu_mps_api::node_files::{
    ConfigOrigin, NodeFileError, load_config, load_effective_config, load_inventory,
};

/// The runc to exec, with as little work as possible: only `runc_path` is read, and a config
/// that fails validation elsewhere (a typo under `[limits]`) still gives it, so that `delete`
/// and `kill` keep reaching runc. The note says why the default was used, if it was.
pub fn runc_path(config_path: &Path) -> (PathBuf, Option<String>) {
    let default = || NodeConfig::default().runc_path;
    match fs::read_to_string(config_path) {
        Ok(text) => match runc_path_from_toml(&text) {
            Ok(Some(path)) => (path, None),
            Ok(None) => (default(), None),
            Err(message) => (default(), Some(format!("{}: {message}", config_path.display()))),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => (default(), None),
        Err(e) => (
            default(),
            Some(format!("cannot read {}: {e}", config_path.display())),
        ),
    }
}

/// `runc_path` from config text, without validating the rest.
pub fn runc_path_from_toml(text: &str) -> Result<Option<PathBuf>, String> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| one_line(e.message()))?;
    match table.get("runc_path") {
        None => Ok(None),
        Some(toml::Value::String(s)) => Ok(Some(PathBuf::from(s))),
        Some(other) => Err(format!(
            "runc_path = {}: expected a path string",
            printable(&other.to_string())
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_config_means_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        assert_eq!(load_config(&path).unwrap(), NodeConfig::default());
        assert_eq!(runc_path(&path), (NodeConfig::default().runc_path, None));
    }

    #[test]
    fn runc_path_survives_errors_elsewhere_in_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        fs::write(
            &path,
            "runc_path = \"/opt/runc\"\n[limits]\npolcy = \"ceiling\"\n",
        )
        .unwrap();
        assert!(load_config(&path).unwrap_err().to_string().contains("polcy"));
        assert_eq!(runc_path(&path), (PathBuf::from("/opt/runc"), None));
        fs::write(&path, "runc_path = [").unwrap();
        let (runc, note) = runc_path(&path);
        assert_eq!(runc, NodeConfig::default().runc_path);
        assert!(note.unwrap().contains("config.toml"));
        assert!(runc_path_from_toml("runc_path = 1").is_err());
    }

    #[test]
    fn a_toml_error_is_one_line() {
        // toml reports a duplicate table as two sentences on two lines.
        let e = runc_path_from_toml("[hook]\n[hook]\n").unwrap_err();
        assert!(e.contains("duplicate key") && !e.contains('\n'), "{e:?}");
        // Found by fuzzing: a runc_path of another type is quoted, multi-line strings and all.
        let e = runc_path_from_toml("runc_path = { a = \"\"\"\n/usr\nsbin\"\"\" }").unwrap_err();
        assert!(
            e.ends_with("expected a path string") && !e.contains('\n'),
            "{e:?}"
        );
    }
}
