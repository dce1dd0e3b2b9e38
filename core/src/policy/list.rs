//! Intrusive doubly linked lists over dense entry ids.
//!
//! One `Lists<N>` holds `N` lists (at most seven); each id is in at most one of them. Every
//! operation is O(1); ids grow the link table on demand. Ids take 30 bits with up to three
//! lists, 29 with more.

use alloc::vec::Vec;

/// Bits of a link that hold an id: 30 for up to three lists, 29 for up to seven (the rest
/// name the list).
const fn id_bits(lists: usize) -> u32 {
    if lists <= 3 { 30 } else { 29 }
}

/// `prev` and `next` ids of one entry, 8 bytes: the top bits of `prev_list` (two for up to
/// three lists, three for up to seven) name the list that holds the entry (all ones = none).
#[derive(Clone, Copy, Debug)]
struct Link<const N: usize> {
    prev_list: u32,
    next: u32,
}

impl<const N: usize> Link<N> {
    /// Bits of an id.
    const BITS: u32 = id_bits(N);
    /// No id; also one more than the largest id a list can hold.
    const NIL: u32 = (1 << Self::BITS) - 1;
    /// The list tag of an unlinked entry.
    const NONE: u32 = u32::MAX >> Self::BITS;
    const UNLINKED: Self = Link {
        prev_list: u32::MAX,
        next: Self::NIL,
    };

    fn prev(self) -> u32 {
        self.prev_list & Self::NIL
    }
    fn list(self) -> u32 {
        self.prev_list >> Self::BITS
    }
    fn new(prev: u32, next: u32, list: u32) -> Self {
        Link {
            prev_list: (list << Self::BITS) | prev,
            next,
        }
    }
    fn set_prev(&mut self, prev: u32) {
        self.prev_list = (self.prev_list & !Self::NIL) | prev;
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Lists<const N: usize> {
    links: Vec<Link<N>>,
    head: [u32; N],
    tail: [u32; N],
    len: [usize; N],
}

impl<const N: usize> Default for Lists<N> {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

impl<const N: usize> Lists<N> {
    const NIL: u32 = Link::<N>::NIL;
    const NONE: u32 = Link::<N>::NONE;

    /// At most seven lists: three bits name one, with the value of all ones for none.
    const FITS: () = assert!(N <= 7, "at most seven lists");

    pub(crate) fn with_capacity(n: usize) -> Self {
        let () = Self::FITS;
        Lists {
            links: Vec::with_capacity(n),
            head: [Self::NIL; N],
            tail: [Self::NIL; N],
            len: [0; N],
        }
    }

    /// Makes room for ids up to `n` without growing.
    pub(crate) fn reserve_ids(&mut self, n: usize) {
        self.links.reserve_exact(n.saturating_sub(self.links.len()));
    }

    pub(crate) fn len(&self, list: usize) -> usize {
        self.len[list]
    }

    /// The list that holds `id`, if any.
    pub(crate) fn list_of(&self, id: u32) -> Option<usize> {
        match self.links.get(id as usize) {
            Some(l) if l.list() != Self::NONE => Some(l.list() as usize),
            _ => None,
        }
    }

    /// The oldest (least recent) id of `list`.
    pub(crate) fn front(&self, list: usize) -> Option<u32> {
        (self.head[list] != Self::NIL).then_some(self.head[list])
    }

    /// The newest (most recent) id of `list`.
    pub(crate) fn back(&self, list: usize) -> Option<u32> {
        (self.tail[list] != Self::NIL).then_some(self.tail[list])
    }

    /// The id after `id` in its list, towards the most recent end.
    pub(crate) fn next(&self, id: u32) -> Option<u32> {
        let n = self.links[id as usize].next;
        (n != Self::NIL).then_some(n)
    }

    /// Appends `id` (which must be unlinked) at the most recent end of `list`.
    pub(crate) fn push_back(&mut self, list: usize, id: u32) {
        let i = id as usize;
        if i >= self.links.len() {
            self.links.resize(i + 1, Link::UNLINKED);
        }
        debug_assert!(id < Self::NIL, "id {id} beyond the list's range");
        debug_assert_eq!(self.links[i].list(), Self::NONE, "id {id} linked twice");
        let tail = self.tail[list];
        self.links[i] = Link::new(tail, Self::NIL, list as u32);
        if tail == Self::NIL {
            self.head[list] = id;
        } else {
            self.links[tail as usize].next = id;
        }
        self.tail[list] = id;
        self.len[list] += 1;
    }

    /// Links `id` (which must be unlinked) into `list` right after `after`, which must be in
    /// `list`.
    pub(crate) fn insert_after(&mut self, list: usize, after: u32, id: u32) {
        let i = id as usize;
        if i >= self.links.len() {
            self.links.resize(i + 1, Link::UNLINKED);
        }
        debug_assert!(id < Self::NIL, "id {id} beyond the list's range");
        debug_assert_eq!(self.links[i].list(), Self::NONE, "id {id} linked twice");
        debug_assert_eq!(
            self.list_of(after),
            Some(list),
            "anchor {after} not in the list"
        );
        let next = self.links[after as usize].next;
        self.links[i] = Link::new(after, next, list as u32);
        self.links[after as usize].next = id;
        if next == Self::NIL {
            self.tail[list] = id;
        } else {
            self.links[next as usize].set_prev(id);
        }
        self.len[list] += 1;
    }

    /// Unlinks `id` from whatever list holds it; returns that list.
    pub(crate) fn remove(&mut self, id: u32) -> Option<usize> {
        let list = self.list_of(id)?;
        let link = self.links[id as usize];
        let (prev, next) = (link.prev(), link.next);
        if prev == Self::NIL {
            self.head[list] = next;
        } else {
            self.links[prev as usize].next = next;
        }
        if next == Self::NIL {
            self.tail[list] = prev;
        } else {
            self.links[next as usize].set_prev(prev);
        }
        self.links[id as usize] = Link::UNLINKED;
        self.len[list] -= 1;
        Some(list)
    }

    /// Moves `id` to the most recent end of `list`.
    pub(crate) fn move_to_back(&mut self, list: usize, id: u32) {
        if self.list_of(id) == Some(list) && self.tail[list] == id {
            return;
        }
        self.remove(id);
        self.push_back(list, id);
    }

    /// Ids of `list`, oldest first.
    pub(crate) fn iter(&self, list: usize) -> impl Iterator<Item = u32> + '_ {
        core::iter::successors(self.front(list), move |&id| self.next(id))
    }

    /// Checks the links are consistent: lengths, back links, membership.
    pub(crate) fn check(&self) -> Result<(), alloc::string::String> {
        let mut seen = 0;
        for list in 0..N {
            let mut prev = Self::NIL;
            let mut count = 0;
            for id in self.iter(list) {
                let l = self.links[id as usize];
                if l.prev() != prev || l.list() as usize != list {
                    return Err(alloc::format!("list {list}: broken link at id {id}"));
                }
                prev = id;
                count += 1;
                if count > self.links.len() {
                    return Err(alloc::format!("list {list}: cycle"));
                }
            }
            if prev != self.tail[list] || count != self.len[list] {
                return Err(alloc::format!("list {list}: tail or length wrong"));
            }
            seen += count;
        }
        let linked = self.links.iter().filter(|l| l.list() != Self::NONE).count();
        if linked != seen {
            return Err(alloc::format!("{linked} ids linked but {seen} reachable"));
        }
        Ok(())
    }
}

#[cfg(test)]
impl<const N: usize> Lists<N> {
    /// Breaks `list`'s length count (for the policies' invariant self-tests).
    pub(crate) fn corrupt_len(&mut self, list: usize) {
        self.len[list] += 1;
    }
}

#[cfg(test)]
mod tests {
    //! `check` must fail on every kind of broken list (I7).

    use super::*;

    fn lists() -> Lists<2> {
        let mut l = Lists::default();
        for id in 0..3 {
            l.push_back(0, id);
        }
        l.push_back(1, 3);
        l.check().unwrap();
        l
    }

    #[test]
    fn check_detects_each_corruption() {
        let mut l = lists();
        l.links[2].set_prev(0); // a wrong back link, in the right list
        assert!(l.check().is_err());
        let mut l = lists();
        l.links[1] = Link::new(0, 2, 1); // the right back link, the wrong list tag
        assert!(l.check().is_err());
        let mut l = lists();
        l.corrupt_len(0); // the right tail, a wrong length
        assert!(l.check().is_err());
        let mut l = lists();
        l.tail[0] = 1; // the right length, a wrong tail
        assert!(l.check().is_err());
        let mut l = lists();
        l.links.push(Link::new(Lists::<2>::NIL, Lists::<2>::NIL, 0)); // linked, unreachable
        assert!(l.check().is_err());
    }

    #[test]
    fn moving_the_tail_keeps_the_order() {
        let mut l = lists();
        l.move_to_back(0, 2);
        l.move_to_back(0, 0);
        l.move_to_back(1, 1); // to another list
        l.check().unwrap();
        assert_eq!(l.iter(0).collect::<Vec<_>>(), [2, 0]);
        assert_eq!(l.iter(1).collect::<Vec<_>>(), [3, 1]);
    }
}
