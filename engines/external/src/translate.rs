//! An engine's KV events in our block identity, as the engine seam's
//! [`KvCacheEvent`]s, so the worker publishes them like any engine's and
//! the router keeps one index whatever the engines are.
//!
//! **How engine blocks map onto ours.** An engine names a block by its own
//! hash, over its own block size. We rehash: a `BlockStored` carries the
//! tokens of the blocks it stores and the engine hash of their parent, and
//! we keep, per engine block, where our chain stands after its tokens: the
//! [`SequenceHash`] of our last full block, and the tokens past it (fewer
//! than our block size). A stored engine block continues its parent's
//! chain with its tokens, and every full block of ours it completes is
//! stored under our hash ([`dynamo_bus_schema::blocks`], the gateway's
//! hashing). So:
//! - an engine block size that is a multiple of ours completes several of
//!   our blocks per engine block;
//! - a smaller one (SGLang's page size of 1) completes one of ours every
//!   few engine blocks;
//! - any other size works the same way: our blocks straddle the engine's.
//!
//! An engine block *owns* the blocks of ours it completed. A block of ours
//! is counted per tier, once per copy of an engine block that owns it:
//! engines may cache the same block twice (vLLM does not de-duplicate), and
//! two engine hashes may cover the same tokens (a cache salt, extra keys).
//! It is removed from a tier when its count there reaches zero. An engine
//! block is forgotten once no copy of it is on any tier. The counts are
//! the engine's block table in our hashes, so a [`Translator::snapshot`]
//! answers the router's dump requests.
//!
//! **Hybrid models.** vLLM publishes the events of each KV cache group of
//! a hybrid model (full attention beside sliding-window or Mamba layers):
//! the same tokens stored once per group, under the same hashes, and
//! removed per group, a sliding window's soon after they leave its window.
//! Only a prefix-cache group (`full_attention`, `mla_attention`,
//! `sink_full_attention`) says which prefixes a worker holds. One group is
//! indexed: the first prefix-cache group a store names (a model may split
//! its full-attention layers into several groups, which hold the same
//! prefixes; counting their copies together would keep a block while any
//! one of them has it). The other groups' events are skipped and counted.
//! A store names its group's kind, and the kind is remembered per
//! `group_idx` for the removals, which name only the index.
//!
//! Without any kind (vLLM releases before it sent one), group 0 is taken as
//! the prefix cache, as NVIDIA Dynamo also does. That is a guess: vLLM
//! orders groups by their first layer, and models whose first layer is
//! sliding-window or linear attention (Gemma 3, GPT-OSS, Qwen3-Next) put
//! full attention elsewhere. The first kindless event of another group is
//! logged at warn, saying so.
//!
//! **Stores without tokens** (vLLM's offloading connector, copying blocks
//! to CPU or disk) name engine blocks already stored: each gains a copy on
//! that tier, and the blocks of ours it owns are announced there. One
//! whose tokens do not fill its blocks (a sliding window's null blocks) is
//! refused where it would be indexed, and counted as invalid.
//!
//! A LoRA block is salted with the adapter's name, as the gateway salts
//! it. An engine that gives only its process-local adapter id is skipped
//! and counted: that id names different adapters on different workers.
//!
//! Invariants: an event refers only to engine blocks this translator has
//! seen stored, or it is skipped and counted ([`Counts`]); at most
//! [`MAX_TRACKED`] engine blocks are tracked (past it, stores are skipped
//! and counted, and the router's view is incomplete, never wrong); our
//! event ids rise by one per emitted event.

use crate::events::{CacheGroup, EngineEvent, EngineHash};
use dynamo_bus_schema::blocks::{chain, hash_salt, local_block_hash, SequenceHash};
use dynamo_engine::{KvCacheEvent, KvCacheEventData, KvSnapshot, KvTier};
use std::collections::HashMap;

/// Most engine blocks tracked at once.
pub const MAX_TRACKED: usize = 1 << 22;

/// Most KV cache groups whose kind is remembered (models have a handful).
pub const MAX_GROUPS: usize = 64;

/// Kinds of KV cache group that hold a prefix cache the router indexes.
pub const PREFIX_KINDS: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];

fn is_prefix_kind(kind: &str) -> bool {
    PREFIX_KINDS.iter().any(|k| k.eq_ignore_ascii_case(kind))
}

/// Where our chain stands after one engine block.
#[derive(Clone, Debug)]
struct Chain {
    last: Option<SequenceHash>,
    tail: Vec<u32>,
    /// Our blocks this engine block completed.
    owns: Vec<SequenceHash>,
    /// Copies of it per tier (device, host, disk).
    copies: [u32; 3],
}

/// What was skipped, by reason.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Stores whose parent was never seen stored.
    pub unknown_parent: u64,
    /// Removals of blocks never seen stored.
    pub unknown_block: u64,
    /// Events with a `medium` we do not know.
    pub unknown_medium: u64,
    /// Events of a type we do not know.
    pub unknown_event: u64,
    /// Events that did not decode.
    pub invalid_event: u64,
    /// Stores past [`MAX_TRACKED`].
    pub over_limit: u64,
    /// LoRA stores with an adapter id and no adapter name.
    pub unnamed_lora: u64,
    /// Stores of a known engine block whose tokens chain differently from
    /// its first store (the first is kept).
    pub rechained: u64,
    /// Events of a KV cache group that is not the prefix cache (a hybrid
    /// model's sliding-window or Mamba layers).
    pub other_group: u64,
}

impl Counts {
    /// Every counter, by its field's name.
    pub fn named(&self) -> [(&'static str, u64); 9] {
        [
            ("unknown_parent", self.unknown_parent),
            ("unknown_block", self.unknown_block),
            ("unknown_medium", self.unknown_medium),
            ("unknown_event", self.unknown_event),
            ("invalid_event", self.invalid_event),
            ("over_limit", self.over_limit),
            ("unnamed_lora", self.unnamed_lora),
            ("rechained", self.rechained),
            ("other_group", self.other_group),
        ]
    }

    /// All events skipped, whatever the reason.
    pub fn total(&self) -> u64 {
        self.named()
            .iter()
            .fold(0u64, |a, (_, n)| a.saturating_add(*n))
    }
}

/// One engine's events → our [`KvCacheEvent`]s.
pub struct Translator {
    model: String,
    block_size: usize,
    blocks: HashMap<EngineHash, Chain>,
    /// Copies per (tier, our block) of the engine blocks that own it.
    refs: HashMap<(usize, SequenceHash), u32>,
    /// Whether each KV cache group seen with a kind is a prefix cache.
    groups: HashMap<i64, bool>,
    /// The group indexed: the first prefix-cache group a store named.
    indexed: Option<i64>,
    /// Whether the kindless guess (group 0) was warned about.
    guessed: bool,
    next_id: u64,
    pub skipped: Counts,
}

/// An engine's `medium` as our tier (`None`: GPU, the default).
pub fn tier(medium: Option<&str>) -> Option<KvTier> {
    match medium.map(str::to_ascii_lowercase).as_deref() {
        None | Some("gpu") | Some("cuda") | Some("device") | Some("hbm") => Some(KvTier::Device),
        Some("cpu") | Some("host") | Some("cpu_pinned") => Some(KvTier::Host),
        Some("disk") | Some("ssd") | Some("local_disk") => Some(KvTier::Disk),
        Some(_) => None,
    }
}

fn slot(t: KvTier) -> usize {
    match t {
        KvTier::Device => 0,
        KvTier::Host => 1,
        KvTier::Disk => 2,
    }
}

impl Translator {
    /// For `model`'s blocks of `block_size` tokens (the gateway's hashing).
    pub fn new(model: &str, block_size: usize) -> Self {
        Translator {
            model: model.to_string(),
            block_size: block_size.max(1),
            blocks: HashMap::new(),
            refs: HashMap::new(),
            groups: HashMap::new(),
            indexed: None,
            guessed: false,
            next_id: 0,
            skipped: Counts::default(),
        }
    }

    /// Engine blocks tracked now.
    pub fn tracked(&self) -> usize {
        self.blocks.len()
    }

    /// The id of the last event emitted (0 before any).
    pub fn last_event_id(&self) -> u64 {
        self.next_id
    }

    fn emit(&mut self, tier: KvTier, data: KvCacheEventData) -> KvCacheEvent {
        self.next_id += 1;
        KvCacheEvent {
            event_id: self.next_id,
            tier,
            data,
        }
    }

    /// The block table in our hashes, consistent with the events emitted.
    pub fn snapshot(&self) -> KvSnapshot {
        let mut tiers: [Vec<SequenceHash>; 3] = Default::default();
        for (tier, h) in self.refs.keys() {
            tiers[*tier].push(*h);
        }
        let [device, host, disk] = tiers;
        KvSnapshot {
            last_event_id: self.next_id,
            blocks: device,
            offloaded: [(KvTier::Host, host), (KvTier::Disk, disk)]
                .into_iter()
                .filter(|(_, b)| !b.is_empty())
                .collect(),
        }
    }

    /// Whether an event of `g` is of the group indexed (learning the kind
    /// of its group where it names one).
    fn indexed_group(&mut self, g: &CacheGroup) -> bool {
        match (&g.kind, g.idx) {
            // A model with one group.
            (None, None) => true,
            (Some(kind), None) => is_prefix_kind(kind),
            (Some(kind), Some(i)) => {
                let prefix = is_prefix_kind(kind);
                if self.groups.len() < MAX_GROUPS || self.groups.contains_key(&i) {
                    self.groups.insert(i, prefix);
                }
                prefix && *self.indexed.get_or_insert(i) == i
            }
            (None, Some(i)) => match self.groups.get(&i) {
                Some(_) => self.indexed == Some(i),
                // Kinds were sent, but not for this group: not the one.
                None if !self.groups.is_empty() => false,
                None => {
                    if i != 0 && !self.guessed {
                        self.guessed = true;
                        tracing::warn!(
                            group_idx = i,
                            "KV events of several cache groups and no kv_cache_spec_kind: group 0 is taken as the prefix cache, which is wrong for models whose first layer is not full attention; use a vLLM that sends kinds"
                        );
                    }
                    i == 0
                }
            },
        }
    }

    /// The tier of an event of the group indexed, with a medium we know;
    /// none (counted) otherwise.
    fn indexed_tier(&mut self, group: &CacheGroup, medium: Option<&str>) -> Option<KvTier> {
        if !self.indexed_group(group) {
            self.skipped.other_group += 1;
            return None;
        }
        let t = tier(medium);
        if t.is_none() {
            self.skipped.unknown_medium += 1;
        }
        t
    }

    /// Our events for one engine event (none when it changes nothing of
    /// ours, or is skipped).
    pub fn translate(&mut self, e: &EngineEvent) -> Vec<KvCacheEvent> {
        match e {
            EngineEvent::Stored {
                hashes,
                parent,
                token_ids,
                block_size,
                lora_id,
                lora_name,
                medium,
                group,
            } => {
                let Some(t) = self.indexed_tier(group, medium.as_deref()) else {
                    return Vec::new();
                };
                if token_ids.is_empty() {
                    return self.copied(hashes, t);
                }
                if token_ids.len() != hashes.len() * *block_size as usize {
                    self.skipped.invalid_event += 1;
                    tracing::debug!(
                        tokens = token_ids.len(),
                        blocks = hashes.len(),
                        block_size,
                        "KV store whose tokens do not fill its blocks; skipped"
                    );
                    return Vec::new();
                }
                if lora_name.is_none() && lora_id.is_some_and(|i| i > 0) {
                    self.skipped.unnamed_lora += 1;
                    return Vec::new();
                }
                let salt = hash_salt(&self.model, lora_name.as_deref());
                self.stored(hashes, *parent, token_ids, *block_size as usize, t, salt)
            }
            EngineEvent::Removed {
                hashes,
                medium,
                group,
            } => {
                let Some(t) = self.indexed_tier(group, medium.as_deref()) else {
                    return Vec::new();
                };
                self.removed(hashes, t)
            }
            EngineEvent::Cleared => {
                self.blocks.clear();
                self.refs.clear();
                vec![self.emit(KvTier::Device, KvCacheEventData::Cleared)]
            }
            EngineEvent::Unknown(_) => {
                self.skipped.unknown_event += 1;
                Vec::new()
            }
            EngineEvent::Invalid(why) => {
                self.skipped.invalid_event += 1;
                tracing::warn!(why, "KV event does not decode; skipped");
                Vec::new()
            }
        }
    }

    fn stored(
        &mut self,
        hashes: &[EngineHash],
        parent: Option<EngineHash>,
        tokens: &[u32],
        engine_bs: usize,
        t: KvTier,
        salt: u64,
    ) -> Vec<KvCacheEvent> {
        let mut at = match parent {
            None => Chain {
                last: None,
                tail: Vec::new(),
                owns: Vec::new(),
                copies: [0; 3],
            },
            Some(p) => match self.blocks.get(&p) {
                Some(c) => c.clone(),
                None => {
                    self.skipped.unknown_parent += 1;
                    return Vec::new();
                }
            },
        };
        let first_parent = at.last;
        let mut ours = Vec::new();
        for (i, h) in hashes.iter().enumerate() {
            let Some(block) = tokens.get(i * engine_bs..(i + 1) * engine_bs) else {
                break; // the decoder checked the lengths
            };
            if !self.blocks.contains_key(h) && self.blocks.len() >= MAX_TRACKED {
                // Untracked blocks are never announced: they could not be
                // taken back.
                self.skipped.over_limit += 1;
                break;
            }
            let mut owns = Vec::new();
            at.tail.extend_from_slice(block);
            while at.tail.len() >= self.block_size {
                let rest = at.tail.split_off(self.block_size);
                let ours_h = chain(at.last, local_block_hash(&at.tail, salt), salt);
                at.tail = rest;
                at.last = Some(ours_h);
                owns.push(ours_h);
            }
            match self.blocks.get_mut(h) {
                Some(c) if c.owns != owns || c.last != at.last => {
                    // The same engine hash over other tokens: keep the
                    // first, and go on from it.
                    self.skipped.rechained += 1;
                    at.last = c.last;
                    at.tail = c.tail.clone();
                    continue;
                }
                Some(c) => c.copies[slot(t)] += 1,
                None => {
                    let mut copies = [0; 3];
                    copies[slot(t)] = 1;
                    self.blocks.insert(
                        *h,
                        Chain {
                            last: at.last,
                            tail: at.tail.clone(),
                            owns: owns.clone(),
                            copies,
                        },
                    );
                }
            }
            for o in &owns {
                *self.refs.entry((slot(t), *o)).or_insert(0) += 1;
            }
            ours.extend_from_slice(&owns);
        }
        self.emit_stored(t, first_parent, ours)
    }

    /// `blocks` stored on `t` after `parent`, as one event (none if empty).
    fn emit_stored(
        &mut self,
        t: KvTier,
        parent: Option<SequenceHash>,
        blocks: Vec<SequenceHash>,
    ) -> Vec<KvCacheEvent> {
        if blocks.is_empty() {
            return Vec::new();
        }
        vec![self.emit(t, KvCacheEventData::Stored { parent, blocks })]
    }

    /// A store without tokens: engine blocks already stored (on any tier)
    /// now have a copy on `t` too (vLLM's offloading connector names the
    /// blocks it copied to CPU or disk this way). Blocks never seen stored
    /// are skipped and counted: without tokens they cannot be rehashed.
    fn copied(&mut self, hashes: &[EngineHash], t: KvTier) -> Vec<KvCacheEvent> {
        let mut new = Vec::new();
        for h in hashes {
            let Some(c) = self.blocks.get_mut(h) else {
                self.skipped.unknown_block += 1;
                continue;
            };
            c.copies[slot(t)] += 1;
            for o in &c.owns {
                let r = self.refs.entry((slot(t), *o)).or_insert(0);
                *r += 1;
                if *r == 1 {
                    new.push(*o);
                }
            }
        }
        self.emit_stored(t, None, new)
    }

    fn removed(&mut self, hashes: &[EngineHash], t: KvTier) -> Vec<KvCacheEvent> {
        let mut gone = Vec::new();
        for h in hashes {
            let Some(c) = self.blocks.get_mut(h) else {
                self.skipped.unknown_block += 1;
                continue;
            };
            let n = &mut c.copies[slot(t)];
            if *n == 0 {
                continue; // not on that tier: nothing of ours changes
            }
            *n -= 1;
            for o in &c.owns {
                let key = (slot(t), *o);
                if let Some(r) = self.refs.get_mut(&key) {
                    *r -= 1;
                    if *r == 0 {
                        self.refs.remove(&key);
                        gone.push(*o);
                    }
                }
            }
            if c.copies == [0; 3] {
                self.blocks.remove(h);
            }
        }
        if gone.is_empty() {
            return Vec::new();
        }
        vec![self.emit(t, KvCacheEventData::Removed { blocks: gone })]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_bus_schema::blocks::sequence_hashes;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u32) -> EngineEvent {
        EngineEvent::Stored {
            hashes: hashes.iter().map(|&h| EngineHash(h)).collect(),
            parent: parent.map(EngineHash),
            token_ids: tokens.to_vec(),
            block_size: bs,
            lora_id: None,
            lora_name: None,
            medium: None,
            group: CacheGroup::default(),
        }
    }

    fn stored_blocks(evs: &[KvCacheEvent]) -> Vec<SequenceHash> {
        evs.iter()
            .flat_map(|e| match &e.data {
                KvCacheEventData::Stored { blocks, .. } => blocks.clone(),
                _ => Vec::new(),
            })
            .collect()
    }

    fn parent_of(e: &KvCacheEvent) -> Option<SequenceHash> {
        match &e.data {
            KvCacheEventData::Stored { parent, .. } => *parent,
            _ => panic!("not a store: {e:?}"),
        }
    }

    #[test]
    fn any_engine_block_size_gives_the_gateways_hashes() {
        let tokens: Vec<u32> = (0..96).map(|i| i * 7 + 1).collect();
        let salt = hash_salt("m", None);
        let want = sequence_hashes(&tokens, 16, salt);
        for engine_bs in [1usize, 4, 16, 32, 48, 5] {
            let mut tr = Translator::new("m", 16);
            let mut got = Vec::new();
            let mut parent = None;
            // One engine block per event, as a cache stores a growing prompt.
            for (i, b) in tokens.chunks_exact(engine_bs).enumerate() {
                let h = 1000 + i as u64;
                got.extend(stored_blocks(&tr.translate(&stored(
                    &[h],
                    parent,
                    b,
                    engine_bs as u32,
                ))));
                parent = Some(h);
            }
            let full = tokens.len() / engine_bs * engine_bs / 16;
            assert_eq!(got, want[..full], "engine blocks of {engine_bs}");
        }
    }

    #[test]
    fn removal_takes_the_blocks_an_engine_block_completed() {
        let tokens: Vec<u32> = (0..64).collect();
        let mut tr = Translator::new("m", 16);
        // Two engine blocks of 32: each completes two of ours.
        let evs = tr.translate(&stored(&[1, 2], None, &tokens, 32));
        assert_eq!(evs.len(), 1);
        assert_eq!(parent_of(&evs[0]), None);
        let ours = stored_blocks(&evs);
        assert_eq!(ours.len(), 4);
        // The child on its own: its parent is our fourth block.
        let more: Vec<u32> = (64..96).collect();
        let evs = tr.translate(&stored(&[3], Some(2), &more, 32));
        assert_eq!(parent_of(&evs[0]), Some(ours[3]));
        let child = stored_blocks(&evs);
        let gone = tr.translate(&EngineEvent::Removed {
            hashes: vec![EngineHash(2)],
            medium: Some("GPU".into()),
            group: CacheGroup::default(),
        });
        assert_eq!(
            gone[0].data,
            KvCacheEventData::Removed {
                blocks: ours[2..4].to_vec()
            }
        );
        assert_eq!(tr.tracked(), 2);
        // Event ids rise by one per event.
        assert_eq!(gone[0].event_id, 3);
        // The snapshot is the table the events leave.
        let mut snap = tr.snapshot();
        snap.blocks.sort();
        let mut want = [&ours[..2], &child[..]].concat();
        want.sort();
        assert_eq!((snap.last_event_id, snap.blocks), (3, want));
    }

    #[test]
    fn unknown_references_and_media_are_skipped_and_counted() {
        let mut tr = Translator::new("m", 16);
        let t: Vec<u32> = (0..16).collect();
        assert!(tr.translate(&stored(&[9], Some(8), &t, 16)).is_empty());
        assert!(tr
            .translate(&EngineEvent::Removed {
                hashes: vec![EngineHash(8)],
                medium: None,
                group: CacheGroup::default(),
            })
            .is_empty());
        let mut odd = stored(&[9], None, &t, 16);
        if let EngineEvent::Stored { medium, .. } = &mut odd {
            *medium = Some("tape".into());
        }
        assert!(tr.translate(&odd).is_empty());
        assert!(tr.translate(&EngineEvent::Unknown("Foo".into())).is_empty());
        assert_eq!(
            tr.skipped,
            Counts {
                unknown_parent: 1,
                unknown_block: 1,
                unknown_medium: 1,
                unknown_event: 1,
                invalid_event: 0,
                over_limit: 0,
                unnamed_lora: 0,
                rechained: 0,
                other_group: 0,
            }
        );
        assert_eq!(tr.last_event_id(), 0);
    }

    #[test]
    fn a_block_on_two_tiers_is_kept_until_it_leaves_both() {
        let mut tr = Translator::new("m", 16);
        let t: Vec<u32> = (0..16).collect();
        tr.translate(&stored(&[1], None, &t, 16));
        let mut host = stored(&[1], None, &t, 16);
        if let EngineEvent::Stored { medium, .. } = &mut host {
            *medium = Some("CPU".into());
        }
        let evs = tr.translate(&host);
        assert_eq!(evs[0].tier, KvTier::Host);
        assert_eq!(tr.snapshot().offloaded.len(), 1);
        let rm = |m: &str| EngineEvent::Removed {
            hashes: vec![EngineHash(1)],
            medium: Some(m.into()),
            group: CacheGroup::default(),
        };
        assert_eq!(tr.translate(&rm("GPU"))[0].tier, KvTier::Device);
        assert_eq!(tr.tracked(), 1);
        tr.translate(&rm("cpu"));
        assert_eq!(tr.tracked(), 0);
        let cleared = tr.translate(&EngineEvent::Cleared);
        assert_eq!(cleared[0].data, KvCacheEventData::Cleared);
    }

    #[test]
    fn a_block_held_twice_is_removed_when_both_copies_go() {
        let mut tr = Translator::new("m", 16);
        let t: Vec<u32> = (0..16).collect();
        // The same engine block cached twice, and another engine hash over
        // the same tokens (a cache salt): three copies of one block of ours.
        let ours = stored_blocks(&tr.translate(&stored(&[1], None, &t, 16)));
        tr.translate(&stored(&[1], None, &t, 16));
        assert_eq!(
            stored_blocks(&tr.translate(&stored(&[2], None, &t, 16))),
            ours
        );
        let rm = |h: u64| EngineEvent::Removed {
            hashes: vec![EngineHash(h)],
            medium: None,
            group: CacheGroup::default(),
        };
        assert!(tr.translate(&rm(1)).is_empty());
        assert!(tr.translate(&rm(2)).is_empty());
        assert_eq!(tr.snapshot().blocks, ours);
        let gone = tr.translate(&rm(1));
        assert_eq!(gone[0].data, KvCacheEventData::Removed { blocks: ours });
        assert_eq!((tr.tracked(), tr.snapshot().blocks.len()), (0, 0));
        // A LoRA store named by its adapter is salted with the name; one
        // with only a process-local id is skipped.
        let mut named = stored(&[5], None, &t, 16);
        if let EngineEvent::Stored {
            lora_id, lora_name, ..
        } = &mut named
        {
            (*lora_id, *lora_name) = (Some(3), Some("a".into()));
        }
        let want = sequence_hashes(&t, 16, hash_salt("m", Some("a")));
        assert_eq!(stored_blocks(&tr.translate(&named)), want);
        let mut unnamed = stored(&[6], None, &t, 16);
        if let EngineEvent::Stored { lora_id, .. } = &mut unnamed {
            *lora_id = Some(3);
        }
        assert!(tr.translate(&unnamed).is_empty());
        assert_eq!(tr.skipped.unnamed_lora, 1);
    }

    fn in_group(mut e: EngineEvent, idx: Option<i64>, kind: Option<&str>) -> EngineEvent {
        let g = CacheGroup {
            idx,
            kind: kind.map(str::to_string),
        };
        match &mut e {
            EngineEvent::Stored { group, .. } | EngineEvent::Removed { group, .. } => *group = g,
            _ => {}
        }
        e
    }

    fn removed(h: u64) -> EngineEvent {
        EngineEvent::Removed {
            hashes: vec![EngineHash(h)],
            medium: None,
            group: CacheGroup::default(),
        }
    }

    #[test]
    fn only_the_prefix_cache_group_of_a_hybrid_model_is_indexed() {
        let t: Vec<u32> = (0..32).collect();
        let want = sequence_hashes(&t, 16, hash_salt("m", None));
        // DeepSeek-V4-like: the sliding window is group 0, full attention
        // group 1, and the stores say so. The window's stores and its early
        // removals change nothing of ours; full attention's do.
        let mut tr = Translator::new("m", 16);
        let swa = in_group(
            stored(&[1, 2], None, &t, 16),
            Some(0),
            Some("sliding_window"),
        );
        assert!(tr.translate(&swa).is_empty());
        let full = in_group(
            stored(&[1, 2], None, &t, 16),
            Some(1),
            Some("full_attention"),
        );
        assert_eq!(stored_blocks(&tr.translate(&full)), want);
        // Removals name only the index: the kinds learned from the stores
        // decide.
        assert!(tr
            .translate(&in_group(removed(1), Some(0), None))
            .is_empty());
        assert_eq!(tr.snapshot().blocks.len(), 2);
        let gone = tr.translate(&in_group(removed(2), Some(1), None));
        assert_eq!(
            gone[0].data,
            KvCacheEventData::Removed {
                blocks: vec![want[1]]
            }
        );
        // Mamba state and a kind this build does not know are skipped too.
        let mamba = in_group(stored(&[7], None, &t[..16], 16), Some(2), Some("mamba"));
        assert!(tr.translate(&mamba).is_empty());
        assert!(tr
            .translate(&in_group(removed(1), Some(2), None))
            .is_empty());
        assert_eq!(tr.skipped.other_group, 4);
        assert_eq!(tr.skipped.total(), 4);

        // Without kinds (vLLM before it sent them): group 0 is the prefix
        // cache, any other group is not, and no group at all is a model
        // with one.
        let mut tr = Translator::new("m", 16);
        let g1 = in_group(stored(&[1, 2], None, &t, 16), Some(1), None);
        assert!(tr.translate(&g1).is_empty());
        let g0 = in_group(stored(&[1, 2], None, &t, 16), Some(0), None);
        assert_eq!(stored_blocks(&tr.translate(&g0)), want);
        assert!(tr
            .translate(&in_group(removed(2), Some(1), None))
            .is_empty());
        assert_eq!(tr.translate(&removed(2)).len(), 1);
        assert_eq!(tr.skipped.other_group, 2);
        // MLA is a prefix cache (DeepSeek's one group), whatever its index.
        let mut tr = Translator::new("m", 16);
        let mla = in_group(
            stored(&[1, 2], None, &t, 16),
            Some(3),
            Some("MLA_ATTENTION"),
        );
        assert_eq!(stored_blocks(&tr.translate(&mla)), want);
        assert_eq!(tr.translate(&in_group(removed(2), Some(3), None)).len(), 1);
    }

    #[test]
    fn stores_without_tokens_copy_known_blocks_to_their_tier() {
        let t: Vec<u32> = (0..32).collect();
        let want = sequence_hashes(&t, 16, hash_salt("m", None));
        let mut tr = Translator::new("m", 16);
        tr.translate(&stored(&[1, 2], None, &t, 16));
        // The offloading connector copies engine block 2 to CPU, and an
        // unknown one: block 2's block of ours is now on host too.
        let mut offload = stored(&[2, 9], None, &[], 0);
        if let EngineEvent::Stored { medium, .. } = &mut offload {
            *medium = Some("CPU".into());
        }
        let got = tr.translate(&offload);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].tier, KvTier::Host);
        assert_eq!(
            got[0].data,
            KvCacheEventData::Stored {
                parent: None,
                blocks: vec![want[1]]
            }
        );
        assert_eq!(tr.skipped.unknown_block, 1);
        let snap = tr.snapshot();
        assert_eq!(snap.offloaded, vec![(KvTier::Host, vec![want[1]])]);
        // Evicted from the GPU, it stays on host; removed from the CPU too,
        // the engine block is forgotten.
        let rm = |m: &str| EngineEvent::Removed {
            hashes: vec![EngineHash(2)],
            medium: Some(m.into()),
            group: CacheGroup::default(),
        };
        assert_eq!(tr.translate(&rm("GPU"))[0].tier, KvTier::Device);
        assert_eq!(tr.snapshot().offloaded, vec![(KvTier::Host, vec![want[1]])]);
        assert_eq!(tr.translate(&rm("CPU"))[0].tier, KvTier::Host);
        assert_eq!(tr.tracked(), 1);
        // Tokens that do not fill the blocks (a window's null blocks left
        // out of the hashes): refused and counted.
        assert!(tr.translate(&stored(&[7], None, &t, 16)).is_empty());
        assert_eq!(tr.skipped.invalid_event, 1);
    }

    #[test]
    fn one_of_several_full_attention_groups_is_indexed_and_kinds_outlive_a_clear() {
        let t: Vec<u32> = (0..32).collect();
        let want = sequence_hashes(&t, 16, hash_salt("m", None));
        let mut tr = Translator::new("m", 16);
        // Full attention split in two groups, the same hashes in each: the
        // first named is indexed, so the second's removal changes nothing
        // and the first's takes the block at once.
        let fa = |i| {
            in_group(
                stored(&[1, 2], None, &t, 16),
                Some(i),
                Some("full_attention"),
            )
        };
        assert_eq!(stored_blocks(&tr.translate(&fa(0))), want);
        assert!(tr.translate(&fa(1)).is_empty());
        assert!(tr
            .translate(&in_group(removed(2), Some(1), None))
            .is_empty());
        assert_eq!(tr.translate(&in_group(removed(2), Some(0), None)).len(), 1);
        assert_eq!(tr.skipped.other_group, 2);
        // A clear (or a discontinuity, which clears) keeps what was learned
        // of the groups: the model is the same.
        let swa = in_group(
            stored(&[5], None, &t[..16], 16),
            Some(2),
            Some("sliding_window"),
        );
        assert!(tr.translate(&swa).is_empty());
        tr.translate(&EngineEvent::Cleared);
        assert!(tr
            .translate(&in_group(removed(5), Some(2), None))
            .is_empty());
        assert_eq!(tr.skipped.other_group, 4);
        assert_eq!(tr.skipped.unknown_block, 0, "skipped as another group's");
        // At most MAX_GROUPS kinds are remembered.
        for i in 0..(2 * MAX_GROUPS as i64) {
            tr.translate(&in_group(removed(9), Some(i), None));
            tr.translate(&in_group(
                stored(&[9], None, &t[..16], 16),
                Some(i),
                Some("mamba"),
            ));
        }
        assert_eq!(tr.groups.len(), MAX_GROUPS);
    }
}
