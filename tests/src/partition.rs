//! A network partition between one process and the test cluster's API
//! server: a loopback TCP relay the process reaches the API server through,
//! which the test can cut and heal.
//!
//! While cut, the relay is a black hole: nothing is forwarded either way and
//! nothing is answered, so the process's requests wait until their own
//! deadlines, as behind a dropped route. New connections are accepted and
//! held silent. At heal, every connection that lived through the cut is
//! closed (as after a partition long enough for both ends to give up, or a
//! reset of the connection tracking between them) and new ones are relayed
//! again. TLS passes through untouched: the relay listens on the API
//! server's own address (127.0.0.1), which its certificate names.
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The relay; it stops when dropped.
pub struct Partition {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Partition {
    /// Starts a relay to the API server of the kubeconfig `through` and
    /// writes `<dir>/partitioned.kubeconfig`, a copy of it that reaches the
    /// API server through the relay.
    pub fn start(through: &Path, dir: &Path) -> Result<(Self, PathBuf)> {
        let mut kc = kube::config::Kubeconfig::read_from(through)?;
        let server = kc
            .clusters
            .iter()
            .find_map(|c| c.cluster.as_ref()?.server.clone())
            .context("the kubeconfig names no API server")?;
        let upstream: SocketAddr = server
            .trim_start_matches("https://")
            .trim_end_matches('/')
            .parse()
            .with_context(|| format!("the API server {server} is not an address and port"))?;
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (cut, cut_rx) = watch::channel(false);
        let (stop, stop_rx) = tokio::sync::oneshot::channel();
        // A thread and runtime of its own: the relay keeps working whatever
        // the test's own runtime is doing.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("partition-relay".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let Ok(listener) = TcpListener::from_std(listener) else {
                        return;
                    };
                    tokio::select! {
                        () = accept(listener, upstream, cut_rx) => {}
                        _ = stop_rx => {}
                    }
                });
            })?;
        for cluster in &mut kc.clusters {
            if let Some(c) = cluster.cluster.as_mut() {
                c.server = Some(format!("https://{addr}"));
            }
        }
        let path = dir.join("partitioned.kubeconfig");
        std::fs::write(&path, serde_saphyr::to_string(&kc)?)?;
        let relay = Self {
            addr,
            cut,
            stop: Some(stop),
            thread: Some(thread),
        };
        Ok((relay, path))
    }

    /// The relay's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts the process off from the API server.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Ends the partition.
    pub fn heal(&self) {
        self.cut.send_replace(false);
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn accept(listener: TcpListener, upstream: SocketAddr, cut: watch::Receiver<bool>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // Out of descriptors and the like: wait rather than spin.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        tokio::spawn(relay(client, upstream, cut.clone()));
    }
}

/// Relays one connection until either end closes it or a cut starts; a
/// connection that meets a cut is held silent until the heal, then closed.
async fn relay(mut client: TcpStream, upstream: SocketAddr, mut cut: watch::Receiver<bool>) {
    if *cut.borrow_and_update() {
        let _ = cut.wait_for(|c| !*c).await;
        return;
    }
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let met_cut = tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => false,
        _ = cut.wait_for(|c| *c) => true,
    };
    if met_cut {
        let _ = cut.wait_for(|c| !*c).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An echo server standing in for the API server.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn round_trip(s: &mut TcpStream) -> Option<Vec<u8>> {
        s.write_all(b"ping").await.ok()?;
        let mut buf = [0u8; 4];
        tokio::time::timeout(Duration::from_millis(300), s.read_exact(&mut buf))
            .await
            .ok()?
            .ok()?;
        Some(buf.to_vec())
    }

    /// Whether the other end closed `s` (cleanly, or reset with unread data).
    async fn closed(s: &mut TcpStream) -> bool {
        let mut buf = [0u8; 4];
        matches!(
            tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cut_silences_every_connection_and_a_heal_closes_the_old_ones() {
        let upstream = echo().await;
        let dir = std::env::temp_dir().join(format!("partition-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = dir.join("in.kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://{upstream}\n\
                 users: []\ncontexts: []\n"
            ),
        )
        .unwrap();
        let (relay, written) = Partition::start(&kubeconfig, &dir).unwrap();
        let text = std::fs::read_to_string(&written).unwrap();
        assert!(text.contains(&relay.addr().to_string()), "{text}");

        let mut before = TcpStream::connect(relay.addr()).await.unwrap();
        assert_eq!(round_trip(&mut before).await.as_deref(), Some(&b"ping"[..]));
        relay.cut();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(round_trip(&mut before).await, None, "a cut answers nothing");
        let mut during = TcpStream::connect(relay.addr()).await.unwrap();
        assert_eq!(round_trip(&mut during).await, None);
        relay.heal();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(closed(&mut before).await, "closed at heal");
        assert!(closed(&mut during).await, "closed at heal");
        let mut after = TcpStream::connect(relay.addr()).await.unwrap();
        assert_eq!(round_trip(&mut after).await.as_deref(), Some(&b"ping"[..]));
        drop(relay);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
