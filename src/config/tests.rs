use super::*;

const GOOD: &str = r#"
[[providers]]
name = "a"
kind = "openai_compatible"
api_base = "http://127.0.0.1:8001"

[[providers]]
name = "b"
kind = "openai_compatible"
api_base = "http://localhost:8002/prefix"

[[routes]]
model = "llama"
strategy = "round_robin"
[[routes.targets]]
provider = "a"
model = "meta-llama/Llama-3.1-8B-Instruct"
[[routes.targets]]
provider = "b"
model = "meta-llama/Llama-3.1-8B-Instruct"
weight = 2

[limits]
max_body_bytes = 65536
"#;

#[test]
fn good_file_parses_with_defaults() {
    let c = parse(GOOD, "good.toml").expect("valid");
    assert_eq!(c.providers.len(), 2);
    assert_eq!(c.routes[0].strategy, StrategyKind::RoundRobin);
    assert_eq!(c.routes[0].targets[0].weight, 1);
    assert_eq!(c.routes[0].targets[1].weight, 2);
    assert_eq!(c.limits.max_body_bytes, 65536);
    assert_eq!(c.limits.connect_timeout_ms, DEFAULT_CONNECT_TIMEOUT_MS);
}

#[test]
fn every_problem_is_reported_on_its_own_line() {
    let bad = GOOD
        .replace(
            "api_base = \"http://localhost:8002/prefix\"",
            "api_base = \"ftp//nope\"\ncolour = \"red\"",
        )
        .replace("provider = \"a\"", "provider = \"zzz\"");
    let err = parse(&bad, "bad.toml").unwrap_err();
    let text = err.to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines.iter().all(|l| l.starts_with("bad.toml: ")), "{text}");
    assert!(text.contains("providers.1.colour: unknown key"), "{text}");
    assert!(
        text.contains("routes[0].targets[0].provider: unknown provider \"zzz\""),
        "{text}"
    );
    assert!(
        text.contains("providers[1].api_base: bad URL \"ftp//nope\""),
        "{text}"
    );
}

#[test]
fn bad_strategy_names_line_and_choices() {
    let bad = GOOD.replace("round_robin", "fastest");
    let text = parse(&bad, "s.toml").unwrap_err().to_string();
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(text.contains("line 14"), "{text}");
    assert!(
        text.contains("fastest") && text.contains("least_load"),
        "{text}"
    );
}

#[test]
fn duplicates_and_empty_routes_are_rejected() {
    let bad = format!(
        "{GOOD}\n[[providers]]\nname = \"a\"\nkind = \"openai_compatible\"\napi_base = \"http://h:1\"\n\
         [[routes]]\nmodel = \"llama\"\nstrategy = \"least_load\"\n"
    );
    let problems = parse(&bad, "d.toml").unwrap_err().problems();
    assert!(
        problems
            .iter()
            .any(|p| p.contains("duplicate provider name \"a\"")),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.contains("duplicate route for model \"llama\"")),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.contains("routes[1].targets: a route needs at least one target")),
        "{problems:?}"
    );
}

#[test]
fn api_base_shapes() {
    assert!(validate::check_api_base("http://10.0.0.1:8000").is_ok());
    assert!(validate::check_api_base("http://vllm-1:8000/v0").is_ok());
    assert!(validate::check_api_base("https://x:1").is_err());
    assert!(validate::check_api_base("localhost:8000").is_err());
    assert!(validate::check_api_base("http://u:p@h:1").is_err());
    assert!(validate::check_api_base("not a url").is_err());
}
