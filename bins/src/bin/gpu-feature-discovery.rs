//! `gpu-feature-discovery`.
fn main() -> std::process::ExitCode {
    eprintln!("gpu-feature-discovery is not available in this build yet");
    std::process::ExitCode::FAILURE
}
