//! The DRA plugin against the stand-in kubelet, over real unix sockets.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tonic::Code;
use tonic::server::NamedService;

use super::api::dra_plugin_server::DraPluginServer;
use super::registration_api::registration_server::RegistrationServer;
use super::server::{DraService, check_claims};
use super::standin::DraKubeletStandin;
use super::*;

const DRIVER: &str = "gpu.example.com";
/// A safety bound on every wait; no test relies on how long anything takes.
const LIMIT: Duration = Duration::from_secs(20);

/// A driver whose answer depends on the claim's name: `bad` fails,
/// `silent` is left out of the results, `quiet` fails with no message,
/// `panic` panics, anything else gets one device named after it.
#[derive(Default)]
struct FakeDriver {
    calls: Mutex<Vec<(&'static str, Vec<String>)>>,
}

impl DraDriver for FakeDriver {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> PrepareResults {
        if let Ok(mut calls) = self.calls.lock() {
            calls.push(("prepare", claims.iter().map(|c| c.uid.clone()).collect()));
        }
        let mut out = BTreeMap::new();
        for c in claims {
            match c.name.as_str() {
                "bad" => {
                    out.insert(c.uid, Err("no such device".to_string()));
                }
                "silent" => {}
                "quiet" => {
                    out.insert(c.uid, Err(String::new()));
                }
                "panic" => panic!("the fake driver panics on request"),
                name => {
                    out.insert(
                        c.uid,
                        Ok(vec![PreparedDevice {
                            request_names: vec!["gpu".into()],
                            pool_name: "node-a".into(),
                            device_name: format!("gpu-{name}"),
                            cdi_device_ids: vec![format!("nvidia.com/gpu={name}")],
                        }]),
                    );
                }
            }
        }
        out
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> UnprepareResults {
        if let Ok(mut calls) = self.calls.lock() {
            calls.push(("unprepare", claims.iter().map(|c| c.uid.clone()).collect()));
        }
        claims
            .into_iter()
            .map(|c| {
                let r = if c.name == "bad" {
                    Err("device busy".to_string())
                } else {
                    Ok(())
                };
                (c.uid, r)
            })
            .collect()
    }
}

fn claim(uid: &str, name: &str) -> ClaimRef {
    ClaimRef {
        namespace: "default".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

struct Running {
    _tmp: tempfile::TempDir,
    registry: PathBuf,
    dra_socket: PathBuf,
    reg_socket: PathBuf,
    state: watch::Receiver<RegistrationState>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), DraServeError>>,
}

impl Running {
    async fn start() -> Running {
        let tmp = tempfile::tempdir().expect("tempdir");
        let registry = tmp.path().join("plugins_registry");
        let plugin = DraPlugin::new(DRIVER, tmp.path().join("plugins").join(DRIVER), &registry)
            .expect("plugin")
            .with_socket_check_interval(Duration::from_millis(20));
        let dra_socket = plugin.dra_socket().to_path_buf();
        let reg_socket = plugin.registration_socket().to_path_buf();
        let state = plugin.registration();
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(plugin.serve(FakeDriver::default(), async {
            let _ = stopped.await;
        }));
        Running {
            _tmp: tmp,
            registry,
            dra_socket,
            reg_socket,
            state,
            stop: Some(stop),
            task,
        }
    }

    async fn wait_state(&mut self, cond: impl Fn(&RegistrationState) -> bool) -> RegistrationState {
        tokio::time::timeout(LIMIT, self.state.wait_for(|s| cond(s)))
            .await
            .expect("registration state in time")
            .expect("plugin still serving")
            .clone()
    }

    async fn shutdown(mut self) -> tempfile::TempDir {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(LIMIT, self.task)
            .await
            .expect("plugin stops in time")
            .expect("plugin task")
            .expect("plugin served without error");
        self._tmp
    }
}

async fn registered() -> (Running, DraKubeletStandin) {
    let mut p = Running::start().await;
    let k = DraKubeletStandin::start(&p.registry)
        .await
        .expect("stand-in");
    p.wait_state(RegistrationState::is_registered).await;
    (p, k)
}

#[test]
fn wire_names_are_upstream_ones() {
    assert_eq!(
        <DraPluginServer<DraService<FakeDriver>> as NamedService>::NAME,
        DRA_GRPC_SERVICE
    );
    assert_eq!(
        <RegistrationServer<registration::RegistrationService> as NamedService>::NAME,
        "pluginregistration.Registration"
    );
    assert_eq!(SUPPORTED_VERSIONS, &["v1.DRAPlugin"]);
    assert_eq!(PLUGIN_TYPE, "DRAPlugin");
    assert_eq!(registration_socket_name(DRIVER), "gpu.example.com-reg.sock");
}

#[test]
fn default_paths_are_the_kubelets() {
    let p = DraPlugin::with_default_dirs(DRIVER).expect("plugin");
    assert_eq!(
        p.dra_socket(),
        Path::new("/var/lib/kubelet/plugins/gpu.example.com/dra.sock")
    );
    assert_eq!(
        p.registration_socket(),
        Path::new("/var/lib/kubelet/plugins_registry/gpu.example.com-reg.sock")
    );
}

#[test]
fn bad_driver_names_and_long_paths_are_refused() {
    for name in [
        "",
        "GPU.example.com",
        "a/b",
        "../x",
        "-a.com",
        "a..b",
        &"a".repeat(64),
    ] {
        assert!(
            matches!(
                DraPlugin::new(name, "/tmp/p", "/tmp/r"),
                Err(DraServeError::InvalidDriverName { .. })
            ),
            "{name:?} accepted"
        );
    }
    let long = format!("/tmp/{}", "d".repeat(120));
    assert!(matches!(
        DraPlugin::new(DRIVER, &long, "/tmp/r"),
        Err(DraServeError::InvalidPath { .. })
    ));
}

#[test]
fn claims_are_checked_before_the_driver() {
    let wire = |uid: &str, ns: &str, name: &str| api::Claim {
        namespace: ns.into(),
        uid: uid.into(),
        name: name.into(),
    };
    let checked = check_claims(
        "NodePrepareResources",
        vec![
            wire("u1", "default", "a"),
            wire("u1", "default", "a"),
            wire("u2", "", "b"),
            wire("u3", "default", "c"),
            wire("u3", "other", "c"),
            wire("u4", "default", "d"),
        ],
    )
    .expect("checked");
    assert_eq!(checked.valid, vec![claim("u1", "a"), claim("u4", "d")]);
    assert_eq!(checked.refused.keys().collect::<Vec<_>>(), vec!["u2", "u3"]);
    let err =
        check_claims("NodePrepareResources", vec![wire("", "default", "a")]).expect_err("no uid");
    assert_eq!(err.code(), Code::InvalidArgument);
    let many = (0..=MAX_CLAIMS_PER_REQUEST)
        .map(|i| wire(&format!("u{i}"), "default", "a"))
        .collect();
    let err = check_claims("NodePrepareResources", many).expect_err("too many");
    assert_eq!(err.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn the_kubelet_registers_the_plugin() {
    let (p, k) = registered().await;
    let view = k.view();
    assert_eq!(view.registrations.len(), 1);
    let r = &view.registrations[0];
    assert_eq!(r.driver, DRIVER);
    assert_eq!(r.socket, p.reg_socket);
    assert_eq!(r.endpoint, p.dra_socket);
    assert!(r.endpoint.is_absolute());
    assert_eq!(r.supported_versions, vec!["v1.DRAPlugin".to_string()]);
    assert_eq!(r.chosen_service, "v1.DRAPlugin");
    assert!(view.rejections.is_empty());
    p.shutdown().await;
    k.stop().await;
}

#[tokio::test]
async fn a_refusal_is_published_with_the_kubelets_reason() {
    let mut p = Running::start().await;
    let k = DraKubeletStandin::start_with(&p.registry, &["v1beta1.DRAPlugin"])
        .await
        .expect("stand-in");
    let state = p
        .wait_state(|s| matches!(s, RegistrationState::Rejected(_)))
        .await;
    let RegistrationState::Rejected(reason) = state else {
        unreachable!("waited for a refusal");
    };
    assert!(reason.contains("v1.DRAPlugin"), "{reason}");
    assert!(k.view().registrations.is_empty());
    p.shutdown().await;
    k.stop().await;
}

#[tokio::test]
async fn prepare_and_unprepare_round_trip_with_per_claim_errors() {
    let (p, k) = registered().await;
    let claims = [
        claim("u-ok", "ok"),
        claim("u-bad", "bad"),
        claim("u-silent", "silent"),
        claim("u-quiet", "quiet"),
        ClaimRef {
            namespace: String::new(),
            ..claim("u-nons", "nons")
        },
    ];
    let prepared = k.prepare(DRIVER, &claims).await.expect("prepare");
    assert_eq!(
        prepared.keys().collect::<Vec<_>>(),
        vec!["u-bad", "u-nons", "u-ok", "u-quiet", "u-silent"],
        "one result per claim"
    );
    assert_eq!(
        prepared["u-ok"],
        Ok(vec![PreparedDevice {
            request_names: vec!["gpu".into()],
            pool_name: "node-a".into(),
            device_name: "gpu-ok".into(),
            cdi_device_ids: vec!["nvidia.com/gpu=ok".into()],
        }])
    );
    assert_eq!(prepared["u-bad"], Err("no such device".to_string()));
    for uid in ["u-silent", "u-quiet", "u-nons"] {
        let err = prepared[uid].clone().expect_err(uid);
        assert!(!err.is_empty(), "{uid}: an empty error reads as success");
    }

    let unprepared = k
        .unprepare(DRIVER, &[claim("u-ok", "ok"), claim("u-bad", "bad")])
        .await
        .expect("unprepare");
    assert_eq!(unprepared["u-ok"], Ok(()));
    assert_eq!(unprepared["u-bad"], Err("device busy".to_string()));

    // No claims: nothing reaches the driver, an empty answer.
    assert!(k.prepare(DRIVER, &[]).await.expect("empty").is_empty());
    p.shutdown().await;
    k.stop().await;
}

#[tokio::test]
async fn requests_over_the_limit_are_refused() {
    let (p, k) = registered().await;
    let claims: Vec<ClaimRef> = (0..MAX_CLAIMS_PER_REQUEST)
        .map(|i| claim(&format!("u{i}"), &format!("c{i}")))
        .collect();
    let at_limit = k.prepare(DRIVER, &claims).await.expect("at the limit");
    assert_eq!(at_limit.len(), MAX_CLAIMS_PER_REQUEST);

    let mut over = claims.clone();
    over.push(claim("one-more", "c"));
    let status = k.prepare(DRIVER, &over).await.expect_err("over the limit");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("256"), "{}", status.message());
    let status = k
        .unprepare(DRIVER, &over)
        .await
        .expect_err("over the limit");
    assert_eq!(status.code(), Code::InvalidArgument);
    p.shutdown().await;
    k.stop().await;
}

#[tokio::test]
async fn a_panicking_driver_fails_the_call_not_the_plugin() {
    let (p, k) = registered().await;
    let status = k
        .prepare(DRIVER, &[claim("u-p", "panic")])
        .await
        .expect_err("panicked");
    assert_eq!(status.code(), Code::Internal);
    let ok = k
        .prepare(DRIVER, &[claim("u-ok", "ok")])
        .await
        .expect("still serving");
    assert!(ok["u-ok"].is_ok());
    p.shutdown().await;
    k.stop().await;
}

#[tokio::test]
async fn sockets_are_removed_after_shutdown() {
    let (p, k) = registered().await;
    let (dra, reg) = (p.dra_socket.clone(), p.reg_socket.clone());
    assert!(dra.exists() && reg.exists());
    let _tmp = p.shutdown().await;
    assert!(!dra.exists(), "DRA socket left behind");
    assert!(!reg.exists(), "registration socket left behind");
    let view = k
        .wait_for("the deregistration", LIMIT, |v| v.plugins.is_empty())
        .await
        .expect("deregistered");
    assert_eq!(view.deregistrations, vec![reg]);
    k.stop().await;
}

#[tokio::test]
async fn stale_sockets_are_replaced_and_other_files_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let plugin_dir = tmp.path().join("plugin");
    let registry = tmp.path().join("registry");
    std::fs::create_dir_all(&plugin_dir).expect("dir");
    std::fs::create_dir_all(&registry).expect("dir");
    // A socket left by a plugin that died.
    drop(std::os::unix::net::UnixListener::bind(plugin_dir.join(DRA_SOCKET)).expect("bind"));
    let plugin = DraPlugin::new(DRIVER, &plugin_dir, &registry).expect("plugin");
    let mut state = plugin.registration();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(plugin.serve(FakeDriver::default(), async {
        let _ = stopped.await;
    }));
    let k = DraKubeletStandin::start(&registry).await.expect("stand-in");
    tokio::time::timeout(LIMIT, state.wait_for(RegistrationState::is_registered))
        .await
        .expect("in time")
        .expect("registered");
    let _ = stop.send(());
    task.await.expect("task").expect("served");
    k.stop().await;

    // A regular file where the registration socket goes is not ours to remove.
    let reg = registry.join(registration_socket_name(DRIVER));
    std::fs::write(&reg, b"not a socket").expect("write");
    let err = serve(
        DRIVER,
        &plugin_dir,
        &registry,
        FakeDriver::default(),
        async {},
    )
    .await
    .expect_err("refused");
    assert!(matches!(err, DraServeError::NotASocket { .. }), "{err}");
    assert!(reg.exists());
    assert!(
        !plugin_dir.join(DRA_SOCKET).exists(),
        "the DRA socket bound before the failure is removed"
    );
}

#[tokio::test]
async fn a_deleted_registration_socket_is_created_again_and_registered() {
    let (mut p, k) = registered().await;
    std::fs::remove_file(&p.reg_socket).expect("remove");
    let view = k
        .wait_for("the second registration", LIMIT, |v| {
            v.registrations.len() == 2 && v.plugins.len() == 1
        })
        .await
        .expect("registered again");
    assert_eq!(view.deregistrations, vec![p.reg_socket.clone()]);
    assert_eq!(view.registrations[1].endpoint, p.dra_socket);
    p.wait_state(RegistrationState::is_registered).await;
    assert!(p.reg_socket.exists());

    // The DRA socket too: the kubelet's client reconnects to the same path.
    std::fs::remove_file(&p.dra_socket).expect("remove");
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !p.dra_socket.exists() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "DRA socket not created again"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ok = k
        .prepare(DRIVER, &[claim("u-ok", "ok")])
        .await
        .expect("served on the new socket");
    assert!(ok["u-ok"].is_ok());
    p.shutdown().await;
    k.stop().await;
}
