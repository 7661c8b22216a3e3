//! Checks of containerd's effective config (`containerd config dump`) after install and
//! uninstall: what containerd will run, not what gpu-mps meant to write.

use gpu_mps_api::message::one_line;
use toml_edit::{DocumentMut, Item, TableLike, Value};

use super::layout::{lookup, same_item};
use super::{ConfigVersion, InstallOptions, RUNC_SHIM, RegistrationError, annotation_patterns};

/// Checks `containerd config dump` output: the runtime is in effect as registered, and the CRI
/// plugin will load (its default runtime has an entry). Returns warnings about settings that
/// differ from the runtime the entry copied (e.g. SystemdCgroup set in another drop-in).
pub fn check_effective(dump: &str, opts: &InstallOptions) -> Result<Vec<String>, RegistrationError> {
    let fail = |message: String| RegistrationError::NotInEffect {
        config: opts.main_config.clone(),
        message,
    };
    let doc = dump
        .parse::<DocumentMut>()
        .map_err(|e| fail(format!("not TOML: {}", one_line(&e.to_string()))))?;
    let (version, runtimes) =
        effective_runtimes(&doc).ok_or_else(|| fail("it has no CRI runtimes at all".into()))?;
    let name = &opts.runtime_name;
    let entry = runtimes.get(name).and_then(Item::as_table_like).ok_or_else(|| {
        fail(format!(
            "runtime {name:?} is missing: an import that redefines the {} plugin may hide it (containerd 1.x replaces whole plugin tables)",
            version.cri_runtime_plugin()
        ))
    })?;
    let runtime_type = entry.get("runtime_type").and_then(Item::as_str).unwrap_or("");
    if runtime_type != RUNC_SHIM {
        return Err(fail(format!(
            "runtime {name:?} has runtime_type = {runtime_type:?}, expected {RUNC_SHIM:?}"
        )));
    }
    let options = entry.get("options").and_then(Item::as_table_like);
    let binary = options
        .and_then(|o| o.get("BinaryName"))
        .and_then(Item::as_str)
        .unwrap_or("");
    let shim = opts.shim_path.display().to_string();
    if binary != shim {
        return Err(fail(format!(
            "runtime {name:?} has options.BinaryName = {binary:?}, expected {shim:?}"
        )));
    }
    for key in ["pod_annotations", "container_annotations"] {
        let listed: Vec<&str> = entry
            .get(key)
            .and_then(Item::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if let Some(missing) = annotation_patterns(key).iter().find(|p| !listed.contains(*p)) {
            return Err(fail(format!(
                "runtime {name:?} has {key} = {listed:?}, without {missing:?}"
            )));
        }
    }
    check_default_runtime(&doc, version, runtimes).map_err(fail)?;
    let mut warnings = Vec::new();
    let base_name = opts.base_runtime.as_deref().unwrap_or("runc");
    let base_options = runtimes
        .get(base_name)
        .and_then(Item::as_table_like)
        .and_then(|b| b.get("options"))
        .and_then(Item::as_table_like);
    if let (Some(ours), Some(theirs)) = (options, base_options) {
        let mut keys: Vec<&str> = ours
            .iter()
            .map(|(k, _)| k)
            .chain(theirs.iter().map(|(k, _)| k))
            .collect();
        keys.sort_unstable();
        keys.dedup();
        for key in keys.into_iter().filter(|k| *k != "BinaryName") {
            let (a, b) = (ours.get(key), theirs.get(key));
            let same = match (a, b) {
                (Some(a), Some(b)) => same_item(a, b),
                // containerd decodes runc options as protobuf: unset is the zero value.
                (Some(x), None) | (None, Some(x)) => is_zero(x),
                (None, None) => true,
            };
            if !same {
                warnings.push(format!(
                    "runtime {name:?} has options.{key} = {}, but {base_name:?} has {}: set it in the {base_name:?} entry of {} and rerun install-containerd",
                    show(a),
                    show(b),
                    opts.main_config.display()
                ));
            }
        }
    }
    Ok(warnings)
}

/// Checks `containerd config dump` output after uninstall: the runtime is gone and the CRI plugin
/// will still load.
pub fn check_removed(dump: &str, opts: &InstallOptions) -> Result<(), RegistrationError> {
    let fail = |message: String| RegistrationError::NotInEffect {
        config: opts.main_config.clone(),
        message,
    };
    let doc = dump
        .parse::<DocumentMut>()
        .map_err(|e| fail(format!("not TOML: {}", one_line(&e.to_string()))))?;
    let Some((version, runtimes)) = effective_runtimes(&doc) else {
        return Ok(());
    };
    if runtimes.contains_key(&opts.runtime_name) {
        return Err(fail(format!(
            "runtime {:?} is still configured after uninstall: another file defines it",
            opts.runtime_name
        )));
    }
    check_default_runtime(&doc, version, runtimes).map_err(fail)
}

/// The CRI runtimes of a `config dump`, in whichever layout containerd printed it.
fn effective_runtimes(doc: &DocumentMut) -> Option<(ConfigVersion, &dyn TableLike)> {
    [ConfigVersion::V3, ConfigVersion::V2].into_iter().find_map(|v| {
        lookup(doc.as_table(), &v.runtimes_path())
            .and_then(Item::as_table_like)
            .map(|r| (v, r))
    })
}

/// The CRI plugin refuses to load when its default runtime has no entry (containerd 1.x checks
/// this at start; `config dump` does not).
fn check_default_runtime(
    doc: &DocumentMut,
    version: ConfigVersion,
    runtimes: &dyn TableLike,
) -> Result<(), String> {
    let containerd = lookup(doc.as_table(), &version.containerd_path()).and_then(Item::as_table_like);
    let default = containerd
        .and_then(|c| c.get("default_runtime_name"))
        .and_then(Item::as_str)
        .unwrap_or("runc");
    if !default.is_empty() && !runtimes.contains_key(default) {
        return Err(format!(
            "default_runtime_name = {default:?} has no entry, so the CRI plugin will not load: add a [...runtimes.{default}] entry"
        ));
    }
    Ok(())
}

fn is_zero(item: &Item) -> bool {
    match item.as_value() {
        Some(Value::String(s)) => s.value().is_empty(),
        Some(Value::Integer(i)) => *i.value() == 0,
        Some(Value::Float(f)) => *f.value() == 0.0,
        Some(Value::Boolean(b)) => !*b.value(),
        Some(Value::Array(a)) => a.is_empty(),
        Some(Value::InlineTable(t)) => t.is_empty(),
        Some(Value::Datetime(_)) => false,
        None => item.as_table_like().is_some_and(|t| t.is_empty()),
    }
}

fn show(item: Option<&Item>) -> String {
    item.and_then(Item::as_value)
        .map(|v| v.to_string().trim().to_owned())
        .unwrap_or_else(|| "(unset)".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::containerd_registration::fixtures::opts;

    const DUMP_V3: &str = r#"version = 3
[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = 'runc'
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.gpu-mps]
    runtime_type = 'io.containerd.runc.v2'
    pod_annotations = ['gpu-mps.io/*', '*.gpu-mps.io/*']
    container_annotations = ['gpu-mps.io/*', '*.gpu-mps.io/*', 'cdi.k8s.io/*', 'gpu-mps-device-plugin/*']
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.gpu-mps.options]
      BinaryName = '/usr/local/bin/gpu-mps-shim'
      SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = 'io.containerd.runc.v2'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = ''
      SystemdCgroup = true
"#;

    #[test]
    fn effective_config_checks() {
        let o = opts(None);
        let warnings = check_effective(DUMP_V3, &o).expect("in effect");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("options.SystemdCgroup = false, but \"runc\" has true"),
            "{}",
            warnings[0]
        );
        // Unset and zero are the same to containerd.
        let unset = DUMP_V3
            .replace("      SystemdCgroup = false\n", "")
            .replace("BinaryName = ''", "BinaryName = ''\n      IoUid = 0");
        let warnings = check_effective(&unset, &o).expect("in effect");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("options.SystemdCgroup = (unset), but \"runc\" has true"),
            "{}",
            warnings[0]
        );
        let missing = DUMP_V3.replace("runtimes.gpu-mps", "runtimes.other");
        let e = check_effective(&missing, &o).expect_err("missing").to_string();
        assert!(e.contains("runtime \"gpu-mps\" is missing"), "{e}");
        let no_runc = DUMP_V3.replace("runtimes.runc", "runtimes.crun");
        let e = check_effective(&no_runc, &o).expect_err("no default").to_string();
        assert!(e.contains("default_runtime_name = \"runc\" has no entry"), "{e}");
        let wrong = DUMP_V3.replace("'/usr/local/bin/gpu-mps-shim'", "''");
        assert!(
            check_effective(&wrong, &o)
                .expect_err("binary")
                .to_string()
                .contains("options.BinaryName = \"\"")
        );
        let annotations = DUMP_V3.replacen("'*.gpu-mps.io/*'", "'x'", 1);
        assert!(
            check_effective(&annotations, &o)
                .expect_err("annotations")
                .to_string()
                .contains("*.gpu-mps.io/*")
        );
    }
}
