//! Messages a user reads are one line: in `kubectl describe pod`, in runc's log, in a journal.

/// Collapses every run of whitespace, newlines included, into one space.
pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn joins_lines() {
        assert_eq!(super::one_line("a\n  b\tc \n"), "a b c");
    }
}
