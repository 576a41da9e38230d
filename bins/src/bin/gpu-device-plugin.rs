//! `gpu-device-plugin`.
fn main() -> std::process::ExitCode {
    eprintln!("gpu-device-plugin is not available in this build yet");
    std::process::ExitCode::FAILURE
}
