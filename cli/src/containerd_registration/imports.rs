//! The main config's `imports` array: whether it already loads the drop-in, adding the drop-in to
//! it and taking it out again.

use std::path::Path;

use toml_edit::{Array, DocumentMut, Item, Value};

use super::{InstallOptions, RegistrationError};

/// Trails an `imports` line gpu-mps added, so uninstall removes the line rather than leaving
/// `imports = []` behind (and keeps an `imports = []` the admin wrote).
pub(super) const IMPORTS_MARKER: &str = "# added by `gpu-mps install-containerd`";

/// Whether an `imports` entry of the main config already loads the drop-in.
///
/// containerd (1.6.20, 1.7.24 and 2.1.9 measured alike) expands an entry as a glob only when it
/// holds a `*`: `conf.?/gpu-mps.toml` is a file of that very name, which 1.x refuses to start
/// without and 2.x skips. So `?` and `[...]` alone are no glob here either.
pub(super) fn imports_cover(
    doc: &DocumentMut,
    opts: &InstallOptions,
    path: &Path,
) -> Result<bool, RegistrationError> {
    let Some(imports) = imports_array(doc, path)? else {
        return Ok(false);
    };
    let target = lexically_clean(&opts.drop_in.display().to_string());
    for entry in imports.iter() {
        let import = resolve_import(entry, opts, path)?;
        let covers = if import.contains('*') {
            glob_match(&import, &target)
        } else {
            import == target
        };
        if covers {
            return Ok(true);
        }
    }
    Ok(false)
}

pub(super) fn add_import(doc: &mut DocumentMut, import: &str, path: &Path) -> Result<(), RegistrationError> {
    if imports_array(doc, path)?.is_none() {
        let mut array = Array::new();
        array.push(import);
        let mut imports = Value::Array(array);
        imports.decor_mut().set_prefix(" ");
        imports.decor_mut().set_suffix(format!("  {IMPORTS_MARKER}"));
        doc.insert("imports", Item::Value(imports));
        return Ok(());
    }
    if let Some(array) = doc.get_mut("imports").and_then(Item::as_array_mut) {
        // One path per line stays one per line.
        let own_line = array
            .iter()
            .last()
            .and_then(|v| v.decor().prefix())
            .and_then(|p| p.as_str())
            .filter(|p| p.contains('\n'))
            .map(str::to_owned);
        // Without a trailing comma the space before `]` belongs to the last path: it moves on to
        // the new last path, so `[ "a" ]` becomes `[ "a", "x" ]` and a `]` on its own line stays
        // there. remove_import gives it back.
        let before_bracket = suffix_before_bracket(array);
        if before_bracket.is_some() {
            if let Some(last) = array.len().checked_sub(1).and_then(|i| array.get_mut(i)) {
                last.decor_mut().set_suffix("");
            }
        }
        match own_line {
            Some(prefix) => array.push_formatted(Value::from(import).decorated(prefix, "")),
            None => array.push(import),
        }
        if let (Some(space), Some(new)) = (
            before_bracket,
            array.len().checked_sub(1).and_then(|i| array.get_mut(i)),
        ) {
            new.decor_mut().set_suffix(space);
        }
    }
    Ok(())
}

/// The space between the last path and `]` when the array has no trailing comma (toml_edit keeps
/// it as that path's suffix).
fn suffix_before_bracket(array: &Array) -> Option<String> {
    if array.trailing_comma() {
        return None;
    }
    array
        .iter()
        .last()
        .and_then(|v| v.decor().suffix())
        .and_then(|s| s.as_str())
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// Removes the `imports` entries that name the drop-in itself (globs that cover it stay), and
/// the whole line when gpu-mps added it and nothing else is left in it.
pub(super) fn remove_import(
    doc: &mut DocumentMut,
    opts: &InstallOptions,
    path: &Path,
) -> Result<(), RegistrationError> {
    let Some(imports) = imports_array(doc, path)? else {
        return Ok(());
    };
    let mut ours = Vec::new();
    for (i, entry) in imports.iter().enumerate() {
        if Path::new(&resolve_import(entry, opts, path)?) == opts.drop_in {
            ours.push(i);
        }
    }
    if ours.is_empty() {
        return Ok(());
    }
    let added_by_us = doc
        .get("imports")
        .and_then(Item::as_value)
        .and_then(|v| v.decor().suffix())
        .and_then(|s| s.as_str())
        .is_some_and(|s| s.contains(IMPORTS_MARKER));
    if let Some(array) = doc.get_mut("imports").and_then(Item::as_array_mut) {
        for i in ours.into_iter().rev() {
            let was_last = i + 1 == array.len();
            let removed = array.remove(i);
            // The space before `]` stays before `]`, with the path now last or in an empty array.
            let space = removed.decor().suffix().and_then(|s| s.as_str()).unwrap_or("");
            if !was_last || array.trailing_comma() || space.is_empty() {
                continue;
            }
            match array.len().checked_sub(1).and_then(|j| array.get_mut(j)) {
                Some(last) => {
                    let kept = last.decor().suffix().and_then(|s| s.as_str()).unwrap_or("");
                    let joined = format!("{kept}{space}");
                    last.decor_mut().set_suffix(joined);
                }
                None => {
                    let joined = format!("{}{space}", array.trailing().as_str().unwrap_or(""));
                    array.set_trailing(joined);
                }
            }
        }
        if array.is_empty() && added_by_us {
            doc.remove("imports");
        }
    }
    Ok(())
}

fn imports_array<'a>(doc: &'a DocumentMut, path: &Path) -> Result<Option<&'a Array>, RegistrationError> {
    match doc.get("imports") {
        None => Ok(None),
        Some(item) => item
            .as_array()
            .map(Some)
            .ok_or_else(|| RegistrationError::Layout {
                path: path.into(),
                key: "imports".into(),
                message: "expected an array of file paths".into(),
            }),
    }
}

/// An import as containerd resolves it: relative to the main config's directory, then cleaned
/// lexically (`./`, `//` and `x/..` go; 2.x loads `conf.d/x/../*.toml` with no `x` on disk).
fn resolve_import(entry: &Value, opts: &InstallOptions, path: &Path) -> Result<String, RegistrationError> {
    let import = entry.as_str().ok_or_else(|| RegistrationError::Layout {
        path: path.into(),
        key: "imports".into(),
        message: format!("{} is not a string", entry.to_string().trim()),
    })?;
    if Path::new(import).is_absolute() {
        return Ok(lexically_clean(import));
    }
    let dir = opts.main_config.parent().unwrap_or(Path::new("/"));
    Ok(lexically_clean(&dir.join(import).display().to_string()))
}

/// `path` without empty and `.` components, each `..` taking out the component before it (none
/// above `/`), as Go's `filepath.Clean` leaves it.
fn lexically_clean(path: &str) -> String {
    let absolute = path.starts_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." if parts.last().is_some_and(|p| *p != "..") => {
                parts.pop();
            }
            ".." if absolute => {}
            part => parts.push(part),
        }
    }
    let joined = parts.join("/");
    match (absolute, joined.is_empty()) {
        (true, _) => format!("/{joined}"),
        (false, true) => ".".into(),
        (false, false) => joined,
    }
}

/// Go's `filepath.Match`, which containerd applies to imports: `*` and `?` stop at `/`,
/// `[a-z]` and `[^a-z]` are classes, `\` escapes.
///
/// Written out rather than taken from the `glob` or `globset` crate: both read patterns another
/// way than Go, and an admin's import that they misjudge makes install skip the import it needs
/// (or add one it does not). Measured against containerd 2.1.9's `config dump` with the drop-in at
/// `<d>/conf.d/gpu-mps.toml` (`glob` with `require_literal_separator`, `globset` with
/// `literal_separator`):
/// - `<d>/conf.d/[!g]*.toml`: containerd loads it (`!` is an ordinary class member in Go); both
///   crates read `[!...]` as negation and say no.
/// - `<d>/conf.d/[^g]*.toml`: containerd does not load it; `glob` reads `^` as a member, says yes.
/// - `<d>/../**/gpu-mps.toml`: containerd does not load it (`**` is two `*`, one name each); both
///   crates let `**` span directories and say yes.
/// - `<d>/conf.d/{gpu-mps,x}*`: containerd does not load it (no braces in Go); `globset` expands
///   them and says yes.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    glob_at(&p, &n)
}

fn glob_at(p: &[char], n: &[char]) -> bool {
    match p.first() {
        None => n.is_empty(),
        Some('*') => (0..=n.len())
            .take_while(|&i| i == 0 || n[i - 1] != '/')
            .any(|i| glob_at(&p[1..], &n[i..])),
        Some('?') => n.first().is_some_and(|&c| c != '/') && glob_at(&p[1..], &n[1..]),
        Some('[') => {
            let Some((&c, rest)) = n.split_first() else {
                return false;
            };
            match class_match(&p[1..], c) {
                Some((true, after)) => glob_at(after, rest),
                _ => false,
            }
        }
        Some('\\') if p.len() > 1 => n.first() == Some(&p[1]) && glob_at(&p[2..], &n[1..]),
        Some(&c) => n.first() == Some(&c) && glob_at(&p[1..], &n[1..]),
    }
}

/// Matches `c` against a class body (after `[`); returns the match and the pattern after `]`.
fn class_match(p: &[char], c: char) -> Option<(bool, &[char])> {
    let (negate, mut i) = if p.first() == Some(&'^') {
        (true, 1)
    } else {
        (false, 0)
    };
    let mut matched = false;
    let mut first = true;
    while i < p.len() {
        if p[i] == ']' && !first {
            return Some((matched != negate, &p[i + 1..]));
        }
        first = false;
        let lo = if p[i] == '\\' {
            i += 1;
            *p.get(i)?
        } else {
            p[i]
        };
        i += 1;
        let hi = if p.get(i) == Some(&'-') && p.get(i + 1).is_some_and(|&h| h != ']') {
            i += 2;
            p[i - 1]
        } else {
            lo
        };
        if lo <= c && c <= hi && c != '/' {
            matched = true;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::containerd_registration::FileChange;
    use crate::containerd_registration::fixtures::*;
    use crate::containerd_registration::{DROP_IN, MAIN_CONFIG, plan_install, plan_uninstall};

    #[test]
    fn imports_that_already_cover_the_drop_in_are_left_alone() {
        for import in [
            "/etc/containerd/conf.d/*.toml",
            "conf.d/*.toml",
            "/etc/containerd/conf.d/gpu-mps.toml",
        ] {
            let main = V3.replace("root =", &format!("imports = [{import:?}]\nroot ="));
            let plan = plan_install(&files(Some(&main)), &opts(Some(2))).expect("plan");
            assert_eq!(
                plan.changes.iter().map(FileChange::path).collect::<Vec<_>>(),
                [Path::new(DROP_IN)],
                "{import}"
            );
        }
        let main = V3.replace("root =", "imports = ['/etc/other/*.toml']\nroot =");
        let plan = plan_install(&files(Some(&main)), &opts(Some(2))).expect("plan");
        assert!(
            written(&plan, MAIN_CONFIG)
                .contains("imports = ['/etc/other/*.toml', \"/etc/containerd/conf.d/gpu-mps.toml\"]")
        );
        // Uninstall removes only the entry it added.
        let removal = plan_uninstall(&after(&files(Some(&main)), &plan), &opts(None)).expect("uninstall");
        assert_eq!(written(&removal, MAIN_CONFIG), main);
    }

    #[test]
    fn multi_line_imports_stay_one_per_line() {
        let main = "version = 3\nimports = [\n  \"/etc/other/*.toml\",\n]\n";
        let existing = files(Some(main));
        let plan = plan_install(&existing, &opts(Some(2))).expect("plan");
        let text = written(&plan, MAIN_CONFIG);
        assert_eq!(
            text,
            "version = 3\nimports = [\n  \"/etc/other/*.toml\",\n  \"/etc/containerd/conf.d/gpu-mps.toml\",\n]\n"
        );
        let installed = after(&existing, &plan);
        let removal = plan_uninstall(&installed, &opts(None)).expect("uninstall");
        assert_eq!(after(&installed, &removal), existing);
    }

    #[test]
    fn glob_matching_follows_go() {
        let cases = [
            (
                "/etc/containerd/conf.d/*.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                true,
            ),
            (
                "/etc/containerd/*.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                false,
            ),
            (
                "/etc/containerd/conf.d/*",
                "/etc/containerd/conf.d/gpu-mps.toml",
                true,
            ),
            (
                "/etc/containerd/conf.?/gpu-mps.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                true,
            ),
            (
                "/etc/containerd/conf.d/[a-h]*.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                true,
            ),
            (
                "/etc/containerd/conf.d/[^g]*.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                false,
            ),
            (
                "/etc/containerd/conf.d/\\*.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                false,
            ),
            (
                "/etc/containerd/conf.d/gpu-mps.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                true,
            ),
            ("/etc/containerd/conf.d/[a-", "/etc/containerd/conf.d/a", false),
            // Where the glob and globset crates answer otherwise (see glob_match).
            (
                "/etc/containerd/conf.d/[!g]*.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                true,
            ),
            (
                "/etc/containerd/conf.d/[!x]*.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                false,
            ),
            (
                "/etc/**/gpu-mps.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                false,
            ),
            (
                "/etc/containerd/**/gpu-mps.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                true,
            ),
            (
                "/etc/containerd/conf.d/{gpu-mps,x}*",
                "/etc/containerd/conf.d/gpu-mps.toml",
                false,
            ),
        ];
        for (pattern, name, want) in cases {
            assert_eq!(glob_match(pattern, name), want, "{pattern} vs {name}");
        }
    }

    #[test]
    fn paths_are_cleaned_as_go_does() {
        for (path, want) in [
            (
                "/etc/containerd/./conf.d//x.toml",
                "/etc/containerd/conf.d/x.toml",
            ),
            (
                "/etc/containerd/x/../conf.d/*.toml",
                "/etc/containerd/conf.d/*.toml",
            ),
            ("/../etc", "/etc"),
            ("/", "/"),
            ("a/../../b/", "../b"),
            ("./", "."),
        ] {
            assert_eq!(lexically_clean(path), want, "{path}");
        }
    }

    #[test]
    fn an_import_without_a_star_is_a_file_name_not_a_glob() {
        for (import, covers) in [
            ("/etc/containerd/conf.?/gpu-mps.toml", false),
            ("/etc/containerd/conf.d/gpu-mps.t?ml", false),
            ("/etc/containerd/conf.d/[g]pu-mps.toml", false),
            ("./conf.d/gpu-mps.toml", true),
            ("/etc/containerd/x/../conf.d/*.toml", true),
        ] {
            let main = V3.replace("root =", &format!("imports = [{import:?}]\nroot ="));
            let plan = plan_install(&files(Some(&main)), &opts(Some(2))).expect("plan");
            let main_written = plan.changes.iter().any(|c| c.path() == Path::new(MAIN_CONFIG));
            assert_eq!(!main_written, covers, "{import}");
        }
    }

    #[test]
    fn the_space_before_the_closing_bracket_stays_there() {
        let drop_in = "\"/etc/containerd/conf.d/gpu-mps.toml\"";
        for (imports, with_drop_in) in [
            ("imports = [\n]", format!("imports = [{drop_in}\n]")),
            (
                "imports = [ \"/etc/other/*.toml\" ]",
                format!("imports = [ \"/etc/other/*.toml\", {drop_in} ]"),
            ),
            (
                "imports = [\n  \"/etc/other/*.toml\"\n]",
                format!("imports = [\n  \"/etc/other/*.toml\",\n  {drop_in}\n]"),
            ),
        ] {
            let main = format!("version = 3\n{imports}\n");
            let existing = files(Some(&main));
            let plan = plan_install(&existing, &opts(Some(2))).expect("plan");
            assert_eq!(
                written(&plan, MAIN_CONFIG),
                format!("version = 3\n{with_drop_in}\n")
            );
            let installed = after(&existing, &plan);
            let removal = plan_uninstall(&installed, &opts(None)).expect("uninstall");
            assert_eq!(after(&installed, &removal), existing, "{imports}");
        }
    }
}
