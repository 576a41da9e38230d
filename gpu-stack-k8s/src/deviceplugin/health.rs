//! Feeding device health from a GPU backend: a blocking thread turns the
//! backend's Xid / GPU-lost events into core health events, and a probe tells
//! whether a faulted device answers again (the "condition cleared" half of the
//! recovery rule).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use gpu_stack_core::backend::{GpuBackend, HealthEventKind};
use gpu_stack_core::deviceplugin::{HealthEvent, Resource};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;

/// How long the health thread waits before offering an event again to a
/// full channel (see [`super::plugin::HEALTH_EVENT_BUFFER`]); short, as the
/// plugins' loop drains the channel as soon as it is free, and between
/// tries the thread sees its stop flag.
const FULL_RETRY: Duration = Duration::from_millis(10);

/// Hands `event` to the plugins, waiting in [`FULL_RETRY`] steps while the
/// channel is full. False when the event cannot be delivered: the plugins
/// are gone, or `stop` was set while waiting.
fn forward(tx: &mpsc::Sender<HealthEvent>, event: HealthEvent, stop: &AtomicBool) -> bool {
    let mut event = event;
    loop {
        match tx.try_send(event) {
            Ok(()) => return true,
            Err(TrySendError::Closed(_)) => return false,
            Err(TrySendError::Full(back)) => {
                if stop.load(Ordering::SeqCst) {
                    return false;
                }
                event = back;
                std::thread::sleep(FULL_RETRY);
            }
        }
    }
}

/// Tells whether a faulted device (by UUID) answers queries again.
pub trait HealthProbe: Send + Sync {
    /// True when the device responds normally.
    fn responds(&self, uuid: &str) -> bool;
}

/// A probe over a [`GpuBackend`]: a GPU (or the parent of a MIG device)
/// responds when `gpu_info` succeeds.
pub struct BackendProbe {
    backend: Arc<dyn GpuBackend>,
    index_of: BTreeMap<String, u32>,
}

impl BackendProbe {
    /// Builds the UUID → GPU index map from the advertised resources.
    pub fn new(backend: Arc<dyn GpuBackend>, resources: &[Resource]) -> BackendProbe {
        let mut index_of = BTreeMap::new();
        for d in resources.iter().flat_map(|r| r.devices.iter()) {
            index_of.insert(d.uuid.clone(), d.gpu_index);
            index_of.insert(d.gpu_uuid.clone(), d.gpu_index);
        }
        BackendProbe { backend, index_of }
    }
}

impl HealthProbe for BackendProbe {
    fn responds(&self, uuid: &str) -> bool {
        self.index_of
            .get(uuid)
            .is_some_and(|i| self.backend.gpu_info(*i).is_ok())
    }
}

/// Stops the health thread when dropped or on [`HealthPump::stop`].
pub struct HealthPump {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl HealthPump {
    /// Signals the thread and waits for it (at most one wait period).
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for HealthPump {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Subscribes to the backend's health events and forwards them. An event with
/// GPU/compute instance ids is attributed to that MIG device when the node
/// advertises it, otherwise to the whole GPU. A failing subscription marks
/// every device (as NVIDIA's plugin does) and is retried. No event is
/// dropped: while `tx` is full the thread waits, and it ends when the
/// receiver is gone or it is stopped.
pub fn spawn_backend_health(
    backend: Arc<dyn GpuBackend>,
    resources: &[Resource],
    tx: mpsc::Sender<HealthEvent>,
) -> HealthPump {
    let mut mig_uuid: BTreeMap<(String, u32), Vec<(u32, String)>> = BTreeMap::new();
    for d in resources.iter().flat_map(|r| r.devices.iter()) {
        if let Some(m) = &d.mig {
            let v = mig_uuid.entry((d.gpu_uuid.clone(), m.gi)).or_default();
            if !v.iter().any(|(_, u)| u == &d.uuid) {
                v.push((m.ci, d.uuid.clone()));
            }
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let handle = std::thread::Builder::new()
        .name("gpu-health".into())
        .spawn(move || {
            let wait = Duration::from_millis(100);
            while !flag.load(Ordering::SeqCst) {
                let mut events = match backend.health_events() {
                    Ok(e) => e,
                    Err(e) => {
                        let all = HealthEvent::AllDevices { reason: format!("health events unavailable: {e}") };
                        if !forward(&tx, all, &flag) {
                            return;
                        }
                        std::thread::sleep(Duration::from_secs(1));
                        continue;
                    }
                };
                while !flag.load(Ordering::SeqCst) {
                    match events.wait(wait) {
                        Ok(None) => {}
                        Ok(Some(ev)) => {
                            // Attribute to the MIG device(s) of the GPU/compute instance
                            // when the node advertises them, else to the whole GPU.
                            let mut uuids: Vec<String> = match ev.gpu_instance_id {
                                Some(gi) => mig_uuid
                                    .get(&(ev.uuid.clone(), gi))
                                    .map(|v| {
                                        v.iter()
                                            .filter(|(ci, _)| ev.compute_instance_id.is_none_or(|c| c == *ci))
                                            .map(|(_, u)| u.clone())
                                            .collect()
                                    })
                                    .unwrap_or_default(),
                                None => Vec::new(),
                            };
                            if uuids.is_empty() {
                                uuids.push(ev.uuid.clone());
                            }
                            for uuid in uuids {
                                let out = match ev.kind {
                                    HealthEventKind::Xid { xid } => HealthEvent::Xid { uuid, xid },
                                    HealthEventKind::GpuLost => HealthEvent::Lost { uuid },
                                };
                                if !forward(&tx, out, &flag) {
                                    return;
                                }
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "waiting for GPU health events failed; marking all devices");
                            let all = HealthEvent::AllDevices { reason: format!("health event wait failed: {e}") };
                            if !forward(&tx, all, &flag) {
                                return;
                            }
                            std::thread::sleep(Duration::from_secs(1));
                            break;
                        }
                    }
                }
            }
        })
        .ok();
    HealthPump { stop, handle }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xid(n: u32) -> HealthEvent {
        HealthEvent::Xid {
            uuid: format!("GPU-{n}"),
            xid: 48,
        }
    }

    #[test]
    fn a_full_channel_delays_events_and_loses_none() {
        let (tx, mut rx) = mpsc::channel(1);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let sender = std::thread::spawn(move || (0..20).all(|n| forward(&tx, xid(n), &flag)));
        let got: Vec<HealthEvent> = std::iter::from_fn(|| rx.blocking_recv()).collect();
        assert_eq!(got, (0..20).map(xid).collect::<Vec<_>>());
        assert!(sender.join().unwrap());
    }

    #[test]
    fn a_stop_ends_the_wait_on_a_full_channel() {
        let (tx, _rx) = mpsc::channel(1);
        let stop = AtomicBool::new(false);
        assert!(forward(&tx, xid(0), &stop));
        stop.store(true, Ordering::SeqCst);
        assert!(!forward(&tx, xid(1), &stop));
    }

    #[test]
    fn nothing_is_forwarded_once_the_plugins_are_gone() {
        let (tx, rx) = mpsc::channel(1);
        drop(rx);
        assert!(!forward(&tx, xid(0), &AtomicBool::new(false)));
    }
}
