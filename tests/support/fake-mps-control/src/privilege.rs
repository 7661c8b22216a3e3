//! Which socket a UI session came in on decides what it may change, as measured on the real
//! daemon (docs/gpu-results.md section 7): every command that changes something is taken only
//! on `control_privileged`; on `control` it is answered with the real daemon's refusal, and
//! reads work on both. A pod that sees only a gate's `control` can then read and not change.

use crate::command::Command;

/// The socket a connection was accepted on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlSocket {
    /// `control` (mode 0666): CUDA clients and anyone's CLI.
    Control,
    /// `control_privileged` (mode 0755): the daemon's owner and root.
    Privileged,
}

impl ControlSocket {
    pub fn name(self) -> &'static str {
        match self {
            ControlSocket::Control => "control",
            ControlSocket::Privileged => "control_privileged",
        }
    }
}

/// The real daemon's answer when `command` may not run on `socket` (its text, "deamon"
/// included), or `None` when it may.
pub fn refusal(command: &Command, socket: ControlSocket, uid: u32) -> Option<String> {
    if socket == ControlSocket::Privileged || !changes_something(command) {
        return None;
    }
    Some(match command {
        Command::Quit => "Not enough privilege to execute quit command".to_string(),
        _ => format!(
            "Insufficient privileges for UID {uid}. Control deamon settings can only be modified by the user who started it or by the root user."
        ),
    })
}

fn changes_something(command: &Command) -> bool {
    match command {
        Command::SetDefaultActiveThreadPercentage { .. }
        | Command::SetDefaultDevicePinnedMemLimit { .. }
        | Command::SetActiveThreadPercentage { .. }
        | Command::SetDevicePinnedMemLimit { .. }
        | Command::StartServer { .. }
        | Command::ShutdownServer { .. }
        | Command::TerminateClient { .. }
        | Command::Quit => true,
        Command::GetServerList
        | Command::GetClientList { .. }
        | Command::GetDefaultActiveThreadPercentage
        | Command::GetDefaultDevicePinnedMemLimit { .. }
        | Command::GetActiveThreadPercentage { .. }
        | Command::GetDevicePinnedMemLimit { .. }
        | Command::GetDeviceClientList { .. }
        | Command::Unknown(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INSUFFICIENT: &str = "Insufficient privileges for UID 1000. Control deamon settings can only be modified by the user who started it or by the root user.";

    #[test]
    fn changes_are_refused_on_control_with_the_real_texts() {
        for line in [
            "set_default_active_thread_percentage 25",
            "set_default_device_pinned_mem_limit 0 4G",
            "set_active_thread_percentage 607 25",
            "set_device_pinned_mem_limit 607 0 4G",
            "start_server -uid 0",
            "shutdown_server 607",
            "terminate_client 607 604",
        ] {
            let command = Command::parse(line);
            assert_eq!(
                refusal(&command, ControlSocket::Control, 1000).as_deref(),
                Some(INSUFFICIENT),
                "{line}"
            );
            assert_eq!(refusal(&command, ControlSocket::Privileged, 1000), None, "{line}");
        }
        assert_eq!(
            refusal(&Command::Quit, ControlSocket::Control, 0).as_deref(),
            Some("Not enough privilege to execute quit command")
        );
        assert_eq!(refusal(&Command::Quit, ControlSocket::Privileged, 0), None);
    }

    #[test]
    fn reads_and_unknown_lines_work_on_both() {
        for line in [
            "get_server_list",
            "get_client_list 607",
            "get_default_active_thread_percentage",
            "get_default_device_pinned_mem_limit 0",
            "get_active_thread_percentage 607",
            "get_device_pinned_mem_limit 607 0",
            "get_device_client_list",
            "bogus_command",
        ] {
            let command = Command::parse(line);
            for socket in [ControlSocket::Control, ControlSocket::Privileged] {
                assert_eq!(refusal(&command, socket, 0), None, "{line}");
            }
        }
    }
}
