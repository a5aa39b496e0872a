//! The API endpoints beyond chat and completions (issue #24), through the real binary in
//! front of recording stubs: pass-through endpoints (model rewritten, every other byte
//! kept, answers relayed, least-load routing, counted by endpoint), multipart audio
//! forms, malformed bodies, the Anthropic Messages API, and the Responses API's
//! `previous_response_id` affinity (JSON and SSE, a busy home replica, reloads, a home
//! that is gone or unhealthy, the id table's cap).

mod common;

use common::*;
use std::time::Duration;

/// Every pass-through JSON path and its `endpoint` metric label.
const PASS_THROUGH: &[(&str, &str)] = &[
    ("/v1/embeddings", "embeddings"),
    ("/v1/rerank", "rerank"),
    ("/rerank", "rerank"),
    ("/v2/rerank", "rerank"),
    ("/v1/score", "score"),
    ("/score", "score"),
    ("/pooling", "pooling"),
    ("/classify", "classify"),
    ("/tokenize", "tokenize"),
    ("/detokenize", "detokenize"),
    ("/v1/chat/completions/render", "chat_render"),
    ("/v1/messages/count_tokens", "messages_count_tokens"),
];

/// A held request's marker (`Behaviour::hold`).
const HOLD: &str = "HOLD-ME";

struct Answer {
    status: u16,
    stub: Option<String>,
    body: String,
}

impl Answer {
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

async fn send(
    gw: &Gateway,
    method: reqwest::Method,
    path: &str,
    content_type: &str,
    body: Vec<u8>,
) -> Answer {
    let resp = reqwest::Client::new()
        .request(method, gw.url(path))
        .header("content-type", content_type)
        .timeout(Duration::from_secs(20))
        .body(body)
        .send()
        .await
        .expect("request to gateway");
    let status = resp.status().as_u16();
    let stub = resp
        .headers()
        .get("x-stub-id")
        .map(|v| v.to_str().unwrap().to_string());
    Answer {
        status,
        stub,
        body: resp.text().await.unwrap(),
    }
}

async fn post(gw: &Gateway, path: &str, body: &str) -> Answer {
    send(
        gw,
        reqwest::Method::POST,
        path,
        "application/json",
        body.as_bytes().to_vec(),
    )
    .await
}

async fn get(gw: &Gateway, path: &str) -> Answer {
    send(
        gw,
        reqwest::Method::GET,
        path,
        "application/json",
        Vec::new(),
    )
    .await
}

/// `body` as upstream `n` must receive it: the top-level `"model":"alias"` rewritten.
fn rewritten(body: &str, n: usize) -> String {
    body.replacen(
        "\"model\":\"alias\"",
        &format!("\"model\":\"upstream-model-{n}\""),
        1,
    )
}

fn stub_index(id: &str) -> usize {
    (id.as_bytes()[0] - b'a') as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pass_through_endpoints_rewrite_only_the_model_relay_the_answer_and_are_counted() {
    let stubs = [
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
    ];
    let urls: Vec<String> = stubs.iter().map(|s| s.url()).collect();
    let gw = Gateway::start(&routes_toml(&urls, "cache_aware", "")).await;
    for (i, (path, _)) in PASS_THROUGH.iter().enumerate() {
        // The model is not the first member, a nested "model" stays, odd spacing stays.
        let body = format!(
            r#"{{"input": ["a", "b {i}"],"model":"alias" , "options":{{"model":"alias"}},"n":{i}}}"#
        );
        let a = post(&gw, path, &body).await;
        assert_eq!(a.status, 200, "{path}: {}", a.body);
        let stub = a.stub.clone().expect("answered by a stub");
        let echo = a.json();
        assert_eq!(echo["path"], *path, "the answer is the upstream's");
        let rec = stubs[stub_index(&stub)].recorded();
        let last = rec.last().unwrap();
        assert_eq!(last.uri, *path);
        let want = rewritten(&body, stub_index(&stub));
        assert_eq!(std::str::from_utf8(&last.body).unwrap(), want, "{path}");
        assert_eq!(last.headers["content-length"], want.len().to_string());
    }
    for (path, label) in PASS_THROUGH {
        let n = PASS_THROUGH.iter().filter(|(_, l)| l == label).count() as f64;
        let series =
            format!("rolter_endpoint_requests_total{{endpoint=\"{label}\",status=\"200\"}}");
        assert_eq!(gw.metric(&series).await, Some(n), "{path}");
    }
    // An upstream error answer is relayed as it is.
    stubs[0].set_behaviour(Behaviour {
        status: 400,
        ..Default::default()
    });
    stubs[1].set_behaviour(Behaviour {
        status: 400,
        ..Default::default()
    });
    let a = post(&gw, "/v1/embeddings", r#"{"model":"alias","input":"x"}"#).await;
    assert_eq!(a.status, 400);
    assert!(a.json()["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("stub "));
}

/// Hold requests carrying [`HOLD`] on `busy` (the other stubs answer at once) until
/// `count` are in flight there; each is sent through the gateway as `send` makes it.
async fn make_busy<F, Fut>(
    busy: &Stub,
    count: usize,
    mut send: F,
) -> Vec<tokio::task::JoinHandle<()>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    busy.set_behaviour(Behaviour {
        hold: Some((HOLD.to_string(), Duration::from_secs(8))),
        ..Default::default()
    });
    let mut held = Vec::new();
    for _ in 0..40 {
        if busy.active() >= count {
            break;
        }
        held.push(tokio::spawn(send()));
        let before = busy.active();
        eventually(Duration::from_millis(300), || async {
            busy.active() > before
        })
        .await;
    }
    assert!(busy.active() >= count, "could not make the stub busy");
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pass_through_requests_go_to_the_least_loaded_target() {
    let (a, b) = (
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
    );
    let gw = Gateway::start(&routes_toml(&[a.url(), b.url()], "cache_aware", "")).await;
    let url = gw.url("/v1/embeddings");
    // Least-load never sends a second request to the busier target while the other is
    // idle, so one held request makes `a` the busier one.
    let held = make_busy(&a, 1, || {
        let url = url.clone();
        async move {
            let _ = reqwest::Client::new()
                .post(url)
                .body(format!(r#"{{"model":"alias","input":"{HOLD}"}}"#))
                .send()
                .await;
        }
    })
    .await;
    for i in 0..6 {
        let r = post(
            &gw,
            "/v1/embeddings",
            &format!(r#"{{"model":"alias","input":"q{i}"}}"#),
        )
        .await;
        assert_eq!(
            (r.status, r.stub.as_deref()),
            (200, Some("b")),
            "request {i}"
        );
    }
    assert!(a.active() >= 1);
    held.iter().for_each(|h| h.abort());
}

/// A multipart/form-data body: a binary file part (with bytes that look like form syntax),
/// the model field, and a language field.
fn audio_form(boundary: &str, model: &str) -> Vec<u8> {
    let mut audio: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    audio.extend_from_slice(b"\r\n--not-the-boundary\r\nname=\"model\"\r\n\r\nalias");
    let mut b = Vec::new();
    b.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n").as_bytes());
    b.extend_from_slice(&audio);
    b.extend_from_slice(
        format!(
            "\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n"
        )
        .as_bytes(),
    );
    b.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"language\"\r\n\r\nen\r\n--{boundary}--\r\n").as_bytes());
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audio_forms_have_only_their_model_field_rewritten() {
    let stub = Stub::start("a").await.unwrap();
    let gw = Gateway::start(&routes_toml(&[stub.url()], "least_load", "")).await;
    let boundary = "----rolterBoundary7MA4YWxk";
    for path in ["/v1/audio/transcriptions", "/v1/audio/translations"] {
        let a = send(
            &gw,
            reqwest::Method::POST,
            path,
            &format!("multipart/form-data; boundary={boundary}"),
            audio_form(boundary, "alias"),
        )
        .await;
        assert_eq!(a.status, 200, "{path}: {}", a.body);
        assert_eq!(a.json()["path"], path);
        let rec = stub.recorded();
        let last = rec.last().unwrap();
        let want = audio_form(boundary, "upstream-model-0");
        assert!(
            last.body == want,
            "{path}: the form differs from the rewritten one"
        );
        assert_eq!(last.headers["content-length"], want.len().to_string());
    }
    assert_eq!(
        gw.metric("rolter_endpoint_requests_total{endpoint=\"audio_translations\",status=\"200\"}")
            .await,
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_on_the_new_endpoints_get_openai_400s_and_reach_no_upstream() {
    let stub = Stub::start("a").await.unwrap();
    let gw = Gateway::start(&routes_toml(&[stub.url()], "cache_aware", "")).await;
    let form = "multipart/form-data; boundary=XyZ";
    let json = "application/json";
    let cases: &[(&str, &str, &[u8])] = &[
        ("/v1/embeddings", json, b"{\"model\":\"alias\",\"input\":"),
        ("/v1/embeddings", json, b"{\"input\":\"x\"}"),
        ("/v1/rerank", json, b"{\"model\":7,\"query\":\"q\"}"),
        ("/score", json, b"[\"model\",\"alias\"]"),
        (
            "/tokenize",
            json,
            b"{\"model\":\"alias\",\"model\":\"alias\"}",
        ),
        (
            "/v1/embeddings",
            json,
            b"{\"model\":\"alias\",\"stream\":\"yes\"}",
        ),
        ("/v1/responses", json, b"{\"model\":\"alias\",\"input\":5}"),
        (
            "/v1/responses",
            json,
            b"{\"model\":\"alias\",\"input\":[{\"role\":\"user\",\"content\":[{\"text\":\"x\"}]}]}",
        ),
        (
            "/v1/responses",
            json,
            b"{\"model\":\"alias\",\"previous_response_id\":1}",
        ),
        (
            "/v1/messages",
            json,
            b"{\"model\":\"alias\",\"messages\":\"x\"}",
        ),
        (
            "/v1/messages",
            json,
            b"{\"model\":\"alias\",\"system\":3,\"messages\":[]}",
        ),
        ("/v1/audio/transcriptions", json, b"{\"model\":\"alias\"}"),
        (
            "/v1/audio/transcriptions",
            "multipart/form-data",
            b"--XyZ\r\n\r\nx\r\n--XyZ--",
        ),
        (
            "/v1/audio/transcriptions",
            form,
            b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nx\r\n--XyZ--",
        ),
        (
            "/v1/audio/translations",
            form,
            b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nalias",
        ),
        ("/v1/audio/translations", form, b"garbage"),
        (
            "/v1/audio/translations",
            form,
            b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n\xff\xfe\r\n--XyZ--",
        ),
    ];
    for (path, ct, body) in cases {
        let a = send(&gw, reqwest::Method::POST, path, ct, body.to_vec()).await;
        let shown = String::from_utf8_lossy(body);
        assert_eq!(a.status, 400, "{path} {shown}: {}", a.body);
        let v = a.json();
        assert_eq!(v["error"]["code"], "bad_request", "{path} {shown}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(a.stub.is_none());
    }
    assert!(
        stub.recorded().is_empty(),
        "a malformed request reached the upstream"
    );
    // Unknown paths stay 404, the wrong method is 405, an unknown model 404.
    assert_eq!(post(&gw, "/v1/nope", "{}").await.status, 404);
    assert_eq!(post(&gw, "/v1/embeddings/x", "{}").await.status, 404);
    assert_eq!(get(&gw, "/v1/embeddings").await.status, 405);
    let unknown = post(&gw, "/v1/embeddings", r#"{"model":"nope","input":"x"}"#).await;
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.json()["error"]["code"], "not_found");
    // Still healthy.
    let ok = post(&gw, "/v1/embeddings", r#"{"model":"alias","input":"x"}"#).await;
    assert_eq!(ok.status, 200);
    assert_eq!(
        gw.metric("rolter_endpoint_requests_total{endpoint=\"responses\",status=\"400\"}")
            .await,
        Some(3.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_are_routed_by_their_prompt_and_forwarded_byte_for_byte() {
    let (a, b) = (
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
    );
    let gw = Gateway::start(&routes_toml(&[a.url(), b.url()], "cache_aware", "")).await;
    let system = "You are a careful assistant. ".repeat(20);
    let mut homes = Vec::new();
    for turn in 0..4 {
        let mut messages = vec![serde_json::json!({"role": "user", "content": "Hello there"})];
        for t in 0..turn {
            messages.push(serde_json::json!({"role": "assistant", "content": [{"type": "text", "text": format!("answer {t}")}]}));
            messages.push(serde_json::json!({"role": "user", "content": format!("question {t}")}));
        }
        let body = serde_json::json!({"model": "alias", "max_tokens": 10, "system": system, "messages": messages}).to_string();
        let r = post(&gw, "/v1/messages", &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let home = r.stub.unwrap();
        let rec = [&a, &b][stub_index(&home)].recorded();
        assert_eq!(
            std::str::from_utf8(&rec.last().unwrap().body).unwrap(),
            rewritten(&body, stub_index(&home))
        );
        homes.push(home);
    }
    // The conversation grows from one prefix: it stays where its cache is.
    assert!(homes.windows(2).all(|w| w[0] == w[1]), "{homes:?}");
    assert!(
        gw.metric("rolter_routing_decisions_total{reason=\"cache_hit\",strategy=\"cache_aware\"}")
            .await
            .unwrap_or(0.0)
            >= 3.0
    );
}

/// The response id of an answer: the JSON `id`, or the first SSE event's `response.id`.
fn response_id(body: &str, stream: bool) -> String {
    if !stream {
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        return v["id"].as_str().unwrap().to_string();
    }
    let data = body
        .lines()
        .find_map(|l| l.strip_prefix("data: "))
        .expect("an SSE data line");
    let v: serde_json::Value = serde_json::from_str(data).unwrap();
    assert_eq!(v["type"], "response.created");
    v["response"]["id"].as_str().unwrap().to_string()
}

fn responses_body(input: &str, previous: Option<&str>, stream: bool) -> String {
    let mut v = serde_json::json!({"model": "alias", "instructions": "Be brief.", "input": input, "stream": stream});
    if let Some(p) = previous {
        v["previous_response_id"] = p.into();
    }
    v.to_string()
}

async fn conversation_follows_its_home(stream: bool) {
    let stubs = [
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
        Stub::start("c").await.unwrap(),
    ];
    let urls: Vec<String> = stubs.iter().map(|s| s.url()).collect();
    let gw = Gateway::start(&routes_toml(&urls, "least_load", "")).await;
    let first = post(
        &gw,
        "/v1/responses",
        &responses_body("turn 1", None, stream),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let home_id = first.stub.clone().unwrap();
    let home = &stubs[stub_index(&home_id)];
    let mut id = response_id(&first.body, stream);
    // Make the home replica the busiest: requests continuing the first response are
    // pinned there and held.
    let url = gw.url("/v1/responses");
    let pinned = responses_body(HOLD, Some(&id), false);
    let held = make_busy(home, 3, || {
        let (url, body) = (url.clone(), pinned.clone());
        async move {
            let _ = reqwest::Client::new().post(url).body(body).send().await;
        }
    })
    .await;
    for turn in 2..=5 {
        let r = post(
            &gw,
            "/v1/responses",
            &responses_body(&format!("turn {turn}"), Some(&id), stream),
        )
        .await;
        assert_eq!(r.status, 200, "turn {turn}: {}", r.body);
        assert_eq!(r.stub.as_deref(), Some(home_id.as_str()), "turn {turn}");
        if stream {
            assert!(r.body.contains("event: response.completed"), "{}", r.body);
        }
        let rec = home.recorded();
        let sent = responses_body(&format!("turn {turn}"), Some(&id), stream);
        assert_eq!(
            std::str::from_utf8(&rec.last().unwrap().body).unwrap(),
            rewritten(&sent, stub_index(&home_id))
        );
        id = response_id(&r.body, stream);
        assert!(home.active() >= 3, "the home was not the busiest");
    }
    // Only the home ever saw the conversation past its first turn.
    for (i, s) in stubs.iter().enumerate() {
        if i != stub_index(&home_id) {
            assert!(s.recorded().is_empty(), "stub {i} got a request");
        }
    }
    // Reading, cancelling and deleting it reach the home too (a bare GET has no body and
    // no Content-Length).
    let bare = reqwest::get(gw.url(&format!("/v1/responses/{id}?stream=false")))
        .await
        .unwrap();
    assert_eq!(bare.status(), 200);
    assert_eq!(
        home.recorded().last().unwrap().uri,
        format!("/v1/responses/{id}?stream=false")
    );
    for (method, path) in [
        (reqwest::Method::GET, format!("/v1/responses/{id}")),
        (reqwest::Method::POST, format!("/v1/responses/{id}/cancel")),
        (reqwest::Method::DELETE, format!("/v1/responses/{id}")),
    ] {
        let r = send(&gw, method.clone(), &path, "application/json", Vec::new()).await;
        assert_eq!(r.status, 200, "{method} {path}: {}", r.body);
        assert_eq!(r.json()["stub"], home_id.as_str());
        assert_eq!(home.recorded().last().unwrap().uri, path);
    }
    let unknown = get(&gw, "/v1/responses/resp_unknown").await;
    assert_eq!(unknown.status, 404);
    assert!(unknown.stub.is_none());
    assert_eq!(unknown.json()["error"]["code"], "not_found");
    // An id this gateway never saw is routed as usual; the replica's 404 passes through.
    let lost = post(
        &gw,
        "/v1/responses",
        &responses_body("x", Some("resp_lost"), stream),
    )
    .await;
    assert_eq!(lost.status, 404);
    assert!(lost.stub.is_some());
    assert!(lost.body.contains("resp_lost"), "{}", lost.body);
    held.iter().for_each(|h| h.abort());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_conversation_follows_previous_response_id_to_its_busy_home() {
    conversation_follows_its_home(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_responses_conversation_follows_previous_response_id_to_its_busy_home() {
    conversation_follows_its_home(true).await;
}

const OK_RELOADS: &str = "rolter_config_reloads_total{result=\"ok\"}";

async fn reload(gw: &Gateway, text: &str, expected_ok: f64) {
    let tmp = gw.routes.with_extension("toml.new");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, &gw.routes).unwrap();
    gw.signal("HUP");
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.metric(OK_RELOADS).await == Some(expected_ok)
        })
        .await,
        "reload not applied"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_response_table_and_a_removed_home_is_a_clear_503() {
    let (a, b) = (
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
    );
    let both = routes_toml(&[a.url(), b.url()], "least_load", "");
    let gw = Gateway::start(&both).await;
    let first = post(&gw, "/v1/responses", &responses_body("hi", None, false)).await;
    let home = first.stub.clone().unwrap();
    let id = response_id(&first.body, false);
    // Same targets, another generation (a changed limit): the id still leads home. (The
    // other stub would answer 404: it does not hold the response.)
    reload(&gw, &format!("{both}[limits]\nmax_inflight = 999\n"), 1.0).await;
    for _ in 0..4 {
        let r = post(
            &gw,
            "/v1/responses",
            &responses_body("again", Some(&id), false),
        )
        .await;
        assert_eq!((r.status, r.stub.as_deref()), (200, Some(home.as_str())));
    }
    // The home's provider removed: a clear 503 naming it, not another replica.
    let other = if home == "a" { &b } else { &a };
    let only_other = format!(
        "[[providers]]\nname = \"p9\"\nkind = \"openai_compatible\"\napi_base = \"{}\"\n\n[[routes]]\nmodel = \"alias\"\nstrategy = \"least_load\"\n[[routes.targets]]\nprovider = \"p9\"\nmodel = \"m\"\n",
        other.url()
    );
    reload(&gw, &only_other, 2.0).await;
    let served = other.served();
    let r = post(
        &gw,
        "/v1/responses",
        &responses_body("lost", Some(&id), false),
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.body);
    let v = r.json();
    assert_eq!(v["error"]["code"], "response_home_unavailable");
    assert!(v["error"]["message"].as_str().unwrap().contains(&id));
    let by_id = get(&gw, &format!("/v1/responses/{id}")).await;
    assert_eq!(by_id.status, 503);
    assert_eq!(other.served(), served, "another replica was asked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_home_is_a_clear_503_and_the_id_table_is_capped() {
    let (a, b) = (
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
    );
    let health = "[providers.health]\ninterval_ms = 100\ntimeout_ms = 200\nunhealthy_threshold = 1\nhealthy_threshold = 1\n";
    let mut routes = String::new();
    for (i, s) in [&a, &b].iter().enumerate() {
        routes += &format!(
            "[[providers]]\nname = \"p{i}\"\nkind = \"openai_compatible\"\napi_base = \"{}\"\n{health}\n",
            s.url()
        );
    }
    routes += "[[routes]]\nmodel = \"alias\"\nstrategy = \"least_load\"\n";
    for i in 0..2 {
        routes +=
            &format!("[[routes.targets]]\nprovider = \"p{i}\"\nmodel = \"upstream-model-{i}\"\n");
    }
    routes += "[limits]\nresponse_affinity_cap = 4\n";
    let gw = Gateway::start(&routes).await;
    let mut ids = Vec::new();
    for i in 0..10 {
        let r = post(
            &gw,
            "/v1/responses",
            &responses_body(&format!("q{i}"), None, false),
        )
        .await;
        assert_eq!(r.status, 200);
        ids.push((response_id(&r.body, false), r.stub.unwrap()));
    }
    let held = gw.metric("rolter_response_affinity_ids").await.unwrap();
    assert!(held <= 4.0, "{held} ids over a cap of 4");
    // The oldest ids were let go: the gateway no longer knows where they live.
    let by_id = |id: &str| format!("/v1/responses/{id}");
    assert_eq!(get(&gw, &by_id(&ids[0].0)).await.status, 404);
    let (last, home) = ids.last().unwrap().clone();
    assert_eq!(get(&gw, &by_id(&last)).await.status, 200);
    // The home stops answering its health checks: continuing there is a clear 503.
    let home_stub = if home == "a" { &a } else { &b };
    home_stub.set_behaviour(Behaviour {
        health_status: 500,
        ..Default::default()
    });
    let label = format!("p{}", stub_index(&home));
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.metric(&format!("rolter_provider_healthy{{provider=\"{label}\"}}"))
                .await
                == Some(0.0)
        })
        .await
    );
    let r = post(
        &gw,
        "/v1/responses",
        &responses_body("next", Some(&last), false),
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "response_home_unavailable");
    assert!(r.stub.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_through_request_follows_its_session_on_a_pipeline_route() {
    let (a, b) = (
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
    );
    let gw = Gateway::start(&routes_toml(&[a.url(), b.url()], "pipeline", "")).await;
    let embed = |session: &'static str, i: usize| {
        let url = gw.url("/v1/embeddings");
        async move {
            let resp = reqwest::Client::new()
                .post(url)
                .header("x-session-id", session)
                .body(format!(r#"{{"model":"alias","input":"q{i}"}}"#))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            resp.headers()["x-stub-id"].to_str().unwrap().to_string()
        }
    };
    // Each session sticks to the target that served it first (without affinity, two idle
    // targets are a coin toss per request: 10 in a row agree with chance 2^-9).
    for session in ["s1", "s2", "s3"] {
        let first = embed(session, 0).await;
        for i in 1..10 {
            assert_eq!(embed(session, i).await, first, "{session} moved at {i}");
        }
    }
    assert!(
        gw.metric("rolter_routing_decisions_total{reason=\"affinity\",strategy=\"pipeline\"}")
            .await
            .unwrap_or(0.0)
            >= 27.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_lists_aliases_with_the_context_length_and_root_their_targets_report() {
    let (a, b, c) = (
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
        Stub::start("c").await.unwrap(),
    );
    let list = |id: &str, len: u64| {
        Some(format!(
            r#"{{"object":"list","data":[{{"id":"lora","root":"/adapters/x","max_model_len":1}},{{"id":"{id}","object":"model","owned_by":"vllm","root":"org/base","parent":null,"max_model_len":{len}}}]}}"#
        ))
    };
    a.set_behaviour(Behaviour {
        models: list("upstream-model-0", 32768),
        ..Default::default()
    });
    b.set_behaviour(Behaviour {
        models: list("upstream-model-1", 8192),
        ..Default::default()
    });
    // c answers 404 on /v1/models, as a server without the listing would.
    let extra = format!(
        "[[providers]]\nname = \"pc\"\nkind = \"openai_compatible\"\napi_base = \"{}\"\n[[routes]]\nmodel = \"plain\"\nstrategy = \"least_load\"\n[[routes.targets]]\nprovider = \"pc\"\nmodel = \"m\"\n",
        c.url()
    );
    let gw = Gateway::start(&routes_toml(&[a.url(), b.url()], "least_load", &extra)).await;
    let v: serde_json::Value = serde_json::from_str(&gw.get_text("/v1/models").await).unwrap();
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[0]["id"], "alias");
    assert_eq!(data[0]["object"], "model");
    assert_eq!(
        data[0]["max_model_len"], 8192,
        "the smallest of the targets'"
    );
    assert_eq!(data[0]["root"], "org/base");
    assert_eq!(data[1]["id"], "plain");
    assert!(data[1].get("max_model_len").is_none() && data[1].get("root").is_none());
    // Answers are remembered: a second listing asks no target again.
    let asked = a.served() + b.served() + c.served();
    assert_eq!(asked, 3, "each target asked once");
    let again: serde_json::Value = serde_json::from_str(&gw.get_text("/v1/models").await).unwrap();
    assert_eq!(again, v);
    assert_eq!(a.served() + b.served() + c.served(), asked);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_answer_s_own_framing_decides_how_its_response_id_is_read() {
    let stub = Stub::start("a").await.unwrap();
    let gw = Gateway::start(&routes_toml(&[stub.url()], "least_load", "")).await;
    // Asked to stream, answered with JSON (a background response): the id is still learnt.
    let r = post(
        &gw,
        "/v1/responses",
        r#"{"model":"alias","input":"x","stream":true,"background":true}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let id = response_id(&r.body, false);
    assert_eq!(gw.metric("rolter_response_affinity_ids").await, Some(1.0));
    let got = get(&gw, &format!("/v1/responses/{id}")).await;
    assert_eq!(got.status, 200, "{}", got.body);
    // An error answer teaches nothing.
    stub.set_behaviour(Behaviour {
        status: 500,
        ..Default::default()
    });
    let failed = post(&gw, "/v1/responses", r#"{"model":"alias","input":"y"}"#).await;
    assert_eq!(failed.status, 500);
    assert_eq!(gw.metric("rolter_response_affinity_ids").await, Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_home_s_own_answer_reaches_the_client_with_no_retry() {
    let (a, b) = (
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
    );
    let gw = Gateway::start(&routes_toml(&[a.url(), b.url()], "least_load", "")).await;
    let first = post(&gw, "/v1/responses", &responses_body("hi", None, false)).await;
    let home = first.stub.clone().unwrap();
    let id = response_id(&first.body, false);
    let (home_stub, other) = if home == "a" { (&a, &b) } else { (&b, &a) };
    home_stub.set_behaviour(Behaviour {
        status: 503,
        ..Default::default()
    });
    let other_served = other.served();
    // Only the home holds the response, so a 503 from it cannot be replaced by another
    // attempt: it is relayed as the replica sent it, and no retry is spent.
    let r = post(
        &gw,
        "/v1/responses",
        &responses_body("again", Some(&id), false),
    )
    .await;
    assert_eq!((r.status, r.stub.as_deref()), (503, Some(home.as_str())));
    assert!(
        r.body.contains(&format!("stub {home} failing")),
        "{}",
        r.body
    );
    assert_eq!(other.served(), other_served, "another replica was asked");
    let retries = gw
        .metric("rolter_retries_total{reason=\"503\",route=\"alias\"}")
        .await
        .unwrap_or(0.0);
    assert_eq!(retries, 0.0);
}
