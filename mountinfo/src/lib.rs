//! A process's /proc/<pid>/mountinfo (proc(5)), parsed, and which mount serves a path in it.
//! Pure: the caller reads the files. One parser for gpu-mps-hook (the gate check, which refuses
//! a line it cannot read), the in-container checker and the e2e harness (which skip one).
//!
//! Which mount serves a path is found the way the kernel's path walk finds it, from the mount
//! tree (`mount_id`/`parent_id`), not from the longest mount point alone: a mount made over a
//! directory above the path (say over `/tmp`) hides every mount below it that was made before,
//! although those are still listed with their mount points.

use serde::{Deserialize, Serialize};

/// One mountinfo line. Serialized in the checker's report, read back by the e2e tests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mount {
    pub mount_id: u64,
    pub parent_id: u64,
    /// `st_dev` of the mounted filesystem, `major:minor`.
    pub major_minor: String,
    /// The directory of the filesystem mounted here: for a bind mount, its source inside its
    /// filesystem.
    pub root: String,
    /// Where it is mounted, as the process whose mountinfo this is names it.
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

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "mountinfo line {number} is not `ID PARENT MAJ:MIN ROOT POINT OPTIONS [TAGS] - TYPE SOURCE OPTIONS`: {line:?}"
)]
pub struct ParseError {
    pub number: usize,
    pub line: String,
}

/// Parses every line; one that does not parse is an error (a mount the check cannot read could
/// be the one that covers the gate).
pub fn parse(text: &str) -> Result<Vec<Mount>, ParseError> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.is_empty())
        .map(|(i, line)| {
            parse_line(line).ok_or_else(|| ParseError {
                number: i + 1,
                line: line.to_string(),
            })
        })
        .collect()
}

/// Parses the lines it can read and leaves out the others: for a report of what a process sees,
/// where one odd line must not hide the rest.
pub fn parse_readable(text: &str) -> Vec<Mount> {
    text.lines().filter_map(parse_line).collect()
}

/// `36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue`: the
/// optional tags run up to a lone `-`.
pub fn parse_line(line: &str) -> Option<Mount> {
    let mut fields = line.split(' ');
    let mount_id = fields.next()?.parse().ok()?;
    let parent_id = fields.next()?.parse().ok()?;
    let major_minor = fields.next().filter(|f| f.contains(':'))?.to_string();
    let root = unescape(fields.next()?);
    let mount_point = unescape(fields.next()?);
    let options = fields.next()?.to_string();
    fields.by_ref().find(|f| *f == "-")?;
    let fstype = unescape(fields.next()?);
    let source = unescape(fields.next()?);
    let super_options = fields.next()?.to_string();
    // A root need not be a path: a bind of a namespace file (nsfs, which every CNI pod's network
    // namespace is under /run/netns) shows `net:[4026532174]`. A mount point always is.
    (!root.is_empty() && mount_point.starts_with('/')).then_some(Mount {
        mount_id,
        parent_id,
        major_minor,
        root,
        mount_point,
        options,
        fstype,
        source,
        super_options,
    })
}

/// The kernel writes a space, tab, newline and backslash in a path as `\040`, `\011`, `\012`
/// and `\134`; any three octal digits after a backslash are read back the same way.
pub fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let digits = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)) && d[0] <= b'3');
        if let Some(d) = digits {
            out.push(d.iter().fold(0u8, |value, c| value * 8 + (c - b'0')));
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `path` is `dir` or below it, by whole components (`/tmp/a` is not below `/tmp/ab`).
pub fn is_at_or_below(path: &str, dir: &str) -> bool {
    let dir = dir.trim_end_matches('/');
    path == dir || dir.is_empty() || path.strip_prefix(dir).is_some_and(|rest| rest.starts_with('/'))
}

/// The mount that serves absolute `path`: the one an open of `path` lands on.
///
/// From the root mount (the `/` mount whose parent is not listed), step into the child mount
/// whose mount point is the shallowest one at or above `path`: a mount stacked on the current
/// one (same mount point) first, then one on a directory on the way down. A mount below a
/// directory that a later mount covers hangs from the covered mount, so the walk never reaches
/// it. When two children share a mount point, the one listed last was mounted last.
pub fn serving<'a>(mounts: &'a [Mount], path: &str) -> Option<&'a Mount> {
    let listed = |id: u64| mounts.iter().any(|m| m.mount_id == id);
    let mut current = mounts
        .iter()
        .rev()
        .find(|m| m.mount_point == "/" && !listed(m.parent_id))?;
    loop {
        let next = mounts
            .iter()
            .filter(|m| m.parent_id == current.mount_id && m.mount_id != current.mount_id)
            .filter(|m| is_at_or_below(path, &m.mount_point))
            .filter(|m| is_at_or_below(&m.mount_point, &current.mount_point))
            .fold(None::<&Mount>, |best, m| match best {
                Some(b) if b.mount_point.len() < m.mount_point.len() => Some(b),
                _ => Some(m),
            });
        match next {
            Some(m) => current = m,
            None => return Some(current),
        }
    }
}

/// What a bind mount of host directory `dir` shows in any mount namespace: the filesystem that
/// holds `dir` on the host and `dir`'s path inside it. `host` is the mountinfo of a process
/// that names `dir` as the host does (the hook's own: runc runs it in the host's namespaces).
pub fn bind_identity(host: &[Mount], dir: &str) -> Option<(String, String)> {
    let holder = serving(host, dir)?;
    let below = dir
        .strip_prefix(holder.mount_point.trim_end_matches('/'))
        .unwrap_or_default();
    let root = format!("{}{}", holder.root.trim_end_matches('/'), below);
    let root = if root.is_empty() { "/".to_string() } else { root };
    Some((holder.major_minor.clone(), root))
}

/// The mount whose mount point is the deepest at or above `path` (absolute, symlinks resolved),
/// the last one listed when several are stacked on the same point. Unlike [`serving`] it does not
/// walk the tree: a mount hidden by a later one over a directory above it can still be named.
/// The checker reports it as the mount a path is on.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(mounts: &[Mount], path: &str) -> Option<u64> {
        serving(mounts, path).map(|m| m.mount_id)
    }

    #[test]
    fn parses_tags_escapes_and_refuses_a_short_line() {
        let mounts = parse(
            "22 1 0:21 / / rw,relatime - overlay overlay rw\n\
             27 22 0:25 /a\\040b\\134c /with\\040space rw shared:3 master:4 - tmpfs my\\040src rw\n",
        )
        .unwrap();
        assert_eq!(mounts[1].mount_id, 27);
        assert_eq!(mounts[1].parent_id, 22);
        assert_eq!(mounts[1].major_minor, "0:25");
        assert_eq!(mounts[1].root, "/a b\\c");
        assert_eq!(mounts[1].mount_point, "/with space");
        assert_eq!(mounts[1].fstype, "tmpfs");
        assert_eq!(mounts[1].source, "my src");
        let err = parse("22 1 0:21 / / rw\n23 22 0:22 / /proc rw - proc\n").unwrap_err();
        assert_eq!(err.number, 1, "{err}");
        assert!(parse("x 1 0:21 / / rw - a b c").is_err());
    }

    #[test]
    fn a_namespace_file_bind_parses_and_serves_only_its_own_path() {
        // What `ip netns add` and every CNI pod sandbox leave in the host's mountinfo.
        let host = parse(
            "1 0 254:0 / / rw - ext4 /dev/vda rw\n\
             30 1 0:30 / /run rw - tmpfs tmpfs rw\n\
             45 30 0:4 net:[4026532174] /run/netns/cni-1 rw - nsfs nsfs rw\n",
        )
        .unwrap();
        assert_eq!(host[2].root, "net:[4026532174]");
        assert_eq!(ids(&host, "/run/netns/cni-1"), Some(45));
        assert_eq!(ids(&host, "/run/gpu-mps/gates/49c1"), Some(30));
        assert_eq!(
            bind_identity(&host, "/run/gpu-mps/gates/49c1"),
            Some(("0:30".into(), "/gpu-mps/gates/49c1".into()))
        );
        assert!(
            parse("45 30 0:4 net:[1] relative rw - nsfs nsfs rw").is_err(),
            "a mount point is a path"
        );
    }

    #[test]
    fn unescapes_octal_triples_only() {
        assert_eq!(unescape(r"/tmp/a\040b\011c\012"), "/tmp/a b\tc\n");
        assert_eq!(unescape(r"/a\9b\04"), r"/a\9b\04");
        assert_eq!(
            unescape(r"/a\777"),
            r"/a\777",
            "more than a byte stays as written"
        );
    }

    #[test]
    fn components_not_prefixes() {
        assert!(is_at_or_below("/tmp/a", "/tmp"));
        assert!(is_at_or_below("/tmp", "/tmp/"));
        assert!(is_at_or_below("/x", "/"));
        assert!(!is_at_or_below("/tmpx", "/tmp"));
        assert!(!is_at_or_below("/tmp", "/tmp/a"));
    }

    const ROOTFS: &str = "\
1 0 254:0 / / rw - ext4 /dev/vda rw
68 1 0:40 / /b/rootfs rw - overlay overlay rw
69 68 0:40 / /b/rootfs rw - overlay overlay rw
85 69 0:30 /gpu-mps/gates/49c1 /b/rootfs/tmp/nvidia-mps ro - tmpfs tmpfs rw
";

    #[test]
    fn the_walk_takes_stacked_mounts_and_stops_at_the_deepest() {
        let m = parse(ROOTFS).unwrap();
        assert_eq!(ids(&m, "/b/rootfs/tmp/nvidia-mps"), Some(85));
        assert_eq!(ids(&m, "/b/rootfs/tmp/nvidia-mps/control"), Some(85));
        assert_eq!(
            ids(&m, "/b/rootfs/tmp"),
            Some(69),
            "the self-bind covers the overlay"
        );
        assert_eq!(ids(&m, "/b/rootfsx"), Some(1));
        assert_eq!(ids(&[], "/"), None);
    }

    #[test]
    fn a_later_mount_on_the_same_point_or_above_serves_the_path() {
        let stacked =
            format!("{ROOTFS}86 85 254:0 /tmp/nvidia-mps /b/rootfs/tmp/nvidia-mps rw - ext4 /dev/vda rw\n");
        assert_eq!(
            ids(&parse(&stacked).unwrap(), "/b/rootfs/tmp/nvidia-mps"),
            Some(86)
        );
        let over_tmp = format!("{ROOTFS}86 69 0:50 / /b/rootfs/tmp rw - tmpfs tmpfs rw\n");
        assert_eq!(
            ids(&parse(&over_tmp).unwrap(), "/b/rootfs/tmp/nvidia-mps"),
            Some(86),
            "the gate hangs from the covered rootfs, out of the walk"
        );
        // Two children of one mount on one point: the one listed last.
        let twins = format!("{ROOTFS}87 69 254:0 /x /b/rootfs/tmp/nvidia-mps rw - ext4 /dev/vda rw\n");
        assert_eq!(ids(&parse(&twins).unwrap(), "/b/rootfs/tmp/nvidia-mps"), Some(87));
    }

    #[test]
    fn a_bind_shows_the_host_dir_inside_its_filesystem() {
        let host = parse(
            "1 0 254:0 / / rw - ext4 /dev/vda rw\n\
             30 1 0:30 / /run rw - tmpfs tmpfs rw\n",
        )
        .unwrap();
        assert_eq!(
            bind_identity(&host, "/run/gpu-mps/gates/49c1"),
            Some(("0:30".into(), "/gpu-mps/gates/49c1".into()))
        );
        assert_eq!(
            bind_identity(&host, "/tmp/g"),
            Some(("254:0".into(), "/tmp/g".into()))
        );
        assert_eq!(bind_identity(&host, "/run"), Some(("0:30".into(), "/".into())));
        // The host's / is a directory of its filesystem (a root made / of a namespace).
        let chroot = parse("5 4 254:0 /srv/root / rw - ext4 /dev/vda rw\n").unwrap();
        assert_eq!(
            bind_identity(&chroot, "/tmp/g"),
            Some(("254:0".into(), "/srv/root/tmp/g".into()))
        );
    }
}

#[cfg(test)]
mod report_tests {
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
        let mounts = parse_readable(SAMPLE);
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
        let mounts = parse_readable(SAMPLE);
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
