//! Messages a user reads are one line: in `kubectl describe pod`, in runc's log, in a journal.

use std::borrow::Cow;

/// Collapses every run of whitespace, newlines included, into one space.
pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `text` as a message shows it when a pod or a spec wrote it (an annotation key, a path):
/// control characters escaped as Rust writes them (`\n`, `\u{1b}`), everything else as it is.
/// Unlike `{:?}` it adds no quotes, so ordinary keys and paths read as before; unlike
/// [`one_line`] it keeps the text recognisable, spaces and all.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut escaped = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            escaped.extend(c.escape_debug());
        } else {
            escaped.push(c);
        }
    }
    Cow::Owned(escaped)
}

#[cfg(test)]
mod tests {
    #[test]
    fn joins_lines() {
        assert_eq!(super::one_line("a\n  b\tc \n"), "a b c");
    }

    #[test]
    fn printable_escapes_only_control_characters() {
        assert_eq!(
            super::printable("gpu-mps.io/memory-limit"),
            "gpu-mps.io/memory-limit"
        );
        assert_eq!(super::printable("ünï \"cødé\""), "ünï \"cødé\"");
        assert_eq!(super::printable("a\nb\r\0\u{1b}\tc"), "a\\nb\\r\\0\\u{1b}\\tc");
        assert!(!super::printable("\u{85}\u{2028}x\n").contains(['\n', '\r', '\u{85}']));
    }
}
