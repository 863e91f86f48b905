//! The references of shared cache blocks beyond each block's first (the
//! first is found through the region summary and may be gone while others
//! remain), kept compact: dedup makes every block of a cloned VM's data
//! shared, so this record is as large as the rest of the index on a clone
//! storm. A block's head (12 bytes, in a hash table by block number) holds
//! a single other reference itself; up to [`POOLED_MAX`] live in an array
//! of the index's block pool (the size classes the lines' block numbers
//! use, kept dense, so a block whose references grew through the smaller
//! classes leaves nothing behind); more spill into a vector of their own (a
//! block shared that widely is rare, and its references cost 4 bytes each
//! there too). Knows nothing of lines: a reference is an opaque `u32`.

use super::{BlockPool, CLASSES, Cbn, class_for};
use hashbrown::{DefaultHashBuilder, HashMap, HashTable};
use std::hash::BuildHasher;

/// Most other references kept in a pooled array.
const POOLED_MAX: usize = CLASSES[CLASSES.len() - 1];

/// Bit of [`Head::count`] telling that the first reference is alive.
const FIRST_ALIVE: u32 = 1 << 31;

/// One shared block.
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(4))]
struct Head {
    cbn: Cbn,
    /// The one other reference, or the pooled array's number in its class.
    at: u32,
    /// Other references (low 31 bits), and [`FIRST_ALIVE`].
    count: u32,
}

impl Head {
    fn others(&self) -> usize {
        (self.count & !FIRST_ALIVE) as usize
    }
}

/// Where `n` other references live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Home {
    None,
    Inline,
    Pool(u8),
    Spill,
}

fn home(n: usize) -> Home {
    match n {
        0 => Home::None,
        1 => Home::Inline,
        n if n <= POOLED_MAX => Home::Pool(class_for(n)),
        _ => Home::Spill,
    }
}

/// What dropping a reference left of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Left {
    pub first_alive: bool,
    pub others: usize,
}

pub struct SharedRefs {
    heads: HashTable<Head>,
    hasher: DefaultHashBuilder,
    /// Arrays of references; an array's owner is its block.
    pool: BlockPool,
    spill: HashMap<Cbn, Vec<u32>>,
}

impl SharedRefs {
    pub fn new() -> SharedRefs {
        SharedRefs {
            heads: HashTable::new(),
            hasher: DefaultHashBuilder::default(),
            pool: BlockPool::new(),
            spill: HashMap::new(),
        }
    }

    fn head(&self, cbn: Cbn) -> Option<&Head> {
        self.heads.find(self.hasher.hash_one(cbn), |h| h.cbn == cbn)
    }

    pub fn contains(&self, cbn: Cbn) -> bool {
        self.head(cbn).is_some()
    }

    /// The references of `cbn` beyond its first (empty when not shared).
    pub fn others(&self, cbn: Cbn) -> Vec<u32> {
        self.head(cbn).map_or_else(Vec::new, |h| self.load(h))
    }

    fn load(&self, h: &Head) -> Vec<u32> {
        let n = h.others();
        match home(n) {
            Home::None => Vec::new(),
            Home::Inline => vec![h.at],
            Home::Pool(c) => self.pool.array(c, h.at)[..n].to_vec(),
            Home::Spill => self.spill.get(&h.cbn).cloned().unwrap_or_default(),
        }
    }

    /// Records one more reference to `cbn` beyond its first, making the
    /// block shared (its first reference alive) if it was not.
    pub fn add(&mut self, cbn: Cbn, r: u32) {
        let hash = self.hasher.hash_one(cbn);
        let Some(head) = self.heads.find(hash, |h| h.cbn == cbn).copied() else {
            let head = Head {
                cbn,
                at: r,
                count: FIRST_ALIVE | 1,
            };
            let hasher = &self.hasher;
            self.heads
                .insert_unique(hash, head, |h| hasher.hash_one(h.cbn));
            return;
        };
        let n = head.others();
        match (home(n), home(n + 1)) {
            (Home::Pool(c), Home::Pool(d)) if c == d => {
                self.pool.array_mut(c, head.at)[n] = r;
            }
            (Home::Spill, _) => self.spill.entry(cbn).or_default().push(r),
            _ => {
                let mut refs = self.load(&head);
                refs.push(r);
                self.rehome(cbn, head.count & FIRST_ALIVE, refs);
                return;
            }
        }
        if let Some(h) = self.heads.find_mut(hash, |h| h.cbn == cbn) {
            h.count += 1;
        }
    }

    /// Drops reference `r` of a shared block (or its first reference, when
    /// `r` is not among the others); None when `cbn` is not shared. The
    /// block stops being shared once no other reference is left.
    pub fn remove(&mut self, cbn: Cbn, r: u32) -> Option<Left> {
        let hash = self.hasher.hash_one(cbn);
        let head = *self.heads.find(hash, |h| h.cbn == cbn)?;
        let n = head.others();
        let Some(i) = self.position(&head, r) else {
            if let Some(h) = self.heads.find_mut(hash, |h| h.cbn == cbn) {
                h.count &= !FIRST_ALIVE;
            }
            return Some(Left {
                first_alive: false,
                others: n,
            });
        };
        let first = head.count & FIRST_ALIVE;
        match (home(n), home(n - 1)) {
            (Home::Pool(c), Home::Pool(d)) if c == d => {
                self.pool.array_mut(c, head.at).swap(i, n - 1);
            }
            (Home::Spill, Home::Spill) => {
                if let Some(v) = self.spill.get_mut(&cbn) {
                    v.swap_remove(i);
                }
            }
            _ => {
                let mut refs = self.load(&head);
                refs.swap_remove(i);
                self.rehome(cbn, first, refs);
                return Some(Left {
                    first_alive: first != 0,
                    others: n - 1,
                });
            }
        }
        if let Some(h) = self.heads.find_mut(hash, |h| h.cbn == cbn) {
            h.count -= 1;
        }
        Some(Left {
            first_alive: first != 0,
            others: n - 1,
        })
    }

    /// Where `r` is among a head's other references.
    fn position(&self, h: &Head, r: u32) -> Option<usize> {
        let n = h.others();
        match home(n) {
            Home::None => None,
            Home::Inline => (h.at == r).then_some(0),
            Home::Pool(c) => self.pool.array(c, h.at)[..n].iter().position(|&x| x == r),
            Home::Spill => self.spill.get(&h.cbn)?.iter().position(|&x| x == r),
        }
    }

    /// Moves `cbn`'s other references to where `refs` (their new list)
    /// belongs, dropping the head when none is left.
    fn rehome(&mut self, cbn: Cbn, first: u32, refs: Vec<u32>) {
        let hash = self.hasher.hash_one(cbn);
        let Ok(entry) = self.heads.find_entry(hash, |h| h.cbn == cbn) else {
            return;
        };
        let (old, _) = entry.remove();
        match home(old.others()) {
            Home::Pool(c) => self.free_array(c, old.at),
            Home::Spill => {
                self.spill.remove(&cbn);
            }
            Home::None | Home::Inline => {}
        }
        let n = refs.len();
        let at = match home(n) {
            Home::None => return,
            Home::Inline => refs[0],
            Home::Pool(c) => {
                let at = self.pool.alloc(c, cbn);
                self.pool.array_mut(c, at)[..n].copy_from_slice(&refs);
                at
            }
            Home::Spill => {
                self.spill.insert(cbn, refs);
                0
            }
        };
        let head = Head {
            cbn,
            at,
            count: first | n as u32,
        };
        let hasher = &self.hasher;
        self.heads
            .insert_unique(hash, head, |h| hasher.hash_one(h.cbn));
    }

    /// Frees a pooled array; the class's last array moves into its place,
    /// and its block's head follows it.
    fn free_array(&mut self, class: u8, at: u32) {
        let Some(moved) = self.pool.free(class, at) else {
            return;
        };
        let hash = self.hasher.hash_one(moved);
        if let Some(h) = self.heads.find_mut(hash, |h| h.cbn == moved) {
            h.at = at;
        }
    }

    /// Bytes of memory held (table buckets, arrays, spilled vectors).
    pub fn bytes(&self) -> usize {
        let heads = self.heads.capacity() * (std::mem::size_of::<Head>() + 1);
        let pooled = self.pool.bytes();
        let spilled = self.spill.capacity() * (std::mem::size_of::<(Cbn, Vec<u32>)>() + 1)
            + self.spill.values().map(|v| v.capacity() * 4).sum::<usize>();
        heads + pooled + spilled
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[test]
    fn a_head_is_twelve_bytes() {
        assert_eq!(std::mem::size_of::<Head>(), 12);
    }

    #[test]
    fn references_move_between_homes_as_they_come_and_go() {
        let mut s = SharedRefs::new();
        assert!(!s.contains(7));
        for r in 0..40u32 {
            s.add(7, r);
            let mut got = s.others(7);
            got.sort_unstable();
            assert_eq!(got, (0..=r).collect::<Vec<_>>());
        }
        for r in (1..40u32).rev() {
            let left = s.remove(7, r).unwrap();
            assert_eq!(
                left,
                Left {
                    first_alive: true,
                    others: r as usize
                }
            );
        }
        // The first reference goes; the last other one keeps the block.
        assert_eq!(
            s.remove(7, 99),
            Some(Left {
                first_alive: false,
                others: 1
            })
        );
        assert_eq!(s.others(7), vec![0]);
        assert_eq!(
            s.remove(7, 0),
            Some(Left {
                first_alive: false,
                others: 0
            })
        );
        assert!(!s.contains(7));
        assert_eq!(s.remove(7, 0), None);
        assert!(s.spill.is_empty());
        assert!(
            s.pool.classes.iter().all(|c| c.arrays.len == 0),
            "every pooled array is freed"
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add(u32, u32),
        Remove(u32, u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0..6u32, 0..24u32).prop_map(|(c, r)| Op::Add(c, r)),
            2 => (0..6u32, 0..24u32).prop_map(|(c, r)| Op::Remove(c, r)),
        ]
    }

    proptest! {
        /// Adds and removes in any order agree with a plain map of
        /// (first alive, other references) per block.
        #[test]
        fn agrees_with_a_plain_map(ops in proptest::collection::vec(op(), 1..400)) {
            let mut s = SharedRefs::new();
            let mut m: BTreeMap<u32, (bool, Vec<u32>)> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Add(c, r) => {
                        s.add(c, r);
                        m.entry(c).or_insert((true, Vec::new())).1.push(r);
                    }
                    Op::Remove(c, r) => {
                        let want = m.get_mut(&c).map(|(first, refs)| {
                            match refs.iter().position(|&x| x == r) {
                                Some(i) => { refs.swap_remove(i); }
                                None => *first = false,
                            }
                            Left { first_alive: *first, others: refs.len() }
                        });
                        if want.is_some_and(|w| w.others == 0) {
                            m.remove(&c);
                        }
                        prop_assert_eq!(s.remove(c, r), want);
                    }
                }
                for c in 0..6u32 {
                    let mut got = s.others(c);
                    got.sort_unstable();
                    let mut want = m.get(&c).map(|e| e.1.clone()).unwrap_or_default();
                    want.sort_unstable();
                    prop_assert_eq!(s.contains(c), m.contains_key(&c));
                    prop_assert_eq!(got, want);
                }
            }
        }
    }
}
