//! The command lines `nvidia-cuda-mps-control` reads on stdin, parsed into [`Command`].
//!
//! Arguments stay text: the answers quote them back (`Server 99999 not found`), and MPS does not
//! validate device ids (a wrong ordinal or UUID is silently stored, see MPS-FACTS.md).

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    GetServerList,
    GetClientList {
        server: String,
    },
    GetDefaultActiveThreadPercentage,
    SetDefaultActiveThreadPercentage {
        value: String,
    },
    GetDefaultDevicePinnedMemLimit {
        device: String,
    },
    SetDefaultDevicePinnedMemLimit {
        device: String,
        value: String,
    },
    GetActiveThreadPercentage {
        server: String,
    },
    SetActiveThreadPercentage {
        server: String,
        value: String,
    },
    GetDevicePinnedMemLimit {
        server: String,
        device: String,
    },
    SetDevicePinnedMemLimit {
        server: String,
        device: String,
        value: String,
    },
    GetDeviceClientList {
        server: Option<String>,
    },
    StartServer {
        uid: u32,
    },
    ShutdownServer {
        server: String,
        force: bool,
    },
    TerminateClient {
        server: String,
        client: String,
    },
    Quit,
    /// Anything else, including a known command with the wrong arguments (what the real one
    /// answers to wrong arguments was not measured). Holds the trimmed line.
    Unknown(String),
}

impl Command {
    /// Whether the daemon asks a server to answer it: such a command hangs while the server is
    /// stuck (measured for `set_active_thread_percentage <srv>`; taken to hold for every command
    /// that names or needs a server).
    pub fn reaches_a_server(&self) -> bool {
        !matches!(
            self,
            Command::GetServerList
                | Command::GetDefaultActiveThreadPercentage
                | Command::SetDefaultActiveThreadPercentage { .. }
                | Command::GetDefaultDevicePinnedMemLimit { .. }
                | Command::SetDefaultDevicePinnedMemLimit { .. }
                | Command::Unknown(_)
        )
    }

    pub fn parse(line: &str) -> Command {
        let line = line.trim();
        let words: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        let unknown = || Command::Unknown(line.to_string());
        let Some((name, args)) = words.split_first() else {
            return unknown();
        };
        match (name.as_str(), args) {
            ("get_server_list", []) => Command::GetServerList,
            ("get_client_list", [server]) => Command::GetClientList {
                server: server.clone(),
            },
            ("get_default_active_thread_percentage", []) => Command::GetDefaultActiveThreadPercentage,
            ("set_default_active_thread_percentage", [value]) => {
                Command::SetDefaultActiveThreadPercentage { value: value.clone() }
            }
            ("get_default_device_pinned_mem_limit", [device]) => Command::GetDefaultDevicePinnedMemLimit {
                device: device.clone(),
            },
            ("set_default_device_pinned_mem_limit", [device, value]) => {
                Command::SetDefaultDevicePinnedMemLimit {
                    device: device.clone(),
                    value: value.clone(),
                }
            }
            ("get_active_thread_percentage", [server]) => Command::GetActiveThreadPercentage {
                server: server.clone(),
            },
            ("set_active_thread_percentage", [server, value]) => Command::SetActiveThreadPercentage {
                server: server.clone(),
                value: value.clone(),
            },
            ("get_device_pinned_mem_limit", [server, device]) => Command::GetDevicePinnedMemLimit {
                server: server.clone(),
                device: device.clone(),
            },
            ("set_device_pinned_mem_limit", [server, device, value]) => Command::SetDevicePinnedMemLimit {
                server: server.clone(),
                device: device.clone(),
                value: value.clone(),
            },
            ("get_device_client_list", []) => Command::GetDeviceClientList { server: None },
            ("get_device_client_list", [server]) => Command::GetDeviceClientList {
                server: Some(server.clone()),
            },
            ("start_server", [flag, uid]) if flag == "-uid" => match uid.parse() {
                Ok(uid) => Command::StartServer { uid },
                Err(_) => unknown(),
            },
            ("shutdown_server", [server]) => Command::ShutdownServer {
                server: server.clone(),
                force: false,
            },
            ("shutdown_server", [server, flag]) if flag == "-f" => Command::ShutdownServer {
                server: server.clone(),
                force: true,
            },
            ("terminate_client", [server, client]) => Command::TerminateClient {
                server: server.clone(),
                client: client.clone(),
            },
            ("quit", []) => Command::Quit,
            _ => unknown(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_command() {
        let s = String::from;
        let table = [
            ("get_server_list", Command::GetServerList),
            (
                "  get_client_list   607 ",
                Command::GetClientList { server: s("607") },
            ),
            (
                "get_default_active_thread_percentage",
                Command::GetDefaultActiveThreadPercentage,
            ),
            (
                "set_default_active_thread_percentage 25",
                Command::SetDefaultActiveThreadPercentage { value: s("25") },
            ),
            (
                "get_default_device_pinned_mem_limit 0",
                Command::GetDefaultDevicePinnedMemLimit { device: s("0") },
            ),
            (
                "set_default_device_pinned_mem_limit 0 4096M",
                Command::SetDefaultDevicePinnedMemLimit {
                    device: s("0"),
                    value: s("4096M"),
                },
            ),
            (
                "get_active_thread_percentage 607",
                Command::GetActiveThreadPercentage { server: s("607") },
            ),
            (
                "set_active_thread_percentage 607 50",
                Command::SetActiveThreadPercentage {
                    server: s("607"),
                    value: s("50"),
                },
            ),
            (
                "get_device_pinned_mem_limit 607 0",
                Command::GetDevicePinnedMemLimit {
                    server: s("607"),
                    device: s("0"),
                },
            ),
            (
                "set_device_pinned_mem_limit 607 0 8192M",
                Command::SetDevicePinnedMemLimit {
                    server: s("607"),
                    device: s("0"),
                    value: s("8192M"),
                },
            ),
            (
                "get_device_client_list",
                Command::GetDeviceClientList { server: None },
            ),
            (
                "get_device_client_list 607",
                Command::GetDeviceClientList {
                    server: Some(s("607")),
                },
            ),
            ("start_server -uid 1000", Command::StartServer { uid: 1000 }),
            (
                "shutdown_server 607",
                Command::ShutdownServer {
                    server: s("607"),
                    force: false,
                },
            ),
            (
                "shutdown_server 607 -f",
                Command::ShutdownServer {
                    server: s("607"),
                    force: true,
                },
            ),
            (
                "terminate_client 607 604",
                Command::TerminateClient {
                    server: s("607"),
                    client: s("604"),
                },
            ),
            ("quit", Command::Quit),
        ];
        for (line, want) in table {
            assert_eq!(Command::parse(line), want, "{line}");
        }
    }

    #[test]
    fn unknown_and_malformed_lines_are_unknown() {
        for line in [
            "bogus_command",
            "get_server_list extra",
            "start_server 5",
            "start_server -uid x",
            "quit now",
        ] {
            assert_eq!(Command::parse(line), Command::Unknown(line.to_string()));
        }
    }
}
