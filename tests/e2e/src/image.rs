//! The test image, built in Rust without docker or a registry: one layer holding the static
//! checker, a fake nvidia-smi to be masked, and the few directories and files a container
//! needs. The same files make the plain rootfs directory that `ctr run --rootfs` uses.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::json;
use sha2::{Digest, Sha256};

/// The image's full name after `ctr -n k8s.io images import`: containerd takes it from the
/// `io.containerd.image.name` annotation of index.json.
pub const TEST_IMAGE: &str = "docker.io/gpu-mps/test:e2e";
/// The image's tag alone, for tools that read `org.opencontainers.image.ref.name`.
const TEST_IMAGE_TAG: &str = "e2e";
/// Where the checker lies in the image; the image's entrypoint.
pub const CHECKER_PATH: &str = "/checker";
/// The fake nvidia-smi the shim must mask.
pub const NVIDIA_SMI_PATH: &str = "/usr/bin/nvidia-smi";
pub const NVIDIA_SMI_CONTENT: &str = "#!fake nvidia-smi for masking tests\n";

const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar";
const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";

/// One file or directory of the image, path relative to `/`.
#[derive(Debug, Clone)]
enum Entry {
    Dir {
        path: &'static str,
        mode: u32,
    },
    File {
        path: &'static str,
        mode: u32,
        data: Vec<u8>,
    },
}

/// Everything in the image, parents before children.
fn entries(checker: &Path) -> Result<Vec<Entry>> {
    let checker_data =
        std::fs::read(checker).with_context(|| format!("reading the checker {}", checker.display()))?;
    let dir = |path, mode| Entry::Dir { path, mode };
    let file = |path, mode, data: &[u8]| Entry::File {
        path,
        mode,
        data: data.to_vec(),
    };
    Ok(vec![
        dir("dev", 0o755),
        dir("proc", 0o555),
        dir("sys", 0o555),
        dir("tmp", 0o1777),
        dir("etc", 0o755),
        file(
            "etc/passwd",
            0o644,
            b"root:x:0:0:root:/root:/checker\nnobody:x:65534:65534:nobody:/:/checker\n",
        ),
        file("etc/group", 0o644, b"root:x:0:\nnogroup:x:65534:\n"),
        dir("root", 0o700),
        dir("usr", 0o755),
        dir("usr/bin", 0o755),
        file(&NVIDIA_SMI_PATH[1..], 0o755, NVIDIA_SMI_CONTENT.as_bytes()),
        Entry::File {
            path: &CHECKER_PATH[1..],
            mode: 0o755,
            data: checker_data,
        },
    ])
}

/// Lays out the image's files as a plain directory, for `ctr run --rootfs`.
pub fn write_rootfs(checker: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for entry in entries(checker)? {
        let (path, mode) = match &entry {
            Entry::Dir { path, mode } => {
                let path = dir.join(path);
                std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
                (path, *mode)
            }
            Entry::File { path, mode, data } => {
                let path = dir.join(path);
                std::fs::write(&path, data).with_context(|| format!("writing {}", path.display()))?;
                (path, *mode)
            }
        };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("chmod {}", path.display()))?;
    }
    Ok(())
}

/// The OCI image layout of the test image as a tar archive, ready for `ctr images import`.
pub fn oci_archive(checker: &Path) -> Result<Vec<u8>> {
    let layer = layer_tar(&entries(checker)?)?;
    let layer_digest = sha256(&layer);
    let (os, architecture) = platform();
    let config = serde_json::to_vec(&json!({
        "architecture": architecture,
        "os": os,
        "config": {
            "Entrypoint": [CHECKER_PATH],
            "Cmd": ["pause"],
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "WorkingDir": "/",
        },
        "rootfs": { "type": "layers", "diff_ids": [&layer_digest] },
        "history": [{ "created_by": "gpu-mps-e2e image.rs", "comment": "checker and fake nvidia-smi" }],
    }))?;
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": { "mediaType": CONFIG_MEDIA_TYPE, "digest": sha256(&config), "size": config.len() },
        "layers": [{ "mediaType": LAYER_MEDIA_TYPE, "digest": &layer_digest, "size": layer.len() }],
    }))?;
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": [{
            "mediaType": MANIFEST_MEDIA_TYPE,
            "digest": sha256(&manifest),
            "size": manifest.len(),
            "platform": { "architecture": architecture, "os": os },
            "annotations": {
                "io.containerd.image.name": TEST_IMAGE,
                "org.opencontainers.image.ref.name": TEST_IMAGE_TAG,
            },
        }],
    }))?;

    let mut archive = tar::Builder::new(Vec::new());
    append_file(
        &mut archive,
        "oci-layout",
        0o644,
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    append_file(&mut archive, "index.json", 0o644, &index)?;
    for dir in ["blobs", "blobs/sha256"] {
        append_dir(&mut archive, dir, 0o755)?;
    }
    for blob in [&layer, &config, &manifest] {
        let name = format!("blobs/sha256/{}", &sha256(blob)["sha256:".len()..]);
        append_file(&mut archive, &name, 0o644, blob)?;
    }
    Ok(archive.into_inner()?)
}

fn layer_tar(entries: &[Entry]) -> Result<Vec<u8>> {
    let mut layer = tar::Builder::new(Vec::new());
    for entry in entries {
        match entry {
            Entry::Dir { path, mode } => append_dir(&mut layer, path, *mode)?,
            Entry::File { path, mode, data } => append_file(&mut layer, path, *mode, data)?,
        }
    }
    Ok(layer.into_inner()?)
}

fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut header = tar::Header::new_ustar();
    header.set_entry_type(kind);
    header.set_mode(mode);
    header.set_size(size);
    header.set_uid(0);
    header.set_gid(0);
    // Fixed times keep the digests stable from run to run.
    header.set_mtime(0);
    header
}

fn append_dir(archive: &mut tar::Builder<Vec<u8>>, path: &str, mode: u32) -> Result<()> {
    let mut header = header(tar::EntryType::Directory, mode, 0);
    archive.append_data(&mut header, format!("{path}/"), std::io::empty())?;
    Ok(())
}

fn append_file(archive: &mut tar::Builder<Vec<u8>>, path: &str, mode: u32, data: &[u8]) -> Result<()> {
    let mut header = header(tar::EntryType::Regular, mode, data.len() as u64);
    archive.append_data(&mut header, path, data)?;
    Ok(())
}

fn sha256(data: &[u8]) -> String {
    let digest = Sha256::digest(data);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// The OCI platform of this host, which the checker is built for.
fn platform() -> (&'static str, &'static str) {
    let architecture = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    ("linux", architecture)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archive_is_an_oci_layout_naming_the_image() {
        let checker = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(checker.path(), b"\x7fELF not really").unwrap();
        let archive = oci_archive(checker.path()).unwrap();
        let mut names = Vec::new();
        let mut index = String::new();
        for entry in tar::Archive::new(archive.as_slice()).entries().unwrap() {
            let mut entry = entry.unwrap();
            let name = entry.path().unwrap().display().to_string();
            if name == "index.json" {
                std::io::Read::read_to_string(&mut entry, &mut index).unwrap();
            }
            names.push(name);
        }
        assert_eq!(
            names
                .iter()
                .filter(|n| n.starts_with("blobs/sha256/") && n.len() > 20)
                .count(),
            3,
            "{names:?}"
        );
        assert!(names.contains(&"oci-layout".to_string()));
        assert!(index.contains(TEST_IMAGE), "{index}");
        assert_eq!(
            oci_archive(checker.path()).unwrap(),
            archive,
            "the archive must be reproducible"
        );
    }

    #[test]
    fn rootfs_has_the_checker_and_the_fake_nvidia_smi() {
        let checker = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(checker.path(), b"binary").unwrap();
        let dir = tempfile::tempdir().unwrap();
        write_rootfs(checker.path(), dir.path()).unwrap();
        let smi = dir.path().join("usr/bin/nvidia-smi");
        assert_eq!(std::fs::read_to_string(&smi).unwrap(), NVIDIA_SMI_CONTENT);
        assert_eq!(
            std::fs::metadata(&smi).unwrap().permissions().mode() & 0o7777,
            0o755
        );
        assert_eq!(
            std::fs::metadata(dir.path().join("tmp"))
                .unwrap()
                .permissions()
                .mode()
                & 0o7777,
            0o1777
        );
        assert_eq!(std::fs::read(dir.path().join("checker")).unwrap(), b"binary");
    }
}
