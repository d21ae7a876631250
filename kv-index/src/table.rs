//! An open-addressing hash table from a block's sequence hash to a small
//! fixed-size value: a worker mask ([`Mask`], the flat oracle) or a block's
//! place in a run ([`Loc`], the index).
//!
//! Invariants:
//! - a slot is occupied iff its key is not 0; keys are unique; an occupied
//!   slot's value is never [`Value::EMPTY`]. Key 0 (a sequence hash like any
//!   other, if improbable) lives beside the slots, in `zero`;
//! - so all-zero memory is an empty table: slots are allocated zeroed and
//!   never filled by us. A large table is a mapping of its own, advised
//!   onto huge pages before any of its pages is touched (`Slots`), not
//!   memory from the global allocator, which may be reused and zeroed;
//! - linear probing with backward-shift deletion: every key is reachable
//!   from its home slot without crossing an empty slot (no tombstones);
//! - the load factor stays ≤ 2/3 (the table doubles before exceeding it):
//!   a fresh key probes to the first free slot, about ½(1 + 1/(1−α)²) slots,
//!   5 at 2/3 against 8.5 at 3/4. Right after doubling a table has three
//!   slots per key (it never shrinks: removals leave it as large).
//!
//! Keys are sequence hashes (XXH3 outputs), so a Fibonacci multiply-shift
//! spreads them; a key's home slot can be prefetched before it is probed so
//! that cache misses overlap.

/// A value a slot can hold; `EMPTY` is the answer for an absent key and is
/// never stored.
///
/// # Safety
/// The all-zero byte pattern must be a valid `Self` (slots are allocated
/// zeroed and read before they are written).
pub unsafe trait Value: Copy {
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

// SAFETY: two integers; all-zero is a valid mask.
unsafe impl Value for Mask {
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

// SAFETY: two integers; all-zero is a valid location.
unsafe impl Value for Loc {
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

/// Huge-page size on x86-64 and most arm64 kernels: a large table's mapping
/// starts on such a boundary, so every 2 MiB of it can be one huge page.
const HUGE_PAGE: usize = 2 << 20;

/// A table's slots: all-zero when made, never reallocated (a table grows by
/// making new slots and moving its entries).
///
/// A large table (≥ [`HUGE_PAGE_BYTES`]) is its own anonymous mapping,
/// aligned to [`HUGE_PAGE`] and advised onto huge pages before any page of
/// it is touched: a page faulted in as 4 KiB stays 4 KiB until khugepaged
/// collapses it, long after the table is in use. It does not come from the
/// global allocator, which may hand out reused memory that it must zero
/// (touching every page first) and keeps freed ranges for small objects.
/// Smaller tables come zeroed from the global allocator.
struct Slots<V> {
    ptr: std::ptr::NonNull<Slot<V>>,
    len: usize,
    /// `Some(bytes)`: an mmap of that many bytes (else the global allocator).
    mapped: Option<usize>,
}

// SAFETY: `Slots` owns its memory as a `Vec` would; slots are plain data.
unsafe impl<V: Send> Send for Slots<V> {}
// SAFETY: shared access gives only `&[Slot<V>]`.
unsafe impl<V: Sync> Sync for Slots<V> {}

impl<V: Value> Slots<V> {
    /// `n` empty (all-zero) slots.
    fn zeroed(n: usize) -> Self {
        assert!(n > 0 && std::mem::size_of::<Slot<V>>() > 0);
        let layout =
            std::alloc::Layout::array::<Slot<V>>(n).expect("a table within the address space");
        #[cfg(target_os = "linux")]
        if layout.size() >= HUGE_PAGE_BYTES && layout.align() <= HUGE_PAGE {
            if let Some((ptr, bytes)) = map_huge(layout.size()) {
                return Slots {
                    ptr: ptr.cast(),
                    len: n,
                    mapped: Some(bytes),
                };
            }
        }
        // SAFETY: `layout` has a non-zero size (asserted above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut Slot<V>;
        let Some(ptr) = std::ptr::NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout);
        };
        Slots {
            ptr,
            len: n,
            mapped: None,
        }
    }
}

/// A fresh, zero-filled anonymous mapping of at least `bytes`, starting on a
/// [`HUGE_PAGE`] boundary and advised onto huge pages; `None` if the kernel
/// refuses (the caller falls back to the global allocator).
#[cfg(target_os = "linux")]
fn map_huge(bytes: usize) -> Option<(std::ptr::NonNull<u8>, usize)> {
    let len = bytes.checked_next_multiple_of(HUGE_PAGE)?;
    let over = len.checked_add(HUGE_PAGE)?;
    // SAFETY: a new private anonymous mapping; nothing else refers to it.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            over,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    let start = raw as usize;
    let aligned = start.next_multiple_of(HUGE_PAGE);
    let (head, tail) = (aligned - start, start + over - (aligned + len));
    // SAFETY: the head and tail are page-aligned parts of the mapping just
    // made (mmap returns page-aligned memory and both HUGE_PAGE and `len`
    // are page multiples), outside what we keep; advice on the kept part is
    // harmless if refused.
    unsafe {
        if head > 0 {
            libc::munmap(raw, head);
        }
        if tail > 0 {
            libc::munmap((aligned + len) as *mut libc::c_void, tail);
        }
        libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
    Some((std::ptr::NonNull::new(aligned as *mut u8)?, len))
}

impl<V> std::ops::Deref for Slots<V> {
    type Target = [Slot<V>];
    fn deref(&self) -> &[Slot<V>] {
        // SAFETY: `len` initialised (all-zero, valid by `Value`'s contract)
        // slots live at `ptr` for as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<V> std::ops::DerefMut for Slots<V> {
    fn deref_mut(&mut self) -> &mut [Slot<V>] {
        // SAFETY: as for `deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<V> Drop for Slots<V> {
    fn drop(&mut self) {
        match self.mapped {
            // SAFETY: the mapping `map_huge` made, unmapped once.
            #[cfg(target_os = "linux")]
            Some(bytes) => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), bytes);
            },
            #[cfg(not(target_os = "linux"))]
            Some(_) => unreachable!("only Linux maps tables"),
            None => {
                let layout = std::alloc::Layout::array::<Slot<V>>(self.len)
                    .expect("the layout it was allocated with");
                // SAFETY: allocated by the global allocator with this layout.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), layout) }
            }
        }
    }
}

pub struct Table<V: Value> {
    slots: Slots<V>,
    /// The value of key 0 (`EMPTY` if absent): a zero key marks a free slot.
    zero: V,
    shift: u32,
    /// Occupied slots, plus one if key 0 is present.
    len: usize,
}

/// The flat oracle's table: sequence hash → 128-bit worker mask.
pub type MaskTable = Table<Mask>;

const FIB: u64 = 0x9E37_79B9_7F4A_7C15;

/// Whether `len` keys in `slots` slots exceed the maximum load factor, 2/3.
#[inline]
fn over_load(len: usize, slots: usize) -> bool {
    len * 3 > slots * 2
}

/// The fewest slot bits, at least `min`, that hold `n` entries and one more.
fn bits_for(n: usize, min: u32) -> u32 {
    let mut bits = min;
    while over_load(n + 1, 1 << bits) {
        bits += 1;
    }
    bits
}
const MIN_BITS: u32 = 4;

impl<V: Value> Table<V> {
    pub fn new() -> Self {
        Self::with_bits(MIN_BITS)
    }

    /// A table that holds `n` entries without growing.
    pub fn with_capacity(n: usize) -> Self {
        Self::with_bits(bits_for(n, MIN_BITS))
    }

    /// Makes room for `additional` more entries without growing, in one
    /// rehash at most.
    pub fn reserve(&mut self, additional: usize) {
        let bits = 64 - self.shift;
        let want = bits_for(self.len + additional, bits);
        if want > bits {
            self.rehash(want);
        }
    }

    fn with_bits(bits: u32) -> Self {
        Table {
            slots: Slots::zeroed(1 << bits),
            zero: V::EMPTY,
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
        self.slots.len() * std::mem::size_of::<Slot<V>>()
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(FIB) >> self.shift) as usize
    }

    /// The slot of a non-zero `key`, or the free slot where it would go.
    #[inline]
    fn find(&self, key: u64) -> Result<usize, usize> {
        debug_assert!(key != 0);
        let m = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let s = &self.slots[i];
            if s.key == key {
                return Ok(i);
            }
            if s.key == 0 {
                return Err(i);
            }
            i = (i + 1) & m;
        }
    }

    /// The value of `key` (`EMPTY` if absent).
    #[inline]
    pub fn get(&self, key: u64) -> V {
        if key == 0 {
            return self.zero;
        }
        match self.find(key) {
            Ok(i) => self.slots[i].val,
            Err(_) => V::EMPTY,
        }
    }

    /// Replaces the value of a present `key`; returns false (and does nothing) if it is absent.
    #[inline]
    pub fn replace(&mut self, key: u64, v: V) -> bool {
        debug_assert!(!v.is_empty());
        if key == 0 {
            let present = !self.zero.is_empty();
            if present {
                self.zero = v;
            }
            return present;
        }
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
            // The home slot's cache line and the next: a probe for a free
            // slot runs past the home line about as often as not (the next
            // line of the last one is the table's first, where probes wrap).
            let home = &self.slots[self.home(key)] as *const Slot<V> as usize;
            let start = self.slots.as_ptr() as usize;
            let end = start + std::mem::size_of_val(&*self.slots);
            let next = home + 64;
            let next = if next < end { next } else { start };
            for p in [home, next] {
                // SAFETY: prefetch is a hint that never faults; both
                // addresses are inside our own allocation.
                unsafe {
                    std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0)
                };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = key;
    }

    /// Sets `key` to `f(old)` (`old` is `EMPTY` when absent): an empty result
    /// removes the key. Returns the old value.
    pub fn update(&mut self, key: u64, f: impl FnOnce(V) -> V) -> V {
        if key == 0 {
            let old = self.zero;
            let new = f(old);
            self.len = self.len + !new.is_empty() as usize - !old.is_empty() as usize;
            self.zero = if new.is_empty() { V::EMPTY } else { new };
            return old;
        }
        if over_load(self.len + 1, self.slots.len()) {
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
        if key == 0 {
            if !self.zero.is_empty() {
                return false;
            }
            self.zero = v;
            self.len += 1;
            return true;
        }
        if over_load(self.len + 1, self.slots.len()) {
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
        if key == 0 {
            let old = std::mem::replace(&mut self.zero, V::EMPTY);
            self.len -= !old.is_empty() as usize;
            return old;
        }
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
        let old = std::mem::replace(&mut self.slots, Slots::zeroed(n));
        let zero = std::mem::replace(&mut self.zero, V::EMPTY);
        self.len = 0;
        let present = old.iter().filter(|s| s.key != 0).map(|s| (s.key, s.val));
        let zero = (!zero.is_empty()).then_some((0, zero));
        for (key, val) in present.chain(zero) {
            let new = f(val);
            if new != val {
                touched += 1;
            }
            if !new.is_empty() {
                self.insert_new(key, new);
            }
        }
        touched
    }

    fn backward_shift(&mut self, mut hole: usize) {
        let m = self.slots.len() - 1;
        let mut i = (hole + 1) & m;
        loop {
            let s = self.slots[i];
            if s.key == 0 {
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
        self.slots[hole].key = 0;
    }

    /// Doubles the table.
    fn grow(&mut self) {
        self.rehash(64 - self.shift + 1);
    }

    /// Moves every entry into a table of `1 << bits` slots (more than now).
    /// A key's home there is its old home times a power of two (plus less),
    /// so walking the old slots in order writes the new ones nearly in
    /// order: the copy streams instead of probing at random.
    fn rehash(&mut self, bits: u32) {
        let old = std::mem::replace(&mut self.slots, Slots::zeroed(1 << bits));
        self.shift = 64 - bits;
        let m = self.slots.len() - 1;
        for s in old.iter().filter(|s| s.key != 0) {
            // Keys are unique: the first free slot from home is the place.
            let mut i = self.home(s.key);
            while self.slots[i].key != 0 {
                i = (i + 1) & m;
            }
            self.slots[i] = *s;
        }
    }

    /// Every (key, value) pair: key 0 first if present, then in table order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        let zero = (!self.zero.is_empty()).then_some((0, self.zero));
        zero.into_iter().chain(
            self.slots
                .iter()
                .filter(|s| s.key != 0)
                .map(|s| (s.key, s.val)),
        )
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

    /// A large table is a mapping of its own on a huge-page boundary, all
    /// zero, writable end to end; a small one comes from the allocator.
    #[test]
    fn large_slots_are_their_own_aligned_zeroed_mapping() {
        let n = (HUGE_PAGE_BYTES / std::mem::size_of::<Slot<Loc>>()) + 3;
        let mut big = Slots::<Loc>::zeroed(n);
        #[cfg(target_os = "linux")]
        {
            assert!(big
                .mapped
                .is_some_and(|b| b >= n * std::mem::size_of::<Slot<Loc>>()));
            assert_eq!(big.as_ptr() as usize % HUGE_PAGE, 0);
        }
        assert_eq!(big.len(), n);
        assert!(big
            .iter()
            .all(|s| s.key == 0 && s.val.run == 0 && s.val.pos == 0));
        big[n - 1].key = 9;
        big[0].key = 8;
        assert_eq!((big[0].key, big[n - 1].key), (8, 9));
        let small = Slots::<Loc>::zeroed(16);
        assert!(small.mapped.is_none());
        assert!(small.iter().all(|s| s.key == 0));
    }

    #[test]
    fn key_zero_lives_beside_the_slots_through_growth_and_rebuilds() {
        let mut t: Table<Loc> = Table::new();
        assert!(t.get(0).is_empty());
        assert!(t.insert_new(0, Loc { run: 7, pos: 1 }));
        assert!(!t.insert_new(0, Loc { run: 8, pos: 1 }));
        // Enough keys to grow past the huge-page size (16-byte slots).
        let n = 400_000u64;
        for k in 1..=n {
            assert!(t.insert_new(
                k.wrapping_mul(FIB),
                Loc {
                    run: k as u32,
                    pos: 0
                }
            ));
        }
        assert!(t.heap_bytes() >= HUGE_PAGE_BYTES);
        assert_eq!(t.len(), n as usize + 1);
        assert_eq!(t.get(0), Loc { run: 7, pos: 1 });
        assert!(t.replace(0, Loc { run: 9, pos: 2 }));
        assert_eq!(t.iter().next(), Some((0, Loc { run: 9, pos: 2 })));
        assert_eq!(t.iter().count(), n as usize + 1);
        // A rebuild keeps key 0 and drops what it empties.
        let changed = t.map_all(|l| if l.run % 2 == 0 { Loc::EMPTY } else { l });
        assert_eq!(changed, n as usize / 2);
        assert_eq!(t.get(0), Loc { run: 9, pos: 2 });
        assert_eq!(t.len(), n as usize / 2 + 1);
        assert_eq!(t.remove(0), Loc { run: 9, pos: 2 });
        assert!(t.get(0).is_empty());
        assert_eq!(t.len(), n as usize / 2);
        for k in 1..=n {
            let l = t.get(k.wrapping_mul(FIB));
            assert_eq!(l.is_empty(), k % 2 == 0, "key {k}");
        }
    }

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
