//! Registration with the kubelet (device plugin API v1beta1): the
//! `Registration/Register` call on `kubelet.sock`, and what a change in the
//! kubelet's device-plugins directory means for a registered plugin.
//!
//! A kubelet that starts removes every socket in its directory and creates
//! `kubelet.sock` anew, maybe with the inode number the old one had, so any
//! creation of `kubelet.sock` means registering again, and a removed plugin
//! socket means serving it again (then registering).

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::api;
use super::server::plugin_options;
use crate::kubelet::transport::unix_channel;

/// File name of the kubelet's registration socket.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Default kubelet device-plugins directory.
pub const DEFAULT_KUBELET_DIR: &str = "/var/lib/kubelet/device-plugins";
/// API version sent in `Register`.
pub const API_VERSION: &str = "v1beta1";

/// What changed in the kubelet directory since the plugins last acted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DirChanges {
    /// `kubelet.sock` was created (or renamed into place): a kubelet
    /// started, whatever inode number its socket got.
    pub kubelet_created: bool,
    /// One of the plugins' own sockets was removed (the kubelet removes them
    /// when it starts) or renamed away.
    pub plugin_socket_removed: bool,
    /// Events may have been lost (the watcher asked for a rescan).
    pub rescan: bool,
}

impl DirChanges {
    /// Records what `event` says about `kubelet_sock` and the plugins'
    /// sockets `ours`.
    pub fn note(&mut self, event: &notify::Event, kubelet_sock: &Path, ours: &[PathBuf]) {
        use notify::EventKind;
        use notify::event::{ModifyKind, RenameMode};
        if event.need_rescan() {
            self.rescan = true;
        }
        let (created, removed) = match event.kind {
            EventKind::Create(_) => (true, false),
            EventKind::Remove(_) => (false, true),
            EventKind::Modify(ModifyKind::Name(RenameMode::To)) => (true, false),
            EventKind::Modify(ModifyKind::Name(RenameMode::From)) => (false, true),
            // A rename reported as one event: the first path left, the second arrived.
            EventKind::Modify(ModifyKind::Name(RenameMode::Both)) => {
                if let [from, to] = event.paths.as_slice() {
                    self.kubelet_created |= to == kubelet_sock;
                    self.plugin_socket_removed |= ours.contains(from);
                }
                return;
            }
            _ => (false, false),
        };
        for p in &event.paths {
            self.kubelet_created |= created && p == kubelet_sock;
            self.plugin_socket_removed |= removed && ours.contains(p);
        }
    }

    /// Whether anything was recorded.
    pub fn any(&self) -> bool {
        self.kubelet_created || self.plugin_socket_removed || self.rescan
    }
}

/// What the plugins do about directory changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirAction {
    /// Nothing to do (for example the plugins' own socket re-creation).
    Nothing,
    /// Register again with the kubelet, over the sockets already served.
    Register,
    /// Serve the sockets again (one is gone), then register.
    Restart,
}

/// Decides what to do about `changes`, given whether one of the plugins'
/// sockets is missing now, whether `kubelet.sock` exists now, and whether
/// the plugins register at all. A removal event for a socket that exists
/// again is the plugins' own restart, and changes nothing.
pub fn dir_action(
    changes: DirChanges,
    plugin_socket_missing: bool,
    kubelet_up: bool,
    register: bool,
) -> DirAction {
    if plugin_socket_missing {
        DirAction::Restart
    } else if register && kubelet_up && (changes.kubelet_created || changes.rescan) {
        DirAction::Register
    } else {
        DirAction::Nothing
    }
}

/// Registering a resource with the kubelet failed.
#[derive(Debug, thiserror::Error)]
#[error("registering {resource} with the kubelet at {socket} failed: {message}")]
pub struct RegisterError {
    /// Resource name.
    pub resource: String,
    /// Kubelet socket.
    pub socket: PathBuf,
    /// Cause.
    pub message: String,
}

/// Device and inode of a file: a re-created `kubelet.sock` has a new identity.
pub fn socket_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Whether `kubelet.sock` now exists with another identity than the one
/// seen when registering (`registered_with`, from [`socket_identity`]).
pub fn kubelet_restarted(path: &Path, registered_with: Option<(u64, u64)>) -> bool {
    match socket_identity(path) {
        Some(now) => Some(now) != registered_with,
        None => false,
    }
}

/// Calls `Registration/Register` on the kubelet socket.
pub async fn register(
    kubelet_sock: &Path,
    endpoint: &str,
    resource: &str,
) -> Result<(), RegisterError> {
    let err = |message: String| RegisterError {
        resource: resource.to_string(),
        socket: kubelet_sock.to_path_buf(),
        message,
    };
    let channel = tokio::time::timeout(Duration::from_secs(5), unix_channel(kubelet_sock))
        .await
        .map_err(|_| err("connecting timed out after 5 s".into()))?
        .map_err(|e| err(format!("cannot connect: {e}")))?;
    let mut client = api::registration_client::RegistrationClient::new(channel);
    let request = api::RegisterRequest {
        version: API_VERSION.to_string(),
        endpoint: endpoint.to_string(),
        resource_name: resource.to_string(),
        options: Some(plugin_options()),
    };
    tokio::time::timeout(Duration::from_secs(15), client.register(request))
        .await
        .map_err(|_| err("Register timed out after 15 s".into()))?
        .map_err(|s| err(format!("{}: {}", s.code(), s.message())))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use notify::event::{CreateKind, Flag, ModifyKind, RemoveKind, RenameMode};
    use notify::{Event, EventKind};
    use proptest::prelude::*;

    fn paths() -> (PathBuf, Vec<PathBuf>) {
        let dir = Path::new("/var/lib/kubelet/device-plugins");
        (
            dir.join(KUBELET_SOCKET),
            vec![
                dir.join("nvidia-gpu.sock"),
                dir.join("nvidia-mig-1g.10gb.sock"),
            ],
        )
    }

    fn event(kind: EventKind, path: &Path) -> Event {
        Event::new(kind).add_path(path.to_path_buf())
    }

    #[test]
    fn a_created_kubelet_socket_means_registering_again() {
        let (kubelet, ours) = paths();
        let mut c = DirChanges::default();
        c.note(
            &event(EventKind::Remove(RemoveKind::File), &kubelet),
            &kubelet,
            &ours,
        );
        assert!(
            !c.any(),
            "a removal alone waits for the kubelet to come back"
        );
        c.note(
            &event(EventKind::Create(CreateKind::File), &kubelet),
            &kubelet,
            &ours,
        );
        assert!(c.kubelet_created);
        assert_eq!(dir_action(c, false, true, true), DirAction::Register);
        assert_eq!(dir_action(c, false, false, true), DirAction::Nothing);
        assert_eq!(dir_action(c, false, true, false), DirAction::Nothing);
    }

    #[test]
    fn a_removed_plugin_socket_means_serving_it_again() {
        let (kubelet, ours) = paths();
        let mut c = DirChanges::default();
        c.note(
            &event(EventKind::Remove(RemoveKind::Any), &ours[1]),
            &kubelet,
            &ours,
        );
        assert!(c.plugin_socket_removed);
        assert_eq!(dir_action(c, true, true, true), DirAction::Restart);
        assert_eq!(dir_action(c, true, false, false), DirAction::Restart);
        // The socket is back (the plugins' own restart): nothing to do.
        assert_eq!(dir_action(c, false, true, true), DirAction::Nothing);
    }

    #[test]
    fn renames_and_rescans_count() {
        let (kubelet, ours) = paths();
        let tmp = kubelet.with_file_name("kubelet.sock.tmp");
        let mut c = DirChanges::default();
        c.note(
            &Event::new(EventKind::Modify(ModifyKind::Name(RenameMode::Both)))
                .add_path(tmp.clone())
                .add_path(kubelet.clone()),
            &kubelet,
            &ours,
        );
        assert!(c.kubelet_created);
        let mut moved = DirChanges::default();
        moved.note(
            &event(
                EventKind::Modify(ModifyKind::Name(RenameMode::From)),
                &ours[0],
            ),
            &kubelet,
            &ours,
        );
        assert!(moved.plugin_socket_removed);
        let mut lost = DirChanges::default();
        lost.note(
            &Event::new(EventKind::Other).set_flag(Flag::Rescan),
            &kubelet,
            &ours,
        );
        assert!(lost.rescan);
        assert_eq!(dir_action(lost, false, true, true), DirAction::Register);
        // Other files and our own socket's creation change nothing.
        let mut other = DirChanges::default();
        other.note(
            &event(EventKind::Create(CreateKind::File), &ours[0]),
            &kubelet,
            &ours,
        );
        other.note(
            &event(EventKind::Create(CreateKind::File), &tmp),
            &kubelet,
            &ours,
        );
        other.note(
            &event(EventKind::Remove(RemoveKind::File), &tmp),
            &kubelet,
            &ours,
        );
        assert!(!other.any());
    }

    proptest! {
        /// Whatever else happens in the directory, a creation of
        /// `kubelet.sock` with the kubelet up ends in a registration, and a
        /// plugin socket that is missing is always served again.
        #[test]
        fn every_kubelet_creation_registers_and_every_lost_socket_is_served(
            events in proptest::collection::vec((0usize..4, 0usize..4), 0..12),
            missing: bool,
            kubelet_up: bool,
            register: bool,
        ) {
            let (kubelet, ours) = paths();
            let other = kubelet.with_file_name("other.sock");
            let targets = [kubelet.clone(), ours[0].clone(), ours[1].clone(), other];
            let kinds = [
                EventKind::Create(CreateKind::File),
                EventKind::Remove(RemoveKind::File),
                EventKind::Modify(ModifyKind::Name(RenameMode::To)),
                EventKind::Modify(ModifyKind::Data(notify::event::DataChange::Any)),
            ];
            let mut c = DirChanges::default();
            for (k, t) in &events {
                c.note(&event(kinds[*k], &targets[*t]), &kubelet, &ours);
            }
            let created = events.iter().any(|(k, t)| *t == 0 && (*k == 0 || *k == 2));
            let removed = events.iter().any(|(k, t)| (*t == 1 || *t == 2) && *k == 1);
            prop_assert_eq!(c.kubelet_created, created);
            prop_assert_eq!(c.plugin_socket_removed, removed);
            let action = dir_action(c, missing, kubelet_up, register);
            if missing {
                prop_assert_eq!(action, DirAction::Restart);
            } else if created && kubelet_up && register {
                prop_assert_eq!(action, DirAction::Register);
            } else {
                prop_assert_eq!(action, DirAction::Nothing);
            }
        }
    }
}
