//! The containerd + runc builds under test: one per Debian suite, fetched by
//! tests/support/fetch-containerd.sh into `$GPU_MPS_CACHE/containerd/<suite>` (default
//! `~/.cache/gpu-mps/containerd/<suite>`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{Context, Result, bail};

/// The suites the tests are generated for, oldest first. The order matters: a suite whose
/// own runc does not run on this host borrows the runc of the oldest suite whose runc does.
pub const KNOWN_SUITES: [&str; 3] = ["bookworm", "trixie", "sid"];
/// Restricts the suites a test run covers, e.g. `GPU_MPS_E2E_SUITES="bookworm sid"`.
pub const SUITES_ENV: &str = "GPU_MPS_E2E_SUITES";
/// The cache root shared with fetch-containerd.sh.
pub const CACHE_ENV: &str = "GPU_MPS_CACHE";
const FETCH_HINT: &str =
    "run tests/support/fetch-containerd.sh first (or restrict the suites with GPU_MPS_E2E_SUITES)";

/// One fetched suite with the runc chosen for it on this host.
#[derive(Debug, Clone)]
pub struct Suite {
    pub name: String,
    /// `<cache>/containerd/<suite>`.
    pub dir: PathBuf,
    pub containerd: PathBuf,
    pub ctr: PathBuf,
    /// Holds containerd-shim-runc-v2; goes on containerd's PATH behind the chosen runc.
    pub bin_dir: PathBuf,
    pub runc: PathBuf,
    /// Why this runc: the suite's own, or another suite's and the reason.
    pub runc_origin: String,
    /// First line of `containerd --version`.
    pub containerd_version: String,
    /// First line of `runc --version` of the chosen runc.
    pub runc_version: String,
    /// containerd's major version, which picks the config schema (2 for 1.x, 3 for 2.x).
    pub containerd_major: u32,
    pub containerd_minor: u32,
    /// The Debian package versions from the suite's VERSIONS file.
    pub packages: String,
}

impl fmt::Display for Suite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "suite {}: containerd {}, runc {} | containerd --version: {} | runc --version: {} | runc used: {} ({}) | packages: {}",
            self.name,
            version_token(&self.containerd_version, 2),
            version_token(&self.runc_version, 2),
            self.containerd_version,
            self.runc_version,
            self.runc.display(),
            self.runc_origin,
            self.packages
        )
    }
}

/// `$GPU_MPS_CACHE/containerd`, else `~/.cache/gpu-mps/containerd`.
pub fn cache_dir() -> PathBuf {
    let base = match std::env::var_os(CACHE_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/root"));
            home.join(".cache/gpu-mps")
        }
    };
    base.join("containerd")
}

/// The suites named by `GPU_MPS_E2E_SUITES`, or `None` when it is unset or empty (all suites).
pub fn selected_suites() -> Option<Vec<String>> {
    let value = std::env::var(SUITES_ENV).ok()?;
    let names: Vec<String> = value
        .split([' ', ','])
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    (!names.is_empty()).then_some(names)
}

impl Suite {
    /// The suite a generated test runs against. `Ok(None)`: GPU_MPS_E2E_SUITES leaves it
    /// out. A suite that is wanted but not fetched is an error, never a silent skip: CI runs
    /// the fetch script first, so a missing suite means a broken setup.
    pub fn for_test(name: &str) -> Result<Option<Suite>> {
        if let Some(selected) = selected_suites() {
            if !selected.iter().any(|s| s == name) {
                return Ok(None);
            }
        }
        let suites = discover()?;
        match suites.iter().find(|s| s.name == name) {
            Some(suite) => Ok(Some(suite.clone())),
            None => bail!(
                "containerd suite {name} is not in {} (found: {}): {FETCH_HINT}",
                cache_dir().display(),
                names(suites)
            ),
        }
    }

    /// containerd's config schema version: 2 for containerd 1.x, 3 for 2.x.
    pub fn config_version(&self) -> u32 {
        if self.containerd_major >= 2 { 3 } else { 2 }
    }

    /// Whether the CRI plugin can resolve CDI devices (`enable_cdi`): since 1.7.
    pub fn has_cdi(&self) -> bool {
        (self.containerd_major, self.containerd_minor) >= (1, 7)
    }

    /// Whether it does by default: 2.x does, 1.7 only when `enable_cdi = true`.
    pub fn cdi_by_default(&self) -> bool {
        self.containerd_major >= 2
    }
}

fn names(suites: &[Suite]) -> String {
    if suites.is_empty() {
        return "none".into();
    }
    suites
        .iter()
        .map(|s| s.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// All suites in the cache (restricted by GPU_MPS_E2E_SUITES), probed once per process.
/// Fails when none is there.
pub fn discover() -> Result<&'static [Suite]> {
    static SUITES: OnceLock<Result<Vec<Suite>, String>> = OnceLock::new();
    SUITES
        .get_or_init(|| discover_uncached().map_err(|e| format!("{e:#}")))
        .as_deref()
        .map_err(|e| anyhow::anyhow!("{e}"))
}

fn discover_uncached() -> Result<Vec<Suite>> {
    let cache = cache_dir();
    let selected = selected_suites();
    let mut present: Vec<(String, PathBuf)> = Vec::new();
    let entries = match std::fs::read_dir(&cache) {
        Ok(entries) => entries.collect::<Result<Vec<_>, _>>()?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", cache.display())),
    };
    for entry in entries {
        let dir = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if dir.join("usr/bin/containerd").is_file() {
            present.push((name, dir));
        }
    }
    // Known suites in their order (oldest first), then any other suite the cache holds.
    present.sort_by_key(|(name, _)| {
        (
            KNOWN_SUITES.iter().position(|k| k == name).unwrap_or(usize::MAX),
            name.clone(),
        )
    });
    if present.is_empty() {
        bail!("no containerd suite in {}: {FETCH_HINT}", cache.display());
    }

    // Which runcs run on this host, whether or not their suite is selected: a suite whose
    // own runc needs a newer glibc borrows one of them.
    let runcs: Vec<(String, PathBuf, Result<String, String>)> = present
        .iter()
        .map(|(name, dir)| {
            let runc = dir.join("usr/sbin/runc");
            let version = first_line_of(&runc, &["--version"]);
            (name.clone(), runc, version)
        })
        .collect();

    let mut suites = Vec::new();
    for ((name, dir), (_, own_runc, own_version)) in present.iter().zip(&runcs) {
        if let Some(selected) = &selected {
            if !selected.contains(name) {
                continue;
            }
        }
        let containerd = dir.join("usr/bin/containerd");
        let containerd_version = first_line_of(&containerd, &["--version"])
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("suite {name}: containerd does not run on this host"))?;
        let (containerd_major, containerd_minor) = parse_version(&containerd_version)
            .with_context(|| format!("suite {name}: no version in {containerd_version:?}"))?;
        let (runc, runc_version, runc_origin) = match own_version {
            Ok(version) => (own_runc.clone(), version.clone(), format!("{name}'s own runc")),
            Err(own_error) => {
                let borrowed = runcs.iter().find(|(_, _, v)| v.is_ok());
                let Some((other, path, Ok(version))) = borrowed else {
                    bail!(
                        "suite {name}: its runc does not run on this host ({own_error}) and no other suite's runc does"
                    );
                };
                let reason =
                    format!("{other}'s runc: {name}'s own runc does not run on this host: {own_error}");
                (path.clone(), version.clone(), reason)
            }
        };
        let packages = std::fs::read_to_string(dir.join("VERSIONS"))
            .map(|v| v.lines().collect::<Vec<_>>().join(", "))
            .unwrap_or_else(|_| "VERSIONS file missing".into());
        suites.push(Suite {
            name: name.clone(),
            dir: dir.clone(),
            ctr: dir.join("usr/bin/ctr"),
            bin_dir: dir.join("usr/bin"),
            containerd,
            runc,
            runc_origin,
            containerd_version,
            runc_version,
            containerd_major,
            containerd_minor,
            packages,
        });
    }
    Ok(suites)
}

/// The first line of `<binary> <args>`' output; the first line of its error when it fails
/// (e.g. a glibc version it needs and this host lacks).
fn first_line_of(binary: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(binary)
        .args(args)
        .output()
        .map_err(|e| format!("{}: {e}", binary.display()))?;
    let text = |bytes: &[u8]| {
        String::from_utf8_lossy(bytes)
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string()
    };
    if out.status.success() {
        Ok(text(&out.stdout))
    } else {
        Err(format!("{} ({})", text(&out.stderr), out.status))
    }
}

/// The `index`th word of a `--version` line (`runc version 1.1.5+ds1` -> `1.1.5+ds1`).
fn version_token(line: &str, index: usize) -> &str {
    line.split_whitespace().nth(index).unwrap_or(line)
}

/// Major and minor version in `containerd github.com/containerd/containerd 1.6.20~ds1 ...` or
/// `containerd github.com/containerd/containerd/v2 2.1.9+unknown`.
fn parse_version(version_line: &str) -> Option<(u32, u32)> {
    let version = version_line.split_whitespace().nth(2)?;
    let mut numbers = version.trim_start_matches('v').split('.');
    let major = numbers.next()?.parse().ok()?;
    let minor = numbers.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        assert_eq!(
            parse_version("containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3"),
            Some((1, 6))
        );
        assert_eq!(
            parse_version("containerd github.com/containerd/containerd/v2 2.1.9+unknown "),
            Some((2, 1))
        );
        assert_eq!(
            parse_version("containerd containerd.io v1.7.24 abc"),
            Some((1, 7))
        );
        assert_eq!(parse_version("containerd x 2"), None);
        assert_eq!(parse_version("garbage"), None);
    }
}
