//! /proc/self/mountinfo lines (proc(5)): which mount a path is on, with which options. The
//! checker reads its container's; the e2e harness reads the host's, to unmount what a test left.

use serde::{Deserialize, Serialize};

/// One mountinfo line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mount {
    pub mount_id: u64,
    pub parent_id: u64,
    pub major_minor: String,
    /// The path inside the mounted filesystem: for a bind mount, its source.
    pub root: String,
    pub mount_point: String,
    /// Per-mount options (`ro,nosuid,nodev,noexec,relatime`).
    pub options: String,
    pub fstype: String,
    pub source: String,
    /// Superblock options (`rw,size=65536k,...`).
    pub super_options: String,
}

impl Mount {
    pub fn has_option(&self, option: &str) -> bool {
        self.options.split(',').any(|o| o == option)
    }

    /// Whether this bind mount's source is `host_path`, a directory as the host names it.
    /// `root` is the source's path inside its filesystem: a tail of `host_path` where the
    /// filesystem is mounted below the host's / (a tmpfs at /tmp), and `host_path` with a head
    /// where the host's / is itself a directory of the filesystem (a root made the / of a mount
    /// namespace, as tests/fresh-root.sh does). Both are absolute, so a tail starts at a `/`:
    /// whole path components.
    pub fn is_bind_of(&self, host_path: &str) -> bool {
        let (root, host) = (self.root.trim_end_matches('/'), host_path.trim_end_matches('/'));
        let tail_of = |long: &str, short: &str| short.starts_with('/') && long.ends_with(short);
        tail_of(host, root) || tail_of(root, host)
    }
}

/// `36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue`
pub fn parse_line(line: &str) -> Option<Mount> {
    let (left, right) = line.split_once(" - ")?;
    let left: Vec<&str> = left.split(' ').collect();
    let right: Vec<&str> = right.split(' ').collect();
    if left.len() < 6 || right.len() < 3 {
        return None;
    }
    Some(Mount {
        mount_id: left[0].parse().ok()?,
        parent_id: left[1].parse().ok()?,
        major_minor: left[2].to_string(),
        root: unescape(left[3]),
        mount_point: unescape(left[4]),
        options: left[5].to_string(),
        fstype: right[0].to_string(),
        source: unescape(right[1]),
        super_options: right[2].to_string(),
    })
}

pub fn parse(text: &str) -> Vec<Mount> {
    text.lines().filter_map(parse_line).collect()
}

/// The mount that `path` (absolute, symlinks resolved) is on: the deepest mount point above it,
/// the last one listed when several are stacked on the same point (that one is visible).
pub fn containing<'a>(mounts: &'a [Mount], path: &str) -> Option<&'a Mount> {
    let mut best: Option<&Mount> = None;
    for m in mounts {
        let covers = m.mount_point == "/"
            || path == m.mount_point
            || path
                .strip_prefix(m.mount_point.as_str())
                .is_some_and(|rest| rest.starts_with('/'));
        if covers && best.is_none_or(|b| m.mount_point.len() >= b.mount_point.len()) {
            best = Some(m);
        }
    }
    best
}

/// Undoes the kernel's octal escapes (`\040` for a space, `\011`, `\012`, `\134`).
pub fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                let value = d.iter().fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
                out.push(u8::try_from(value).unwrap_or(b'?'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 0:21 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
23 22 0:22 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
24 22 0:23 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
25 24 0:24 / /dev/shm rw,nosuid,nodev,noexec,relatime - tmpfs shm rw,size=65536k
26 22 253:1 /run/gpu-mps/daemons/GPU-1/pipe /tmp/nvidia-mps ro,nosuid,nodev,noexec,relatime master:7 - ext4 /dev/vda1 rw
27 22 0:25 / /with\\040space rw shared:3 master:4 - tmpfs my\\040src rw
28 24 0:26 / /dev/shm rw,relatime - tmpfs shm2 rw
";

    #[test]
    fn parses_fields_with_optional_tags_and_escapes() {
        let mounts = parse(SAMPLE);
        assert_eq!(mounts.len(), 7);
        let pipe = &mounts[4];
        assert_eq!(pipe.mount_id, 26);
        assert_eq!(pipe.parent_id, 22);
        assert_eq!(pipe.major_minor, "253:1");
        assert_eq!(pipe.root, "/run/gpu-mps/daemons/GPU-1/pipe");
        assert_eq!(pipe.mount_point, "/tmp/nvidia-mps");
        assert_eq!(pipe.options, "ro,nosuid,nodev,noexec,relatime");
        assert_eq!(pipe.fstype, "ext4");
        assert_eq!(pipe.source, "/dev/vda1");
        assert_eq!(pipe.super_options, "rw");
        assert_eq!(mounts[5].mount_point, "/with space");
        assert_eq!(mounts[5].source, "my src");
        assert_eq!(parse_line("garbage"), None);
        assert!(pipe.has_option("ro") && !pipe.has_option("r"));
    }

    #[test]
    fn unescapes_only_octal_triples() {
        assert_eq!(unescape(r"/tmp/a\040b\011c"), "/tmp/a b\tc");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert_eq!(unescape(r"/a\9b\04"), r"/a\9b\04");
    }

    #[test]
    fn finds_the_visible_mount_of_a_path() {
        let mounts = parse(SAMPLE);
        assert_eq!(containing(&mounts, "/dev/shm").map(|m| m.mount_id), Some(28));
        assert_eq!(containing(&mounts, "/dev/shm/x").map(|m| m.mount_id), Some(28));
        assert_eq!(containing(&mounts, "/dev/shmx").map(|m| m.mount_id), Some(24));
        assert_eq!(
            containing(&mounts, "/tmp/nvidia-mps/control").map(|m| m.mount_id),
            Some(26)
        );
        assert_eq!(containing(&mounts, "/tmp").map(|m| m.mount_id), Some(22));
    }

    #[test]
    fn a_bind_source_is_matched_by_whole_path_components() {
        let bind = |root: &str| Mount {
            mount_id: 1,
            parent_id: 0,
            major_minor: "254:0".into(),
            root: root.into(),
            mount_point: "/tmp/nvidia-mps".into(),
            options: "ro".into(),
            fstype: "ext4".into(),
            source: "/dev/vda".into(),
            super_options: "rw".into(),
        };
        let gate = "/tmp/gme2e-mps.x/r/gates/49c1";
        assert!(bind(gate).is_bind_of(gate));
        // A tmpfs at /tmp: the root within it.
        assert!(bind("/gme2e-mps.x/r/gates/49c1").is_bind_of(gate));
        // The host's / is a directory of the filesystem.
        assert!(bind("/tmp/fresh.y/root/tmp/gme2e-mps.x/r/gates/49c1").is_bind_of(gate));
        // Another directory, or a name that only ends the same.
        assert!(!bind("/tmp/gme2e-mps.x/r/daemons/GPU-0/pipe").is_bind_of(gate));
        assert!(!bind("/tmp/gme2e-mps.x/r/gates/149c1").is_bind_of(gate));
        assert!(!bind("/tmp/gme2e-mps.x/r/gates/49c1").is_bind_of("/other/r/gates/x49c1"));
        assert!(!bind("").is_bind_of(gate));
    }
}
