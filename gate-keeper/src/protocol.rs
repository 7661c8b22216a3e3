//! Pure decisions of the protocol: what a request says, which names may be held, who may talk.
//! The words on the wire are in the crate's doc.

use crate::MAX_NAME;

/// Largest request or answer: `PUT listener ` and a 128-byte name fit several times. A longer
/// message arrives cut (MSG_TRUNC) and is refused.
pub(crate) const MAX_MESSAGE: usize = 512;

/// The one kind of descriptor held, as it is written in PUT and HELD.
pub(crate) const LISTENER: &str = "listener";

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Request {
    /// `PUT listener <name>`: hold this gate's listening socket.
    Put {
        name: String,
    },
    Drop {
        name: String,
    },
    Take,
    QuitIfEmpty,
    Ping,
    Version,
}

/// Why `name` cannot be held, if it cannot.
pub(crate) fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        Err("empty name".to_string())
    } else if name.len() > MAX_NAME {
        Err(format!("name of {} bytes (at most {MAX_NAME})", name.len()))
    } else if name.contains('/') {
        Err("name contains '/'".to_string())
    } else if name.contains('\0') {
        Err("name contains NUL".to_string())
    } else if name == "." || name == ".." {
        Err(format!("name is {name:?}"))
    } else {
        Ok(())
    }
}

/// `<kind> <name>`, as in PUT and HELD. Version 1's `parked` is refused like any unknown kind:
/// no manager ever sent it.
pub(crate) fn parse_kind_name(rest: &str) -> Result<&str, String> {
    let (kind, name) = rest
        .split_once(' ')
        .ok_or_else(|| "expected <kind> <name>".to_string())?;
    if kind != LISTENER {
        return Err(format!("unknown kind {:?} ({LISTENER})", clip(kind)));
    }
    check_name(name)?;
    Ok(name)
}

/// Decodes one request message that came with `fds` descriptors.
pub(crate) fn parse_request(message: &[u8], fds: usize) -> Result<Request, String> {
    let text = std::str::from_utf8(message).map_err(|_| "request is not UTF-8".to_string())?;
    let (verb, rest) = match text.split_once(' ') {
        Some((verb, rest)) => (verb, Some(rest)),
        None => (text, None),
    };
    let request = match (verb, rest) {
        ("PUT", Some(rest)) => Request::Put {
            name: parse_kind_name(rest)?.to_string(),
        },
        ("DROP", Some(name)) => {
            check_name(name)?;
            Request::Drop {
                name: name.to_string(),
            }
        }
        ("TAKE", None) => Request::Take,
        ("QUIT_IF_EMPTY", None) => Request::QuitIfEmpty,
        ("PING", None) => Request::Ping,
        ("VERSION", None) => Request::Version,
        ("PUT" | "DROP", None) => return Err(format!("{verb} needs arguments")),
        ("TAKE" | "QUIT_IF_EMPTY" | "PING" | "VERSION", Some(_)) => {
            return Err(format!("{verb} takes no argument"));
        }
        _ => {
            return Err(format!(
                "unknown request {:?} (PUT, DROP, TAKE, QUIT_IF_EMPTY, PING, VERSION)",
                clip(verb)
            ));
        }
    };
    let wanted = usize::from(matches!(request, Request::Put { .. }));
    if fds != wanted {
        return Err(format!("{verb} carries {wanted} descriptor(s), this one {fds}"));
    }
    Ok(request)
}

/// Whether a peer of this uid may talk to the keeper: root, or the keeper's own user (root in
/// production; the user running the tests elsewhere). The socket's mode 0600 says the same.
pub(crate) fn peer_allowed(peer_uid: u32, own_uid: u32) -> bool {
    peer_uid == 0 || peer_uid == own_uid
}

/// A client's word, short enough to echo in an error.
pub(crate) fn clip(word: &str) -> &str {
    match word.char_indices().nth(32) {
        Some((end, _)) => &word[..end],
        None => word,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_parsed_strictly() {
        let long = "x".repeat(MAX_NAME + 1);
        let longest = "x".repeat(MAX_NAME);
        let put = |name: &str| Request::Put {
            name: name.to_string(),
        };
        let unknown = |verb: &str| {
            Err(format!(
                "unknown request {verb:?} (PUT, DROP, TAKE, QUIT_IF_EMPTY, PING, VERSION)"
            ))
        };
        let cases: Vec<(Vec<u8>, usize, Result<Request, String>)> = vec![
            (b"PUT listener gate-a".to_vec(), 1, Ok(put("gate-a"))),
            (b"PUT listener gate a b".to_vec(), 1, Ok(put("gate a b"))),
            (
                format!("PUT listener {longest}").into_bytes(),
                1,
                Ok(put(&longest)),
            ),
            (
                b"DROP gate-a".to_vec(),
                0,
                Ok(Request::Drop {
                    name: "gate-a".to_string(),
                }),
            ),
            (b"TAKE".to_vec(), 0, Ok(Request::Take)),
            (b"QUIT_IF_EMPTY".to_vec(), 0, Ok(Request::QuitIfEmpty)),
            (b"PING".to_vec(), 0, Ok(Request::Ping)),
            (b"VERSION".to_vec(), 0, Ok(Request::Version)),
            (
                b"PUT listener gate-a".to_vec(),
                0,
                Err("PUT carries 1 descriptor(s), this one 0".into()),
            ),
            (
                b"PUT listener gate-a".to_vec(),
                2,
                Err("PUT carries 1 descriptor(s), this one 2".into()),
            ),
            (
                b"PING".to_vec(),
                1,
                Err("PING carries 0 descriptor(s), this one 1".into()),
            ),
            (
                b"PUT socket gate-a".to_vec(),
                1,
                Err("unknown kind \"socket\" (listener)".into()),
            ),
            (
                b"PUT parked gate-a".to_vec(),
                1,
                Err("unknown kind \"parked\" (listener)".into()),
            ),
            (b"PUT listener".to_vec(), 1, Err("expected <kind> <name>".into())),
            (b"PUT listener ".to_vec(), 1, Err("empty name".into())),
            (b"PUT".to_vec(), 1, Err("PUT needs arguments".into())),
            (b"PUT listener a/b".to_vec(), 1, Err("name contains '/'".into())),
            (b"PUT listener a\0b".to_vec(), 1, Err("name contains NUL".into())),
            (
                format!("PUT listener {long}").into_bytes(),
                1,
                Err("name of 129 bytes (at most 128)".into()),
            ),
            (b"DROP ..".to_vec(), 0, Err("name is \"..\"".into())),
            (b"DROP".to_vec(), 0, Err("DROP needs arguments".into())),
            (b"TAKE all".to_vec(), 0, Err("TAKE takes no argument".into())),
            (b"VERSION 2".to_vec(), 0, Err("VERSION takes no argument".into())),
            (b"take".to_vec(), 0, unknown("take")),
            (b"".to_vec(), 0, unknown("")),
            (b"PING\n".to_vec(), 0, unknown("PING\n")),
            (b"\xff\xfe".to_vec(), 0, Err("request is not UTF-8".into())),
        ];
        for (message, fds, expected) in cases {
            let got = parse_request(&message, fds);
            assert_eq!(
                got,
                expected,
                "{:?} with {fds} descriptors",
                String::from_utf8_lossy(&message)
            );
        }
    }

    #[test]
    fn only_root_or_the_keepers_own_user_may_talk() {
        assert!(peer_allowed(0, 0));
        assert!(!peer_allowed(1000, 0));
        assert!(!peer_allowed(65534, 0));
        // A keeper run by an unprivileged user (tests): root and that user.
        assert!(peer_allowed(0, 1000));
        assert!(peer_allowed(1000, 1000));
        assert!(!peer_allowed(1001, 1000));
    }

    #[test]
    fn a_long_word_is_clipped_on_a_character_boundary() {
        assert_eq!(clip("short"), "short");
        let long = "é".repeat(40);
        assert_eq!(clip(&long).chars().count(), 32);
    }
}
