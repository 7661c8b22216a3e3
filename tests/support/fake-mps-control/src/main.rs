//! A FAKE `nvidia-cuda-mps-control`: a test double for machines without a GPU, so that CI can
//! run gpu-mps-manager, containerd and runc end to end. It speaks the real CLI's command set and
//! answer formats (docs/internals.md) and keeps everything in memory. Never install it on a node.

mod client;
mod command;
mod control_log;
mod daemon;
mod limits;
mod paths;
mod privilege;
mod protocol;
mod server;
mod state;

use std::process::ExitCode;

const HELP: &str = "\
fake-mps-control: a FAKE nvidia-cuda-mps-control (gpu-mps test double; no GPU, no MPS).
It exists so gpu-mps-manager can be tested end to end without a GPU. Never install it on a GPU node.

Usage:
  fake-mps-control -d [-M]     start the control daemon in the background; returns 0 once it
                               accepts commands, 1 with a one-line reason otherwise
  fake-mps-control -f [-M]     run the control daemon in the foreground
  fake-mps-control             client: read commands from stdin, one per line, print the answers
  fake-mps-control -h|--help   this text
  (-M, -multiuser-server: one server for all users)

Environment:
  CUDA_MPS_PIPE_DIRECTORY  pipe dir (default /tmp/nvidia-mps): control, control_privileged,
                           control_lock, log, nvidia-cuda-mps-control.pid
  CUDA_MPS_LOG_DIRECTORY   log dir (default /var/log/nvidia-mps): control.log, server.log
  CUDA_VISIBLE_DEVICES     read by the daemon; the number of entries is the number of devices
  FAKE_MPS_CONTROL_MAX_CLIENTS
                           read by the daemon, test only: clients per server (default 48, MPS's)

Commands:
  get_server_list, get_client_list <srv>, get_device_client_list [srv],
  get_default_active_thread_percentage, set_default_active_thread_percentage <p>,
  get_default_device_pinned_mem_limit <dev>, set_default_device_pinned_mem_limit <dev> <N>M|<N>G,
  get_active_thread_percentage <srv>, set_active_thread_percentage <srv> <p>,
  get_device_pinned_mem_limit <srv> <dev>, set_device_pinned_mem_limit <srv> <dev> <N>M|<N>G,
  start_server -uid <uid>, shutdown_server <srv> [-f], terminate_client <srv> <pid>, quit

The client uses <pipe dir>/control_privileged when it can connect to it, else <pipe dir>/control,
where commands that change anything are refused as the real daemon refuses them.

On the sockets the fake frames its messages as the real daemon does (measured on the H200):
hello, credentials, kind 2 (CUDA client) or 4 (UI session). Fake CUDA clients
(gpu-mps-checker mps-client) get their channel to the server as a passed descriptor, and on it
the fake's own line `SERVER <pid> THREADS <p> MEM <dev>=<v>[,...]`; the fake servers are child
processes (`fake-mps-control --fake-server --uid <uid>`) that do nothing.
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    match words.as_slice() {
        [] => client::run(),
        ["-h" | "--help"] => {
            print!("{HELP}");
            ExitCode::SUCCESS
        }
        [server::FAKE_SERVER_FLAG, "--uid", uid] => server::run_fake_server(uid),
        _ => run_daemon(&words),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum DaemonMode {
    Background,
    Foreground,
    Child,
}

fn run_daemon(words: &[&str]) -> ExitCode {
    let mut mode = None;
    let mut multiuser = false;
    for word in words {
        match *word {
            "-d" => mode = Some(DaemonMode::Background),
            "-f" => mode = Some(DaemonMode::Foreground),
            daemon::DAEMON_CHILD_FLAG => mode = Some(DaemonMode::Child),
            "-M" | "-multiuser-server" => multiuser = true,
            other => return usage_error(&format!("unknown option {other:?}")),
        }
    }
    match mode {
        Some(DaemonMode::Background) => daemon::start_in_background(multiuser),
        Some(DaemonMode::Foreground) => daemon::run(multiuser, false),
        Some(DaemonMode::Child) => daemon::run(multiuser, true),
        None => usage_error("-M needs -d or -f"),
    }
}

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("fake-mps-control: {msg}; see fake-mps-control --help");
    ExitCode::FAILURE
}
