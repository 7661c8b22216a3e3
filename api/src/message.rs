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

/// `text` without the " (os error 2)" that an io::Error deep inside another crate's message
/// carries: the words before it say the same to a person.
pub fn without_os_error_numbers(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(" (os error ") {
        let tail = &rest[at + " (os error ".len()..];
        let digits = tail.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 && tail[digits..].starts_with(')') {
            out.push_str(&rest[..at]);
            rest = &tail[digits + 1..];
        } else {
            out.push_str(&rest[..at + 1]);
            rest = &rest[at + 1..];
        }
    }
    out.push_str(rest);
    out
}

/// An error and its causes as one line, `what: why: why`, each cause said once: many of our
/// errors already put their source in their own text (`"NVML: {0}"`), and printing the chain as
/// well (`{:#}`, anyhow's `Caused by:`) said the same thing two or three times. OS errors are
/// in words only ("No such file or directory", not "... (os error 2)").
pub fn error_chain_line<'a>(
    chain: impl IntoIterator<Item = &'a (dyn std::error::Error + 'static)>,
) -> String {
    let mut line = String::new();
    for cause in chain {
        let text = without_os_error_numbers(&one_line(&cause.to_string()));
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("NVML: loading libnvidia-ml.so.1: {0}")]
        Repeats(#[source] Inner),
        #[error("starting the manager")]
        Adds(#[source] Inner),
    }

    #[derive(Debug, thiserror::Error)]
    #[error("cannot open shared object file:\n  No such file or directory (os error 2)")]
    struct Inner;

    fn line(e: &Outer) -> String {
        let mut chain: Vec<&(dyn std::error::Error + 'static)> = vec![e];
        while let Some(next) = chain.last().and_then(|c| c.source()) {
            chain.push(next);
        }
        super::error_chain_line(chain)
    }

    #[test]
    fn a_cause_already_in_the_message_is_said_once() {
        assert_eq!(
            line(&Outer::Repeats(Inner)),
            "NVML: loading libnvidia-ml.so.1: cannot open shared object file: No such file or directory"
        );
        assert_eq!(
            line(&Outer::Adds(Inner)),
            "starting the manager: cannot open shared object file: No such file or directory"
        );
    }

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
