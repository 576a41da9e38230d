//! Reading the host facts node discovery labels: PCI devices from sysfs, the
//! os-release file and the kernel release. Every read is bounded, and every
//! error names the path it could not read.
use std::io::Read;
use std::path::{Path, PathBuf};

use gpu_stack_core::nodediscovery::{
    HostFacts, MAX_KERNEL_RELEASE_BYTES, MAX_OS_RELEASE_BYTES, MAX_PCI_DEVICES, PciDevice,
};

use super::DiscoveryError;

/// Longest sysfs attribute read (`0x030200\n` is 9 bytes).
const MAX_ATTRIBUTE_BYTES: u64 = 64;

/// Where the kernel release comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelRelease {
    /// Given as is (`--kernel-release`).
    Fixed(String),
    /// Read from a file (`/proc/sys/kernel/osrelease`; a container sees the host's kernel).
    File(PathBuf),
}

/// The files the facts are read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPaths {
    /// sysfs root (`/sys`); devices are under `bus/pci/devices/`.
    pub sysfs_root: PathBuf,
    /// The host's os-release file.
    pub os_release: PathBuf,
    /// The kernel release.
    pub kernel: KernelRelease,
}

impl Default for HostPaths {
    fn default() -> Self {
        Self {
            sysfs_root: PathBuf::from("/sys"),
            os_release: PathBuf::from("/etc/os-release"),
            kernel: KernelRelease::File(PathBuf::from("/proc/sys/kernel/osrelease")),
        }
    }
}

/// Reads at most `limit` bytes of `path` as text (invalid UTF-8 replaced).
fn read_bounded(path: &Path, limit: u64) -> std::io::Result<String> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(limit)
        .read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

fn read_error(path: &Path, hint: &'static str) -> impl FnOnce(std::io::Error) -> DiscoveryError {
    let path = path.to_path_buf();
    move |error| DiscoveryError::Read { path, error, hint }
}

/// The PCI devices under `<sysfs_root>/bus/pci/devices` (at most
/// [`MAX_PCI_DEVICES`], in address order). A device whose `vendor`, `class` or
/// `device` cannot be read is skipped with a warning, as NFD does; a missing
/// devices directory is an error.
pub fn read_pci_devices(sysfs_root: &Path) -> Result<Vec<PciDevice>, DiscoveryError> {
    let dir = sysfs_root.join("bus/pci/devices");
    let hint = "check --sysfs-root (the host's /sys, mounted read-only)";
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(read_error(&dir, hint))? {
        let entry = entry.map_err(read_error(&dir, hint))?;
        names.push(entry.file_name());
        if names.len() >= MAX_PCI_DEVICES {
            tracing::warn!(dir = %dir.display(), max = MAX_PCI_DEVICES, "more PCI devices than looked at; the rest are ignored");
            break;
        }
    }
    names.sort();
    let mut devices = Vec::with_capacity(names.len());
    for name in names {
        let dev = dir.join(&name);
        let attr = |file: &str| {
            let path = dev.join(file);
            read_bounded(&path, MAX_ATTRIBUTE_BYTES).map_err(|e| (path, e))
        };
        match (attr("vendor"), attr("class"), attr("device")) {
            (Ok(vendor), Ok(class), Ok(device)) => devices.push(PciDevice {
                vendor,
                class,
                device,
            }),
            (Err((path, e)), _, _) | (_, Err((path, e)), _) | (_, _, Err((path, e))) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read a PCI device attribute; device skipped");
            }
        }
    }
    Ok(devices)
}

/// The os-release file's text (at most [`MAX_OS_RELEASE_BYTES`]).
pub fn read_os_release(path: &Path) -> Result<String, DiscoveryError> {
    read_bounded(path, MAX_OS_RELEASE_BYTES as u64).map_err(read_error(
        path,
        "check --os-release (the host's /etc/os-release, mounted read-only; \
         the chart mounts it at /host-etc/os-release)",
    ))
}

/// The kernel release (at most [`MAX_KERNEL_RELEASE_BYTES`]).
pub fn read_kernel_release(kernel: &KernelRelease) -> Result<String, DiscoveryError> {
    match kernel {
        KernelRelease::Fixed(release) => Ok(release.clone()),
        KernelRelease::File(path) => {
            read_bounded(path, MAX_KERNEL_RELEASE_BYTES as u64).map_err(read_error(
                path,
                "pass --kernel-release, or check that /proc is the host's",
            ))
        }
    }
}

/// Reads every fact; the first failing read is the error.
pub fn scan(paths: &HostPaths) -> Result<HostFacts, DiscoveryError> {
    Ok(HostFacts {
        pci_devices: read_pci_devices(&paths.sysfs_root)?,
        os_release: read_os_release(&paths.os_release)?,
        kernel_release: read_kernel_release(&paths.kernel)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// A sysfs tree as the kernel lays it out: device directories under
    /// `devices/pci0000:00/`, linked from `bus/pci/devices/`.
    fn fake_sysfs(devices: &[(&str, &str, &str, &str)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let bus = root.path().join("bus/pci/devices");
        fs::create_dir_all(&bus).unwrap();
        for (addr, vendor, class, device) in devices {
            let real = root.path().join("devices/pci0000:00").join(addr);
            fs::create_dir_all(&real).unwrap();
            for (file, value) in [("vendor", vendor), ("class", class), ("device", device)] {
                if !value.is_empty() {
                    fs::write(real.join(file), format!("{value}\n")).unwrap();
                }
            }
            std::os::unix::fs::symlink(
                format!("../../../devices/pci0000:00/{addr}"),
                bus.join(addr),
            )
            .unwrap();
        }
        root
    }

    #[test]
    fn pci_devices_are_read_through_the_bus_links_in_address_order() {
        let sys = fake_sysfs(&[
            ("0000:c1:00.0", "0x10de", "0x030200", "0x2330"),
            ("0000:00:00.0", "0x8086", "0x060000", "0x09a2"),
            ("0000:41:00.0", "0x10de", "", "0x2330"), // no class file: skipped
        ]);
        let devices = read_pci_devices(sys.path()).unwrap();
        assert_eq!(
            devices,
            vec![
                PciDevice::new("0x8086\n", "0x060000\n", "0x09a2\n"),
                PciDevice::new("0x10de\n", "0x030200\n", "0x2330\n"),
            ]
        );
    }

    #[test]
    fn a_scan_gives_the_labels_of_the_fake_host() {
        let sys = fake_sysfs(&[("0000:c1:00.0", "0x10de", "0x030200", "0x2330")]);
        let os_release = sys.path().join("os-release");
        fs::write(&os_release, "ID=ubuntu\nVERSION_ID=\"22.04\"\n").unwrap();
        let osrelease = sys.path().join("osrelease");
        fs::write(&osrelease, "5.15.0-127-generic\n").unwrap();
        let paths = HostPaths {
            sysfs_root: sys.path().to_path_buf(),
            os_release,
            kernel: KernelRelease::File(osrelease),
        };
        let labels = scan(&paths).unwrap().labels();
        assert_eq!(
            labels["feature.node.kubernetes.io/pci-10de.present"],
            "true"
        );
        assert_eq!(
            labels["feature.node.kubernetes.io/pci-0302_10de_2330.present"],
            "true"
        );
        assert_eq!(
            labels["feature.node.kubernetes.io/system-os_release.VERSION_ID.major"],
            "22"
        );
        assert_eq!(
            labels["feature.node.kubernetes.io/kernel-version.full"],
            "5.15.0-127-generic"
        );

        let fixed = HostPaths {
            kernel: KernelRelease::Fixed("6.8.0-45-generic".into()),
            ..paths
        };
        let labels = scan(&fixed).unwrap().labels();
        assert_eq!(
            labels["feature.node.kubernetes.io/kernel-version.minor"],
            "8"
        );
    }

    #[test]
    fn errors_name_the_path_and_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let e = read_pci_devices(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("bus/pci/devices") && e.contains("--sysfs-root"),
            "{e}"
        );
        let missing = dir.path().join("no-os-release");
        let e = read_os_release(&missing).unwrap_err().to_string();
        assert!(
            e.contains("no-os-release") && e.contains("--os-release"),
            "{e}"
        );
        let e = read_kernel_release(&KernelRelease::File(dir.path().join("osrelease")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("osrelease") && e.contains("--kernel-release"),
            "{e}"
        );
    }

    #[test]
    fn reads_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("os-release");
        fs::write(&big, "ID=ubuntu\n".repeat(MAX_OS_RELEASE_BYTES)).unwrap();
        assert_eq!(read_os_release(&big).unwrap().len(), MAX_OS_RELEASE_BYTES);
        let kernel = dir.path().join("osrelease");
        fs::write(&kernel, [0xff_u8; 4096]).unwrap();
        let release = read_kernel_release(&KernelRelease::File(kernel)).unwrap();
        assert!(release.chars().all(|c| c == char::REPLACEMENT_CHARACTER));
        assert!(release.chars().count() <= MAX_KERNEL_RELEASE_BYTES);
    }
}
