//! msgpack encoding of KV-event batches, byte-compatible with vLLM's msgspec encoder.
//!
//! Owns the wire layout only (see `vllm/distributed/kv_events.py`):
//! - A batch is `KVEventBatch(ts: float, events: list, data_parallel_rank: int | None = None)`,
//!   encoded `array_like` as `[ts, events, data_parallel_rank]` (vLLM's publisher fills in the
//!   rank, so it is present; very old versions had `[ts, events]`).
//! - Events are msgspec tagged structs with `omit_defaults=True`: the tag is the class name.
//!   Up to vLLM 0.23 they are `array_like`: `["BlockStored", field, field, ...]` with every
//!   field the release declares, in declaration order — msgspec ignores `omit_defaults` for
//!   `array_like` structs (msgspec issue #720; checked with msgspec 0.23: a default-valued
//!   trailing field is written as nil), so arrays differ in length only between releases.
//!   From 0.24 (vLLM PR #42892) they are maps: `{"type": "BlockStored", "field": value, ...}`
//!   in declaration order, fields equal to their default omitted.
//! - Declaration order: `BlockStored(block_hashes, parent_block_hash, token_ids, block_size,
//!   lora_id, medium, lora_name, extra_keys=None, group_idx=None, kv_cache_spec_kind=None,
//!   kv_cache_spec_sliding_window=None)`, `BlockRemoved(block_hashes, medium, group_idx=None)`,
//!   `AllBlocksCleared()`. Fields without a default are always written, even when None.
//! - Integers use the smallest msgpack format (as msgspec does), floats are float64, strings
//!   fixstr/str8, and a `bytes` hash is bin8.

use rmpv::Value;

use crate::cache::{BlockHash, CacheEvent};

/// How events are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EventLayout {
    /// `array_like` tagged arrays (vLLM ≤ 0.23).
    #[default]
    Array,
    /// Tagged maps with the tag under `"type"` (vLLM ≥ 0.24).
    Map,
}

/// How the outer batch is laid out. vLLM releases keep the batch `array_like`; `Map` exists for
/// decoder robustness tests (one vLLM main-branch snapshot declares `EventBatch` without
/// `array_like`, which would encode it as `{"ts", "events", "data_parallel_rank"}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum BatchLayout {
    #[default]
    Array,
    Map,
}

/// How block hashes are presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum HashRepr {
    /// Unsigned 64-bit int (vLLM's default since 0.10.2).
    #[default]
    U64,
    /// The same 64 bits as a signed int, often negative (older vLLM's Python `hash()`).
    I64,
    /// 32-byte binary (vLLM's bytes hashes, e.g. SHA-256); the last 8 bytes are the u64
    /// big-endian, the first 24 are derived from it.
    Bytes32,
}

/// Which fields a generation of vLLM declares (the structs of `tools/vllm_kv_events/structs.py`
/// in parentheses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, PartialOrd, Ord, clap::ValueEnum)]
pub enum EventFields {
    /// vLLM 0.8.5 era (`Legacy*`): `BlockStored` up to `lora_id`, `BlockRemoved` with only
    /// hashes, batch `[ts, events]`.
    Base,
    /// Adds `medium = "GPU"` to both events and the batch's `data_parallel_rank`.
    Medium,
    /// Adds `lora_name = None` to `BlockStored` (`Mid*`).
    #[default]
    LoraName,
    /// Adds `extra_keys = [None] * n`, `group_idx = 0`, `kv_cache_spec_kind = "full_attention"`,
    /// `kv_cache_spec_sliding_window = None` (and `group_idx = 0` on removals), as recent vLLM
    /// writes them (`Array*`, and the map-layout structs).
    Extended,
}

/// Everything that decides the bytes of a payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WireFormat {
    pub layout: EventLayout,
    pub batch_layout: BatchLayout,
    pub hash: HashRepr,
    pub fields: EventFields,
    /// The publisher's data-parallel rank written into each batch.
    pub data_parallel_rank: u32,
}

/// vLLM's `MEDIUM_GPU`.
pub const MEDIUM_GPU: &str = "GPU";
/// vLLM's `KVCacheSpecKind.FULL_ATTENTION` value.
pub const SPEC_KIND_FULL_ATTENTION: &str = "full_attention";

/// A block hash as it appears on the wire.
pub fn wire_hash(h: BlockHash, repr: HashRepr) -> Value {
    match repr {
        HashRepr::U64 => Value::from(h),
        HashRepr::I64 => Value::from(h as i64),
        HashRepr::Bytes32 => Value::Binary(hash_bytes32(h).to_vec()),
    }
}

/// The 32-byte form of a hash (see [`HashRepr::Bytes32`]).
pub fn hash_bytes32(h: BlockHash) -> [u8; 32] {
    let mut out = [0u8; 32];
    let mut x = h;
    for i in 0..3 {
        x = crate::tokenizer::splitmix64(x);
        out[i * 8..(i + 1) * 8].copy_from_slice(&x.to_be_bytes());
    }
    out[24..].copy_from_slice(&h.to_be_bytes());
    out
}

fn s(v: &str) -> Value {
    Value::from(v)
}

/// Build a struct value: tagged array or tagged map, `fields` in declaration order. `None`
/// marks a field holding its default: written as nil in array layout (msgspec writes every
/// field of an `array_like` struct), omitted in map layout. `Some(Value::Nil)` is a field
/// without a default whose value is None: written in both layouts.
fn tagged(tag: &str, fields: Vec<(&str, Option<Value>)>, layout: EventLayout) -> Value {
    match layout {
        EventLayout::Array => {
            let mut arr = Vec::with_capacity(fields.len() + 1);
            arr.push(s(tag));
            arr.extend(fields.into_iter().map(|(_, v)| v.unwrap_or(Value::Nil)));
            Value::Array(arr)
        }
        EventLayout::Map => {
            let mut map = Vec::with_capacity(fields.len() + 1);
            map.push((s("type"), s(tag)));
            map.extend(fields.into_iter().filter_map(|(k, v)| v.map(|v| (s(k), v))));
            Value::Map(map)
        }
    }
}

/// One event as a msgpack value.
pub fn event_value(ev: &CacheEvent, fmt: &WireFormat) -> Value {
    let hashes =
        |hs: &[BlockHash]| Value::Array(hs.iter().map(|&h| wire_hash(h, fmt.hash)).collect());
    let f = fmt.fields;
    match ev {
        CacheEvent::Stored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
        } => {
            let mut fields = vec![
                ("block_hashes", Some(hashes(block_hashes))),
                (
                    "parent_block_hash",
                    Some(parent_block_hash.map_or(Value::Nil, |h| wire_hash(h, fmt.hash))),
                ),
                (
                    "token_ids",
                    Some(Value::Array(
                        token_ids.iter().map(|&t| Value::from(t)).collect(),
                    )),
                ),
                ("block_size", Some(Value::from(*block_size as u64))),
                ("lora_id", Some(Value::Nil)),
            ];
            if f >= EventFields::Medium {
                fields.push(("medium", Some(s(MEDIUM_GPU))));
            }
            if f >= EventFields::LoraName {
                fields.push(("lora_name", Some(Value::Nil)));
            }
            if f >= EventFields::Extended {
                let extra = Value::Array(vec![Value::Nil; block_hashes.len()]);
                fields.push(("extra_keys", Some(extra)));
                fields.push(("group_idx", Some(Value::from(0u64))));
                fields.push(("kv_cache_spec_kind", Some(s(SPEC_KIND_FULL_ATTENTION))));
                fields.push(("kv_cache_spec_sliding_window", None));
            }
            tagged("BlockStored", fields, fmt.layout)
        }
        CacheEvent::Removed { block_hashes } => {
            let mut fields = vec![("block_hashes", Some(hashes(block_hashes)))];
            if f >= EventFields::Medium {
                fields.push(("medium", Some(s(MEDIUM_GPU))));
            }
            if f >= EventFields::Extended {
                fields.push(("group_idx", Some(Value::from(0u64))));
            }
            tagged("BlockRemoved", fields, fmt.layout)
        }
        CacheEvent::AllCleared => tagged("AllBlocksCleared", Vec::new(), fmt.layout),
    }
}

/// The batch as a msgpack value.
pub fn batch_value(ts: f64, events: &[CacheEvent], fmt: &WireFormat) -> Value {
    let events = Value::Array(events.iter().map(|e| event_value(e, fmt)).collect());
    let rank = (fmt.fields >= EventFields::Medium).then(|| Value::from(fmt.data_parallel_rank));
    match fmt.batch_layout {
        BatchLayout::Array => {
            let mut arr = vec![Value::F64(ts), events];
            arr.extend(rank);
            Value::Array(arr)
        }
        BatchLayout::Map => {
            let mut map = vec![(s("ts"), Value::F64(ts)), (s("events"), events)];
            map.extend(rank.map(|r| (s("data_parallel_rank"), r)));
            Value::Map(map)
        }
    }
}

/// Encode a batch to payload bytes.
pub fn encode_batch(ts: f64, events: &[CacheEvent], fmt: &WireFormat) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 64);
    rmpv::encode::write_value(&mut out, &batch_value(ts, events, fmt))
        .expect("writing msgpack to a Vec cannot fail");
    out
}

/// The payload a corruption fault sends instead: the first half of the real one, so the outer
/// array (whose last element ends the payload) is always truncated and no decoder accepts it.
pub fn corrupt_payload(payload: &[u8]) -> Vec<u8> {
    payload[..payload.len() / 2].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn stored() -> CacheEvent {
        CacheEvent::Stored {
            block_hashes: vec![1],
            parent_block_hash: None,
            token_ids: vec![1, 2],
            block_size: 2,
        }
    }

    /// Golden bytes worked out by hand from msgspec's encoding rules.
    #[test]
    fn golden_array_layout() {
        let fmt = WireFormat::default(); // array, u64, up to lora_name, rank 0
        let b = encode_batch(1.5, &[stored()], &fmt);
        // 93 [ts, events, rank]; cb 3ff8.. = 1.5; 91 one event; 98 = 8 elements:
        // "BlockStored" [1] nil [1,2] 2 nil "GPU" nil; then rank 0.
        let want = concat!(
            "93",
            "cb3ff8000000000000",
            "91",
            "98",
            "ab426c6f636b53746f726564",
            "9101",
            "c0",
            "920102",
            "02",
            "c0",
            "a3475055",
            "c0",
            "00"
        );
        assert_eq!(hex(&b), want);
    }

    #[test]
    fn golden_map_layout_removed_and_cleared() {
        let fmt = WireFormat {
            layout: EventLayout::Map,
            ..WireFormat::default()
        };
        let b = encode_batch(
            0.0,
            &[
                CacheEvent::Removed {
                    block_hashes: vec![300],
                },
                CacheEvent::AllCleared,
            ],
            &fmt,
        );
        let want = concat!(
            "93",
            "cb0000000000000000",
            "92",
            // {"type": "BlockRemoved", "block_hashes": [300], "medium": "GPU"}
            "83",
            "a474797065",
            "ac426c6f636b52656d6f766564",
            "ac626c6f636b5f686173686573",
            "91cd012c",
            "a66d656469756d",
            "a3475055",
            // {"type": "AllBlocksCleared"}
            "81",
            "a474797065",
            "b0416c6c426c6f636b73436c6561726564",
            "00"
        );
        assert_eq!(hex(&b), want);
    }

    #[test]
    fn array_writes_every_declared_field_map_omits_defaults() {
        let base = WireFormat {
            fields: EventFields::Base,
            ..WireFormat::default()
        };
        let v = batch_value(1.0, &[stored()], &base);
        let arr = v.as_array().unwrap();
        assert_eq!(arr.len(), 2, "no data_parallel_rank before it existed");
        assert_eq!(arr[1][0].as_array().unwrap().len(), 6);

        let ext = WireFormat {
            fields: EventFields::Extended,
            ..WireFormat::default()
        };
        let v = event_value(&stored(), &ext);
        let a = v.as_array().unwrap();
        // tag + 11 fields; sliding_window (default None) still written, as nil.
        assert_eq!(a.len(), 12);
        assert_eq!(a[8], Value::Array(vec![Value::Nil]));
        assert_eq!(a[10].as_str(), Some("full_attention"));
        assert_eq!(a[11], Value::Nil);
        let removed = event_value(
            &CacheEvent::Removed {
                block_hashes: vec![1],
            },
            &ext,
        );
        assert_eq!(removed.as_array().unwrap().len(), 4);
        let m = event_value(
            &stored(),
            &WireFormat {
                layout: EventLayout::Map,
                ..ext
            },
        );
        let keys: Vec<&str> = m
            .as_map()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str().unwrap())
            .collect();
        assert_eq!(
            keys,
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
                "group_idx",
                "kv_cache_spec_kind"
            ]
        );
    }

    #[test]
    fn hash_representations() {
        let h = u64::MAX - 1;
        assert_eq!(wire_hash(h, HashRepr::U64).as_u64(), Some(h));
        assert_eq!(wire_hash(h, HashRepr::I64).as_i64(), Some(-2));
        let b = hash_bytes32(h);
        assert_eq!(&b[24..], &h.to_be_bytes());
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &wire_hash(h, HashRepr::Bytes32)).unwrap();
        assert_eq!(&out[..2], &[0xc4, 32]);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &wire_hash(h, HashRepr::U64)).unwrap();
        assert_eq!(out[0], 0xcf);
    }

    #[test]
    fn batch_map_layout_and_corruption() {
        let fmt = WireFormat {
            batch_layout: BatchLayout::Map,
            ..WireFormat::default()
        };
        let v = batch_value(2.0, &[], &fmt);
        let keys: Vec<&str> = v
            .as_map()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str().unwrap())
            .collect();
        assert_eq!(keys, ["ts", "events", "data_parallel_rank"]);
        let p = encode_batch(2.0, &[stored()], &WireFormat::default());
        let bad = corrupt_payload(&p);
        assert!(rmpv::decode::read_value(&mut &bad[..]).is_err());
    }
}
