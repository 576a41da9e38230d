//! OCI images of the project's binaries, made from the cargo build without a
//! registry or a container daemon: one OCI image-layout archive holding every
//! image, which `ctr images import` loads into containerd.
//!
//! Contents follow deploy/docker: the agents and the `gpu-stack` CLI dlopen the
//! host's libnvidia-ml, so their images carry glibc (the shared libraries the
//! binary links, found with `ldd`, as distroless/cc does) and no shell; every
//! image runs as any user (an `/etc/passwd` with `nonroot` 65532 is included).
//! Test-only images come along: `pause` (the pod sandbox, a static C binary
//! from tools/node/pause.c), `busybox` (Debian's busybox-static, for workload
//! pods that print what they see), and a stand-in for NVIDIA's driver
//! container and k8s-driver-manager ([`driver_standin_images`]).
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::json;
use sha2::{Digest, Sha256};

/// Repository the test node's images are named under (no registry serves
/// it: `localhost/...` names are never pulled once imported).
pub const LOCAL_REPOSITORY: &str = "localhost/gpu-stack";

/// The project's binaries, each shipped as an image of the same name.
pub const BINARIES: [&str; 8] = [
    "gpu-operator",
    "gpu-stack",
    "gpu-device-plugin",
    "gpu-feature-discovery",
    "gpu-exporter",
    "gpu-mig-manager",
    "gpu-dra-plugin",
    "gpu-node-agent",
];

/// Tag of every project image: the workspace version, as the chart's appVersion.
pub fn tag() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Full name of a project image.
pub fn image_name(name: &str) -> String {
    format!("{LOCAL_REPOSITORY}/{name}:{}", tag())
}

/// Name of the sandbox (pause) image.
pub fn pause_image() -> String {
    image_name("pause")
}

/// Name of the busybox test image.
pub fn busybox_image() -> String {
    image_name("busybox")
}

/// Driver versions the stand-in driver image is tagged with: the real-node
/// test installs the first and upgrades to the second.
pub const DRIVER_STANDIN_VERSIONS: [&str; 2] = ["570.195.03", "580.95.05"];

/// The stand-in driver images' names, as the operator names a driver image
/// for this machine's OS (`localhost/gpu-stack/driver:<version>-<os tag>`,
/// the OS from `/etc/os-release`, which the real node shares), then the
/// stand-in driver manager (`localhost/gpu-stack/k8s-driver-manager`).
pub fn driver_standin_images() -> Result<(Vec<(&'static str, String)>, String)> {
    let text = fs::read_to_string("/etc/os-release").context("reading /etc/os-release")?;
    let labels = gpu_stack_core::nodediscovery::os_release_labels(&text);
    let os = gpu_stack_core::operator::driver::OsInfo::from_labels(&labels)
        .context("/etc/os-release has no ID or VERSION_ID")?;
    let drivers = DRIVER_STANDIN_VERSIONS
        .iter()
        .map(|v| (*v, format!("{LOCAL_REPOSITORY}/driver:{v}-{}", os.tag())))
        .collect();
    Ok((drivers, image_name("k8s-driver-manager")))
}

/// Entrypoint of the stand-in driver container. The simulated host's driver
/// is the one in use, so the container plays only the driver container's
/// part in the pod's life: it runs until stopped and says which version it is.
const STANDIN_DRIVER: &str = r#"#!/bin/sh
version=$(cat /etc/nvidia-driver-version)
echo "driver container stand-in $version: $*"
trap 'echo "driver $version stopping"; exit 0' TERM INT
while :; do sleep 1; done
"#;

/// `nvidia-smi` of the stand-in, which the driver pod's startup probe runs.
const STANDIN_NVIDIA_SMI: &str = r#"#!/bin/sh
echo "NVIDIA-SMI stand-in    Driver Version: $(cat /etc/nvidia-driver-version)"
"#;

/// `driver-manager` of the stand-in: the upgrade controller evicts the GPU
/// pods, and the simulated host has no kernel module to unload.
const STANDIN_DRIVER_MANAGER: &str = r#"#!/bin/sh
echo "driver-manager stand-in: $*: no kernel module to unload on the simulated host"
"#;

/// One file of a layer.
enum Entry {
    Dir,
    File { source: PathBuf, mode: u32 },
    Bytes { data: Vec<u8>, mode: u32 },
    Symlink(String),
}

/// A layer: paths (relative, no leading slash) to entries, written in order.
#[derive(Default)]
struct Layer {
    entries: BTreeMap<String, Entry>,
}

impl Layer {
    fn dir(&mut self, path: &str) {
        let mut prefix = String::new();
        for part in path.trim_matches('/').split('/') {
            if !prefix.is_empty() {
                prefix.push('/');
            }
            prefix.push_str(part);
            self.entries.entry(prefix.clone()).or_insert(Entry::Dir);
        }
    }

    fn parent_dirs(&mut self, path: &str) {
        if let Some((parent, _)) = path.trim_matches('/').rsplit_once('/') {
            self.dir(parent);
        }
    }

    fn file(&mut self, path: &str, source: &Path, mode: u32) {
        self.parent_dirs(path);
        self.entries.insert(
            path.trim_matches('/').to_string(),
            Entry::File {
                source: source.to_path_buf(),
                mode,
            },
        );
    }

    fn bytes(&mut self, path: &str, data: &[u8], mode: u32) {
        self.parent_dirs(path);
        self.entries.insert(
            path.trim_matches('/').to_string(),
            Entry::Bytes {
                data: data.to_vec(),
                mode,
            },
        );
    }

    fn symlink(&mut self, path: &str, target: &str) {
        self.parent_dirs(path);
        self.entries.insert(
            path.trim_matches('/').to_string(),
            Entry::Symlink(target.to_string()),
        );
    }

    /// The uncompressed layer tar (deterministic: fixed owners and times).
    fn tar(&self) -> Result<Vec<u8>> {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, entry) in &self.entries {
            let mut header = tar::Header::new_ustar();
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(0);
            match entry {
                Entry::Dir => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_mode(if path == "tmp" { 0o1777 } else { 0o755 });
                    header.set_size(0);
                    builder.append_data(&mut header, format!("{path}/"), std::io::empty())?;
                }
                Entry::File { source, mode } => {
                    let data = fs::read(source)
                        .with_context(|| format!("reading {}", source.display()))?;
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_mode(*mode);
                    header.set_size(data.len() as u64);
                    builder.append_data(&mut header, path, data.as_slice())?;
                }
                Entry::Bytes { data, mode } => {
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_mode(*mode);
                    header.set_size(data.len() as u64);
                    builder.append_data(&mut header, path, data.as_slice())?;
                }
                Entry::Symlink(target) => {
                    header.set_entry_type(tar::EntryType::Symlink);
                    header.set_mode(0o777);
                    header.set_size(0);
                    builder.append_link(&mut header, path, target)?;
                }
            }
        }
        Ok(builder.into_inner()?)
    }
}

/// A finished blob: its digest and size.
#[derive(Clone)]
struct Blob {
    digest: String,
    size: usize,
}

/// The OCI image-layout archive being written.
struct Archive {
    tar: tar::Builder<BufWriter<File>>,
    written: BTreeSet<String>,
    manifests: Vec<serde_json::Value>,
}

impl Archive {
    fn create(path: &Path) -> Result<Self> {
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut archive = Self {
            tar: tar::Builder::new(BufWriter::new(file)),
            written: BTreeSet::new(),
            manifests: Vec::new(),
        };
        archive.entry("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        Ok(archive)
    }

    fn entry(&mut self, path: &str, data: &[u8]) -> Result<()> {
        let mut header = tar::Header::new_ustar();
        header.set_mode(0o644);
        header.set_mtime(0);
        header.set_size(data.len() as u64);
        header.set_entry_type(tar::EntryType::Regular);
        self.tar.append_data(&mut header, path, data)?;
        Ok(())
    }

    fn blob(&mut self, data: &[u8]) -> Result<Blob> {
        let hex = Sha256::digest(data)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>();
        if self.written.insert(hex.clone()) {
            self.entry(&format!("blobs/sha256/{hex}"), data)?;
        }
        Ok(Blob {
            digest: format!("sha256:{hex}"),
            size: data.len(),
        })
    }

    /// Adds one image made of `layers` (blobs already written with their
    /// uncompressed digests) and `entrypoint`.
    fn image(
        &mut self,
        name: &str,
        layers: &[Blob],
        entrypoint: &[&str],
        user: Option<&str>,
    ) -> Result<()> {
        let mut config = json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Entrypoint": entrypoint,
                "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                "WorkingDir": "/",
            },
            "rootfs": {
                "type": "layers",
                "diff_ids": layers.iter().map(|l| l.digest.clone()).collect::<Vec<_>>(),
            },
        });
        if let Some(user) = user {
            config["config"]["User"] = json!(user);
        }
        let config = self.blob(&serde_json::to_vec(&config)?)?;
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config.digest,
                "size": config.size,
            },
            "layers": layers.iter().map(|l| json!({
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": l.digest,
                "size": l.size,
            })).collect::<Vec<_>>(),
        });
        let manifest = self.blob(&serde_json::to_vec(&manifest)?)?;
        self.manifests.push(json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest.digest,
            "size": manifest.size,
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {
                // containerd names the image from the first; tools that
                // pick one image of the archive (skopeo's oci-archive:FILE:REF)
                // from the second.
                "io.containerd.image.name": name,
                "org.opencontainers.image.ref.name": name,
            },
        }));
        Ok(())
    }

    fn finish(mut self) -> Result<()> {
        let index = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": self.manifests,
        });
        let index = serde_json::to_vec(&index)?;
        self.entry("index.json", &index)?;
        let mut out = self.tar.into_inner()?;
        out.flush()?;
        Ok(())
    }
}

/// The shared libraries `binary` needs at run time (from `ldd`), the dynamic
/// loader included, as absolute paths on this machine.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd (Debian package libc-bin)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if text.contains("not a dynamic executable") {
        return Ok(Vec::new());
    }
    let mut libs = Vec::new();
    for line in text.lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
        // "/lib64/ld-linux-x86-64.so.2 (0x...)"; skip the vDSO.
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(path) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(path));
        }
    }
    if !out.status.success() && libs.is_empty() {
        bail!("ldd {} failed: {}", binary.display(), text.trim());
    }
    Ok(libs)
}

/// `strip`ped copy of `binary` in `dir` (debug builds are mostly debug info).
fn stripped(binary: &Path, dir: &Path) -> Result<PathBuf> {
    let name = binary.file_name().context("binary without a file name")?;
    let out = dir.join(name);
    let status = Command::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(&out)
        .arg(binary)
        .status()
        .context("running strip (Debian package binutils)")?;
    if !status.success() {
        bail!("strip {} failed ({status})", binary.display());
    }
    Ok(out)
}

/// Base layer of the glibc images: the libraries every binary links, users,
/// `/tmp`.
fn base_layer(binaries: &[PathBuf]) -> Result<Layer> {
    let mut layer = Layer::default();
    let mut libs = BTreeSet::new();
    for binary in binaries {
        libs.extend(shared_libraries(binary)?);
    }
    for lib in &libs {
        let real = fs::canonicalize(lib).with_context(|| format!("resolving {}", lib.display()))?;
        let path = lib.to_string_lossy();
        layer.file(&path, &real, 0o755);
        // Debian's /lib and /lib64 are links into /usr; the loader is looked
        // up by the path the binary names, which the layer now holds as is.
    }
    layer.bytes(
        "etc/passwd",
        b"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
        0o644,
    );
    layer.bytes("etc/group", b"root:x:0:\nnonroot:x:65532:\n", 0o644);
    layer.dir("tmp");
    layer.dir("home/nonroot");
    Ok(layer)
}

/// Compiles the pause binary (static, so its image needs nothing else).
fn pause_binary(repo: &Path, work: &Path) -> Result<PathBuf> {
    let source = repo.join("tools/node/pause.c");
    let out = work.join("pause");
    let status = Command::new("cc")
        .args(["-static", "-O2", "-o"])
        .arg(&out)
        .arg(&source)
        .status()
        .context("running cc (Debian package gcc) for the pause image")?;
    if !status.success() {
        bail!("compiling {} failed ({status})", source.display());
    }
    Ok(out)
}

/// Where Debian's busybox-static puts its binary.
const BUSYBOX: &str = "/bin/busybox";
/// Applets the workload pods use, linked in the busybox image.
const BUSYBOX_APPLETS: [&str; 14] = [
    "sh", "cat", "env", "ls", "sleep", "echo", "grep", "test", "true", "wc", "wget", "nc", "touch",
    "rm",
];

/// Writes the archive of every image to `out` from the binaries in
/// `bin_dir` (a cargo profile directory). Returns the image names.
pub fn build(repo: &Path, bin_dir: &Path, out: &Path) -> Result<Vec<String>> {
    let work = out.with_extension("work");
    fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let mut binaries = Vec::new();
    for name in BINARIES {
        let built = bin_dir.join(name);
        if !built.is_file() {
            bail!(
                "{} is missing: build the binaries first (`cargo build -p gpu-stack-bins \
                 --bins`, or `--release` with the release directory)",
                built.display()
            );
        }
        binaries.push(stripped(&built, &work)?);
    }
    let mut archive = Archive::create(out)?;
    let base = archive.blob(&base_layer(&binaries)?.tar()?)?;
    let mut names = Vec::new();
    for (name, binary) in BINARIES.iter().zip(&binaries) {
        let mut layer = Layer::default();
        let path = format!("usr/bin/{name}");
        layer.file(&path, binary, 0o755);
        let layer = archive.blob(&layer.tar()?)?;
        let image = image_name(name);
        archive.image(&image, &[base.clone(), layer], &[&format!("/{path}")], None)?;
        names.push(image);
    }

    let mut pause = Layer::default();
    pause.file("pause", &pause_binary(repo, &work)?, 0o755);
    let pause = archive.blob(&pause.tar()?)?;
    archive.image(&pause_image(), &[pause], &["/pause"], Some("65535:65535"))?;
    names.push(pause_image());

    if !Path::new(BUSYBOX).is_file() {
        bail!(
            "{BUSYBOX} is missing: install Debian's busybox-static (apt-get install busybox-static)"
        );
    }
    let mut busybox = Layer::default();
    busybox.file("bin/busybox", Path::new(BUSYBOX), 0o755);
    for applet in BUSYBOX_APPLETS {
        busybox.symlink(&format!("bin/{applet}"), "busybox");
    }
    busybox.dir("tmp");
    let busybox = archive.blob(&busybox.tar()?)?;
    archive.image(
        &busybox_image(),
        std::slice::from_ref(&busybox),
        &["/bin/sh"],
        None,
    )?;
    names.push(busybox_image());

    let mut tools = Layer::default();
    tools.bytes("usr/bin/nvidia-smi", STANDIN_NVIDIA_SMI.as_bytes(), 0o755);
    tools.bytes(
        "usr/bin/driver-manager",
        STANDIN_DRIVER_MANAGER.as_bytes(),
        0o755,
    );
    tools.bytes(
        "usr/local/bin/nvidia-driver",
        STANDIN_DRIVER.as_bytes(),
        0o755,
    );
    let tools = archive.blob(&tools.tar()?)?;
    let (drivers, manager) = driver_standin_images()?;
    for (version, image) in drivers {
        let mut v = Layer::default();
        v.bytes(
            "etc/nvidia-driver-version",
            format!("{version}\n").as_bytes(),
            0o644,
        );
        let v = archive.blob(&v.tar()?)?;
        let entrypoint = ["/usr/local/bin/nvidia-driver", "init"];
        archive.image(
            &image,
            &[busybox.clone(), tools.clone(), v],
            &entrypoint,
            None,
        )?;
        names.push(image);
    }
    archive.image(
        &manager,
        &[busybox, tools],
        &["/usr/bin/driver-manager"],
        None,
    )?;
    names.push(manager);

    archive.finish()?;
    fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))?;
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_lists_parents_before_children() {
        let mut layer = Layer::default();
        layer.bytes("etc/ssl/x", b"x", 0o644);
        let keys: Vec<&String> = layer.entries.keys().collect();
        assert_eq!(keys, ["etc", "etc/ssl", "etc/ssl/x"]);
    }

    #[test]
    fn layer_tar_is_deterministic() {
        let mut layer = Layer::default();
        layer.bytes("etc/passwd", b"root:x:0:0::/:/x\n", 0o644);
        layer.symlink("bin/sh", "busybox");
        assert_eq!(layer.tar().unwrap(), layer.tar().unwrap());
    }

    #[test]
    fn image_names_use_the_local_repository_and_version() {
        assert_eq!(
            image_name("gpu-operator"),
            format!("localhost/gpu-stack/gpu-operator:{}", tag())
        );
    }
}
