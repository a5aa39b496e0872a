//! The `rolter` binary: parse the CLI and hand over to [`rolter::server::run`].

use clap::Parser;

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = rolter::server::Cli::parse();
    if let Err(e) = rolter::server::run(cli) {
        eprintln!("{e}");
        std::process::exit(1);
    }
}
