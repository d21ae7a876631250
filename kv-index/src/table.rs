//! An open-addressing hash table from a block's sequence hash to a 128-bit
//! worker mask (one bit per worker slot).
//!
//! Invariants:
//! - a slot is occupied iff its mask is non-zero; keys are unique;
//! - linear probing with backward-shift deletion: every key is reachable
//!   from its home slot without crossing an empty slot (no tombstones);
//! - the load factor stays ≤ 3/4 (the table doubles before exceeding it).
//!
//! Keys are sequence hashes (XXH3 outputs), so a Fibonacci multiply-shift
//! spreads them; a query's slots can be prefetched before they are probed
//! so that its cache misses overlap.

/// 24 bytes: the mask is two `u64` halves so the slot is not padded to
/// `u128`'s 16-byte alignment.
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Slot {
    key: u64,
    lo: u64,
    hi: u64,
}

impl Slot {
    #[inline]
    fn mask(&self) -> u128 {
        (self.hi as u128) << 64 | self.lo as u128
    }
    #[inline]
    fn set_mask(&mut self, m: u128) {
        self.lo = m as u64;
        self.hi = (m >> 64) as u64;
    }
    #[inline]
    fn is_empty(&self) -> bool {
        self.lo | self.hi == 0
    }
}

/// Tables at least this large ask the kernel for transparent huge pages:
/// probes are random, and 4 KiB pages make nearly every probe a TLB miss.
const HUGE_PAGE_BYTES: usize = 4 << 20;

fn alloc_slots(n: usize) -> Vec<Slot> {
    let v = vec![Slot::default(); n];
    #[cfg(target_os = "linux")]
    if n * std::mem::size_of::<Slot>() >= HUGE_PAGE_BYTES {
        // SAFETY: advisory call on our own, live allocation; failure is harmless.
        unsafe {
            libc::madvise(
                v.as_ptr() as *mut libc::c_void,
                n * std::mem::size_of::<Slot>(),
                libc::MADV_HUGEPAGE,
            );
        }
    }
    v
}

pub struct MaskTable {
    slots: Vec<Slot>,
    shift: u32,
    len: usize,
}

const FIB: u64 = 0x9E37_79B9_7F4A_7C15;
const MIN_BITS: u32 = 4;

impl MaskTable {
    pub fn new() -> Self {
        Self::with_bits(MIN_BITS)
    }

    fn with_bits(bits: u32) -> Self {
        MaskTable {
            slots: alloc_slots(1 << bits),
            shift: 64 - bits,
            len: 0,
        }
    }

    /// Entries (keys with a non-empty mask).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by the table.
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
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
            if s.is_empty() {
                return Err(i);
            }
            if s.key == key {
                return Ok(i);
            }
            i = (i + 1) & m;
        }
    }

    /// The mask of `key` (0 if absent).
    #[inline]
    pub fn get(&self, key: u64) -> u128 {
        match self.find(key) {
            Ok(i) => self.slots[i].mask(),
            Err(_) => 0,
        }
    }

    /// Hints the CPU to load `key`'s home slot.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let p = &self.slots[self.home(key)] as *const Slot as *const i8;
            // SAFETY: prefetch is a hint; `p` points into our own allocation.
            unsafe { std::arch::x86_64::_mm_prefetch(p, std::arch::x86_64::_MM_HINT_T0) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = key;
    }

    /// Sets `bits` on `key`; returns the previous mask.
    pub fn set(&mut self, key: u64, bits: u128) -> u128 {
        debug_assert!(bits != 0);
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        match self.find(key) {
            Ok(i) => {
                let old = self.slots[i].mask();
                self.slots[i].set_mask(old | bits);
                old
            }
            Err(i) => {
                self.slots[i].key = key;
                self.slots[i].set_mask(bits);
                self.len += 1;
                0
            }
        }
    }

    /// Clears `bits` on `key` (removing it when its mask empties); returns the previous mask.
    pub fn clear(&mut self, key: u64, bits: u128) -> u128 {
        let Ok(i) = self.find(key) else { return 0 };
        let old = self.slots[i].mask();
        self.slots[i].set_mask(old & !bits);
        if self.slots[i].is_empty() {
            self.len -= 1;
            self.backward_shift(i);
        }
        old
    }

    /// Clears `bits` from every entry; returns how many entries lost any of them.
    pub fn clear_all(&mut self, bits: u128) -> usize {
        let mut touched = 0;
        for s in &mut self.slots {
            if s.mask() & bits != 0 {
                s.set_mask(s.mask() & !bits);
                touched += 1;
            }
        }
        // Rebuild to restore the probing invariant after removals.
        let n = self.slots.len();
        let old = std::mem::replace(&mut self.slots, alloc_slots(n));
        self.len = 0;
        for s in old {
            if !s.is_empty() {
                self.set(s.key, s.mask());
            }
        }
        touched
    }

    fn backward_shift(&mut self, mut hole: usize) {
        let m = self.slots.len() - 1;
        let mut i = (hole + 1) & m;
        loop {
            let s = self.slots[i];
            if s.is_empty() {
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
        self.slots[hole] = Slot::default();
    }

    fn grow(&mut self) {
        let bits = 64 - self.shift + 1;
        let old = std::mem::replace(self, Self::with_bits(bits));
        for s in old.slots {
            if !s.is_empty() {
                self.set(s.key, s.mask());
            }
        }
    }

    /// Every (key, mask) pair, in table order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u128)> + '_ {
        self.slots
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| (s.key, s.mask()))
    }
}

impl Default for MaskTable {
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
        fn behaves_like_a_hashmap(ops in proptest::collection::vec((0u8..3, 0u64..64, 0u32..4), 1..400)) {
            let mut t = MaskTable::new();
            let mut m: HashMap<u64, u128> = HashMap::new();
            for (op, key, bit) in ops {
                // Small keys collide on purpose (same home slot for many).
                let key = key.wrapping_mul(1 << 40);
                let bits = 1u128 << bit;
                match op {
                    0 => { t.set(key, bits); *m.entry(key).or_default() |= bits; }
                    1 => { t.clear(key, bits); if let Some(v) = m.get_mut(&key) { *v &= !bits; if *v == 0 { m.remove(&key); } } }
                    _ => { t.clear_all(bits); m.retain(|_, v| { *v &= !bits; *v != 0 }); }
                }
                prop_assert_eq!(t.len(), m.len());
                for (k, v) in &m { prop_assert_eq!(t.get(*k), *v); }
            }
        }
    }
}
