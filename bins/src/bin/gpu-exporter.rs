//! `gpu-exporter`.
fn main() -> std::process::ExitCode {
    eprintln!("gpu-exporter is not available in this build yet");
    std::process::ExitCode::FAILURE
}
