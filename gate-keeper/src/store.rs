//! What the keeper holds: one listening socket per gate name.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// Listeners by name; dropping one closes the keeper's duplicate.
pub(crate) struct Store {
    listeners: BTreeMap<String, OwnedFd>,
    cap: usize,
}

impl Store {
    pub(crate) fn new(cap: usize) -> Self {
        Store {
            listeners: BTreeMap::new(),
            cap,
        }
    }

    pub(crate) fn count(&self) -> usize {
        self.listeners.len()
    }

    /// Holds `fd` under `name`; the listener held under that name before, if any, is closed.
    pub(crate) fn put(&mut self, name: String, fd: OwnedFd) -> Result<(), String> {
        if !self.listeners.contains_key(&name) && self.count() >= self.cap {
            return Err(format!(
                "full: {} descriptors held (at most {})",
                self.count(),
                self.cap
            ));
        }
        self.listeners.insert(name, fd);
        Ok(())
    }

    pub(crate) fn drop_name(&mut self, name: &str) {
        self.listeners.remove(name);
    }

    /// Hands every listener to `send`, keeping each: the next restart needs it again.
    pub(crate) fn take(
        &self,
        mut send: impl FnMut(&str, BorrowedFd<'_>) -> io::Result<()>,
    ) -> io::Result<()> {
        self.listeners
            .iter()
            .try_for_each(|(name, fd)| send(name, fd.as_fd()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::fs::File;

    use super::*;

    fn some_fd() -> OwnedFd {
        OwnedFd::from(File::open("/dev/null").unwrap())
    }

    #[test]
    fn the_store_is_capped_and_a_listener_replaces_its_name() {
        let mut store = Store::new(2);
        store.put("a".into(), some_fd()).unwrap();
        store.put("b".into(), some_fd()).unwrap();
        let full = store.put("c".into(), some_fd()).unwrap_err();
        assert_eq!(full, "full: 2 descriptors held (at most 2)");
        // Replacing does not grow, and is allowed when full.
        store.put("a".into(), some_fd()).unwrap();
        assert_eq!(store.count(), 2);
        store.drop_name("a");
        store.drop_name("b");
        assert_eq!(store.count(), 0);
    }

    #[test]
    fn take_keeps_what_it_hands_over_and_stops_at_the_first_failure() {
        let mut store = Store::new(8);
        for name in ["a", "b", "c"] {
            store.put(name.into(), some_fd()).unwrap();
        }
        let mut sent = Vec::new();
        let failed = store.take(|name, _| {
            if sent.len() == 2 {
                return Err(io::Error::other("peer gone"));
            }
            sent.push(name.to_string());
            Ok(())
        });
        assert!(failed.is_err());
        assert_eq!(sent, vec!["a", "b"]);
        assert_eq!(store.count(), 3, "nothing is forgotten by a TAKE");
    }
}
