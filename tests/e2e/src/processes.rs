//! Host processes the harness starts or has to find again: daemons it stops, and the ones
//! that outlive them (containerd shims, MPS control daemons, container inits).

use std::process::Child;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Whether `pid` runs: it exists and is neither a zombie nor dead (state `Z` or `X` in
/// /proc/<pid>/stat). Not read from the cmdline: that is empty for a zombie, but also for a
/// process in the middle of execve (the new image is in place, comm already says `sleep`, its
/// argument pages not yet recorded), which is what a freshly spawned child often is (seen in
/// 203 of 300 spawns of `sleep 5` read at once, all in state R or S).
pub fn alive(pid: u32) -> bool {
    pid != 0
        && std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state != "Z" && state != "X")
        })
}

/// Polls `condition` every 20 ms until it holds (true) or `timeout` passes (false): what the
/// kernel shows of a process just started (its argv, its children) comes a moment later.
pub fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn kill_hard(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

/// SIGTERM, then SIGKILL after `grace`; reaps the child.
pub fn stop_child(child: &mut Child, grace: Duration) {
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Waits up to `timeout` for all of `pids` to be gone; true when they are.
pub fn wait_gone(pids: &[u32], timeout: Duration) -> bool {
    wait_until(timeout, || !pids.iter().any(|p| alive(*p)))
}

/// Every process with its argv, NUL-split.
fn all() -> impl Iterator<Item = (u32, Vec<Vec<u8>>)> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let argv = cmdline
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(<[u8]>::to_vec)
                .collect();
            Some((pid, argv))
        })
}

/// Processes whose argv[0] contains `program` and that have `arg` among their arguments,
/// e.g. the containerd-shims started with `-address <this containerd's socket>`.
pub fn with_argument(program: &[u8], arg: &[u8]) -> Vec<u32> {
    all()
        .filter(|(_, argv)| {
            argv.first()
                .is_some_and(|argv0| argv0.windows(program.len()).any(|w| w == program))
                && argv.iter().skip(1).any(|a| a == arg)
        })
        .map(|(pid, _)| pid)
        .collect()
}

/// Whether `pid` runs `program` (argv[0] starts with it): a pid read from a stale pid file
/// may have been recycled by another process.
pub fn runs(pid: u32, program: &[u8]) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.starts_with(program))
}

/// A process's argv.
pub fn cmdline(pid: u32) -> Vec<String> {
    let bytes = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    bytes
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// The environment a process started with, in order, duplicates included (what getenv(3)
/// sees is the first of a name).
pub fn environ(pid: u32) -> std::io::Result<Vec<String>> {
    let bytes = std::fs::read(format!("/proc/{pid}/environ"))?;
    Ok(bytes
        .split(|b| *b == 0)
        .filter(|v| !v.is_empty())
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect())
}

pub fn children_of(parent: u32) -> Vec<u32> {
    let mut children = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // After the parenthesised command name: state, ppid, ...
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid == Some(parent) {
            children.push(pid);
        }
    }
    children
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_itself() {
        let me = std::process::id();
        assert!(alive(me));
        assert!(!alive(0));
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        // Alive from the moment spawn returns, though its argv may not be readable yet.
        assert!(alive(child.id()));
        assert!(children_of(me).contains(&child.id()));
        assert!(
            wait_until(Duration::from_secs(10), || with_argument(b"sleep", b"5")
                .contains(&child.id())),
            "sleep 5 never showed its argv: {:?}",
            cmdline(child.id())
        );
        stop_child(&mut child, Duration::from_secs(1));
        assert!(!alive(child.id()));
    }

    #[test]
    fn a_zombie_is_gone_and_a_process_just_spawned_is_alive() {
        // Many spawns, each checked at once: the state, not the argv, tells whether it runs.
        for _ in 0..50 {
            let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
            assert!(
                alive(child.id()),
                "{} counted as gone right after spawn",
                child.id()
            );
            kill_hard(child.id());
            // Killed but not reaped: a zombie until wait.
            assert!(wait_until(Duration::from_secs(10), || !alive(child.id())));
            assert!(std::fs::metadata(format!("/proc/{}", child.id())).is_ok());
            child.wait().unwrap();
        }
    }
}
