//! `rolter-stub`: a fast, non-delaying OpenAI-compatible upstream for overhead
//! benchmarks (answers every chat/completions request at once with a small JSON body).

use clap::Parser;
use rolter_loadtest::stub::Stub;

#[derive(Parser)]
#[command(about = "Fast OpenAI-compatible stub upstream for benchmarks")]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:18001")]
    listen: std::net::SocketAddr,
    /// Runtime worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let stub = Stub::start_with("stub", args.listen, args.threads)?;
    stub.set_recording(false);
    println!("rolter-stub listening on {}", stub.addr());
    loop {
        std::thread::park();
    }
}
