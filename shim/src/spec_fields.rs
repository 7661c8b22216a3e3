//! The parts of config.json the shim reads or edits, checked against the OCI runtime spec.
//!
//! The spec stays a `serde_json::Value` so that every field the shim does not own (and ones
//! the oci-spec crate does not know) is written back as it came. Each part the shim touches is
//! deserialized into its oci-spec type first, so a malformed part fails the create with a
//! message instead of being edited blindly. The whole spec is deliberately not deserialized:
//! oci-spec rejects capability names and namespace types newer than the crate, and a valid spec
//! from a newer containerd must not fail a create.

use std::collections::HashMap;

use gpu_mps_api::message::printable;
use oci_spec::runtime::{Hooks, Mount};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum SpecError {
    #[error("config.json is not valid JSON: {0}")]
    Json(String),
    #[error("config.json is not a JSON object")]
    NotAnObject,
    /// `message` is serde's, which quotes an unknown name as the spec spells it: shown with
    /// its control characters escaped.
    #[error("config.json: {field}: {}", printable(.message))]
    Field { field: &'static str, message: String },
}

/// Reads `spec[path...]` as `T`; `None` when absent or null.
fn read<T: DeserializeOwned>(spec: &Value, field: &'static str) -> Result<Option<T>, SpecError> {
    let mut at = spec;
    for key in field.split('.') {
        match at.get(key) {
            Some(Value::Null) | None => return Ok(None),
            Some(v) => at = v,
        }
    }
    T::deserialize(at).map(Some).map_err(|e| SpecError::Field {
        field,
        message: e.to_string(),
    })
}

/// The top level as an object.
pub fn root_object(spec: &mut Value) -> Result<&mut Map<String, Value>, SpecError> {
    spec.as_object_mut().ok_or(SpecError::NotAnObject)
}

/// Parses config.json text, which must be a JSON object.
pub fn parse(text: &str) -> Result<Value, SpecError> {
    let value: Value = serde_json::from_str(text).map_err(|e| SpecError::Json(e.to_string()))?;
    if !value.is_object() {
        return Err(SpecError::NotAnObject);
    }
    Ok(value)
}

/// `annotations` (absent: empty).
pub fn annotations(spec: &Value) -> Result<HashMap<String, String>, SpecError> {
    Ok(read(spec, "annotations")?.unwrap_or_default())
}

/// `process.env` (absent: empty).
pub fn env(spec: &Value) -> Result<Vec<String>, SpecError> {
    Ok(read(spec, "process.env")?.unwrap_or_default())
}

/// `mounts` as oci-spec mounts, in order (absent: empty).
pub fn mounts(spec: &Value) -> Result<Vec<Mount>, SpecError> {
    Ok(read(spec, "mounts")?.unwrap_or_default())
}

/// One entry of `linux.devices`: a device node runc creates in the container. Read into a type
/// of its own rather than oci-spec's `LinuxDevice`, which turns an absent major or minor into 0
/// and so cannot tell "no numbers" from `/dev/nvidia0`'s own 195:0.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct DeviceNode {
    pub path: String,
    #[serde(rename = "type")]
    pub kind: DeviceKind,
    #[serde(default)]
    pub major: Option<i64>,
    #[serde(default)]
    pub minor: Option<i64>,
}

/// The device types of the OCI runtime spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum DeviceKind {
    #[serde(rename = "c")]
    Char,
    /// Unbuffered character device: a character device too.
    #[serde(rename = "u")]
    Unbuffered,
    #[serde(rename = "b")]
    Block,
    #[serde(rename = "p")]
    Fifo,
}

impl DeviceKind {
    pub fn is_char(self) -> bool {
        matches!(self, DeviceKind::Char | DeviceKind::Unbuffered)
    }
}

/// `linux.devices` (absent: empty). An entry that is not an OCI device fails with its position
/// and what it must look like.
pub fn linux_devices(spec: &Value) -> Result<Vec<DeviceNode>, SpecError> {
    let entries: Vec<Value> = read(spec, "linux.devices")?.unwrap_or_default();
    entries
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            DeviceNode::deserialize(entry).map_err(|e| SpecError::Field {
                field: "linux.devices",
                message: format!(
                    "entry {i} {entry}: {e}: each entry is {{\"path\", \"type\": c|u|b|p, \"major\", \"minor\"}} as in the OCI runtime spec (fix the device plugin, CDI spec or runtime that added it)"
                ),
            })
        })
        .collect()
}

/// `hooks` (absent: none).
pub fn hooks(spec: &Value) -> Result<Option<Hooks>, SpecError> {
    read(spec, "hooks")
}

/// `linux.maskedPaths` (absent: empty).
pub fn masked_paths(spec: &Value) -> Result<Vec<String>, SpecError> {
    Ok(read(spec, "linux.maskedPaths")?.unwrap_or_default())
}

/// The object at `parent[key]`, created empty when absent or null.
pub fn object_entry<'a>(
    parent: &'a mut Map<String, Value>,
    key: &str,
    field: &'static str,
) -> Result<&'a mut Map<String, Value>, SpecError> {
    let slot = parent.entry(key).or_insert(Value::Null);
    if slot.is_null() {
        *slot = Value::Object(Map::new());
    }
    slot.as_object_mut().ok_or(SpecError::Field {
        field,
        message: "not an object".into(),
    })
}

/// The array at `parent[key]`, created empty when absent or null.
pub fn array_entry<'a>(
    parent: &'a mut Map<String, Value>,
    key: &str,
    field: &'static str,
) -> Result<&'a mut Vec<Value>, SpecError> {
    let slot = parent.entry(key).or_insert(Value::Null);
    if slot.is_null() {
        *slot = Value::Array(Vec::new());
    }
    slot.as_array_mut().ok_or(SpecError::Field {
        field,
        message: "not an array".into(),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn absent_and_null_parts_are_empty() {
        let spec = json!({ "process": { "env": null }, "hooks": null });
        assert!(env(&spec).unwrap().is_empty());
        assert!(annotations(&spec).unwrap().is_empty());
        assert!(mounts(&spec).unwrap().is_empty());
        assert!(hooks(&spec).unwrap().is_none());
        assert!(masked_paths(&spec).unwrap().is_empty());
        assert!(linux_devices(&spec).unwrap().is_empty());
        assert!(
            linux_devices(&json!({ "linux": { "devices": null } }))
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn linux_devices_keep_absent_numbers_absent() {
        let spec = json!({ "linux": { "devices": [
            { "path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 438, "uid": 0 },
            { "path": "/dev/nvidia1", "type": "u" },
            { "path": "/dev/sda", "type": "b", "major": 8, "minor": 0 }
        ] } });
        let devices = linux_devices(&spec).unwrap();
        assert_eq!(
            devices[0],
            DeviceNode {
                path: "/dev/nvidia0".into(),
                kind: DeviceKind::Char,
                major: Some(195),
                minor: Some(0)
            }
        );
        assert_eq!((devices[1].major, devices[1].minor), (None, None));
        assert!(devices[1].kind.is_char() && !devices[2].kind.is_char());
    }

    #[test]
    fn malformed_parts_name_the_field() {
        let cases = [
            (json!({ "process": { "env": "A=1" } }), "process.env"),
            (json!({ "process": { "env": [1] } }), "process.env"),
            (json!({ "annotations": { "a": 1 } }), "annotations"),
            (json!({ "mounts": [{ "type": "bind" }] }), "mounts"),
            (json!({ "linux": { "maskedPaths": "/x" } }), "linux.maskedPaths"),
            (json!({ "hooks": { "poststop": [{ "args": [] }] } }), "hooks"),
            (json!({ "linux": { "devices": {} } }), "linux.devices"),
            (
                json!({ "linux": { "devices": [{ "path": "/dev/nvidia0", "type": "c", "major": "195" }] } }),
                "linux.devices",
            ),
            (
                json!({ "linux": { "devices": [{ "path": "/dev/nvidia0", "type": "x" }] } }),
                "linux.devices",
            ),
            (
                json!({ "linux": { "devices": [{ "type": "c", "major": 195, "minor": 0 }] } }),
                "linux.devices",
            ),
        ];
        for (spec, field) in cases {
            let errors = [
                env(&spec).err(),
                annotations(&spec).err(),
                mounts(&spec).err(),
                masked_paths(&spec).err(),
                hooks(&spec).err(),
                linux_devices(&spec).err(),
            ];
            let e = errors
                .into_iter()
                .flatten()
                .next()
                .unwrap_or_else(|| panic!("{spec} passed"));
            assert!(
                e.to_string().starts_with(&format!("config.json: {field}: ")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_malformed_part_is_refused_in_one_line_whatever_it_holds() {
        // serde quotes an unknown enum variant or field name as it is, line breaks and all.
        let spec = json!({ "linux": { "devices": [{ "path": "/dev/nvidia0", "type": "c\nx" }] } });
        let e = linux_devices(&spec).unwrap_err().to_string();
        assert!(e.contains("unknown variant `c\\nx`") && !e.contains('\n'), "{e}");
        let spec = json!({ "hooks": { "prestart\r\n": [] } });
        if let Err(e) = hooks(&spec) {
            assert!(!e.to_string().contains(['\n', '\r']), "{e}");
        }
        let spec = json!({ "mounts": [{ "destination": "/x", "type": "bind", "\nuid": [] }] });
        if let Err(e) = mounts(&spec) {
            assert!(!e.to_string().contains('\n'), "{e}");
        }
    }

    #[test]
    fn numbers_the_shim_does_not_own_are_written_back_exactly() {
        // Parsed to the nearest f64 and printed shortest, each reads back as written; a parse
        // one ulp off would change a field of the pod's spec at every create.
        let text =
            r#"{"linux":{"resources":{"memory":{"limit":2.2222222222222223e+74}}},"x":[0.1,1e-7,2.5]}"#;
        assert_eq!(parse(text).unwrap().to_string(), text);
        // An integer beyond u64 becomes the nearest f64 too (found by fuzzing: it was one off,
        // so a second rewrite of the same spec changed it again).
        let big = format!("{{\"limit\":{}17179869184}}", "2".repeat(64));
        assert_eq!(
            parse(&big).unwrap().to_string(),
            r#"{"limit":2.2222222222222223e+74}"#
        );
    }

    #[test]
    fn top_level_must_be_an_object() {
        assert!(matches!(parse("[]"), Err(SpecError::NotAnObject)));
        assert!(matches!(parse("{"), Err(SpecError::Json(_))));
    }
}
