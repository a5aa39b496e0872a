//! The `rolter` binary: parse the CLI and hand over to [`rolter::server::run`].

use clap::Parser;

#[global_allocator]
static GLOBAL: rolter::allocator::MiMalloc = rolter::allocator::MiMalloc;

fn main() {
    // Plain (uncoloured) log lines: no per-line ANSI detection/stripping cost, and
    // journald/files get clean text.
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .write_style(env_logger::WriteStyle::Never)
        .init();
    let cli = rolter::server::Cli::parse();
    if let Err(e) = rolter::server::run(cli) {
        eprintln!("{e}");
        std::process::exit(1);
    }
}
