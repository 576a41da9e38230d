//! `gpu-operator`.
fn main() -> std::process::ExitCode {
    eprintln!("gpu-operator is not available in this build yet");
    std::process::ExitCode::FAILURE
}
