//! The standalone `dcr-relay` binary for relay hosts.

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(dcr_relay::main_with_args(std::env::args()).clamp(0, 255) as u8)
}
