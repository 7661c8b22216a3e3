//! The framing of the MPS control protocol as measured on the H200 (driver 580, MPS v2:
//! docs/gpu-results.md section 7, tests/gpu/shape-probe.py): the bytes the checker sends as a
//! CUDA client or as the control CLI, and those the e2e tests expect through a gate. Written
//! from the measurement, apart from fake-mps-control's copy, so that the two do not agree on
//! a mistake.
//!
//! Every message is one SOCK_SEQPACKET message. The daemon says [`HELLO`]; the connecting
//! side sends [`CREDENTIALS`] then a u32 kind, both with SCM_CREDENTIALS. Kind 2 (a CUDA
//! client): the daemon answers [`CHANNEL_PASSED`] with one descriptor, the client sends
//! [`CLIENT_ACK`] and closes. Kind 4 (a UI session): per command a u64 length then
//! `<command>\n\0`, then a u64 0; per answer an output message (4 zero bytes, then the text)
//! when there is output, then a u64 1.

pub const HELLO: &[u8] = b"OUTBHELL\0";
pub const CREDENTIALS: &[u8] = b"OUTBCRED\0";
pub const CHANNEL_PASSED: &[u8] = b"OUTBCUFD\0";
pub const CLIENT_ACK: [u8; 4] = [0; 4];
pub const KIND_CUDA_CLIENT: u32 = 2;
pub const KIND_UI: u32 = 4;
pub const END_OF_ANSWER: [u8; 8] = 1u64.to_le_bytes();
pub const END_OF_SESSION: [u8; 8] = 0u64.to_le_bytes();
const OUTPUT_PREFIX: [u8; 4] = [0; 4];

/// What the checker's client sends first on its channel, for the test double (the real bytes
/// there were never measured; that a client which sends nothing leaves the server stuck was).
pub const CHANNEL_REGISTER: &[u8] = b"REGISTER";

pub fn kind_message(kind: u32) -> [u8; 4] {
    kind.to_le_bytes()
}

/// The u64 length message and the command message of one UI command.
pub fn ui_command(command: &str) -> ([u8; 8], Vec<u8>) {
    let mut message = command.as_bytes().to_vec();
    message.extend_from_slice(b"\n\0");
    ((message.len() as u64).to_le_bytes(), message)
}

/// The text of a UI output message; `None` for any other message.
pub fn ui_output(message: &[u8]) -> Option<String> {
    let text = message.strip_prefix(&OUTPUT_PREFIX[..])?;
    Some(String::from_utf8_lossy(text).into_owned())
}

/// Bytes as lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_measured_bytes() {
        assert_eq!(hex(HELLO), "4f55544248454c4c00");
        assert_eq!(hex(CREDENTIALS), "4f5554424352454400");
        assert_eq!(hex(CHANNEL_PASSED), "4f5554424355464400");
        assert_eq!(hex(&kind_message(KIND_CUDA_CLIENT)), "02000000");
        assert_eq!(hex(&kind_message(KIND_UI)), "04000000");
        assert_eq!(hex(&END_OF_ANSWER), "0100000000000000");
        let (length, command) = ui_command("get_server_list");
        assert_eq!(
            (length, command.as_slice()),
            (17u64.to_le_bytes(), &b"get_server_list\n\0"[..])
        );
        assert_eq!(ui_output(&[0, 0, 0, 0, b'5', b'4', b'7']).as_deref(), Some("547"));
        assert_eq!(ui_output(&END_OF_ANSWER), None);
    }
}
