//! Tests of `upstream`.

use super::*;

#[test]
fn encoded_request_is_one_well_formed_message() {
    let mut client = RequestHeader::build("POST", b"/v1/chat/completions?x=1", None).unwrap();
    for (k, v) in [
        ("host", "gateway.example"),
        ("content-length", "999"),
        ("connection", "keep-alive"),
        ("transfer-encoding", "chunked"),
        (crate::prompt::TOKEN_IDS_HEADER, "1,2,3"),
        ("authorization", "Bearer k"),
        ("x-session-id", "s1"),
    ] {
        client.append_header(k, v).unwrap();
    }
    let body = br#"{"model":"alias","messages":[]}"#;
    let span = 9..16;
    assert_eq!(&body[span.clone()], br#""alias""#);
    let quoted = crate::prompt::quote_model("org/m \"q\"");
    let len = body.len() - span.len() + quoted.len();
    let info = ClientInfo {
        x_forwarded_for: XForwardedFor::Off,
        addr: None,
    };
    let head = encode_head(
        &client,
        "10.0.0.7:8000",
        "/base",
        len,
        info,
        UpstreamAuth::Forward,
    );
    let buf = super::super::framing::BodyBuf::from_pieces(vec![
        bytes::Bytes::from_static(&body[..5]),
        bytes::Bytes::from_static(&body[5..]),
    ]);
    let out: Vec<u8> = buf
        .gather(&head, span, quoted.as_bytes())
        .iter()
        .flat_map(|s| s.iter().copied())
        .collect();

    let mut headers = [httparse::EMPTY_HEADER; 16];
    let mut req = httparse::Request::new(&mut headers);
    let httparse::Status::Complete(head) = req.parse(&out).unwrap() else {
        panic!("incomplete head");
    };
    assert_eq!(req.method, Some("POST"));
    assert_eq!(req.path, Some("/base/v1/chat/completions?x=1"));
    let get = |n: &str| {
        let v: Vec<_> = req.headers.iter().filter(|h| h.name == n).collect();
        assert!(v.len() <= 1, "{n} sent twice");
        v.first()
            .map(|h| std::str::from_utf8(h.value).unwrap().to_string())
    };
    let sent = &out[head..];
    assert_eq!(sent, br#"{"model":"org/m \"q\"","messages":[]}"#);
    assert_eq!(get("content-length"), Some(sent.len().to_string()));
    assert_eq!(get("host").as_deref(), Some("10.0.0.7:8000"));
    assert_eq!(get("authorization").as_deref(), Some("Bearer k"));
    assert_eq!(get("x-session-id").as_deref(), Some("s1"));
    for gone in [
        "connection",
        "transfer-encoding",
        crate::prompt::TOKEN_IDS_HEADER,
    ] {
        assert_eq!(get(gone), None, "{gone} forwarded");
    }
}

/// The header lines of an encoded head, in order (name lowercased, value as sent).
fn header_lines(head: &[u8]) -> Vec<(String, String)> {
    let text = std::str::from_utf8(head).unwrap();
    text.split("\r\n")
        .skip(1)
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.to_string()))
        .collect()
}

fn request_with(headers: &[(&str, &str)]) -> RequestHeader {
    let mut client = RequestHeader::build("POST", b"/v1/chat/completions", None).unwrap();
    for (k, v) in headers {
        client.append_header(k.to_string(), *v).unwrap();
    }
    client
}

fn off() -> ClientInfo {
    ClientInfo {
        x_forwarded_for: XForwardedFor::Off,
        addr: None,
    }
}

#[test]
fn headers_the_connection_header_names_are_not_forwarded() {
    let client = request_with(&[
        ("connection", "keep-alive, X-Secret,x-other , Keep-Alive"),
        ("connection", "x-third"),
        ("x-secret", "s"),
        ("X-Other", "o"),
        ("x-third", "t"),
        ("http2-settings", "AAMAAABkAAQAAP__"),
        ("x-kept", "k"),
        ("authorization", "Bearer k"),
    ]);
    let lines = header_lines(&encode_head(
        &client,
        "u:1",
        "",
        0,
        off(),
        UpstreamAuth::Forward,
    ));
    let names: Vec<&str> = lines.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["x-kept", "authorization", "host", "content-length"]);
}

#[test]
fn x_forwarded_for_appends_replaces_or_passes_the_clients_list() {
    let with_list = request_with(&[
        ("x-forwarded-for", "203.0.113.9"),
        ("x-forwarded-for", "10.0.0.1, 10.0.0.2"),
        ("x-kept", "k"),
    ]);
    let bare = request_with(&[("x-kept", "k")]);
    let v4: IpAddr = "192.0.2.7".parse().unwrap();
    let v6: IpAddr = "2001:db8::1".parse().unwrap();
    let xff = |client: &RequestHeader, mode, addr| {
        let info = ClientInfo {
            x_forwarded_for: mode,
            addr,
        };
        let lines = header_lines(&encode_head(
            client,
            "u:1",
            "",
            0,
            info,
            UpstreamAuth::Forward,
        ));
        let values: Vec<String> = lines
            .iter()
            .filter(|(k, _)| k == "x-forwarded-for")
            .map(|(_, v)| v.clone())
            .collect();
        assert!(lines.iter().any(|(k, _)| k == "x-kept"));
        values
    };
    use XForwardedFor::*;
    assert_eq!(
        xff(&with_list, Append, Some(v4)),
        ["203.0.113.9, 10.0.0.1, 10.0.0.2, 192.0.2.7"]
    );
    assert_eq!(xff(&bare, Append, Some(v6)), ["2001:db8::1"]);
    assert_eq!(xff(&bare, Append, None), Vec::<String>::new());
    assert_eq!(xff(&with_list, Replace, Some(v4)), ["192.0.2.7"]);
    assert_eq!(xff(&with_list, Replace, None), Vec::<String>::new());
    assert_eq!(
        xff(&with_list, Off, Some(v4)),
        ["203.0.113.9", "10.0.0.1, 10.0.0.2"]
    );
    // A client that marks its own list hop-by-hop does not get it forwarded.
    let hop = request_with(&[
        ("connection", "x-forwarded-for"),
        ("x-forwarded-for", "1.1.1.1"),
        ("x-kept", "k"),
    ]);
    assert_eq!(xff(&hop, Append, Some(v4)), ["192.0.2.7"]);
    assert_eq!(xff(&hop, Off, Some(v4)), Vec::<String>::new());
}

#[test]
fn addresses_are_written_as_display_writes_them() {
    for ip in [
        "0.0.0.0",
        "9.10.99.100",
        "255.255.255.255",
        "127.0.0.1",
        "::1",
        "2001:db8::7",
    ] {
        let ip: IpAddr = ip.parse().unwrap();
        let mut out = Vec::new();
        write_ip(&mut out, ip);
        assert_eq!(String::from_utf8(out).unwrap(), ip.to_string());
    }
    for n in 0..=255u8 {
        let ip = IpAddr::from([n, n, 0, 255 - n]);
        let mut out = Vec::new();
        write_ip(&mut out, ip);
        assert_eq!(String::from_utf8(out).unwrap(), ip.to_string());
    }
}

#[test]
fn downstream_response_drops_hop_by_hop_headers_and_frames_the_body() {
    let mut up = ResponseHeader::build(201, None).unwrap();
    for (k, v) in [
        ("content-type", "text/event-stream"),
        ("connection", "close"),
        ("keep-alive", "timeout=5"),
        ("upgrade", "h2c"),
        ("x-request-id", "a"),
        ("x-request-id", "b"),
    ] {
        up.append_header(k, v).unwrap();
    }
    up.set_version(http::Version::HTTP_10);
    let h = downstream_response(Box::new(up)).unwrap();
    assert_eq!(h.status.as_u16(), 201);
    assert_eq!(h.version, http::Version::HTTP_11);
    for gone in NOT_FORWARDED_RESPONSE {
        assert!(h.headers.get(*gone).is_none(), "{gone} forwarded");
    }
    let ids: Vec<_> = h.headers.get_all("x-request-id").iter().collect();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!(h.headers["content-type"], "text/event-stream");
    // No length from upstream (close-delimited): re-framed as chunked.
    assert_eq!(h.headers["transfer-encoding"], "chunked");

    let mut up = ResponseHeader::build(200, None).unwrap();
    up.append_header("content-length", "2").unwrap();
    let h = downstream_response(Box::new(up)).unwrap();
    assert_eq!(h.headers["content-length"], "2");
    assert!(h.headers.get("transfer-encoding").is_none());
    // No body by definition: never re-framed.
    for status in [204, 304] {
        let h =
            downstream_response(Box::new(ResponseHeader::build(status, None).unwrap())).unwrap();
        assert!(h.headers.get("transfer-encoding").is_none(), "{status}");
    }
}

#[test]
fn the_upstream_gets_its_own_key_or_none_never_the_clients() {
    let mut client = RequestHeader::build("POST", b"/v1/completions", None).unwrap();
    client
        .append_header("authorization", "Bearer client-key")
        .unwrap();
    client
        .append_header("Authorization", "Bearer second")
        .unwrap();
    client.append_header("x-other", "1").unwrap();
    let info = ClientInfo {
        x_forwarded_for: XForwardedFor::Off,
        addr: None,
    };
    let text = |auth| String::from_utf8(encode_head(&client, "u:1", "", 0, info, auth)).unwrap();
    let replaced = text(UpstreamAuth::Replace("Bearer upstream-key"));
    assert!(
        !replaced.contains("client-key") && !replaced.contains("second"),
        "{replaced}"
    );
    assert_eq!(
        replaced
            .matches("authorization: Bearer upstream-key\r\n")
            .count(),
        1
    );
    assert!(replaced.contains("x-other: 1\r\n"));
    let dropped = text(UpstreamAuth::Drop);
    assert!(
        !dropped.to_ascii_lowercase().contains("authorization"),
        "{dropped}"
    );
    let forwarded = text(UpstreamAuth::Forward);
    assert!(forwarded.contains("Bearer client-key") && forwarded.contains("Bearer second"));
}

/// A request larger than the socket takes at once (the reader starts late) is written
/// whole and in order, across partial vectored writes.
#[tokio::test]
async fn a_vectored_request_larger_than_the_socket_takes_arrives_whole() {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.unwrap();
        got
    });
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut stream: Stream = Box::new(pingora::protocols::l4::stream::Stream::from(tcp));
    let parts: Vec<Vec<u8>> = (0..12u8)
        .map(|i| vec![i; 700_000 + usize::from(i)])
        .collect();
    let slices: Vec<IoSlice> = parts.iter().map(|p| IoSlice::new(p)).collect();
    write_all_vectored(&mut stream, &slices).await.unwrap();
    stream.flush().await.unwrap();
    drop(stream);
    let got = tokio::time::timeout(Duration::from_secs(10), reader)
        .await
        .expect("the reader ends")
        .unwrap();
    assert!(got == parts.concat(), "bytes lost or out of order");
}
