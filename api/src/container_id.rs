//! A container id, checked, and the short name of its gate dir under policy `exact`.

use std::fmt;

use thiserror::Error;

/// Longest id accepted. containerd and runc ids are far shorter (64 hex digits from CRI).
pub const MAX_LEN: usize = 128;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "container id {} cannot name a gate dir: {why} (allowed: 1 to {MAX_LEN} of A-Z a-z 0-9 . _ - +, not . or ..)",
    quoted(.id)
)]
pub struct ContainerIdError {
    pub id: String,
    pub why: &'static str,
}

/// Characters of a refused id a message quotes: enough to find it in `ctr c ls` or crictl, and a
/// 4 KiB id no longer fills the one line it is refused in.
const QUOTED_CHARS: usize = 80;

/// The id as a refusal quotes it: escaped, and cut after [`QUOTED_CHARS`] characters with the
/// length said.
fn quoted(id: &str) -> String {
    let chars = id.chars().count();
    if chars <= QUOTED_CHARS {
        return format!("{id:?}");
    }
    let head: String = id.chars().take(QUOTED_CHARS).collect();
    format!("{:?}... ({chars} characters)", head)
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContainerId(String);

impl ContainerId {
    /// Accepts the characters runc allows in an id (`^[\w+-\.]+$`, ASCII), which never form a
    /// path separator or a parent reference.
    pub fn parse(id: &str) -> Result<Self, ContainerIdError> {
        let bad = |why| {
            Err(ContainerIdError {
                id: id.to_string(),
                why,
            })
        };
        if id.is_empty() {
            return bad("it is empty");
        }
        if id.len() > MAX_LEN {
            return bad("it is too long");
        }
        if id == "." || id == ".." {
            return bad("it is a relative path component");
        }
        if !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'+'))
        {
            return bad("it has a character outside the allowed set");
        }
        Ok(ContainerId(id.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name of the container's gate dir: 16 hex digits of the SHA-256 of the id. Not the
    /// id itself: a unix socket address holds 107 bytes, and a CRI id alone is 64
    /// (`<root>/gates/<64 hex>/control` did not fit under a test's root). SHA-256, so that no
    /// one can choose an id that lands on another container's gate.
    pub fn gate_name(&self) -> String {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(self.0.as_bytes());
        digest[..8].iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Display for ContainerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_refused_id_is_quoted_cut_with_its_length() {
        let e = ContainerId::parse(&"c".repeat(4097)).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "container id \"{}\"... (4097 characters) cannot",
                "c".repeat(80)
            )),
            "{e}"
        );
        assert!(e.len() < 300, "{} bytes: {e}", e.len());
        let short = ContainerId::parse("a/b").unwrap_err().to_string();
        assert!(short.starts_with("container id \"a/b\" cannot"), "{short}");
    }

    #[test]
    fn gate_names_are_short_stable_and_distinct() {
        let a = ContainerId::parse(&"a".repeat(64)).unwrap();
        let b = ContainerId::parse(&"b".repeat(64)).unwrap();
        assert_eq!(a.gate_name().len(), 16);
        assert_eq!(
            a.gate_name(),
            ContainerId::parse(&"a".repeat(64)).unwrap().gate_name()
        );
        assert_ne!(a.gate_name(), b.gate_name());
        // sha256("abc") begins ba7816bf8f01cfea.
        assert_eq!(ContainerId::parse("abc").unwrap().gate_name(), "ba7816bf8f01cfea");
    }

    #[test]
    fn accepts_runc_ids_and_refuses_paths() {
        for ok in ["abc", "a1b2-c3_d4.e+f", &"f".repeat(64), &"x".repeat(MAX_LEN)] {
            assert_eq!(ContainerId::parse(ok).unwrap().as_str(), ok);
        }
        for (bad, why) in [
            ("", "empty"),
            (".", "relative"),
            ("..", "relative"),
            ("a/b", "character"),
            ("../x", "character"),
            ("a b", "character"),
            ("é", "character"),
            (&"x".repeat(MAX_LEN + 1), "too long"),
        ] {
            let e = ContainerId::parse(bad).unwrap_err();
            assert!(e.to_string().contains(why), "{bad:?}: {e}");
        }
    }
}
