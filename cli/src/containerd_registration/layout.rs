//! Reading and editing the TOML tree of a containerd config while keeping its formatting: where
//! the tables are, how the new lines are indented, and whether two entries say the same.

use std::path::Path;

use toml_edit::{Item, Table, TableLike, Value};

use super::{ConfigVersion, RegistrationError};

/// Indentation of the tables and keys gpu-mps writes, taken from the file around them so the
/// entry reads like its neighbours (containerd's own `config default` indents by nesting).
pub(super) struct Style {
    header: String,
    keys: String,
    options_header: String,
    options_keys: String,
}

impl Style {
    pub(super) fn flat() -> Style {
        Style {
            header: String::new(),
            keys: String::new(),
            options_header: String::new(),
            options_keys: String::new(),
        }
    }

    pub(super) fn for_entry(root: &Table, version: ConfigVersion, base: Option<&str>) -> Style {
        let runtimes_path = version.runtimes_path();
        let base_table = base.and_then(|name| {
            lookup(root, &runtimes_path)
                .and_then(Item::as_table)
                .and_then(|r| r.get(name))
                .and_then(Item::as_table)
                .filter(|t| !t.is_dotted())
        });
        let deeper = |indent: &str| {
            if indent.is_empty() {
                String::new()
            } else {
                format!("{indent}  ")
            }
        };
        let (header, keys, options) = match base_table {
            Some(t) => {
                let header = header_indent(t);
                let keys = first_key_indent(t).unwrap_or_else(|| deeper(&header));
                (header, keys, t.get("options").and_then(Item::as_table))
            }
            None => {
                // The closest table with a header of its own along the path.
                let ancestor = (1..=runtimes_path.len()).rev().find_map(|depth| {
                    lookup(root, &runtimes_path[..depth])
                        .and_then(Item::as_table)
                        .filter(|t| !t.is_implicit() && t.position().is_some())
                });
                let header = ancestor
                    .map(|t| deeper(&first_key_indent(t).unwrap_or_else(|| header_indent(t))))
                    .unwrap_or_default();
                let keys = deeper(&header);
                (header, keys, None)
            }
        };
        let options_header = options.map(header_indent).unwrap_or_else(|| keys.clone());
        let options_keys = options
            .and_then(first_key_indent)
            .unwrap_or_else(|| deeper(&options_header));
        Style {
            header,
            keys,
            options_header,
            options_keys,
        }
    }

    /// Sets indentation on a freshly built entry (and its `options`), with `marker` as a comment
    /// above its header.
    pub(super) fn format(&self, entry: &mut Table, marker: &str) {
        let prefix = if marker.is_empty() {
            format!("\n{}", self.header)
        } else {
            format!("\n{h}# {marker}\n{h}", h = self.header)
        };
        entry.decor_mut().set_prefix(prefix);
        indent_keys(entry, &self.keys);
        if let Some(options) = entry.get_mut("options").and_then(Item::as_table_mut) {
            options
                .decor_mut()
                .set_prefix(format!("\n{}", self.options_header));
            indent_keys(options, &self.options_keys);
        }
    }
}

fn indent_keys(table: &mut Table, indent: &str) {
    let keys: Vec<String> = table
        .iter()
        .filter(|(_, i)| i.is_value())
        .map(|(k, _)| k.to_owned())
        .collect();
    for key in keys {
        if let Some(mut k) = table.key_mut(&key) {
            k.leaf_decor_mut().set_prefix(indent);
            k.leaf_decor_mut().set_suffix(" ");
        }
        if let Some(v) = table.get_mut(&key).and_then(Item::as_value_mut) {
            v.decor_mut().set_prefix(" ");
            v.decor_mut().set_suffix("");
        }
    }
}

/// The spaces before a table's header (after the last newline of its prefix).
fn header_indent(t: &Table) -> String {
    trailing_blank(t.decor().prefix().and_then(|p| p.as_str()).unwrap_or(""))
}

fn first_key_indent(t: &Table) -> Option<String> {
    let (key, _) = t.iter().find(|(_, i)| i.is_value())?;
    let prefix = t.key(key)?.leaf_decor().prefix()?.as_str()?;
    Some(trailing_blank(prefix))
}

fn trailing_blank(s: &str) -> String {
    let tail = s.rsplit('\n').next().unwrap_or("");
    if tail.chars().all(|c| c == ' ' || c == '\t') {
        tail.to_owned()
    } else {
        String::new()
    }
}

/// Drops tables along `path`, deepest first, that are empty and have no header of their own.
pub(super) fn prune_empty_implicit(root: &mut Table, path: &[&str]) {
    for depth in (1..=path.len()).rev() {
        let (parents, last) = (&path[..depth - 1], path[depth - 1]);
        let parent = if parents.is_empty() {
            Some(&mut *root)
        } else {
            lookup_mut(root, parents).and_then(Item::as_table_mut)
        };
        let Some(parent) = parent else { return };
        let empty = parent
            .get(last)
            .and_then(Item::as_table)
            .is_some_and(|t| t.is_empty() && t.is_implicit());
        if !empty {
            return;
        }
        parent.remove(last);
    }
}

pub(super) fn lookup<'a>(root: &'a Table, path: &[&str]) -> Option<&'a Item> {
    let (first, rest) = path.split_first()?;
    let mut item = root.get(first)?;
    for key in rest {
        item = item.as_table_like()?.get(key)?;
    }
    Some(item)
}

pub(super) fn lookup_mut<'a>(root: &'a mut Table, path: &[&str]) -> Option<&'a mut Item> {
    let (first, rest) = path.split_first()?;
    let mut item = root.get_mut(first)?;
    for key in rest {
        item = item.as_table_like_mut()?.get_mut(key)?;
    }
    Some(item)
}

/// The table at `path`, created (without headers of its own) where missing. Tables written as
/// dotted keys or inline are refused: gpu-mps only adds `[table]` sections.
pub(super) fn table_at<'a>(
    root: &'a mut Table,
    path: &[&str],
    file: &Path,
) -> Result<&'a mut Table, RegistrationError> {
    let mut table = root;
    for (depth, key) in path.iter().enumerate() {
        let item = table.entry(key).or_insert_with(|| {
            let mut t = Table::new();
            t.set_implicit(true);
            Item::Table(t)
        });
        table = match item {
            Item::Table(t) if !t.is_dotted() => t,
            _ => {
                return Err(RegistrationError::Layout {
                    path: file.into(),
                    key: dotted(&path[..=depth]),
                    message: "written inline or as dotted keys; gpu-mps only edits [table] sections: rewrite it as one and rerun".into(),
                });
            }
        };
    }
    Ok(table)
}

fn dotted(path: &[&str]) -> String {
    path.iter()
        .map(|k| {
            if k.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                (*k).to_owned()
            } else {
                format!("{k:?}")
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// A table-like item (table, inline table, dotted keys) as a plain table of values, without the
/// formatting of the file it came from.
pub(super) fn plain_table(t: &dyn TableLike) -> Table {
    let mut out = Table::new();
    for (key, item) in t.iter() {
        let item = match item {
            Item::Table(sub) => Item::Table(plain_table(sub)),
            Item::Value(Value::InlineTable(sub)) => Item::Table(plain_table(sub)),
            Item::Value(v) => Item::Value(plain_value(v)),
            other => other.clone(),
        };
        out.insert(key, item);
    }
    out
}

/// A value in toml_edit's default formatting, so a copied entry quotes like the rest of the
/// entry whatever quoting the file used.
fn plain_value(v: &Value) -> Value {
    match v {
        Value::String(s) => Value::from(s.value().as_str()),
        Value::Array(a) => Value::Array(a.iter().map(plain_value).collect()),
        other => {
            let mut other = other.clone();
            other.decor_mut().clear();
            other
        }
    }
}

/// Equal as TOML data, whatever the formatting, quoting or key order.
pub(super) fn same_item(a: &Item, b: &Item) -> bool {
    match (a.as_table_like(), b.as_table_like()) {
        (Some(x), Some(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_item(v, w)))
        }
        (None, None) => match (a.as_value(), b.as_value()) {
            (Some(x), Some(y)) => same_value(x, y),
            _ => false,
        },
        _ => false,
    }
}

fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::String(x), Value::String(y)) => x.value() == y.value(),
        (Value::Integer(x), Value::Integer(y)) => x.value() == y.value(),
        (Value::Float(x), Value::Float(y)) => x.value() == y.value(),
        (Value::Boolean(x), Value::Boolean(y)) => x.value() == y.value(),
        (Value::Datetime(x), Value::Datetime(y)) => x.value() == y.value(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y.iter()).all(|(p, q)| same_value(p, q))
        }
        (Value::InlineTable(x), Value::InlineTable(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => false,
    }
}

/// `rendered` (toml_edit's text of an edited `previous`) with the line endings of `previous`:
/// toml_edit ends every key-value line with `\n`, the last one too, so a file written with CRLF,
/// or without a final newline, would come back changed in lines gpu-mps never touched.
pub(super) fn keep_line_endings(previous: &str, rendered: String) -> String {
    let crlf = previous.contains("\r\n") && !previous.replace("\r\n", "").contains('\n');
    let (mut text, eol) = if crlf {
        (rendered.replace("\r\n", "\n").replace('\n', "\r\n"), "\r\n")
    } else {
        (rendered, "\n")
    };
    if !previous.is_empty() && !previous.ends_with('\n') && text.ends_with(eol) {
        text.truncate(text.len() - eol.len());
    }
    text
}
