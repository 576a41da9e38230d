//! `gpu-mig-manager`.
fn main() -> std::process::ExitCode {
    eprintln!("gpu-mig-manager is not available in this build yet");
    std::process::ExitCode::FAILURE
}
