//! A keeper outlives manager upgrades, so the keeper of today must answer a manager of
//! protocol version 1 (to 2026-12-06) exactly as a version-1 keeper did. This test speaks
//! version 1's bytes with bare socket calls, independent of the crate's client: a change to
//! the wire that an old manager would trip over fails here.
#![allow(clippy::unwrap_used)]

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::cmsg_space;
use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr,
};

fn seqpacket() -> OwnedFd {
    socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap()
}

/// One version-1 call: connect, send `request` (with `fd`), read answers until `last` says
/// the call is done. Each answer: its text and the raw numbers of the descriptors it carried
/// (left open: the test process ends soon, and adopting them would need `unsafe`).
fn call(root: &Path, request: &[u8], fd: Option<RawFd>, more: fn(&str) -> bool) -> Vec<(String, Vec<RawFd>)> {
    let conn = seqpacket();
    socket::connect(
        conn.as_raw_fd(),
        &UnixAddr::new(&root.join("gate-keeper.sock")).unwrap(),
    )
    .unwrap();
    let raw: Vec<RawFd> = fd.into_iter().collect();
    let cmsgs: Vec<ControlMessage<'_>> = if raw.is_empty() {
        vec![]
    } else {
        vec![ControlMessage::ScmRights(&raw)]
    };
    socket::sendmsg::<()>(
        conn.as_raw_fd(),
        &[IoSlice::new(request)],
        &cmsgs,
        MsgFlags::empty(),
        None,
    )
    .unwrap();
    let mut answers = Vec::new();
    loop {
        let mut buf = [0u8; 512];
        let mut space = cmsg_space!([RawFd; 4]);
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = socket::recvmsg::<()>(
            conn.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .unwrap();
        let fds: Vec<RawFd> = msg
            .cmsgs()
            .unwrap()
            .flat_map(|c| match c {
                ControlMessageOwned::ScmRights(fds) => fds,
                _ => vec![],
            })
            .collect();
        let bytes = msg.bytes;
        let text = String::from_utf8(buf[..bytes].to_vec()).unwrap();
        let go_on = more(&text);
        answers.push((text, fds));
        if !go_on {
            return answers;
        }
    }
}

fn one(_: &str) -> bool {
    false
}

fn until_end(text: &str) -> bool {
    text != "END"
}

#[test]
fn a_version_1_manager_is_answered_as_version_1_answered() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let (done_tx, done) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(gpu_mps_gate_keeper::run_keeper(&root, None).is_ok());
    });
    let socket_path = dir.path().join("gate-keeper.sock");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket_path.exists() {
        assert!(Instant::now() < deadline, "no keeper socket");
        std::thread::sleep(Duration::from_millis(10));
    }

    // PING: `PONG <pid>`, the pid a u32 (the keeper runs in this process here).
    let pong = call(dir.path(), b"PING", None, one);
    assert_eq!(pong, vec![(format!("PONG {}", std::process::id()), vec![])]);

    // PUT listener <name> with one descriptor: `OK`.
    let gate = dir.path().join("control");
    let listener = seqpacket();
    socket::bind(listener.as_raw_fd(), &UnixAddr::new(&gate).unwrap()).unwrap();
    socket::listen(&listener, Backlog::new(8).unwrap()).unwrap();
    let put = call(
        dir.path(),
        b"PUT listener gate-a",
        Some(listener.as_raw_fd()),
        one,
    );
    assert_eq!(put, vec![("OK".to_string(), vec![])]);
    drop(listener);

    // TAKE: `HELD listener <name>` with one descriptor per listener, then `END`; the
    // descriptor is the gate's listening socket, still listening.
    let client = seqpacket();
    socket::connect(client.as_raw_fd(), &UnixAddr::new(&gate).unwrap()).unwrap();
    let taken = call(dir.path(), b"TAKE", None, until_end);
    assert_eq!(taken.len(), 2, "{taken:?}");
    assert_eq!(taken[0].0, "HELD listener gate-a");
    assert_eq!(taken[0].1.len(), 1);
    assert_eq!(taken[1], ("END".to_string(), vec![]));
    let served = socket::accept(taken[0].1[0]).unwrap();
    socket::send(client.as_raw_fd(), b"hi", MsgFlags::empty()).unwrap();
    let mut buf = [0u8; 8];
    assert_eq!(socket::recv(served, &mut buf, MsgFlags::empty()).unwrap(), 2);

    // QUIT_IF_EMPTY while something is held: `BUSY <count>`.
    assert_eq!(
        call(dir.path(), b"QUIT_IF_EMPTY", None, one),
        vec![("BUSY 1".to_string(), vec![])]
    );
    // DROP <name>: `OK`, also for a name not held.
    assert_eq!(
        call(dir.path(), b"DROP gate-a", None, one),
        vec![("OK".to_string(), vec![])]
    );
    assert_eq!(
        call(dir.path(), b"DROP never-held", None, one),
        vec![("OK".to_string(), vec![])]
    );
    // A malformed request: `ERR <why>`, and the keeper goes on.
    let refused = call(dir.path(), b"take", None, one);
    assert!(refused[0].0.starts_with("ERR "), "{refused:?}");
    // QUIT_IF_EMPTY when empty: `OK`, and the keeper ends cleanly.
    assert_eq!(
        call(dir.path(), b"QUIT_IF_EMPTY", None, one),
        vec![("OK".to_string(), vec![])]
    );
    assert!(done.recv_timeout(Duration::from_secs(5)).unwrap());
}
