//! OpenAI request body → the conversation vLLM hands to a chat template, and a completion's
//! prompt.
//!
//! Mirrors vLLM's `entrypoints/chat_utils.py` (`_parse_chat_message_content`,
//! `_postprocess_messages`) for text-only requests: `content` as a string, `null` (→ `""`)
//! or a list of parts whose text parts (`text`, `input_text`, `output_text`, `refusal`,
//! `thinking`) are joined by `"\n"` — or, for a template that iterates over a message's
//! content ("openai" content format), kept as a list of `{"type": "text", "text": ...}`;
//! an assistant's `tool_calls` passed through with each `function.arguments` JSON-decoded
//! (invalid → `{}`, an empty list dropped); a tool message's `tool_call_id`; a string
//! `name`. `tools` become vLLM's pydantic dump: `{"type", "function": {"name",
//! "description", "parameters", ...}}` with absent fields as `null`. Maps keep the client's
//! key order (Python dicts do, and `tojson` shows it).

use minijinja::Value;
use serde::Deserialize;

use super::TokenizeError;

/// A chat request as the template sees it.
#[derive(Debug)]
pub struct ChatRequest {
    /// The conversation (a list of message maps).
    pub messages: Value,
    /// `tools`, or `none`.
    pub tools: Value,
    /// `documents`, or `none`.
    pub documents: Value,
    /// vLLM's `add_generation_prompt` (default true).
    pub add_generation_prompt: bool,
    /// vLLM's `add_special_tokens` (default false for chat).
    pub add_special_tokens: bool,
    /// `chat_template_kwargs`, in order.
    pub kwargs: Vec<(String, Value)>,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<Value>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    documents: Option<Value>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: Option<bool>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
}

fn bad(msg: impl Into<String>) -> TokenizeError {
    TokenizeError::Request(msg.into())
}

fn get(v: &Value, key: &str) -> Option<Value> {
    v.get_attr(key).ok().filter(|x| !x.is_undefined())
}

fn text_part(part: &Value) -> Option<String> {
    if let Some(s) = part.as_str() {
        return Some(s.to_owned());
    }
    let kind = get(part, "type")?;
    let field = match kind.as_str()? {
        "text" | "input_text" | "output_text" => "text",
        "refusal" => "refusal",
        "thinking" => "thinking",
        _ => return None,
    };
    get(part, field).and_then(|t| t.as_str().map(str::to_owned))
}

/// `content` in the "string" format, or the "openai" one (a list of text parts).
fn content(raw: Option<Value>, openai: bool) -> Result<Value, TokenizeError> {
    let parts: Vec<Value> = match raw {
        None => Vec::new(),
        Some(v) if v.is_none() => Vec::new(),
        Some(v) if v.as_str().is_some() => {
            if !openai {
                return Ok(v);
            }
            vec![v]
        }
        Some(v) => v
            .try_iter()
            .map_err(|_| bad("message content must be a string, null or a list"))?
            .collect(),
    };
    let texts: Vec<String> = parts.iter().filter_map(text_part).collect();
    if openai {
        Ok(Value::from_iter(texts.into_iter().map(|t| {
            Value::from_iter([("type", Value::from("text")), ("text", Value::from(t))])
        })))
    } else {
        Ok(Value::from(texts.join("\n")))
    }
}

/// A map rebuilt in order with `key` replaced.
fn replace(map: &Value, key: &str, new: Value) -> Value {
    let Ok(keys) = map.try_iter() else {
        return map.clone();
    };
    Value::from_iter(keys.map(|k| {
        let v = if k.as_str() == Some(key) {
            new.clone()
        } else {
            map.get_item(&k).unwrap_or_default()
        };
        (k, v)
    }))
}

fn tool_call(call: &Value) -> Value {
    let Some(function) = get(call, "function") else {
        return call.clone();
    };
    let args = match get(&function, "arguments") {
        Some(a) if a.as_str().is_some() => {
            serde_json::from_str::<Value>(a.as_str().unwrap_or_default())
                .unwrap_or_else(|_| Value::from_iter(std::iter::empty::<(String, Value)>()))
        }
        Some(a) if a.kind() == minijinja::value::ValueKind::Map => a,
        Some(a) if a.kind() == minijinja::value::ValueKind::Seq => a,
        _ => Value::from_iter(std::iter::empty::<(String, Value)>()),
    };
    let function = if get(&function, "arguments").is_some() {
        replace(&function, "arguments", args)
    } else {
        let mut pairs: Vec<(Value, Value)> = function
            .try_iter()
            .map(|ks| {
                ks.map(|k| {
                    let v = function.get_item(&k).unwrap_or_default();
                    (k, v)
                })
                .collect()
            })
            .unwrap_or_default();
        pairs.push((Value::from("arguments"), args));
        Value::from_iter(pairs)
    };
    replace(call, "function", function)
}

fn message(m: &Value, openai: bool) -> Result<Value, TokenizeError> {
    let role = get(m, "role")
        .and_then(|r| r.as_str().map(str::to_owned))
        .ok_or_else(|| bad("every message needs a string \"role\""))?;
    let mut out: Vec<(&str, Value)> = Vec::with_capacity(4);
    let mut body = content(get(m, "content"), openai)?;
    if role == "tool" && body.kind() == minijinja::value::ValueKind::Seq {
        // vLLM flattens a tool result's text parts to a string whatever the format.
        let texts: Vec<String> = body
            .try_iter()
            .map(|it| it.filter_map(|p| text_part(&p)).collect())
            .unwrap_or_default();
        body = Value::from(texts.join("\n"));
    }
    out.push(("role", Value::from(role.as_str())));
    out.push(("content", body));
    if role == "assistant" {
        if let Some(calls) = get(m, "tool_calls").filter(|c| !c.is_none()) {
            match calls.try_iter() {
                Ok(it) => {
                    let calls: Vec<Value> = it.map(|c| tool_call(&c)).collect();
                    if !calls.is_empty() {
                        out.push(("tool_calls", Value::from(calls)));
                    }
                }
                Err(_) => out.push(("tool_calls", calls)),
            }
        }
    }
    if role == "tool" {
        if let Some(id) = get(m, "tool_call_id") {
            out.push(("tool_call_id", id));
        }
    }
    if let Some(name) = get(m, "name").filter(|n| n.as_str().is_some()) {
        out.push(("name", name));
    }
    Ok(Value::from_iter(out))
}

fn tool(t: &Value) -> Result<Value, TokenizeError> {
    let f = get(t, "function").ok_or_else(|| bad("a tool needs \"function\""))?;
    let name = get(&f, "name")
        .filter(|n| n.as_str().is_some())
        .ok_or_else(|| bad("a tool function needs a string \"name\""))?;
    let mut fields: Vec<(Value, Value)> = vec![
        (Value::from("name"), name),
        (
            Value::from("description"),
            get(&f, "description").unwrap_or(Value::from(())),
        ),
        (
            Value::from("parameters"),
            get(&f, "parameters").unwrap_or(Value::from(())),
        ),
    ];
    for k in f
        .try_iter()
        .map_err(|_| bad("a tool function must be an object"))?
    {
        if !matches!(k.as_str(), Some("name" | "description" | "parameters")) {
            let v = f.get_item(&k).unwrap_or_default();
            fields.push((k, v));
        }
    }
    let mut out: Vec<(Value, Value)> = vec![
        (
            Value::from("type"),
            get(t, "type").unwrap_or(Value::from("function")),
        ),
        (Value::from("function"), Value::from_iter(fields)),
    ];
    for k in t.try_iter().map_err(|_| bad("a tool must be an object"))? {
        if !matches!(k.as_str(), Some("type" | "function")) {
            let v = t.get_item(&k).unwrap_or_default();
            out.push((k, v));
        }
    }
    Ok(Value::from_iter(out))
}

/// Parse a chat body; `openai` selects the "openai" content format.
pub fn parse_chat(body: &[u8], openai: bool) -> Result<ChatRequest, TokenizeError> {
    let b: ChatBody = serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
    if b.continue_final_message == Some(true) {
        // transformers cuts the rendered text after the last message's content; not
        // reproduced: the request routes without ids.
        return Err(bad("continue_final_message is not supported"));
    }
    let messages: Vec<Value> = b
        .messages
        .iter()
        .map(|m| message(m, openai))
        .collect::<Result<_, _>>()?;
    let tools = match b.tools {
        None => Value::from(()),
        Some(ts) => Value::from(ts.iter().map(tool).collect::<Result<Vec<_>, _>>()?),
    };
    let kwargs = match b.chat_template_kwargs {
        Some(k) if k.kind() == minijinja::value::ValueKind::Map => k
            .try_iter()
            .map(|it| {
                it.filter_map(|key| {
                    let v = k.get_item(&key).ok()?;
                    Some((key.as_str()?.to_owned(), v))
                })
                .collect()
            })
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    Ok(ChatRequest {
        messages: Value::from(messages),
        tools,
        documents: b.documents.unwrap_or(Value::from(())),
        add_generation_prompt: b.add_generation_prompt.unwrap_or(true),
        add_special_tokens: b.add_special_tokens.unwrap_or(false),
        kwargs,
    })
}

/// A completions request's prompt.
#[derive(Debug, PartialEq, Eq)]
pub enum CompletionPrompt {
    /// Token ids the client sent: used as they are.
    Ids(Vec<u32>),
    /// Text to encode.
    Text {
        text: String,
        add_special_tokens: bool,
    },
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: serde_json::Value,
    #[serde(default)]
    add_special_tokens: Option<bool>,
}

fn ids(items: &[serde_json::Value]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

/// Parse a completions body: a string, an id array, or a batch (its first member).
pub fn parse_completion(body: &[u8]) -> Result<CompletionPrompt, TokenizeError> {
    let b: CompletionBody = serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
    let add_special_tokens = b.add_special_tokens.unwrap_or(true);
    let text = |s: &str| CompletionPrompt::Text {
        text: s.to_owned(),
        add_special_tokens,
    };
    match &b.prompt {
        serde_json::Value::String(s) => Ok(text(s)),
        serde_json::Value::Array(items) if items.is_empty() => Err(bad("empty prompt")),
        serde_json::Value::Array(items) => match &items[0] {
            serde_json::Value::Number(_) => ids(items)
                .map(CompletionPrompt::Ids)
                .ok_or_else(|| bad("prompt ids must be u32")),
            serde_json::Value::String(s) => Ok(text(s)),
            serde_json::Value::Array(first) => ids(first)
                .map(CompletionPrompt::Ids)
                .ok_or_else(|| bad("prompt ids must be u32")),
            _ => Err(bad("unsupported prompt")),
        },
        _ => Err(bad("prompt must be a string or an array")),
    }
}
