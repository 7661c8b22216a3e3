//! Running the host's containerd: its version, and its effective config (`config dump`).

use std::path::{Path, PathBuf};
use std::process::Command;

use gpu_mps_api::message::one_line;

use super::{InstallOptions, RegistrationError};

/// `containerd --version` output to (major, minor), for Debian
/// (`containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3`) and upstream
/// (`containerd containerd.io v1.7.27 05044ec...`) builds.
pub fn parse_containerd_version(output: &str) -> Option<(u32, u32)> {
    output.split_whitespace().skip(1).find_map(|field| {
        let v = field.strip_prefix('v').unwrap_or(field);
        let mut parts = v.split('.');
        let major = parts.next()?.parse().ok()?;
        let minor: String = parts.next()?.chars().take_while(char::is_ascii_digit).collect();
        Some((major, minor.parse().ok()?))
    })
}

/// Runs the host's containerd: directly, or through chroot when the host root is elsewhere.
fn containerd_command(opts: &InstallOptions, binary: &Path) -> Command {
    if opts.host_root == Path::new("/") {
        Command::new(binary)
    } else {
        let mut c = Command::new("chroot");
        c.arg(&opts.host_root).arg(binary);
        c
    }
}

fn run_containerd(
    opts: &InstallOptions,
    binary: &Path,
    args: &[&std::ffi::OsStr],
) -> Result<String, RegistrationError> {
    let out = containerd_command(opts, binary)
        .args(args)
        .output()
        .map_err(|e| RegistrationError::Containerd {
            binary: binary.into(),
            message: format!("cannot run it: {e}"),
        })?;
    let stderr = one_line(&String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    // containerd 1.x prints "failed to load TOML" and exits 0 with nothing on stdout.
    if !out.status.success() || stdout.trim().is_empty() {
        return Err(RegistrationError::Containerd {
            binary: binary.into(),
            message: format!("{}: {stderr}", out.status),
        });
    }
    Ok(stdout)
}

/// The (major, minor) version of the host's containerd.
pub fn containerd_version(opts: &InstallOptions, binary: &Path) -> Result<(u32, u32), RegistrationError> {
    let out = run_containerd(opts, binary, &["--version".as_ref()])?;
    parse_containerd_version(&out).ok_or_else(|| RegistrationError::Containerd {
        binary: binary.into(),
        message: format!("cannot read a version from {:?}", out.trim()),
    })
}

/// containerd's effective config: the main config with its imports merged, as containerd reads it.
pub fn dump_config(opts: &InstallOptions, binary: &Path) -> Result<String, RegistrationError> {
    run_containerd(
        opts,
        binary,
        &[
            "--config".as_ref(),
            opts.main_config.as_os_str(),
            "config".as_ref(),
            "dump".as_ref(),
        ],
    )
}

/// The containerd binary on the host, as a host path: the first of `$PATH` and the usual
/// directories that holds one.
pub fn find_containerd(opts: &InstallOptions) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/bin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join("containerd"))
        .find(|candidate| candidate.is_absolute() && opts.on_host(candidate).is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containerd_versions() {
        let cases = [
            (
                "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3",
                (1, 6),
            ),
            (
                "containerd github.com/containerd/containerd 1.7.24~ds1 1.7.24~ds1-6+deb13u1",
                (1, 7),
            ),
            (
                "containerd github.com/containerd/containerd/v2 2.1.9+unknown ",
                (2, 1),
            ),
            (
                "containerd containerd.io v1.7.27 05044ec0a9a75232cad458027ca83437aae3f4da",
                (1, 7),
            ),
        ];
        for (text, want) in cases {
            assert_eq!(parse_containerd_version(text), Some(want), "{text}");
        }
        assert_eq!(parse_containerd_version("containerd garbage"), None);
    }
}
