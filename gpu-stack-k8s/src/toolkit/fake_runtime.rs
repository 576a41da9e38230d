//! A CRI runtime for tests: answers `Status` on a unix socket with an
//! effective configuration the test sets.

use std::path::Path;
use std::sync::{Arc, Mutex};

use super::cri::api;

/// The runtime's current answer.
#[derive(Clone)]
pub struct FakeRuntime(Arc<Mutex<String>>);

impl FakeRuntime {
    /// Serves on `socket` (its directory is created) from the current runtime.
    pub fn serve(socket: &Path, config_json: &str) -> Self {
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir).unwrap();
        }
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        let runtime = FakeRuntime(Arc::new(Mutex::new(config_json.to_string())));
        let svc = api::runtime_service_server::RuntimeServiceServer::new(runtime.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(crate::kubelet::transport::unix_incoming(listener)),
        );
        runtime
    }

    /// Changes the effective configuration reported from now on.
    pub fn set(&self, config_json: &str) {
        *self.0.lock().unwrap() = config_json.to_string();
    }
}

#[tonic::async_trait]
impl api::runtime_service_server::RuntimeService for FakeRuntime {
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
