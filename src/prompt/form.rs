//! multipart/form-data bodies (`/v1/audio/transcriptions`, `/v1/audio/translations`):
//! find the form field `model` so its value can be rewritten in place, every other byte
//! (the audio file included) forwarded untouched.
//!
//! A small parser of RFC 7578 / RFC 2046 §5.1 framing over an already buffered body: the
//! boundary from `Content-Type`, then each part's header section and the span of its
//! content up to the next delimiter. It reads only part headers (each bounded by
//! [`MAX_PART_HEADER_BYTES`]) and searches for delimiters with `memchr::memmem`, so its cost
//! is linear in the body and it allocates nothing per part. A malformed form is an error
//! (400 for the client), never a guess. Must not: touch sockets or decode file contents.

use memchr::memmem;
use std::ops::Range;
use thiserror::Error;

/// Longest header section of one part. Real parts carry a `Content-Disposition` and maybe
/// a `Content-Type` (well under 1 KiB); 16 KiB leaves room for long file names.
pub const MAX_PART_HEADER_BYTES: usize = 16 * 1024;
/// Longest boundary RFC 2046 §5.1.1 allows.
const MAX_BOUNDARY: usize = 70;

/// Why a form body could not be read.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum FormError {
    #[error("this endpoint takes a multipart/form-data body")]
    NotMultipart,
    #[error("multipart/form-data without a valid boundary parameter")]
    NoBoundary,
    #[error("malformed multipart/form-data body: {0}")]
    Malformed(&'static str),
    #[error("the form has no 'model' field")]
    MissingModel,
    #[error("the form has more than one 'model' field")]
    DuplicateModel,
}

/// The boundary named by a `Content-Type` value, if it is multipart/form-data.
pub fn boundary(content_type: &[u8]) -> Result<&[u8], FormError> {
    let mut parts = split_params(content_type);
    let media = parts.next().ok_or(FormError::NotMultipart)?;
    if !media
        .trim_ascii()
        .eq_ignore_ascii_case(b"multipart/form-data")
    {
        return Err(FormError::NotMultipart);
    }
    for param in parts {
        let param = param.trim_ascii();
        let Some(eq) = param.iter().position(|&b| b == b'=') else {
            continue;
        };
        if !param[..eq].trim_ascii().eq_ignore_ascii_case(b"boundary") {
            continue;
        }
        let value = unquote(param[eq + 1..].trim_ascii()).ok_or(FormError::NoBoundary)?;
        if value.is_empty()
            || value.len() > MAX_BOUNDARY
            || value.iter().any(|&b| b == b'\r' || b == b'\n')
        {
            return Err(FormError::NoBoundary);
        }
        return Ok(value);
    }
    Err(FormError::NoBoundary)
}

/// The byte range of the `model` field's value in `body`, a multipart/form-data body
/// whose `Content-Type` is `content_type`. The whole form is checked: every part framed,
/// the closing delimiter present, exactly one `model` field.
pub fn model_field(body: &[u8], content_type: &[u8]) -> Result<Range<usize>, FormError> {
    let boundary = boundary(content_type)?;
    // "\r\n--" + boundary: every delimiter but a first one at the body's very start.
    let mut delimiter = Vec::with_capacity(boundary.len() + 4);
    delimiter.extend_from_slice(b"\r\n--");
    delimiter.extend_from_slice(boundary);
    let finder = memmem::Finder::new(&delimiter);
    // Just past the first delimiter (a preamble before it is allowed and ignored).
    let mut at = if body.starts_with(&delimiter[2..]) {
        delimiter.len() - 2
    } else {
        finder
            .find(body)
            .map(|i| i + delimiter.len())
            .ok_or(FormError::Malformed("no opening boundary"))?
    };
    let mut model = None;
    loop {
        let rest = &body[at..];
        if rest.starts_with(b"--") {
            // The closing delimiter; an epilogue after it is ignored.
            return model.ok_or(FormError::MissingModel);
        }
        // Transport padding, then the line break that ends the delimiter line.
        let pad = rest
            .iter()
            .take_while(|&&b| b == b' ' || b == b'\t')
            .count();
        if !rest[pad..].starts_with(b"\r\n") {
            return Err(FormError::Malformed("boundary line not followed by CRLF"));
        }
        let headers_at = at + pad + 2;
        let window = &body[headers_at..body.len().min(headers_at + MAX_PART_HEADER_BYTES + 4)];
        let (headers, content_at) = if window.starts_with(b"\r\n") {
            (&window[..0], headers_at + 2)
        } else {
            let end = memmem::find(window, b"\r\n\r\n").ok_or(FormError::Malformed(
                "part header section unterminated or too long",
            ))?;
            (&window[..end], headers_at + end + 4)
        };
        let content_end = finder
            .find(&body[content_at..])
            .map(|i| content_at + i)
            .ok_or(FormError::Malformed("part not closed by a boundary"))?;
        if part_name(headers)?.is_some_and(|n| n == b"model") {
            if model.is_some() {
                return Err(FormError::DuplicateModel);
            }
            model = Some(content_at..content_end);
        }
        at = content_end + delimiter.len();
    }
}

/// The `name` parameter of a part's `Content-Disposition: form-data` header.
fn part_name(headers: &[u8]) -> Result<Option<&[u8]>, FormError> {
    let mut name = None;
    for line in headers.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            return Err(FormError::Malformed("part header line without a colon"));
        };
        if !line[..colon]
            .trim_ascii()
            .eq_ignore_ascii_case(b"content-disposition")
        {
            continue;
        }
        if name.is_some() {
            return Err(FormError::Malformed("two Content-Disposition headers"));
        }
        let mut params = split_params(&line[colon + 1..]);
        let kind = params.next().unwrap_or_default().trim_ascii();
        if !kind.eq_ignore_ascii_case(b"form-data") {
            return Err(FormError::Malformed("part is not form-data"));
        }
        let mut found = None;
        for param in params {
            let param = param.trim_ascii();
            let Some(eq) = param.iter().position(|&b| b == b'=') else {
                continue;
            };
            if param[..eq].trim_ascii().eq_ignore_ascii_case(b"name") {
                found = Some(
                    unquote(param[eq + 1..].trim_ascii())
                        .ok_or(FormError::Malformed("bad name parameter"))?,
                );
            }
        }
        name = Some(found.ok_or(FormError::Malformed("form-data part without a name"))?);
    }
    Ok(name)
}

/// `;`-separated parameters, a `;` inside a quoted string not splitting.
fn split_params(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(value);
    std::iter::from_fn(move || {
        let text = rest?;
        let (mut quoted, mut escaped) = (false, false);
        for (i, &b) in text.iter().enumerate() {
            match b {
                _ if escaped => escaped = false,
                b'\\' if quoted => escaped = true,
                b'"' => quoted = !quoted,
                b';' if !quoted => {
                    rest = Some(&text[i + 1..]);
                    return Some(&text[..i]);
                }
                _ => {}
            }
        }
        rest = None;
        Some(text)
    })
}

/// A parameter value: a token as is, or a quoted string's inside. A quoted string with an
/// escape is refused (browsers percent-encode instead; no model field name needs one).
fn unquote(v: &[u8]) -> Option<&[u8]> {
    match v.strip_prefix(b"\"") {
        None if v.contains(&b'"') => None,
        None => Some(v),
        Some(inner) => {
            let inner = inner.strip_suffix(b"\"")?;
            (!inner.contains(&b'"') && !inner.contains(&b'\\')).then_some(inner)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CT: &[u8] = b"multipart/form-data; boundary=XyZ";

    fn form(parts: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = Vec::new();
        for (name, value) in parts {
            b.extend_from_slice(b"--XyZ\r\n");
            b.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"").as_bytes(),
            );
            if *name == "file" {
                b.extend_from_slice(b"; filename=\"a;b.wav\"\r\nContent-Type: audio/wav");
            }
            b.extend_from_slice(b"\r\n\r\n");
            b.extend_from_slice(value);
            b.extend_from_slice(b"\r\n");
        }
        b.extend_from_slice(b"--XyZ--\r\n");
        b
    }

    #[test]
    fn finds_the_model_field_among_binary_parts() {
        let audio: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
        let body = form(&[("file", &audio), ("model", b"whisper"), ("language", b"en")]);
        let span = model_field(&body, CT).unwrap();
        assert_eq!(&body[span], b"whisper");
        let quoted = b"Multipart/Form-Data; charset=utf-8; boundary=\"XyZ\"";
        assert_eq!(&body[model_field(&body, quoted).unwrap()], b"whisper");
    }

    #[test]
    fn malformed_forms_are_errors() {
        let ok = form(&[("model", b"m")]);
        let cases: Vec<(Vec<u8>, &[u8], FormError)> = vec![
            (ok.clone(), b"application/json", FormError::NotMultipart),
            (ok.clone(), b"multipart/form-data", FormError::NoBoundary),
            (
                ok.clone(),
                b"multipart/form-data; boundary=\"\"",
                FormError::NoBoundary,
            ),
            (form(&[("file", b"x")]), CT, FormError::MissingModel),
            (
                form(&[("model", b"a"), ("model", b"b")]),
                CT,
                FormError::DuplicateModel,
            ),
            (
                ok[..ok.len() - 9].to_vec(),
                CT,
                FormError::Malformed("part not closed by a boundary"),
            ),
            (
                b"nothing here".to_vec(),
                CT,
                FormError::Malformed("no opening boundary"),
            ),
            (
                b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\nm\r\n--XyZ--".to_vec(),
                CT,
                FormError::Malformed("part header section unterminated or too long"),
            ),
            (
                b"--XyZ\r\nContent-Disposition: attachment; name=\"model\"\r\n\r\nm\r\n--XyZ--"
                    .to_vec(),
                CT,
                FormError::Malformed("part is not form-data"),
            ),
            (
                b"--XyZjunk\r\n\r\nm\r\n--XyZ--".to_vec(),
                CT,
                FormError::Malformed("boundary line not followed by CRLF"),
            ),
        ];
        for (body, ct, want) in cases {
            assert_eq!(
                model_field(&body, ct),
                Err(want.clone()),
                "{want:?}: {}",
                String::from_utf8_lossy(&body)
            );
        }
    }

    proptest! {
        /// Arbitrary bytes never panic; what a well-formed form says is found exactly.
        #[test]
        fn never_panics_and_finds_any_model_value(
            junk in proptest::collection::vec(any::<u8>(), 0..400),
            value in "[a-zA-Z0-9/._-]{0,40}",
            file in proptest::collection::vec(any::<u8>(), 0..400),
        ) {
            let _ = model_field(&junk, CT);
            let body = form(&[("file", &file), ("model", value.as_bytes())]);
            // A file containing the delimiter would end its part early: skip those.
            prop_assume!(memmem::find(&file, b"\r\n--XyZ").is_none());
            let span = model_field(&body, CT).unwrap();
            prop_assert_eq!(&body[span], value.as_bytes());
        }
    }
}
