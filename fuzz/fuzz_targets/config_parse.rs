//! Routing-file parsing and validation (`config::parse`).
//!
//! Any text must give a `Config` or a `ConfigError` whose every problem is one line
//! naming the file; nothing panics (egress checks, URL parsing and range checks included).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = rolter::config::parse(text, "fuzz.toml") {
        for line in e.to_string().lines() {
            assert!(line.starts_with("fuzz.toml: "), "unprefixed problem line: {line}");
        }
    }
});
