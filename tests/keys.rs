//! Upstream and client keys through the real binary (issue #25): every upstream sees
//! only its own key, a wrong or missing client key gets 401 in OpenAI's shape and
//! reaches no upstream, `/metrics` and `/health` are open or protected by config, and no
//! key appears in the log, the metrics or `-t` output.

mod common;

use common::*;
use std::process::Command;

const UPSTREAM_A: &str = "sk-upstream-aaaa";
const UPSTREAM_B: &str = "sk-upstream-bbbb";
const CLIENT_FILE_KEY: &str = "sk-client-from-file";
const CLIENT_ENV_KEY: &str = "sk-client-from-env";

/// Two providers with their own keys (one inline, one from the environment) and
/// `[auth]` with keys from a file and the environment.
fn routes(a: &Stub, b: &Stub, keys_file: &std::path::Path, auth_extra: &str) -> String {
    format!(
        r#"[[providers]]
name = "a"
kind = "openai_compatible"
api_base = "{}"
api_key = "{UPSTREAM_A}"

[[providers]]
name = "b"
kind = "openai_compatible"
api_base = "{}"
api_key_env = "ROLTER_KEYS_TEST_UPSTREAM_B"

[[routes]]
model = "alias"
strategy = "round_robin"
[[routes.targets]]
provider = "a"
model = "m"
[[routes.targets]]
provider = "b"
model = "m"

[auth]
keys_file = "{}"
keys_env = "ROLTER_KEYS_TEST_CLIENT"
{auth_extra}
"#,
        a.url(),
        b.url(),
        keys_file.display()
    )
}

fn set_env() {
    // The gateway process inherits these.
    std::env::set_var("ROLTER_KEYS_TEST_UPSTREAM_B", UPSTREAM_B);
    std::env::set_var("ROLTER_KEYS_TEST_CLIENT", CLIENT_ENV_KEY);
}

fn keys_file(dir: &TempDir) -> std::path::PathBuf {
    let path = dir.path().join("client-keys");
    std::fs::write(&path, format!("# clients\n{CLIENT_FILE_KEY}\n")).unwrap();
    path
}

fn assert_no_secret(what: &str, text: &str) {
    for secret in [UPSTREAM_A, UPSTREAM_B, CLIENT_FILE_KEY, CLIENT_ENV_KEY] {
        assert!(!text.contains(secret), "{what} shows a key:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_upstream_sees_only_its_own_key_and_wrong_client_keys_get_401() {
    set_env();
    let a = Stub::start("a").await.unwrap();
    let b = Stub::start("b").await.unwrap();
    let dir = TempDir::new("keys");
    let gw = Gateway::start_logged(&routes(&a, &b, &keys_file(&dir), "")).await;

    for (i, key) in [
        CLIENT_FILE_KEY,
        CLIENT_ENV_KEY,
        CLIENT_FILE_KEY,
        CLIENT_ENV_KEY,
    ]
    .iter()
    .enumerate()
    {
        let auth = format!("Bearer {key}");
        let (status, _, body) = post_chat_with(
            &gw,
            chat_body("alias", &format!("q{i}"), false),
            &[("authorization", &auth)],
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    // Anthropic's SDK sends its key as x-api-key: admitted, and not forwarded either.
    for i in 0..2 {
        let (status, _, body) = post_chat_with(
            &gw,
            chat_body("alias", &format!("x{i}"), false),
            &[("x-api-key", CLIENT_ENV_KEY)],
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, _, _) = post_chat_with(
        &gw,
        chat_body("alias", "both", false),
        &[
            ("authorization", &format!("Bearer {CLIENT_FILE_KEY}")),
            ("x-api-key", CLIENT_FILE_KEY),
        ],
    )
    .await;
    assert_eq!(status, 200);
    let mut seen = 0;
    for (stub, own) in [(&a, UPSTREAM_A), (&b, UPSTREAM_B)] {
        let recorded = stub.recorded();
        seen += recorded.len();
        for r in recorded {
            let values: Vec<_> = r.headers.get_all("authorization").iter().collect();
            assert_eq!(values, [format!("Bearer {own}").as_str()]);
            assert!(
                r.headers.get("x-api-key").is_none(),
                "a client key went upstream"
            );
        }
    }
    assert_eq!(seen, 7);

    let served = a.served() + b.served();
    for auth in [Some("Bearer sk-wrong"), Some(UPSTREAM_A), None] {
        let mut req = reqwest::Client::new()
            .post(gw.url("/v1/chat/completions"))
            .body(chat_body("alias", "let me in", false));
        if let Some(v) = auth {
            req = req.header("authorization", v);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401);
        assert_eq!(resp.headers()["www-authenticate"], "Bearer");
        let v: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "invalid_api_key");
        assert!(v["error"]["param"].is_null());
    }
    assert_eq!(
        a.served() + b.served(),
        served,
        "a refused request reached an upstream"
    );
    let models = reqwest::get(gw.url("/v1/models")).await.unwrap();
    assert_eq!(models.status(), 401);

    // Open by default.
    assert_eq!(reqwest::get(gw.url("/health")).await.unwrap().status(), 200);
    let metrics = reqwest::get(gw.url("/metrics")).await.unwrap();
    assert_eq!(metrics.status(), 200);
    let metrics = metrics.text().await.unwrap();
    assert!(
        metrics.contains("rolter_auth_failures_total 4"),
        "{metrics}"
    );
    assert_no_secret("/metrics", &metrics);
    assert_no_secret("the log", &gw.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_health_can_be_protected_and_no_key_reaches_test_output() {
    set_env();
    let a = Stub::start("a").await.unwrap();
    let b = Stub::start("b").await.unwrap();
    let dir = TempDir::new("keys-protected");
    let text = routes(&a, &b, &keys_file(&dir), "protect_metrics = true\n");
    let gw = Gateway::start_logged(&text).await;
    let client = reqwest::Client::new();
    assert_eq!(
        client.get(gw.url("/health")).send().await.unwrap().status(),
        200
    );
    // The harness needs an open /health to start; protect it by a reload.
    let text = routes(
        &a,
        &b,
        &keys_file(&dir),
        "protect_metrics = true\nprotect_health = true\n",
    );
    std::fs::write(&gw.routes, &text).unwrap();
    gw.signal("HUP");
    assert!(
        eventually(std::time::Duration::from_secs(5), || async {
            client.get(gw.url("/health")).send().await.unwrap().status() == 401
        })
        .await
    );
    for path in ["/metrics", "/health", "/ready"] {
        let denied = client.get(gw.url(path)).send().await.unwrap();
        assert_eq!(denied.status(), 401, "{path}");
        let allowed = client
            .get(gw.url(path))
            .bearer_auth(CLIENT_ENV_KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(allowed.status(), 200, "{path}");
    }

    // `-t` checks the file (keys read from the environment and the key file) and says
    // nothing of the keys.
    let conf = write_pingora_yaml(dir.path());
    let routes_path = dir.path().join("routes.toml");
    std::fs::write(&routes_path, &text).unwrap();
    let out = Command::new(rolter_bin())
        .args(["-t", "-c"])
        .arg(&conf)
        .arg("--routes")
        .arg(&routes_path)
        .output()
        .unwrap();
    let shown =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{shown}");
    assert_no_secret("-t", &shown);
    // A key env variable that is not set: the error names the variable, not a value.
    let broken = text.replace("ROLTER_KEYS_TEST_UPSTREAM_B", "ROLTER_KEYS_TEST_UNSET");
    std::fs::write(&routes_path, broken).unwrap();
    let out = Command::new(rolter_bin())
        .args(["-t", "-c"])
        .arg(&conf)
        .arg("--routes")
        .arg(&routes_path)
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success());
    assert!(
        shown.contains("providers[1].api_key_env") && shown.contains("ROLTER_KEYS_TEST_UNSET"),
        "{shown}"
    );
    assert_no_secret("-t", &shown);
    assert_no_secret("the log", &gw.log());
}
