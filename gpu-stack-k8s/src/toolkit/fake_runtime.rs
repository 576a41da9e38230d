//! A CRI runtime for tests: answers `Version` and `Status` on a unix socket
//! with the release and effective configuration the test sets.

use std::path::Path;
use std::sync::{Arc, Mutex};

use super::cri::api;

/// The runtime's current answers: its effective configuration and the
/// containerd release it reports (`v2.3.7` unless a test sets another).
#[derive(Clone)]
pub struct FakeRuntime(Arc<Mutex<String>>, Arc<Mutex<String>>);

impl FakeRuntime {
    /// Serves on `socket` (its directory is created) from the current runtime.
    pub fn serve(socket: &Path, config_json: &str) -> Self {
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir).unwrap();
        }
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        let runtime = FakeRuntime(
            Arc::new(Mutex::new(config_json.to_string())),
            Arc::new(Mutex::new("v2.3.7".to_string())),
        );
        let svc = api::runtime_service_server::RuntimeServiceServer::new(runtime.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(crate::kubelet::transport::unix_incoming(listener)),
        );
        runtime
    }

    /// Changes the containerd release reported from now on.
    pub fn set_version(&self, version: &str) {
        *self.1.lock().unwrap() = version.to_string();
    }

    /// Changes the effective configuration reported from now on.
    pub fn set(&self, config_json: &str) {
        *self.0.lock().unwrap() = config_json.to_string();
    }
}

#[tonic::async_trait]
impl api::runtime_service_server::RuntimeService for FakeRuntime {
    async fn version(
        &self,
        _: tonic::Request<api::VersionRequest>,
    ) -> Result<tonic::Response<api::VersionResponse>, tonic::Status> {
        Ok(tonic::Response::new(api::VersionResponse {
            version: "0.1.0".into(),
            runtime_name: "containerd".into(),
            runtime_version: self.1.lock().map(|v| v.clone()).unwrap_or_default(),
            runtime_api_version: "v1".into(),
        }))
    }

    async fn status(
        &self,
        _: tonic::Request<api::StatusRequest>,
    ) -> Result<tonic::Response<api::StatusResponse>, tonic::Status> {
        let config = self.0.lock().map(|c| c.clone()).unwrap_or_default();
        Ok(tonic::Response::new(api::StatusResponse {
            status: Some(api::RuntimeStatus {
                conditions: vec![api::RuntimeCondition {
                    r#type: "RuntimeReady".into(),
                    status: true,
                    ..Default::default()
                }],
            }),
            info: [("config".to_string(), config)].into(),
        }))
    }
}
