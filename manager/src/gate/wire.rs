//! The shape of the MPS control protocol the gate relies on, as measured on the H200 (driver
//! 580, MPS v2; tests/gpu/shape-probe.py, docs/gpu-results.md section 7). Pure: the gate reads
//! a connection's first messages and decides from these alone what it is.
//!
//! Every connection starts with the daemon's 9-byte hello. A CUDA client then sends two
//! messages with its credentials: `OUTBCRED\0`, and a little-endian u32 kind, 2 for "my
//! channel to the server". The daemon answers `OUTBCUFD\0` with one descriptor (the channel),
//! the client acknowledges with four zero bytes and closes. The control CLI (a UI session)
//! sends kind 4 and then its commands; nothing else was ever seen. A CUDA client's first
//! connection is a probe: it reads the hello and closes without sending anything.
//!
//! Measured on what a client does when a connection ends early:
//! - closed before the client sent its request (no listener, accept and close, hello and
//!   close): CUDA opens a DIRECT context with the whole GPU (in Default compute mode);
//! - closed after the request, without an answer (what a daemon that is shutting down does):
//!   the client fails at once with "MPS client failed to connect to the MPS control daemon or
//!   the MPS server", and the control CLI with "Cannot send command to MPS control daemon
//!   process" (exit 1). This is how the gate refuses.

/// The daemon's greeting, first on every connection. The gate sends it itself, so that a
/// connection that never speaks holds no daemon.
pub const HELLO: &[u8] = b"OUTBHELL\0";
/// The first message of every request, with the sender's SCM_CREDENTIALS.
pub const CREDENTIALS: &[u8] = b"OUTBCRED\0";
/// The daemon's answer to a CUDA client: it carries the client's channel as one descriptor.
pub const CHANNEL_ANSWER: &[u8] = b"OUTBCUFD\0";
/// Kind of request: a CUDA client asking for its channel to the server.
pub const KIND_CUDA_CLIENT: u32 = 2;
/// Kind of request: a UI session (`nvidia-cuda-mps-control` commands).
pub const KIND_UI: u32 = 4;
/// A client's acknowledgement of its channel, after the answer.
pub const CLIENT_ACK: &[u8] = &[0, 0, 0, 0];

/// What a connection asked for, from its first two messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Exactly the measured request of a CUDA client.
    CudaClient,
    /// The control CLI: set, quit, terminate_client, shutdown_server, and the reads that list
    /// other pods' processes. Never relayed.
    UiSession,
    /// Anything else; the reason for the log.
    Other(String),
}

impl Request {
    /// One line for the log and `gpu-mps status`.
    pub fn describe(&self) -> String {
        match self {
            Request::CudaClient => "a CUDA client".into(),
            Request::UiSession => "a control (UI) session: only CUDA clients pass the gate".into(),
            Request::Other(why) => format!("not a CUDA client ({why})"),
        }
    }
}

/// The first message alone: `None` while it may still be the start of a request (it is the
/// credentials message), else what it is.
pub fn classify_first(first: &[u8]) -> Option<Request> {
    (first != CREDENTIALS).then(|| Request::Other(format!("first message {}", show(first))))
}

/// The request from its two messages.
pub fn classify(first: &[u8], second: &[u8]) -> Request {
    if let Some(other) = classify_first(first) {
        return other;
    }
    let Ok(kind) = <[u8; 4]>::try_from(second) else {
        return Request::Other(format!("request kind {}", show(second)));
    };
    match u32::from_le_bytes(kind) {
        KIND_CUDA_CLIENT => Request::CudaClient,
        KIND_UI => Request::UiSession,
        other => Request::Other(format!("request kind {other}")),
    }
}

/// The second message of a CUDA client's request, as the gate forwards it.
pub fn cuda_client_kind() -> [u8; 4] {
    KIND_CUDA_CLIENT.to_le_bytes()
}

/// Whether a daemon's answer is the measured channel answer: the bytes and one descriptor.
pub fn is_channel_answer(bytes: &[u8], descriptors: usize) -> bool {
    bytes == CHANNEL_ANSWER && descriptors == 1
}

/// A UI session's framing (measured, docs/gpu-results.md section 7): each command comes as an
/// 8-byte little-endian length, then the command with `\n\0`; an 8-byte 0 ends the session. The
/// daemon answers a command with 4 zero bytes and its output (when it has any), then an 8-byte 1.
pub const UI_END_OF_SESSION: u64 = 0;
pub const UI_END_OF_ANSWER: u64 = 1;
const UI_OUTPUT_PREFIX: [u8; 4] = [0; 4];

/// What a UI session sent next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UiStep {
    /// The length of the command that follows.
    Length(u64),
    /// The session's end.
    End,
    /// Not the measured framing.
    Malformed,
}

/// Reads a UI session's length message.
pub fn ui_step(message: &[u8]) -> UiStep {
    match <[u8; 8]>::try_from(message).map(u64::from_le_bytes) {
        Ok(UI_END_OF_SESSION) => UiStep::End,
        Ok(length) => UiStep::Length(length),
        Err(_) => UiStep::Malformed,
    }
}

/// The command of a framed command message of `length` bytes; `None` if it is not framed so.
pub fn ui_command(message: &[u8], length: u64) -> Option<String> {
    if message.len() as u64 != length {
        return None;
    }
    let text = message.strip_suffix(b"\n\0")?;
    Some(String::from_utf8_lossy(text).trim().to_string())
}

/// What MPS answers an unprivileged user (measured through `control`, as root in a pod) for a
/// command that would change the daemon or a server; `None` for the reads, which the gate does
/// not answer at all (they list other pods' processes).
pub fn ui_refusal(command: &str, uid: u32) -> Option<String> {
    const CHANGES: [&str; 8] = [
        "set_default_active_thread_percentage",
        "set_default_device_pinned_mem_limit",
        "set_active_thread_percentage",
        "set_device_pinned_mem_limit",
        "start_server",
        "shutdown_server",
        "terminate_client",
        "quit",
    ];
    let verb = command.split_whitespace().next()?;
    if verb == "quit" {
        return Some("Not enough privilege to execute quit command".into());
    }
    CHANGES.contains(&verb).then(|| {
        format!(
            "Insufficient privileges for UID {uid}. Control deamon settings can only be modified by the user who started it or by the root user."
        )
    })
}

/// A command's answer as the daemon frames it: the output message, then the end of the answer.
pub fn ui_answer(text: &str) -> [Vec<u8>; 2] {
    let mut output = UI_OUTPUT_PREFIX.to_vec();
    output.extend_from_slice(text.as_bytes());
    [output, UI_END_OF_ANSWER.to_le_bytes().to_vec()]
}

/// A message for a log line: printable ASCII as text, the rest as hex; at most 32 bytes.
pub fn show(bytes: &[u8]) -> String {
    let head = &bytes[..bytes.len().min(32)];
    let more = if bytes.len() > head.len() { "..." } else { "" };
    if head.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
        format!(
            "{:?}{more} ({} bytes)",
            String::from_utf8_lossy(head),
            bytes.len()
        )
    } else {
        let hex: String = head.iter().map(|b| format!("{b:02x}")).collect();
        format!("0x{hex}{more} ({} bytes)", bytes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_measured_client_request_is_a_cuda_client() {
        assert_eq!(classify(CREDENTIALS, &[2, 0, 0, 0]), Request::CudaClient);
        assert_eq!(cuda_client_kind(), [2, 0, 0, 0]);
        assert_eq!(classify_first(CREDENTIALS), None);
    }

    #[test]
    fn the_control_cli_is_a_ui_session() {
        assert_eq!(classify(CREDENTIALS, &[4, 0, 0, 0]), Request::UiSession);
        assert!(Request::UiSession.describe().contains("only CUDA clients"));
    }

    #[test]
    fn anything_else_is_other() {
        for (first, second) in [
            (&b"OUTBCRED"[..], &[2u8, 0, 0, 0][..]),
            (b"OUTBCRED\0\0", &[2, 0, 0, 0]),
            (b"get_server_list\n\0", &[2, 0, 0, 0]),
            (CREDENTIALS, &[2, 0, 0, 0, 0]),
            (CREDENTIALS, &[2, 0, 0]),
            (CREDENTIALS, &[3, 0, 0, 0]),
            (CREDENTIALS, &[2, 0, 0, 1]),
            (CREDENTIALS, &[]),
        ] {
            assert!(
                matches!(classify(first, second), Request::Other(_)),
                "{first:?} {second:?}"
            );
        }
        assert!(matches!(classify_first(b"quit\n\0"), Some(Request::Other(_))));
    }

    #[test]
    fn only_the_channel_answer_with_one_descriptor_counts() {
        assert!(is_channel_answer(CHANNEL_ANSWER, 1));
        assert!(!is_channel_answer(CHANNEL_ANSWER, 0));
        assert!(!is_channel_answer(CHANNEL_ANSWER, 2));
        assert!(!is_channel_answer(HELLO, 1));
    }

    #[test]
    fn a_ui_session_is_read_as_framed_and_changes_are_refused_as_mps_refuses_a_user() {
        assert_eq!(ui_step(&12u64.to_le_bytes()), UiStep::Length(12));
        assert_eq!(ui_step(&0u64.to_le_bytes()), UiStep::End);
        assert_eq!(ui_step(b"quit\n\0"), UiStep::Malformed);
        let command = b"set_default_active_thread_percentage 100\n\0";
        assert_eq!(
            ui_command(command, command.len() as u64).as_deref(),
            Some("set_default_active_thread_percentage 100")
        );
        assert_eq!(ui_command(command, 3), None);
        assert_eq!(ui_command(b"quit", 4), None);
        let refused = ui_refusal("set_default_active_thread_percentage 100", 0).unwrap();
        assert!(
            refused.starts_with("Insufficient privileges for UID 0."),
            "{refused}"
        );
        assert_eq!(
            ui_refusal("quit", 1000).as_deref(),
            Some("Not enough privilege to execute quit command")
        );
        for read in [
            "get_server_list",
            "get_client_list 1",
            "",
            "set_default_active_thread_percentagex 1",
        ] {
            assert_eq!(ui_refusal(read, 0), None, "{read}");
        }
        let [output, end] = ui_answer("no");
        assert_eq!(output, b"\0\0\0\0no");
        assert_eq!(end, 1u64.to_le_bytes());
    }

    #[test]
    fn messages_show_as_text_or_hex() {
        assert_eq!(show(b"quit"), "\"quit\" (4 bytes)");
        assert_eq!(show(&[2, 0, 0, 0]), "0x02000000 (4 bytes)");
        assert!(show(&[0u8; 40]).ends_with("... (40 bytes)"));
    }
}
