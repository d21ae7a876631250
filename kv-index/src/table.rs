//! An open-addressing hash table from a block's sequence hash to a small
//! fixed-size value: a worker mask ([`Mask`], the flat oracle) or a block's
//! place in a run ([`Loc`], the index).
//!
//! Invariants:
//! - a slot is occupied iff its value is not [`Value::EMPTY`]; keys are unique;
//! - linear probing with backward-shift deletion: every key is reachable
//!   from its home slot without crossing an empty slot (no tombstones);
//! - the load factor stays ≤ 3/4 (the table doubles before exceeding it).
//!
//! Keys are sequence hashes (XXH3 outputs), so a Fibonacci multiply-shift
//! spreads them; a key's home slot can be prefetched before it is probed so
//! that cache misses overlap.

/// A value a slot can hold; `EMPTY` marks a free slot and is never stored.
pub trait Value: Copy {
    const EMPTY: Self;
    fn is_empty(&self) -> bool;
}

/// A 128-bit worker mask as two `u64` halves, so that a slot is 24 bytes and
/// not padded to `u128`'s 16-byte alignment.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct Mask {
    lo: u64,
    hi: u64,
}

impl Mask {
    #[inline]
    pub fn get(self) -> u128 {
        (self.hi as u128) << 64 | self.lo as u128
    }
}

impl From<u128> for Mask {
    #[inline]
    fn from(m: u128) -> Self {
        Mask {
            lo: m as u64,
            hi: (m >> 64) as u64,
        }
    }
}

impl Value for Mask {
    const EMPTY: Self = Mask { lo: 0, hi: 0 };
    #[inline]
    fn is_empty(&self) -> bool {
        self.lo | self.hi == 0
    }
}

/// Where a block sits: run id and absolute position in that run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct Loc {
    pub run: u32,
    pub pos: u32,
}

impl Value for Loc {
    const EMPTY: Self = Loc {
        run: u32::MAX,
        pos: 0,
    };
    #[inline]
    fn is_empty(&self) -> bool {
        self.run == u32::MAX
    }
}

#[derive(Clone, Copy)]
#[repr(C)]
struct Slot<V> {
    key: u64,
    val: V,
}

/// Tables at least this large ask the kernel for transparent huge pages:
/// probes are random, and 4 KiB pages make nearly every probe a TLB miss.
const HUGE_PAGE_BYTES: usize = 4 << 20;

fn alloc_slots<V: Value>(n: usize) -> Vec<Slot<V>> {
    let v = vec![
        Slot {
            key: 0,
            val: V::EMPTY
        };
        n
    ];
    let bytes = n * std::mem::size_of::<Slot<V>>();
    #[cfg(target_os = "linux")]
    if bytes >= HUGE_PAGE_BYTES {
        // SAFETY: advisory call on our own, live allocation; failure is harmless.
        unsafe {
            libc::madvise(v.as_ptr() as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
    v
}

pub struct Table<V: Value> {
    slots: Vec<Slot<V>>,
    shift: u32,
    len: usize,
}

/// The flat oracle's table: sequence hash → 128-bit worker mask.
pub type MaskTable = Table<Mask>;

const FIB: u64 = 0x9E37_79B9_7F4A_7C15;
const MIN_BITS: u32 = 4;

impl<V: Value> Table<V> {
    pub fn new() -> Self {
        Self::with_bits(MIN_BITS)
    }

    /// A table that holds `n` entries without growing.
    pub fn with_capacity(n: usize) -> Self {
        let mut bits = MIN_BITS;
        while (n + 1) * 4 > (1usize << bits) * 3 {
            bits += 1;
        }
        Self::with_bits(bits)
    }

    fn with_bits(bits: u32) -> Self {
        Table {
            slots: alloc_slots(1 << bits),
            shift: 64 - bits,
            len: 0,
        }
    }

    /// Occupied entries.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by the table.
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot<V>>()
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(FIB) >> self.shift) as usize
    }

    #[inline]
    fn find(&self, key: u64) -> Result<usize, usize> {
        let m = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let s = &self.slots[i];
            if s.val.is_empty() {
                return Err(i);
            }
            if s.key == key {
                return Ok(i);
            }
            i = (i + 1) & m;
        }
    }

    /// The value of `key` (`EMPTY` if absent).
    #[inline]
    pub fn get(&self, key: u64) -> V {
        match self.find(key) {
            Ok(i) => self.slots[i].val,
            Err(_) => V::EMPTY,
        }
    }

    /// Replaces the value of a present `key`; returns false (and does nothing) if it is absent.
    #[inline]
    pub fn replace(&mut self, key: u64, v: V) -> bool {
        debug_assert!(!v.is_empty());
        match self.find(key) {
            Ok(i) => {
                self.slots[i].val = v;
                true
            }
            Err(_) => false,
        }
    }

    /// Hints the CPU to load `key`'s home slot.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let p = &self.slots[self.home(key)] as *const Slot<V> as *const i8;
            // SAFETY: prefetch is a hint; `p` points into our own allocation.
            unsafe { std::arch::x86_64::_mm_prefetch(p, std::arch::x86_64::_MM_HINT_T0) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = key;
    }

    /// Sets `key` to `f(old)` (`old` is `EMPTY` when absent): an empty result
    /// removes the key. Returns the old value.
    pub fn update(&mut self, key: u64, f: impl FnOnce(V) -> V) -> V {
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        match self.find(key) {
            Ok(i) => {
                let old = self.slots[i].val;
                let new = f(old);
                if new.is_empty() {
                    self.len -= 1;
                    self.backward_shift(i);
                } else {
                    self.slots[i].val = new;
                }
                old
            }
            Err(i) => {
                let new = f(V::EMPTY);
                if !new.is_empty() {
                    self.slots[i] = Slot { key, val: new };
                    self.len += 1;
                }
                V::EMPTY
            }
        }
    }

    /// Inserts `key` only if absent; returns whether it was inserted.
    #[inline]
    pub fn insert_new(&mut self, key: u64, v: V) -> bool {
        debug_assert!(!v.is_empty());
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        match self.find(key) {
            Ok(_) => false,
            Err(i) => {
                self.slots[i] = Slot { key, val: v };
                self.len += 1;
                true
            }
        }
    }

    /// Removes `key`; returns its old value (`EMPTY` if absent).
    pub fn remove(&mut self, key: u64) -> V {
        let Ok(i) = self.find(key) else {
            return V::EMPTY;
        };
        let old = self.slots[i].val;
        self.len -= 1;
        self.backward_shift(i);
        old
    }

    /// Applies `f` to every value; entries it empties are removed (the table
    /// is rebuilt, restoring the probing invariant). Returns how many changed.
    pub fn map_all(&mut self, mut f: impl FnMut(V) -> V) -> usize
    where
        V: PartialEq,
    {
        let mut touched = 0;
        let n = self.slots.len();
        let old = std::mem::replace(&mut self.slots, alloc_slots(n));
        self.len = 0;
        for s in old {
            if s.val.is_empty() {
                continue;
            }
            let new = f(s.val);
            if new != s.val {
                touched += 1;
            }
            if !new.is_empty() {
                self.insert_new(s.key, new);
            }
        }
        touched
    }

    fn backward_shift(&mut self, mut hole: usize) {
        let m = self.slots.len() - 1;
        let mut i = (hole + 1) & m;
        loop {
            let s = self.slots[i];
            if s.val.is_empty() {
                break;
            }
            let home = self.home(s.key);
            // Move `s` into the hole if its home is not in (hole, i].
            let dist_hole = hole.wrapping_sub(home) & m;
            let dist_i = i.wrapping_sub(home) & m;
            if dist_hole < dist_i {
                self.slots[hole] = s;
                hole = i;
            }
            i = (i + 1) & m;
        }
        self.slots[hole].val = V::EMPTY;
    }

    fn grow(&mut self) {
        let bits = 64 - self.shift + 1;
        let old = std::mem::replace(self, Self::with_bits(bits));
        for s in old.slots {
            if !s.val.is_empty() {
                self.insert_new(s.key, s.val);
            }
        }
    }

    /// Every (key, value) pair, in table order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        self.slots
            .iter()
            .filter(|s| !s.val.is_empty())
            .map(|s| (s.key, s.val))
    }
}

impl<V: Value> Default for Table<V> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, rng_seed: proptest::test_runner::RngSeed::Fixed(11), ..ProptestConfig::default() })]
        #[test]
        fn behaves_like_a_hashmap(ops in proptest::collection::vec((0u8..4, 0u64..64, 0u32..4), 1..400)) {
            let mut t = MaskTable::new();
            let mut m: HashMap<u64, u128> = HashMap::new();
            for (op, key, bit) in ops {
                // Small keys collide on purpose (same home slot for many).
                let key = key.wrapping_mul(1 << 40);
                let bits = 1u128 << bit;
                match op {
                    0 => { t.update(key, |v| Mask::from(v.get() | bits)); *m.entry(key).or_default() |= bits; }
                    1 => { t.update(key, |v| Mask::from(v.get() & !bits)); if let Some(v) = m.get_mut(&key) { *v &= !bits; if *v == 0 { m.remove(&key); } } }
                    2 => { t.remove(key); m.remove(&key); }
                    _ => { t.map_all(|v| Mask::from(v.get() & !bits)); m.retain(|_, v| { *v &= !bits; *v != 0 }); }
                }
                prop_assert_eq!(t.len(), m.len());
                for (k, v) in &m { prop_assert_eq!(t.get(*k).get(), *v); }
            }
        }
    }
}
