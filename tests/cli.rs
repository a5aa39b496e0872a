//! `rolter -t`: validating both config files and exiting with one line per problem.

mod common;

use common::*;
use std::process::Command;

fn check(routes: &str) -> (bool, String) {
    check_logging(routes, "error")
}

/// `rolter -t` on `routes` with `RUST_LOG=rust_log`: success, and stderr then stdout.
fn check_logging(routes: &str, rust_log: &str) -> (bool, String) {
    let dir = TempDir::new("cli");
    let path = dir.path().join("routes.toml");
    std::fs::write(&path, routes).unwrap();
    let out = Command::new(rolter_bin())
        .arg("-t")
        .arg("--routes")
        .arg(&path)
        .env("RUST_LOG", rust_log)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout),
    )
}

#[test]
fn test_flag_reports_each_problem_on_its_own_line() {
    let toml = r#"
[[providers]]
name = "a"
kind = "openai_compatible"
api_base = "http//missing-colon"
flavour = "spicy"

[[routes]]
model = "m"
strategy = "round_robin"
[[routes.targets]]
provider = "nobody"
model = "x"
"#;
    let (ok, out) = check(toml);
    assert!(!ok, "{out}");
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("routes.toml: "))
        .collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("providers.0.flavour: unknown key")),
        "{out}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("unknown provider \"nobody\"")),
        "{out}"
    );
    assert!(
        lines.iter().any(|l| l.contains("api_base: bad URL")),
        "{out}"
    );
}

#[test]
fn test_flag_accepts_a_good_file_and_the_shipped_examples() {
    let (ok, out) = check(&routes_toml(
        &["http://127.0.0.1:9".into()],
        "least_load",
        "",
    ));
    assert!(ok, "{out}");
    assert!(out.contains("routing file ok"), "{out}");
    for file in ["conf/rolter.example.toml", "conf/demo.toml"] {
        let text =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/").to_string() + file)
                .unwrap();
        let (ok, out) = check(&text);
        assert!(ok, "{file}: {out}");
    }
}

#[test]
fn test_flag_rejects_a_missing_file() {
    let out = Command::new(rolter_bin())
        .args(["-t", "--routes", "/nonexistent/rolter.toml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/rolter.toml: cannot read"));
}

/// A cache_aware route over a provider with neither `kv_cache_tokens` nor a `metrics_path`
/// to read it from loads, with a warning that names the provider and says what to set; a
/// provider with either gets none.
#[test]
fn a_cache_aware_target_without_its_cache_size_is_warned_about() {
    let toml = r#"
[[providers]]
name = "sized"
kind = "openai_compatible"
api_base = "http://127.0.0.1:9001"
kv_cache_tokens = 131072

[[providers]]
name = "unsized"
kind = "openai_compatible"
api_base = "http://127.0.0.1:9002"
metrics_path = ""

[[providers]]
name = "read"
kind = "openai_compatible"
api_base = "http://127.0.0.1:9003"

[[routes]]
model = "m"
strategy = "cache_aware"
[[routes.targets]]
provider = "sized"
model = "x"
[[routes.targets]]
provider = "unsized"
model = "x"
[[routes.targets]]
provider = "read"
model = "x"
"#;
    let (ok, text) = check_logging(toml, "warn");
    assert!(ok, "{text}");
    let warned: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("has no kv_cache_tokens"))
        .collect();
    assert_eq!(warned.len(), 1, "{text}");
    assert!(warned[0].contains("provider \"unsized\""), "{text}");
    assert!(warned[0].contains("GPU KV cache size"), "{text}");
}
