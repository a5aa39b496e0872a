//! Tests of `residency`.

use super::*;
use proptest::prelude::*;
use std::collections::HashMap as StdMap;

const BS: u32 = 4;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], medium: Option<Medium>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|h| BlockHash(*h)).collect(),
        parent_block_hash: parent.map(BlockHash),
        token_ids: tokens.to_vec(),
        block_size: BS,
        lora_id: None,
        medium,
        lora_name: None,
        extra_keys: None,
        group_idx: None,
    })
}

fn removed(hashes: &[u64], medium: Option<Medium>) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|h| BlockHash(*h)).collect(),
        medium,
        group_idx: None,
    })
}

fn toks(n_blocks: u32, base: u32) -> Vec<u32> {
    (0..n_blocks * BS).map(|i| base + i).collect()
}

#[test]
fn learns_chain_and_matches_leading_blocks() {
    let idx = ResidencyIndex::new(100);
    let t = toks(3, 100);
    // First two blocks in one event, the third chained by parent hash.
    idx.apply(&[stored(&[11, 12], None, &t[..8], Some(Medium::Gpu))]);
    idx.apply(&[stored(&[13], Some(12), &t[8..], None)]);
    assert_eq!(idx.block_size(), Some(BS));
    assert_eq!(idx.block_count(), 3);
    let mut req = t.clone();
    req.extend([1, 2, 3]); // a partial trailing block is ignored
    let m = idx.match_prefix(&req, None);
    assert_eq!((m.gpu_blocks, m.any_tier_blocks, m.total_blocks), (3, 3, 3));
    assert_eq!(idx.match_blocks(&req, BS as usize), 3);
    assert_eq!(
        idx.match_blocks(&req, 8),
        0,
        "other block size never matches"
    );
    // A different second block stops the match after the first.
    let mut other = t.clone();
    other[5] = 9999;
    assert_eq!(idx.match_blocks(&other, BS as usize), 1);
    // Removing the middle block cuts the prefix there.
    idx.apply(&[removed(&[12], None)]);
    assert_eq!(idx.match_blocks(&t, BS as usize), 1);
    // Re-storing it (same parent, same tokens) restores the whole chain.
    idx.apply(&[stored(&[12], Some(11), &t[4..8], None)]);
    assert_eq!(idx.match_blocks(&t, BS as usize), 3);
    idx.check_invariants();
}

#[test]
fn evictions_are_remembered_with_their_stamp() {
    let idx = ResidencyIndex::new(100);
    let t = toks(2, 300);
    let chain = PrefixChain::new(&t, BS, None);
    let [h0, h1] = [chain.hashes()[0], chain.hashes()[1]];
    idx.apply(&[stored(&[21, 22], None, &t, None)]);
    let before = idx.stamp();
    idx.with_evictions(|gone| assert_eq!((gone(h0), gone(h1)), (None, None)));
    idx.apply(&[removed(&[22], None)]);
    idx.with_evictions(|gone| {
        assert_eq!(gone(h0), None);
        assert!(
            gone(h1).is_some_and(|at| at > before),
            "evicted after `before`"
        );
    });
    let after = idx.stamp();
    idx.with_evictions(|gone| assert!(gone(h1).is_some_and(|at| at <= after)));
}

#[test]
fn stores_are_idempotent_and_removal_is_exact() {
    let idx = ResidencyIndex::new(100);
    let t = toks(2, 0);
    for _ in 0..3 {
        idx.apply(&[stored(&[1, 2], None, &t, None)]);
    }
    assert_eq!(idx.block_count(), 2);
    assert_eq!(idx.entry_count(), 2);
    let s = idx.apply(&[
        removed(&[2], None),
        removed(&[2], None),
        removed(&[77], None),
    ]);
    assert_eq!((s.blocks_removed, s.unknown_removals), (1, 2));
    assert_eq!(idx.block_count(), 1);
    assert_eq!(
        idx.entry_count(),
        2,
        "removed mapping remembered for parents"
    );
    idx.check_invariants();
}

#[test]
fn cpu_tier_never_drops_gpu_residency() {
    let idx = ResidencyIndex::new(100);
    let t = toks(2, 0);
    idx.apply(&[stored(&[1, 2], None, &t, Some(Medium::Gpu))]);
    // Offloading connector: token-less CPU copies, then their removal.
    let cpu_copy = KvEvent::BlockStored(BlockStored {
        block_size: 0,
        ..match stored(&[1, 2, 3], None, &[], Some(Medium::Cpu)) {
            KvEvent::BlockStored(s) => s,
            _ => unreachable!(),
        }
    });
    let s = idx.apply(&[cpu_copy]);
    assert_eq!(
        (s.blocks_stored, s.orphan_stores),
        (2, 1),
        "unknown hash 3 skipped"
    );
    assert!(idx.tiers(0, BlockHash(1)).contains(&Medium::Cpu));
    idx.apply(&[removed(&[1, 2], Some(Medium::Cpu))]);
    assert_eq!(idx.match_blocks(&t, BS as usize), 2);
    // GPU eviction with a CPU copy left: offloaded, not on GPU.
    idx.apply(&[stored(&[1], None, &t[..4], Some(Medium::Cpu))]);
    idx.apply(&[removed(&[1], Some(Medium::Gpu))]);
    let m = idx.match_prefix(&t, None);
    assert_eq!((m.gpu_blocks, m.any_tier_blocks), (0, 2));
    idx.check_invariants();
}

#[test]
fn lora_chains_and_salted_blocks_stay_apart() {
    let idx = ResidencyIndex::new(100);
    let t = toks(1, 0);
    let KvEvent::BlockStored(base) = stored(&[1], None, &t, None) else {
        unreachable!()
    };
    idx.apply(&[KvEvent::BlockStored(BlockStored {
        block_hashes: vec![BlockHash(2)],
        lora_name: Some("sql".into()),
        extra_keys: Some(vec![Some(vec![ExtraKey::Str("sql".into())])]),
        ..base.clone()
    })]);
    assert_eq!(idx.match_prefix(&t, None).gpu_blocks, 0);
    assert_eq!(idx.match_prefix(&t, Some("sql")).gpu_blocks, 1);
    assert_eq!(idx.match_prefix(&t, Some("other")).gpu_blocks, 0);
    // A salted block is never matched by token ids alone.
    idx.apply(&[KvEvent::BlockStored(BlockStored {
        block_hashes: vec![BlockHash(3)],
        extra_keys: Some(vec![Some(vec![ExtraKey::Str("salt".into())])]),
        ..base.clone()
    })]);
    assert_eq!(idx.match_prefix(&t, None).gpu_blocks, 0);
    idx.apply(&[KvEvent::BlockStored(base)]);
    assert_eq!(idx.match_prefix(&t, None).gpu_blocks, 1);
}

#[test]
fn skips_orphans_misaligned_and_foreign_sizes() {
    let idx = ResidencyIndex::new(100);
    let s = idx.apply(&[stored(&[5], Some(4), &toks(1, 0), None)]);
    assert_eq!(s.orphan_stores, 1);
    let s = idx.apply(&[stored(&[5, 6], None, &toks(1, 0), None)]);
    assert_eq!(s.misaligned_stores, 1);
    assert_eq!(idx.block_size(), None);
    idx.apply(&[stored(&[1], None, &toks(1, 0), None)]);
    let KvEvent::BlockStored(e) = stored(&[9], None, &toks(2, 0), None) else {
        unreachable!()
    };
    let s = idx.apply(&[KvEvent::BlockStored(BlockStored {
        block_size: 2 * BS,
        ..e
    })]);
    assert_eq!(s.foreign_block_size_stores, 1);
    assert_eq!(idx.block_size(), Some(BS));
}

#[test]
fn clear_and_all_blocks_cleared() {
    let idx = ResidencyIndex::new(100);
    let t = toks(2, 0);
    idx.apply(&[stored(&[1, 2], None, &t, None), KvEvent::AllBlocksCleared]);
    assert_eq!((idx.block_count(), idx.entry_count()), (0, 0));
    assert_eq!(
        idx.block_size(),
        Some(BS),
        "AllBlocksCleared keeps the block size"
    );
    idx.apply(&[stored(&[1, 2], None, &t, None)]);
    idx.clear();
    assert_eq!(idx.block_size(), None);
    assert_eq!(idx.match_blocks(&t, BS as usize), 0);
}

#[test]
fn the_cache_size_is_the_most_blocks_resident_once_the_replica_evicts() {
    let idx = ResidencyIndex::new(100);
    // Five blocks stored on GPU, one chain: the replica is filling, its size is unknown.
    let t = toks(5, 0);
    idx.apply(&[stored(&[1, 2, 3], None, &t[..12], None)]);
    idx.apply(&[stored(&[4, 5], Some(3), &t[12..], Some(Medium::Gpu))]);
    assert_eq!(idx.capacity_tokens(), None);
    // Removals that are no GPU eviction say nothing: a CPU copy's, an unknown block's.
    idx.apply(&[
        stored(&[4], None, &[], Some(Medium::Cpu)),
        removed(&[4], Some(Medium::Cpu)),
        removed(&[99], None),
    ]);
    assert_eq!(idx.capacity_tokens(), None);
    // The first GPU eviction: the cache held 5 blocks of 4 tokens when full.
    let size = |blocks: usize| Some(blocks * BS as usize);
    idx.apply(&[removed(&[5], None)]);
    assert_eq!(idx.capacity_tokens(), size(5));
    // Refilling to 6 (a running request's blocks completed) raises it; later removals do not
    // lower it.
    idx.apply(&[stored(&[6, 7], None, &toks(2, 500), None)]);
    assert_eq!(idx.capacity_tokens(), size(6));
    idx.apply(&[removed(&[1, 2, 3], None)]);
    assert_eq!(idx.capacity_tokens(), size(6));
    // After a gap (clear) the replica still holds blocks the new count never sees: the size
    // stays, and the new count may only raise it.
    idx.clear();
    assert_eq!(idx.capacity_tokens(), size(6));
    idx.apply(&[
        stored(&[8, 9], None, &toks(2, 900), None),
        removed(&[8], None),
    ]);
    assert_eq!(idx.capacity_tokens(), size(6));
    idx.apply(&[stored(
        &[10, 11, 12, 13, 14, 15],
        Some(9),
        &toks(6, 950),
        None,
    )]);
    assert_eq!(idx.capacity_tokens(), size(7));
    // After a restart the cache starts empty: the old size holds until the new count has
    // seen an eviction, which then replaces it, smaller or not.
    idx.restart();
    assert_eq!(idx.capacity_tokens(), size(7));
    idx.apply(&[stored(&[20, 21], None, &toks(2, 700), None)]);
    assert_eq!(idx.capacity_tokens(), size(7));
    idx.apply(&[removed(&[21], None)]);
    assert_eq!(idx.capacity_tokens(), size(2));
    // AllBlocksCleared (vLLM reset every block) also starts a count that replaces the size;
    // an eviction in the same batch before it still counts for the count it ends.
    idx.apply(&[
        stored(&[30, 31, 32], None, &toks(3, 300), None),
        removed(&[30], None),
        KvEvent::AllBlocksCleared,
        stored(&[40], None, &toks(1, 400), None),
    ]);
    assert_eq!(idx.capacity_tokens(), size(4));
    idx.apply(&[removed(&[40], None)]);
    assert_eq!(idx.capacity_tokens(), size(1));
    // The index's own cap dropping entries is no eviction by the replica, and the count
    // never passes the cap.
    let capped = ResidencyIndex::new(2);
    capped.apply(&[stored(&[1, 2, 3], None, &toks(3, 0), None)]);
    assert_eq!(capped.capacity_tokens(), None);
    capped.apply(&[removed(&[3], None)]);
    assert_eq!(capped.capacity_tokens(), size(2));
}

#[test]
fn eviction_prefers_removed_then_oldest() {
    let idx = ResidencyIndex::new(3);
    let t = toks(1, 0);
    let u = toks(1, 50);
    let v = toks(1, 90);
    idx.apply(&[stored(&[1], None, &t, None), stored(&[2], None, &u, None)]);
    idx.apply(&[removed(&[1], None)]); // 1 remembered, 2 resident
    idx.apply(&[stored(&[3], None, &v, None)]);
    let s = idx.apply(&[stored(&[4], Some(3), &t, None)]);
    assert_eq!(s.evictions, 1);
    assert_eq!(idx.entry_count(), 3);
    assert!(
        idx.tiers(0, BlockHash(2)).gpu(),
        "resident survives while removed go first"
    );
    let s = idx.apply(&[stored(&[5], Some(4), &u, None)]);
    assert_eq!(s.evictions, 1);
    assert!(
        !idx.tiers(0, BlockHash(2)).any(),
        "then the least recently stored"
    );
    idx.check_invariants();
}

/// Regression: a reload lowering `kv_events.max_blocks` was accepted but ignored
/// (the index kept its creation-time cap).
#[test]
fn lowering_the_cap_evicts_down_to_it_removed_first() {
    let idx = ResidencyIndex::new(8);
    let (t, u, v) = (toks(1, 0), toks(1, 50), toks(1, 90));
    idx.apply(&[
        stored(&[1], None, &t, None),
        stored(&[2], None, &u, None),
        stored(&[3], None, &v, None),
        stored(&[4], Some(3), &t, None),
    ]);
    idx.apply(&[removed(&[3], None)]); // 3 remembered, 1, 2, 4 resident
    assert_eq!(idx.set_max_entries(2), 2);
    assert_eq!((idx.max_entries(), idx.entry_count()), (2, 2));
    assert!(!idx.tiers(0, BlockHash(3)).any(), "removed goes first");
    assert!(!idx.tiers(0, BlockHash(1)).any(), "then the oldest");
    assert!(idx.tiers(0, BlockHash(2)).gpu() && idx.tiers(0, BlockHash(4)).gpu());
    idx.check_invariants();
    // The new cap holds for later stores; raising it evicts nothing.
    let s = idx.apply(&[stored(&[5], None, &t, None)]);
    assert_eq!((s.evictions, idx.entry_count()), (1, 2));
    assert_eq!(idx.set_max_entries(10), 0);
    idx.apply(&[stored(&[6], None, &u, None)]);
    assert_eq!(idx.entry_count(), 3);
    idx.check_invariants();
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        hashes: Vec<u64>,
        parent: Option<u64>,
        seed: u32,
        tier: u8,
    },
    TierOnly {
        hashes: Vec<u64>,
        tier: u8,
    },
    Remove {
        hashes: Vec<u64>,
        tier: u8,
    },
    Clear,
}

fn medium_of(tier: u8) -> Option<Medium> {
    match tier {
        0 => None,
        1 => Some(Medium::Gpu),
        2 => Some(Medium::Cpu),
        _ => Some(Medium::Storage),
    }
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let hashes = proptest::collection::vec(0u64..24, 1..4);
    prop_oneof![
        5 => (hashes.clone(), proptest::option::of(0u64..24), 0u32..3, 0u8..4)
            .prop_map(|(hashes, parent, seed, tier)| Op::Store { hashes, parent, seed, tier }),
        1 => (hashes.clone(), 1u8..4).prop_map(|(hashes, tier)| Op::TierOnly { hashes, tier }),
        3 => (hashes, 0u8..4).prop_map(|(hashes, tier)| Op::Remove { hashes, tier }),
        1 => Just(Op::Clear),
    ]
}

fn to_event(op: &Op) -> KvEvent {
    match op {
        Op::Store {
            hashes,
            parent,
            seed,
            tier,
        } => {
            let tokens: Vec<u32> = (0..hashes.len() as u32 * BS)
                .map(|i| seed * 1000 + i)
                .collect();
            stored(hashes, *parent, &tokens, medium_of(*tier))
        }
        Op::TierOnly { hashes, tier } => stored(hashes, None, &[], medium_of(*tier)),
        Op::Remove { hashes, tier } => removed(hashes, medium_of(*tier)),
        Op::Clear => KvEvent::AllBlocksCleared,
    }
}

/// Reference model without a cap: hash → tier bits (0 = remembered after removal).
fn model_apply(model: &mut StdMap<u64, u8>, op: &Op) {
    let bit = |t: u8| tier_bit(medium_of(t).as_ref());
    match op {
        Op::Store {
            hashes,
            parent,
            tier,
            ..
        } => {
            if parent.is_some_and(|p| !model.contains_key(&p)) {
                return;
            }
            for h in hashes {
                *model.entry(*h).or_insert(0) |= bit(*tier);
            }
        }
        Op::TierOnly { hashes, tier } => {
            for h in hashes {
                if let Some(t) = model.get_mut(h) {
                    *t |= bit(*tier);
                }
            }
        }
        Op::Remove { hashes, tier } => {
            for h in hashes {
                if let Some(t) = model.get_mut(h) {
                    *t &= !bit(*tier);
                }
            }
        }
        Op::Clear => model.clear(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn cap_is_never_exceeded(
        ops in proptest::collection::vec(op_strategy(), 1..80),
        cap in 1usize..12,
        recap in proptest::option::of((0usize..80, 1usize..12)),
    ) {
        let idx = ResidencyIndex::new(cap);
        let mut cap = cap;
        for (i, op) in ops.iter().enumerate() {
            // A reload may change the cap between batches.
            if let Some((_, new_cap)) = recap.filter(|&(at, _)| at == i) {
                idx.set_max_entries(new_cap);
                cap = new_cap;
                prop_assert!(idx.entry_count() <= cap);
            }
            idx.apply(&[to_event(op)]);
            prop_assert!(idx.entry_count() <= cap);
            idx.check_invariants();
        }
    }

    #[test]
    fn residency_matches_the_reference_model(ops in proptest::collection::vec(op_strategy(), 1..80)) {
        let idx = ResidencyIndex::new(1_000);
        let mut model = StdMap::new();
        for op in &ops {
            idx.apply(&[to_event(op)]);
            model_apply(&mut model, op);
        }
        idx.check_invariants();
        for h in 0u64..24 {
            let want = model.get(&h).copied().unwrap_or(0);
            prop_assert_eq!(idx.tiers(0, BlockHash(h)).0, want, "hash {}", h);
        }
        let gpu: usize = model.values().filter(|t| **t & TIER_GPU != 0).count();
        prop_assert_eq!(idx.block_count(), gpu);
    }

    #[test]
    fn offloaded_tier_events_never_touch_gpu(
        ops in proptest::collection::vec((proptest::collection::vec(0u64..8, 1..4), 2u8..4, any::<bool>()), 0..40)
    ) {
        let idx = ResidencyIndex::new(1_000);
        let t = toks(4, 7);
        idx.apply(&[stored(&[0, 1, 2, 3], None, &t, Some(Medium::Gpu))]);
        for (hashes, tier, store) in &ops {
            let op = if *store {
                Op::TierOnly { hashes: hashes.clone(), tier: *tier }
            } else {
                Op::Remove { hashes: hashes.clone(), tier: *tier }
            };
            idx.apply(&[to_event(&op)]);
        }
        prop_assert_eq!(idx.match_blocks(&t, BS as usize), 4);
        prop_assert_eq!(idx.block_count(), 4);
    }
}
