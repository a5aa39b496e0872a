//! Decoding of vLLM V1 KV-event messages: ZMQ multipart frames → typed batches.
//!
//! Owns the wire format and nothing else: [`decode_message`] (a live PUB message),
//! [`decode_replay`] (a reply from the replay ROUTER) and [`decode_batch`] (the
//! msgpack payload) are pure functions over byte slices, so they can be fuzzed and
//! never touch sockets, clocks or the residency index. Malformed input of any kind
//! yields a [`DecodeError`]; nothing here panics or allocates in proportion to a
//! length the input merely claims (rmpv reads arrays without preallocating).
//!
//! Wire facts (vLLM's `vllm/distributed/kv_events.py`, checked against the
//! 0.8.5-era source, later releases with medium/lora_name/extra_keys/group_idx/
//! kv_cache_spec_*, and forks adding locality/ownership/session_id; see SPEC §4.1):
//! - A live message is three frames: topic, an 8-byte big-endian sequence number,
//!   and the msgpack payload. A publisher with a snapshot endpoint (seen in an
//!   llm-d fork) appends a 16-byte stream id to the sequence frame: accepted.
//! - The payload is `EventBatch(ts, events, data_parallel_rank=None)`, an array
//!   (`array_like=True`); one upstream snapshot declares it as a plain struct (a map
//!   keyed by field name): both are accepted.
//! - Events are a tagged union. Up to vLLM 0.23 each event is an array with the tag
//!   (class name) first and the fields in declaration order; from 0.24 a map keyed by
//!   field name with the tag under `"type"`. msgspec never omits defaults in arrays,
//!   so arrays are short only because older releases declare fewer fields; absent
//!   optional fields decode as `None`, extra positions and unknown keys are ignored.
//! - Block hashes are `int` (u64 since 0.10.2, signed from Python's `hash()` before)
//!   or `bytes` (32-byte sha256 with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`). All are
//!   normalised to [`BlockHash`], a u64: bytes by vLLM's own int conversion
//!   (`int.from_bytes(b, "big") & (2**64 - 1)`), negative ints as two's complement.
//! - A replay reply is `[b"", seq, payload]` (older) or `[b"", topic, seq, payload]`
//!   (vLLM ≥ 0.26) as a DEALER receives it (the identity is stripped, the empty
//!   delimiter is not); the end marker has sequence −1 and an empty payload. Replies
//!   with the delimiter already stripped are accepted too.

pub use crate::prefix::event::{BlockHash, BlockRemoved, BlockStored, ExtraKey, KvEvent, Medium};
use rmpv::decode::read_value_ref_with_max_depth;
use rmpv::ValueRef;

/// Length of the sequence-number frame: vLLM's `seq.to_bytes(8, "big")`.
pub const SEQ_LEN: usize = 8;
/// Length of the publisher stream id some publishers append to the sequence frame
/// (`uuid.uuid4().bytes` when a snapshot endpoint is configured, llm-d fork).
pub const STREAM_ID_LEN: usize = 16;
/// Sequence frame of the replay end marker: vLLM's `(-1).to_bytes(8, "big", signed=True)`.
pub const END_SEQ_FRAME: [u8; SEQ_LEN] = [0xFF; SEQ_LEN];
/// Nesting limit for msgpack values. The deepest legitimate value is
/// batch → events → event → extra_keys → per-block tuple → item (6 levels).
pub const MAX_MSGPACK_DEPTH: usize = 32;

/// The one byte the msgpack spec never uses.
const MSGPACK_NEVER_USED: u8 = 0xc1;
/// Frames of one live PUB message: topic, sequence, payload.
const PUB_FRAMES: usize = 3;
/// Most frames of a replay reply: delimiter, topic, sequence, payload.
const MAX_REPLAY_FRAMES: usize = 4;

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Wrong number of frames for the message kind.
    #[error("expected {expected} frames, got {got}")]
    FrameCount { expected: &'static str, got: usize },
    /// The sequence frame has the wrong length.
    #[error("sequence frame must be 8 bytes (or 8 + a 16-byte stream id), got {0}")]
    Sequence(usize),
    /// The payload is not valid msgpack (truncated, reserved byte, too deep, ...).
    #[error("malformed msgpack: {0}")]
    Msgpack(String),
    /// Bytes follow the batch's msgpack value.
    #[error("{0} unexpected bytes after the msgpack value")]
    TrailingBytes(usize),
    /// Valid msgpack of the wrong shape (missing field, wrong type, out of range).
    #[error("unexpected shape: {0}")]
    Schema(String),
    /// An event whose tag is none of BlockStored / BlockRemoved / AllBlocksCleared.
    #[error("unknown event tag {0:?}")]
    UnknownTag(String),
}

impl DecodeError {
    /// Stable short name of the variant, for metric labels and fixture manifests.
    pub fn kind(&self) -> &'static str {
        match self {
            DecodeError::FrameCount { .. } => "FrameCount",
            DecodeError::Sequence(_) => "Sequence",
            DecodeError::Msgpack(_) => "Msgpack",
            DecodeError::TrailingBytes(_) => "TrailingBytes",
            DecodeError::Schema(_) => "Schema",
            DecodeError::UnknownTag(_) => "UnknownTag",
        }
    }
}

fn schema(msg: impl Into<String>) -> DecodeError {
    DecodeError::Schema(msg.into())
}

/// The msgpack payload: `EventBatch(ts, events, data_parallel_rank)`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Publisher wall-clock time (seconds since the epoch).
    pub ts: f64,
    /// Events in order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank of the publishing engine, when sent.
    pub data_parallel_rank: Option<u32>,
}

/// One decoded message: framing plus batch.
#[derive(Debug, Clone, PartialEq)]
pub struct KvMessage {
    /// Topic frame (`None` for replay replies of releases that send none).
    pub topic: Option<Vec<u8>>,
    /// Batch sequence number (per publisher, from 0; restarts at 0 with the engine).
    pub seq: u64,
    /// Publisher stream id appended to the sequence frame, when present.
    pub stream_id: Option<[u8; STREAM_ID_LEN]>,
    /// The batch.
    pub batch: EventBatch,
}

/// One message received from the replay endpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayReply {
    /// A replayed batch.
    Batch(KvMessage),
    /// The end marker (sequence −1): no more batches for this request.
    End,
}

/// Decode one live PUB message (`[topic, seq, payload]`).
pub fn decode_message(frames: &[&[u8]]) -> Result<KvMessage, DecodeError> {
    if frames.len() != PUB_FRAMES {
        return Err(DecodeError::FrameCount {
            expected: "3 (topic, seq, payload)",
            got: frames.len(),
        });
    }
    let (seq, stream_id) = decode_seq(frames[1])?;
    let batch = decode_batch(frames[2])?;
    Ok(KvMessage {
        topic: Some(frames[0].to_vec()),
        seq,
        stream_id,
        batch,
    })
}

/// Decode one replay reply, with or without the leading delimiter and topic frames.
pub fn decode_replay(frames: &[&[u8]]) -> Result<ReplayReply, DecodeError> {
    let n = frames.len();
    if !(2..=MAX_REPLAY_FRAMES).contains(&n) {
        return Err(DecodeError::FrameCount {
            expected: "2 to 4 ([delimiter,] [topic,] seq, payload)",
            got: n,
        });
    }
    let topic = match n {
        // [b"", topic, seq, payload]: the first frame must be the empty delimiter.
        4 if frames[0].is_empty() => Some(frames[1].to_vec()),
        4 => {
            return Err(schema(
                "replay reply of 4 frames must start with an empty delimiter",
            ))
        }
        // [delimiter or topic, seq, payload]: an empty first frame is the delimiter
        // (old layout) or an empty topic; either way there is no topic to report.
        3 if frames[0].is_empty() => None,
        3 => Some(frames[0].to_vec()),
        _ => None,
    };
    let seq_frame = frames[n - 2];
    if seq_frame == END_SEQ_FRAME.as_slice() {
        return Ok(ReplayReply::End);
    }
    let (seq, stream_id) = decode_seq(seq_frame)?;
    let batch = decode_batch(frames[n - 1])?;
    Ok(ReplayReply::Batch(KvMessage {
        topic,
        seq,
        stream_id,
        batch,
    }))
}

/// Decode a sequence frame: 8 bytes big-endian, optionally followed by a stream id.
pub fn decode_seq(frame: &[u8]) -> Result<(u64, Option<[u8; STREAM_ID_LEN]>), DecodeError> {
    let seq_of = |b: &[u8]| {
        let mut buf = [0u8; SEQ_LEN];
        buf.copy_from_slice(&b[..SEQ_LEN]);
        u64::from_be_bytes(buf)
    };
    match frame.len() {
        SEQ_LEN => Ok((seq_of(frame), None)),
        n if n == SEQ_LEN + STREAM_ID_LEN => {
            let mut id = [0u8; STREAM_ID_LEN];
            id.copy_from_slice(&frame[SEQ_LEN..]);
            Ok((seq_of(frame), Some(id)))
        }
        n => Err(DecodeError::Sequence(n)),
    }
}

/// Decode the msgpack payload of a message into an [`EventBatch`].
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    // rmpv reads msgpack's never-used byte 0xc1 as nil; reject it where it would be
    // the whole payload (nested, it can only ever stand for a nil field).
    if payload.first() == Some(&MSGPACK_NEVER_USED) {
        return Err(DecodeError::Msgpack("reserved byte 0xc1".into()));
    }
    let mut rd = payload;
    let value = read_value_ref_with_max_depth(&mut rd, MAX_MSGPACK_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(DecodeError::TrailingBytes(rd.len()));
    }
    let (ts, events, rank) = match &value {
        ValueRef::Array(items) => {
            if items.len() < 2 {
                return Err(schema(format!(
                    "batch array has {} elements, needs ts and events",
                    items.len()
                )));
            }
            (Some(&items[0]), Some(&items[1]), items.get(2))
        }
        ValueRef::Map(entries) => (
            map_get(entries, "ts"),
            map_get(entries, "events"),
            map_get(entries, "data_parallel_rank"),
        ),
        other => {
            return Err(schema(format!(
                "batch must be an array or map, got {}",
                kind_of(other)
            )))
        }
    };
    let ts = as_f64(ts.ok_or_else(|| schema("batch has no ts"))?, "ts")?;
    let events = match events.ok_or_else(|| schema("batch has no events"))? {
        ValueRef::Array(evs) => evs
            .iter()
            .map(decode_event)
            .collect::<Result<Vec<_>, _>>()?,
        other => {
            return Err(schema(format!(
                "events must be an array, got {}",
                kind_of(other)
            )))
        }
    };
    let data_parallel_rank = opt(rank)
        .map(|v| as_u32(v, "data_parallel_rank"))
        .transpose()?;
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

/// Field access over both event layouts: positional (index) or by name.
enum Fields<'v, 'a> {
    Positional(&'v [ValueRef<'a>]),
    Named(&'v [(ValueRef<'a>, ValueRef<'a>)]),
}

impl<'v, 'a> Fields<'v, 'a> {
    /// The field at declaration position `pos` (0 = first field after the tag) or named `name`.
    fn get(&self, pos: usize, name: &str) -> Option<&'v ValueRef<'a>> {
        match self {
            Fields::Positional(items) => items.get(pos + 1),
            Fields::Named(entries) => map_get(entries, name),
        }
    }

    /// A field that must be present (it may still be nil if its type allows).
    fn required(&self, tag: &str, pos: usize, name: &str) -> Result<&'v ValueRef<'a>, DecodeError> {
        self.get(pos, name)
            .ok_or_else(|| schema(format!("{tag} lacks required field {name}")))
    }
}

fn decode_event(value: &ValueRef<'_>) -> Result<KvEvent, DecodeError> {
    let (tag, fields) = match value {
        ValueRef::Array(items) => {
            let tag = match items.first() {
                Some(ValueRef::String(s)) => {
                    s.as_str().ok_or_else(|| schema("event tag is not UTF-8"))?
                }
                Some(other) => {
                    return Err(schema(format!(
                        "event tag must be a string, got {}",
                        kind_of(other)
                    )))
                }
                None => return Err(schema("empty event array")),
            };
            (tag, Fields::Positional(items))
        }
        ValueRef::Map(entries) => {
            let tag = match map_get(entries, "type") {
                Some(ValueRef::String(s)) => {
                    s.as_str().ok_or_else(|| schema("event tag is not UTF-8"))?
                }
                Some(other) => {
                    return Err(schema(format!(
                        "event tag must be a string, got {}",
                        kind_of(other)
                    )))
                }
                None => return Err(schema("event map has no \"type\" tag")),
            };
            (tag, Fields::Named(entries))
        }
        other => {
            return Err(schema(format!(
                "event must be an array or map, got {}",
                kind_of(other)
            )))
        }
    };
    match tag {
        "BlockStored" => decode_stored(&fields).map(KvEvent::BlockStored),
        "BlockRemoved" => decode_removed(&fields).map(KvEvent::BlockRemoved),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(DecodeError::UnknownTag(other.chars().take(64).collect())),
    }
}

fn decode_stored(f: &Fields<'_, '_>) -> Result<BlockStored, DecodeError> {
    const TAG: &str = "BlockStored";
    // Declaration order of vLLM's BlockStored fields (positions after the tag).
    let block_hashes = hashes(f.required(TAG, 0, "block_hashes")?, "block_hashes")?;
    let parent_block_hash = opt(f.get(1, "parent_block_hash"))
        .map(|v| hash(v, "parent_block_hash"))
        .transpose()?;
    let token_ids = match f.required(TAG, 2, "token_ids")? {
        ValueRef::Array(items) => items
            .iter()
            .map(|v| as_u32(v, "token_ids"))
            .collect::<Result<Vec<_>, _>>()?,
        other => {
            return Err(schema(format!(
                "token_ids must be an array, got {}",
                kind_of(other)
            )))
        }
    };
    // May be 0: vLLM's offloading connector announces CPU-tier copies with
    // `token_ids=[]` and `block_size=0` (or the tier's block size).
    let block_size = as_u32(f.required(TAG, 3, "block_size")?, "block_size")?;
    let lora_id = opt(f.get(4, "lora_id"))
        .map(|v| as_i64(v, "lora_id"))
        .transpose()?;
    let medium = opt(f.get(5, "medium"))
        .map(|v| as_str(v, "medium").map(Medium::parse))
        .transpose()?;
    let lora_name = opt(f.get(6, "lora_name"))
        .map(|v| as_str(v, "lora_name").map(str::to_string))
        .transpose()?;
    let extra_keys = opt(f.get(7, "extra_keys")).map(extra_keys).transpose()?;
    let group_idx = opt(f.get(8, "group_idx"))
        .map(|v| as_u32(v, "group_idx"))
        .transpose()?;
    Ok(BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        lora_id,
        medium,
        lora_name,
        extra_keys,
        group_idx,
    })
}

fn decode_removed(f: &Fields<'_, '_>) -> Result<BlockRemoved, DecodeError> {
    let block_hashes = hashes(
        f.required("BlockRemoved", 0, "block_hashes")?,
        "block_hashes",
    )?;
    let medium = opt(f.get(1, "medium"))
        .map(|v| as_str(v, "medium").map(Medium::parse))
        .transpose()?;
    let group_idx = opt(f.get(2, "group_idx"))
        .map(|v| as_u32(v, "group_idx"))
        .transpose()?;
    Ok(BlockRemoved {
        block_hashes,
        medium,
        group_idx,
    })
}

fn extra_keys(v: &ValueRef<'_>) -> Result<Vec<Option<Vec<ExtraKey>>>, DecodeError> {
    let ValueRef::Array(per_block) = v else {
        return Err(schema(format!(
            "extra_keys must be an array, got {}",
            kind_of(v)
        )));
    };
    per_block
        .iter()
        .map(|entry| match entry {
            ValueRef::Nil => Ok(None),
            ValueRef::Array(items) => Ok(Some(items.iter().map(extra_key).collect())),
            other => Err(schema(format!(
                "extra_keys entry must be an array or nil, got {}",
                kind_of(other)
            ))),
        })
        .collect()
}

fn extra_key(v: &ValueRef<'_>) -> ExtraKey {
    match v {
        ValueRef::String(s) => match s.as_str() {
            Some(s) => ExtraKey::Str(s.to_string()),
            None => ExtraKey::Bytes(s.as_bytes().to_vec()),
        },
        ValueRef::Integer(i) => match i.as_i64() {
            Some(i) => ExtraKey::Int(i),
            None => ExtraKey::Other,
        },
        ValueRef::Binary(b) => ExtraKey::Bytes(b.to_vec()),
        _ => ExtraKey::Other,
    }
}

fn hashes(v: &ValueRef<'_>, what: &str) -> Result<Vec<BlockHash>, DecodeError> {
    match v {
        ValueRef::Array(items) => items.iter().map(|h| hash(h, what)).collect(),
        other => Err(schema(format!(
            "{what} must be an array, got {}",
            kind_of(other)
        ))),
    }
}

fn hash(v: &ValueRef<'_>, what: &str) -> Result<BlockHash, DecodeError> {
    match v {
        ValueRef::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Ok(BlockHash(u)),
            (None, Some(s)) => Ok(BlockHash::from_i64(s)),
            (None, None) => Err(schema(format!("{what}: integer out of range"))),
        },
        ValueRef::Binary(b) if !b.is_empty() => Ok(BlockHash::from_bytes(b)),
        other => Err(schema(format!(
            "{what}: a block hash must be an int or non-empty bytes, got {}",
            kind_of(other)
        ))),
    }
}

/// `None` for an absent or nil field.
fn opt<'v, 'a>(v: Option<&'v ValueRef<'a>>) -> Option<&'v ValueRef<'a>> {
    v.filter(|v| !matches!(v, ValueRef::Nil))
}

fn map_get<'v, 'a>(
    entries: &'v [(ValueRef<'a>, ValueRef<'a>)],
    key: &str,
) -> Option<&'v ValueRef<'a>> {
    entries
        .iter()
        .find(|(k, _)| matches!(k, ValueRef::String(s) if s.as_str() == Some(key)))
        .map(|(_, v)| v)
}

fn as_f64(v: &ValueRef<'_>, what: &str) -> Result<f64, DecodeError> {
    match v {
        ValueRef::F64(x) => Ok(*x),
        ValueRef::F32(x) => Ok(f64::from(*x)),
        ValueRef::Integer(i) => i
            .as_f64()
            .ok_or_else(|| schema(format!("{what}: bad number"))),
        other => Err(schema(format!(
            "{what} must be a number, got {}",
            kind_of(other)
        ))),
    }
}

fn as_i64(v: &ValueRef<'_>, what: &str) -> Result<i64, DecodeError> {
    match v {
        ValueRef::Integer(i) => i
            .as_i64()
            .ok_or_else(|| schema(format!("{what}: integer out of range"))),
        other => Err(schema(format!(
            "{what} must be an integer, got {}",
            kind_of(other)
        ))),
    }
}

fn as_u32(v: &ValueRef<'_>, what: &str) -> Result<u32, DecodeError> {
    match v {
        ValueRef::Integer(i) => i
            .as_u64()
            .and_then(|u| u32::try_from(u).ok())
            .ok_or_else(|| schema(format!("{what}: integer out of u32 range"))),
        other => Err(schema(format!(
            "{what} must be an integer, got {}",
            kind_of(other)
        ))),
    }
}

fn as_str<'v>(v: &'v ValueRef<'_>, what: &str) -> Result<&'v str, DecodeError> {
    match v {
        ValueRef::String(s) => s
            .as_str()
            .ok_or_else(|| schema(format!("{what} is not UTF-8"))),
        other => Err(schema(format!(
            "{what} must be a string, got {}",
            kind_of(other)
        ))),
    }
}

fn kind_of(v: &ValueRef<'_>) -> &'static str {
    match v {
        ValueRef::Nil => "nil",
        ValueRef::Boolean(_) => "bool",
        ValueRef::Integer(_) => "int",
        ValueRef::F32(_) | ValueRef::F64(_) => "float",
        ValueRef::String(_) => "str",
        ValueRef::Binary(_) => "bin",
        ValueRef::Array(_) => "array",
        ValueRef::Map(_) => "map",
        ValueRef::Ext(..) => "ext",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};
    use std::path::PathBuf;

    fn fixture_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kv_events")
    }

    /// Split a fixture file into frames (u32-BE length prefixed, see the manifest).
    fn read_frames(name: &str) -> Vec<Vec<u8>> {
        let data = std::fs::read(fixture_dir().join(name)).expect("fixture file");
        let mut frames = Vec::new();
        let mut rest = data.as_slice();
        while !rest.is_empty() {
            let (len, tail) = rest.split_at(4);
            let len = u32::from_be_bytes(len.try_into().unwrap()) as usize;
            frames.push(tail[..len].to_vec());
            rest = &tail[len..];
        }
        frames
    }

    fn manifest() -> Vec<Value> {
        let text = std::fs::read_to_string(fixture_dir().join("manifest.json")).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        v["fixtures"].as_array().unwrap().clone()
    }

    fn hashes_json(h: &[BlockHash]) -> Value {
        json!(h.iter().map(|h| h.0).collect::<Vec<_>>())
    }

    fn extra_json(e: &Option<Vec<Option<Vec<ExtraKey>>>>) -> Value {
        match e {
            None => Value::Null,
            Some(blocks) => Value::Array(
                blocks
                    .iter()
                    .map(|b| match b {
                        None => Value::Null,
                        Some(items) => Value::Array(
                            items
                                .iter()
                                .map(|k| match k {
                                    ExtraKey::Str(s) => json!(s),
                                    ExtraKey::Int(i) => json!(i),
                                    ExtraKey::Bytes(b) => json!(format!("{b:02x?}")),
                                    ExtraKey::Other => json!("other"),
                                })
                                .collect(),
                        ),
                    })
                    .collect(),
            ),
        }
    }

    fn event_json(e: &KvEvent) -> Value {
        match e {
            KvEvent::BlockStored(s) => json!({
                "type": "BlockStored",
                "block_hashes": hashes_json(&s.block_hashes),
                "parent_block_hash": s.parent_block_hash.map(|h| h.0),
                "token_ids": s.token_ids,
                "block_size": s.block_size,
                "lora_id": s.lora_id,
                "medium": s.medium.as_ref().map(Medium::as_str),
                "lora_name": s.lora_name,
                "extra_keys": extra_json(&s.extra_keys),
                "group_idx": s.group_idx,
            }),
            KvEvent::BlockRemoved(r) => json!({
                "type": "BlockRemoved",
                "block_hashes": hashes_json(&r.block_hashes),
                "medium": r.medium.as_ref().map(Medium::as_str),
                "group_idx": r.group_idx,
            }),
            KvEvent::AllBlocksCleared => json!({"type": "AllBlocksCleared"}),
        }
    }

    fn message_json(m: &KvMessage) -> Value {
        json!({
            "end": false,
            "topic": m.topic.as_ref().map(|t| String::from_utf8_lossy(t).into_owned()),
            "seq": m.seq,
            "ts": m.batch.ts,
            "data_parallel_rank": m.batch.data_parallel_rank,
            "events": m.batch.events.iter().map(event_json).collect::<Vec<_>>(),
        })
    }

    fn decode_fixture(kind: &str, frames: &[Vec<u8>]) -> Result<Value, DecodeError> {
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        match kind {
            "pub" => decode_message(&refs).map(|m| message_json(&m)),
            "replay" => decode_replay(&refs).map(|r| match r {
                ReplayReply::Batch(m) => message_json(&m),
                ReplayReply::End => json!({"end": true}),
            }),
            other => panic!("unknown fixture kind {other}"),
        }
    }

    #[test]
    fn every_fixture_decodes_as_the_manifest_says() {
        let fixtures = manifest();
        assert!(
            fixtures.len() >= 30,
            "manifest lists {} fixtures",
            fixtures.len()
        );
        for f in &fixtures {
            let name = f["name"].as_str().unwrap();
            let frames = read_frames(f["file"].as_str().unwrap());
            let got = decode_fixture(f["kind"].as_str().unwrap(), &frames);
            match (f.get("expect"), f.get("error")) {
                (Some(expect), None) => {
                    let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
                    let mut expect = expect.clone();
                    if expect["end"] == json!(true) {
                        // The end marker carries no batch; its topic frame is not reported.
                        expect = json!({"end": true});
                    }
                    assert_eq!(got, expect, "fixture {name}");
                }
                (None, Some(err)) => {
                    let e = got.expect_err(name);
                    assert_eq!(e.kind(), err.as_str().unwrap(), "fixture {name}: {e}");
                }
                _ => panic!("{name}: manifest needs expect or error"),
            }
        }
    }

    #[test]
    fn hash_representations_normalise_to_one_key() {
        let frames = read_frames("pub_legacy_stored_negative.bin");
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        let m = decode_message(&refs).unwrap();
        let KvEvent::BlockStored(s) = &m.batch.events[0] else {
            panic!("not a store")
        };
        assert_eq!(s.block_hashes[1], BlockHash(u64::MAX), "-1 is all ones");
        assert_eq!(
            s.block_hashes[0],
            BlockHash::from_i64(-0x1234_5678_9ABC_DEF0)
        );
        // 32 bytes: the last 8, big-endian; shorter inputs zero-extend.
        let mut b = [0u8; 32];
        b[24..].copy_from_slice(&0xF00D_CAFE_DEAD_BEEFu64.to_be_bytes());
        assert_eq!(BlockHash::from_bytes(&b), BlockHash(0xF00D_CAFE_DEAD_BEEF));
        assert_eq!(BlockHash::from_bytes(&[1, 2]), BlockHash(0x0102));
    }

    #[test]
    fn stream_id_suffix_is_accepted() {
        let mut seq = 5u64.to_be_bytes().to_vec();
        seq.extend_from_slice(&[7u8; STREAM_ID_LEN]);
        assert_eq!(decode_seq(&seq).unwrap(), (5, Some([7u8; STREAM_ID_LEN])));
        assert_eq!(decode_seq(&[0; 9]).unwrap_err(), DecodeError::Sequence(9));
    }

    #[test]
    fn hostile_inputs_error_without_panicking() {
        // An array header claiming 2^32-1 elements with nothing behind it.
        let huge = [0xdd, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(decode_batch(&huge).unwrap_err().kind(), "Msgpack");
        // Nesting deeper than the limit.
        let deep = vec![0x91u8; 10_000];
        assert_eq!(decode_batch(&deep).unwrap_err().kind(), "Msgpack");
        // Every prefix of a valid payload fails cleanly.
        let frames = read_frames("pub_map_stored_bytes.bin");
        for cut in 0..frames[2].len() {
            assert!(decode_batch(&frames[2][..cut]).is_err(), "prefix {cut}");
        }
        // A negative block size or token id is out of range.
        let neg = [0x92, 0x00, 0x91, 0x95, 0xab]
            .iter()
            .copied()
            .chain(*b"BlockStored")
            .chain([0x90, 0xc0, 0x90, 0xff])
            .collect::<Vec<u8>>();
        assert_eq!(decode_batch(&neg).unwrap_err().kind(), "Schema");
        // Replay framing errors.
        assert_eq!(
            decode_replay(&[b"x", b"t", &[0; 8], b""])
                .unwrap_err()
                .kind(),
            "Schema"
        );
        assert_eq!(decode_replay(&[]).unwrap_err().kind(), "FrameCount");
    }
}
