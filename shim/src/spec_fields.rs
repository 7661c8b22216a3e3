//! The parts of config.json the shim reads or edits, checked against the OCI runtime spec.
//!
//! The spec stays a `serde_json::Value` so that every field the shim does not own (and ones
//! the oci-spec crate does not know) is written back as it came. Each part the shim touches is
//! deserialized into its oci-spec type first, so a malformed part fails the create with a
//! message instead of being edited blindly. The whole spec is deliberately not deserialized:
//! oci-spec rejects capability names and namespace types newer than the crate, and a valid spec
//! from a newer containerd must not fail a create.

use std::collections::HashMap;

use oci_spec::runtime::{Hooks, Mount};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum SpecError {
    #[error("config.json is not valid JSON: {0}")]
    Json(String),
    #[error("config.json is not a JSON object")]
    NotAnObject,
    #[error("config.json: {field}: {message}")]
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
        ];
        for (spec, field) in cases {
            let errors = [
                env(&spec).err(),
                annotations(&spec).err(),
                mounts(&spec).err(),
                masked_paths(&spec).err(),
                hooks(&spec).err(),
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
    fn top_level_must_be_an_object() {
        assert!(matches!(parse("[]"), Err(SpecError::NotAnObject)));
        assert!(matches!(parse("{"), Err(SpecError::Json(_))));
    }
}
